"""ferrule's plugin contract: every hook a model-family plugin can implement.

Glossary (DESIGN.md §2 has the full vocabulary):

- *family*: one plugin-declared model family (``qwen2``, ``llama``); *model_type*: HF
  ``config.model_type``, which the registry maps to a family.
- *hf_* / *mcore_*: Hugging Face vs Megatron-Core naming (``q_proj`` vs ``linear_qkv``).
- *spec*: a frozen dataclass from :mod:`ferrule.contract.specs` that a ``register_*`` hook returns;
  heavy objects inside are lazy ``"module:attr"`` references.
- *provider*: builds the family's Megatron model from an HF config and a parallel layout.
- *mapping table*: the family's complete mcore <-> HF parameter table (:mod:`ferrule.mapping`).
- *config translation*: rows translating HF config keys to ``TransformerConfig`` fields
  (:mod:`ferrule.config_translation`); a provider without ``build`` is driven by them.
- *update group*: parameters that travel to the rollout engine together in one bucket.
- *hook part*: one row of :data:`ferrule.contract.hook_parts.HOOK_PARTS` (hook, spec type, registry table).

Lifecycle. :mod:`ferrule.contract.registry` (the only module that calls ``pm.hook``) loads each
``ferrule`` entry point once per process, then calls the ``register_*`` hooks once and caches
the specs. Collect hooks (``register_*``) run in every plugin and their lists are joined;
specs are matched by family name. ``resolve_model_family`` is first-result: the first
non-None answer wins.

Rules for implementations (checked by the registry and the conformance kit
``ferrule.conformance.kit``):

- no side effects, no I/O, no import of torch, megatron or transformers at call time: return
  frozen specs from :mod:`ferrule.contract.specs`, naming heavy objects as ``"module:attr"`` strings;
- re-entrant: the hooks may be called in every process of a distributed job;
- a spec whose family or model_type another plugin already claims is an error naming both
  distributions.

Each hook is documented with its exact signature in ``docs/hooks.md`` (a test checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ferrule import hookspec
from ferrule.contract.specs import (
    ChatTemplateSpec,
    CommandSpec,
    ConverterSpec,
    EnvironmentSpec,
    LoRAApplierSpec,
    ModelFamilySpec,
    ProviderSpec,
    ToolParserSpec,
    TowerSpec,
    UpdateGroupTable,
)

# ---------------------------------------------------------------------------------------
# Discovery: which families exist
# ---------------------------------------------------------------------------------------


@hookspec
def register_model_families() -> Sequence[ModelFamilySpec]:
    """Declare the model families this plugin supports.

    Called by the registry once per process, at first use; collect hook (all plugins run,
    results are concatenated).

    :return: family specs. Invariants: each ``name`` and each ``model_type`` is claimed by
        one plugin only; a VALIDATED or UNSTABLE family must be complete (provider,
        converter, update groups, plus every part listed in ``features``).
    :raises: nothing; a plugin that raises here is reported as failed (fatal when
        ``FERRULE_STRICT_PLUGINS=1``).
    """


@hookspec(firstresult=True)
def resolve_model_family(hf_config: Mapping[str, Any]) -> str | None:
    """Name the family of a checkpoint whose ``model_type`` no family claims.

    Called by ``registry.family_for_hf_config`` only after the plain ``model_type`` (and
    ``text_config.model_type``) lookup found nothing; first-result hook (the first non-None
    answer wins).

    :param hf_config: the parsed ``config.json`` of the checkpoint (read-only).
    :return: a registered family name, or None to pass.
    :raises: nothing; returning an unregistered name makes the registry raise
        ``UnknownModelError``.
    """


# ---------------------------------------------------------------------------------------
# Training side: building and converting the Megatron model
# ---------------------------------------------------------------------------------------


@hookspec
def register_providers() -> Sequence[ProviderSpec]:
    """Declare how to build each family's Megatron-Core model.

    Called by the registry once per process; collect hook.

    :return: provider specs; ``build`` is a lazy ``"module:attr"`` reference to
        ``build(hf_config: dict, layout: ParallelLayout, **options) -> list[MegatronModule]``,
        or None (the default) for megatron's GPT builder driven by the family's
        config-translation rows (``ConverterSpec.config_translation``). At most one provider
        per family.
    """


@hookspec
def register_converters() -> Sequence[ConverterSpec]:
    """Declare each family's HF <-> Megatron mapping table and config translation.

    Called by the registry once per process; collect hook. Used by ``ferrule convert``,
    the train engine (loading HF weights) and weight sync (exporting HF-named tensors).

    :return: converter specs. The mapping table must cover every parameter the family's
        provider creates and every key of the family's HF checkpoints (mapped or explicitly
        ignored); the converter raises on any gap. At most one converter per family.
    """


@hookspec
def register_update_groups() -> Sequence[UpdateGroupTable]:
    """Declare each family's weight-sync update-group table.

    Called by the registry once per process; collect hook. The weight-sync exporter walks
    the table in order; parameters of one unit (same group, same prefix) travel in one
    bucket to the rollout engine.

    :return: update-group tables; ``groups`` is a tuple or a lazy ``"module:attr"``
        reference to one. Every Megatron parameter of the family must match exactly one
        group's suffix. At most one table per family.
    """


@hookspec
def register_lora_appliers() -> Sequence[LoRAApplierSpec]:
    """Declare LoRA appliers (attach, export to HF PEFT, load) per module kind.

    Called by the registry once per process; collect hook. ``registry.iter_lora_appliers``
    yields the family-specific applier for each kind, else the ``"*"`` one.

    :return: LoRA applier specs; at most one per (family, kind).
    """


@hookspec
def register_chat_templates() -> Sequence[ChatTemplateSpec]:
    """Declare chat templates (jinja resources) and their stop tokens.

    Called by the registry once per process; collect hook. Used to render prompts for
    rollout and by ``ferrule chat-template render``.

    :return: chat template specs; template names are unique across plugins.
    """


@hookspec
def register_towers() -> Sequence[TowerSpec]:
    """Declare multimodal towers (vision, audio encoders) per family.

    Called by the registry once per process; collect hook. The model scatters a tower's
    embeddings into the text sequence at ``placeholder_token_id`` positions.

    :return: tower specs; at most one per (family, modality).
    """


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


@hookspec
def register_commands() -> Sequence[CommandSpec]:
    """Declare ``ferrule`` CLI sub-commands that the plugin contributes.

    Called by :mod:`ferrule.cli` when the command line starts (through the registry); collect
    hook. Each command is mounted lazily: ``app`` is imported only when the command line is
    built, so the module should import typer and nothing heavy at module level.

    :return: command specs; ``app`` is a ``"module:attr"`` reference to a ``typer.Typer``
        (mounted as a command group, ``ferrule NAME SUB ...``) or to a function (mounted as
        one command). Names are unique across plugins and may not shadow a built-in command.
    :raises: nothing; a plugin that raises here is reported as failed, like any other hook.
    """


# ---------------------------------------------------------------------------------------
# Agentic RL: environments and tool calls
# ---------------------------------------------------------------------------------------


@hookspec
def register_environments() -> Sequence[EnvironmentSpec]:
    """Declare multi-turn environments for ``ferrule train`` (``agent.environment: NAME``).

    Called by the registry once per process; collect hook. The launcher resolves the chosen
    spec's ``factory`` when a run starts and drives the object it returns through the
    :mod:`ferrule.rl.envs` protocol (``reset(item, seed)``, ``step(turn)``) on the host side of
    the loop, each call bounded by ``agent.step_timeout_s``.

    :return: environment specs; names are unique across plugins (a duplicate names both
        distributions).
    :raises: nothing; a plugin that raises here is reported as failed, like any other hook.
    """


@hookspec
def register_tool_parsers() -> Sequence[ToolParserSpec]:
    """Declare how each family's model writes tool calls.

    Called by the registry once per process; collect hook. The episode runner parses every model
    turn with the parser of the run's family (else the ``"*"`` one, :mod:`ferrule.chat.tool_calls`'s
    Hermes ``<tool_call>`` JSON) before handing it to the environment.

    :return: tool-parser specs; at most one per family (and one ``"*"``).
    :raises: nothing; a plugin that raises here is reported as failed, like any other hook.
    """
