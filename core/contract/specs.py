"""Frozen spec dataclasses returned by ferrule's hooks (see :mod:`ferrule.contract.hookspecs`).

Every spec is a keyword-only, frozen, picklable dataclass whose sequence fields are tuples.
Specs carry *declarations*, never live objects: heavy callables (model builders, LoRA
appliers, towers) are named as ``"package.module:attr"`` strings and imported lazily by
:func:`resolve_ref`. Constructing a spec validates it in ``__post_init__`` and raises
:class:`SpecError` (a ``ValueError``) naming the offending field and the fix.

Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import enum
import importlib
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SpecError",
    "FamilyStatus",
    "ModelFamilySpec",
    "LayoutSupport",
    "ProviderSpec",
    "ConverterSpec",
    "UpdateGroup",
    "UpdateGroupTable",
    "LoRAApplierSpec",
    "LORA_KINDS",
    "ChatTemplateSpec",
    "TowerSpec",
    "TOWER_MODALITIES",
    "CommandSpec",
    "EnvironmentSpec",
    "ToolParserSpec",
    "DEFAULT_PROVIDER_BUILD",
    "FAMILY_FEATURES",
    "resolve_ref",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

#: Optional parts a family may declare; a declared part must be registered.
FAMILY_FEATURES = ("lora", "chat_template", "towers")
#: Module kinds a LoRA applier can target (DESIGN.md §2).
#: ``loop_gate``: a looped model's message gates (Inkling-2-Loop); no core applier serves it.
LORA_KINDS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "lm_head", "loop_gate")
#: Modalities a tower can encode.
TOWER_MODALITIES = ("vision", "audio")
#: The builder a :class:`ProviderSpec` without ``build`` gets: the family's config-translation
#: rows (``ConverterSpec.config_translation``) drive megatron's GPT builder.
DEFAULT_PROVIDER_BUILD = "ferrule.megatron.gpt_builder:build_from_hf_config"


class SpecError(ValueError):
    """A spec was constructed with invalid values (the message names field and fix)."""


def _check_name(cls: str, fld: str, value: Any) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise SpecError(
            f"{cls}.{fld}={value!r} is not a valid name: use lower-case letters, digits and "
            f"underscores, starting with a letter (e.g. 'qwen3_moe')."
        )


def _check_ref(cls: str, fld: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not _REF_RE.match(value):
        raise SpecError(
            f"{cls}.{fld}={value!r} is not a lazy reference: write 'package.module:attr' "
            f"(a string, so that discovery imports nothing heavy)."
        )


def _check_tuple(cls: str, fld: str, value: Any, *, item_type: type | tuple[type, ...] = str,
                 allow_empty: bool = False) -> None:
    if not isinstance(value, tuple):
        raise SpecError(f"{cls}.{fld} must be a tuple (specs are immutable), got {type(value).__name__}.")
    if not allow_empty and not value:
        raise SpecError(f"{cls}.{fld} must not be empty.")
    for item in value:
        if not isinstance(item, item_type):
            raise SpecError(f"{cls}.{fld} holds {item!r} of type {type(item).__name__}; expected {item_type}.")
    if len(set(value)) != len(value):
        dupes = sorted({v for v in value if value.count(v) > 1}, key=str)
        raise SpecError(f"{cls}.{fld} has duplicate entries {dupes}; list each once.")


def resolve_ref(ref: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute (dotted attrs allowed).

    Raises:
        ImportError: the module cannot be imported (the original error is chained).
        AttributeError: the module has no such attribute; the message names both.
    """
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise AttributeError(f"{ref!r}: module {module_name!r} has no attribute path {attr_path!r}") from exc
    return obj


class FamilyStatus(str, enum.Enum):
    """How far a family's support has been proven.

    - ``VALIDATED``: numerics checked against the HF reference (round trip, logits parity);
      the family must be complete.
    - ``STRUCTURAL``: registered and discoverable, but parts are missing or unverified;
      ``reason`` says what.
    - ``UNSTABLE``: complete, but a known numerical or behavioural problem exists; ``reason``
      says which.
    """

    VALIDATED = "validated"
    STRUCTURAL = "structural"
    UNSTABLE = "unstable"


#: transformers ``attn_implementation`` values the embedded rollout engine drives.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

#: The parallel degrees a :class:`LayoutSupport` can restrict (``ferrule.megatron.parallel.ParallelLayout``'s).
LAYOUT_DEGREES = ("tp", "pp", "ep", "etp")
_DEGREE_FLAGS = {"tp": "--tp / parallel.tp", "pp": "--pp / parallel.pp", "ep": "--ep / parallel.ep",
                 "etp": "--etp / parallel.etp"}


@dataclass(frozen=True, kw_only=True)
class LayoutSupport:
    """The parallel layouts a family can be built at (``ModelFamilySpec.layouts``).

    Each degree is a tuple of the values the family supports, or None for any value the model's shapes allow
    (heads, layers and experts are checked for every family anyway). ``etp`` is the *effective* expert
    tensor-parallel size: a layout that leaves it unset gets megatron's default, ``tp``. Every command that
    takes a layout (``ferrule check``, ``ferrule convert``, ``ferrule train``'s ``parallel`` section, the
    conformance kit) refuses one outside these values before any process starts, with one line naming the
    degree, the supported values and ``reason``, as a :class:`ferrule.megatron.parallel.ParallelLayoutError`
    (exit code 2 from every command).

    Example (a biased-MoE family, megatron-core 0.16.1 builds MoE biases only at expert-TP 1)::

        LayoutSupport(etp=(1,), reason="megatron-core builds MoE biases only at expert TP 1")
    """

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        for name in LAYOUT_DEGREES:
            value = getattr(self, name)
            if value is None:
                continue
            _check_tuple("LayoutSupport", name, value, item_type=int)
            if any(isinstance(v, bool) or v < 1 for v in value):
                raise SpecError(f"LayoutSupport.{name}={value!r}; expected a tuple of integers >= 1 (or None: any).")

    def refusal(self, family: str, layout: Any) -> str | None:
        """Why ``family`` cannot be built at ``layout`` (a ``ParallelLayout``), as one line, or None."""
        for name in LAYOUT_DEGREES:
            allowed = getattr(self, name)
            value = getattr(layout, name)
            if name == "etp" and value is None:
                value = layout.tp  # megatron's default expert TP size
            if allowed is not None and value not in allowed:
                why = f" ({self.reason})" if self.reason else ""
                return (f"family {family!r} supports {name} in {list(allowed)}{why}, not {name}={value}; "
                        f"set {_DEGREE_FLAGS[name]} to one of {list(allowed)}.")
        return None


@dataclass(frozen=True, kw_only=True)
class ModelFamilySpec:
    """One model family (returned by ``register_model_families``).

    Attributes:
        name: family name, e.g. ``"qwen3_moe"`` (lower snake case, unique across plugins).
        model_types: HF ``config.model_type`` values this family claims (unique across
            plugins). Multimodal configs are also matched on ``text_config.model_type``.
        status: a :class:`FamilyStatus`.
        reason: why the status is not VALIDATED; required for STRUCTURAL and UNSTABLE.
        hf_model_class: lazy reference to the transformers class the embedded rollout engine
            instantiates, e.g. ``"transformers:Qwen3ForCausalLM"``; None if the family has none.
        features: optional parts this family declares (subset of :data:`FAMILY_FEATURES`);
            the registry checks that each declared part is registered.
        description: one line for ``ferrule plugins``.
        attn_implementation: the transformers ``attn_implementation`` the embedded rollout
            engine and the RL reference model load ``hf_model_class`` with: ``"sdpa"`` (default)
            or ``"eager"`` (e.g. Gemma-2, whose attention soft-capping transformers does not
            run under SDPA).
        layouts: the parallel layouts the family supports (:class:`LayoutSupport`); None: any
            layout the model's shapes allow.
    """

    name: str
    model_types: tuple[str, ...]
    status: FamilyStatus
    reason: str = ""
    hf_model_class: str | None = None
    features: tuple[str, ...] = ()
    description: str = ""
    attn_implementation: str = "sdpa"
    layouts: LayoutSupport | None = None

    def __post_init__(self) -> None:
        _check_name("ModelFamilySpec", "name", self.name)
        if self.layouts is not None and not isinstance(self.layouts, LayoutSupport):
            raise SpecError(f"ModelFamilySpec({self.name}).layouts={self.layouts!r}; use a LayoutSupport "
                            f"(ferrule.contract.specs) or None.")
        _check_tuple("ModelFamilySpec", "model_types", self.model_types)
        if not isinstance(self.status, FamilyStatus):
            raise SpecError(
                f"ModelFamilySpec({self.name}).status={self.status!r}; use a FamilyStatus member "
                f"({', '.join(s.name for s in FamilyStatus)})."
            )
        if self.status is not FamilyStatus.VALIDATED and not self.reason.strip():
            raise SpecError(
                f"ModelFamilySpec({self.name}) has status {self.status.name} without a reason; "
                f"say what is missing or unstable in `reason=`."
            )
        _check_ref("ModelFamilySpec", "hf_model_class", self.hf_model_class, optional=True)
        _check_tuple("ModelFamilySpec", "features", self.features, allow_empty=True)
        unknown = [f for f in self.features if f not in FAMILY_FEATURES]
        if unknown:
            raise SpecError(
                f"ModelFamilySpec({self.name}).features has unknown entries {unknown}; "
                f"allowed: {list(FAMILY_FEATURES)}."
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise SpecError(
                f"ModelFamilySpec({self.name}).attn_implementation={self.attn_implementation!r}; the embedded "
                f"engine supports {list(ATTN_IMPLEMENTATIONS)}."
            )


@dataclass(frozen=True, kw_only=True)
class ProviderSpec:
    """How to build the Megatron model of a family (``register_providers``).

    Attributes:
        family: the family name.
        build: lazy reference to ``build(hf_config: dict, layout, **options) -> list[MegatronModule]``
            (one module per virtual pipeline stage). None (the default) means
            :data:`DEFAULT_PROVIDER_BUILD` driven by the family's config-translation rows
            (``ConverterSpec.config_translation``): a Llama-shaped family whose whole model
            follows from its config translation writes no builder.
            :func:`ferrule.contract.registry.provider_build` resolves either to a callable.
    """

    family: str
    build: str | None = None

    def __post_init__(self) -> None:
        _check_name("ProviderSpec", "family", self.family)
        _check_ref("ProviderSpec", "build", self.build, optional=True)


@dataclass(frozen=True, kw_only=True)
class ConverterSpec:
    """HF <-> Megatron checkpoint conversion for a family (``register_converters``).

    Attributes:
        family: the family name.
        mapping: the family's mapping table (a :class:`ferrule.mapping.MappingTable`,
            module-level immutable data), or a lazy ``"module:attr"`` reference to it.
        config_translation: the HF-config <-> ``TransformerConfig`` translation table
            (a :class:`ferrule.config_translation.ConfigTranslation`), or a lazy reference to it.
    """

    family: str
    mapping: Any
    config_translation: Any

    def __post_init__(self) -> None:
        _check_name("ConverterSpec", "family", self.family)
        for fld in ("mapping", "config_translation"):
            value = getattr(self, fld)
            if isinstance(value, str):
                _check_ref("ConverterSpec", fld, value)
            elif value is None:
                raise SpecError(f"ConverterSpec({self.family}).{fld} is required.")

    def resolved_mapping(self) -> Any:
        """The mapping table, importing it if it was given as a reference."""
        return resolve_ref(self.mapping) if isinstance(self.mapping, str) else self.mapping

    def resolved_config_translation(self) -> Any:
        """The config translation, importing it if it was given as a reference."""
        value = self.config_translation
        return resolve_ref(value) if isinstance(value, str) else value


@dataclass(frozen=True, kw_only=True)
class UpdateGroup:
    """Parameters that must reach the rollout engine together, in one bucket.

    A parameter (mcore name) belongs to the group when its name ends with one of
    ``suffixes``; parameters of one group that share the same prefix (e.g. the same
    ``decoder.layers.3.``) form one *unit* that is never split across buckets.

    Attributes:
        key: group name, unique within a table (e.g. ``"attention"``).
        suffixes: mcore parameter-name suffixes, e.g. ``("self_attention.linear_qkv.weight",)``.
        optional: True if a rank may legitimately hold no parameter of this group (e.g. a
            pipeline stage without MoE layers); a non-optional group that matches nothing is
            an error (it catches typos).
    """

    key: str
    suffixes: tuple[str, ...]
    optional: bool = False

    def __post_init__(self) -> None:
        _check_name("UpdateGroup", "key", self.key)
        _check_tuple(f"UpdateGroup({self.key})", "suffixes", self.suffixes)
        empty = [s for s in self.suffixes if not s.strip()]
        if empty:
            raise SpecError(f"UpdateGroup({self.key}).suffixes holds an empty suffix; remove it.")


@dataclass(frozen=True, kw_only=True)
class UpdateGroupTable:
    """A family's ordered update-group table (``register_update_groups``).

    Attributes:
        family: the family name.
        groups: the ordered :class:`UpdateGroup` tuple, or a lazy ``"module:attr"`` reference
            to it (resolved and validated by :meth:`resolved`; the registry hands out resolved
            tables).
    """

    family: str
    groups: tuple[UpdateGroup, ...] | str

    def __post_init__(self) -> None:
        _check_name("UpdateGroupTable", "family", self.family)
        if isinstance(self.groups, str):
            _check_ref(f"UpdateGroupTable({self.family})", "groups", self.groups)
            return
        _check_tuple(f"UpdateGroupTable({self.family})", "groups", self.groups, item_type=UpdateGroup)
        keys = [g.key for g in self.groups]
        if len(set(keys)) != len(keys):
            raise SpecError(f"UpdateGroupTable({self.family}) repeats group keys {keys}; keys must be unique.")
        seen: dict[str, str] = {}
        for g in self.groups:
            for s in g.suffixes:
                if s in seen:
                    raise SpecError(
                        f"UpdateGroupTable({self.family}): suffix {s!r} is claimed by groups "
                        f"{seen[s]!r} and {g.key!r}; a parameter must belong to exactly one group."
                    )
                seen[s] = g.key

    def resolved(self) -> "UpdateGroupTable":
        """This table with ``groups`` imported if it was a reference (validated like a literal one).

        Raises:
            SpecError: the reference names no tuple of :class:`UpdateGroup`, or it breaks a rule.
        """
        if not isinstance(self.groups, str):
            return self
        value = resolve_ref(self.groups)
        if isinstance(value, list):
            value = tuple(value)
        return UpdateGroupTable(family=self.family, groups=value)


@dataclass(frozen=True, kw_only=True)
class LoRAApplierSpec:
    """Attaches, exports and loads LoRA adapters for one module kind (``register_lora_appliers``).

    Attributes:
        kind: one of :data:`LORA_KINDS`.
        family: the family name, or ``"*"`` for an applier that serves every family.
        apply / export / load: lazy references (the contract is :mod:`ferrule.lora.appliers`):
            ``apply(chunk, settings, ctx) -> list[str]`` attaches adapters to one model chunk and
            returns the adapted modules' global mcore names; ``export(entries, ctx)`` yields
            ``(PEFT key, full tensor)`` (collective); ``load(entries, tensors, ctx, *, dry_run)
            -> (used keys, problems)`` copies full PEFT tensors into this rank's shards.
            The core serves ``attention``, ``dense_mlp``, ``shared_experts`` and ``lm_head``
            for megatron's column/row-parallel linears; a spec registered for a kind replaces
            the core's (the family's own first, then a ``"*"`` one).
    """

    kind: str
    family: str
    apply: str
    export: str
    load: str

    def __post_init__(self) -> None:
        if self.kind not in LORA_KINDS:
            raise SpecError(f"LoRAApplierSpec.kind={self.kind!r}; expected one of {list(LORA_KINDS)}.")
        if self.family != "*":
            _check_name("LoRAApplierSpec", "family", self.family)
        for fld in ("apply", "export", "load"):
            _check_ref("LoRAApplierSpec", fld, getattr(self, fld))


@dataclass(frozen=True, kw_only=True)
class ChatTemplateSpec:
    """A chat template (``register_chat_templates``).

    Attributes:
        name: template name, unique across plugins (e.g. ``"qwen2_5"``).
        family: the family whose checkpoints use it.
        template: jinja resource as ``"package:relative/path.jinja"`` (read with
            :mod:`importlib.resources`).
        stop_tokens: token strings that end an assistant turn (e.g. ``("<|im_end|>",)``).
        tokenizer: optional lazy reference to a zero-argument loader returning the HF tokenizer
            that goes with the template (used when a checkpoint ships none, and by
            ``ferrule chat-template render``).
        description: one line for listings.
    """

    name: str
    family: str
    template: str
    stop_tokens: tuple[str, ...]
    tokenizer: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("ChatTemplateSpec", "name", self.name)
        _check_name("ChatTemplateSpec", "family", self.family)
        pkg, sep, path = self.template.partition(":")
        if not sep or not pkg or not path.endswith(".jinja"):
            raise SpecError(
                f"ChatTemplateSpec({self.name}).template={self.template!r}; write "
                f"'package:templates/name.jinja'."
            )
        _check_tuple(f"ChatTemplateSpec({self.name})", "stop_tokens", self.stop_tokens)
        _check_ref(f"ChatTemplateSpec({self.name})", "tokenizer", self.tokenizer, optional=True)

    def read_source(self) -> str:
        """Return the jinja source text of the template (reads the package resource)."""
        from importlib import resources

        pkg, _, path = self.template.partition(":")
        return resources.files(pkg).joinpath(path).read_text(encoding="utf-8")


@dataclass(frozen=True, kw_only=True)
class TowerSpec:
    """A multimodal encoder (``register_towers``) whose embeddings replace placeholder tokens.

    The core (:mod:`ferrule.megatron.towers`) builds the module, attaches it to the first
    pipeline stage's model chunk as ``towers.<name>`` (a plain PyTorch module replicated on every
    TP rank), runs it on a batch's media of this ``modality`` and scatters its output rows into
    the text embeddings at the placeholder positions, in order, before the decoder.

    Attributes:
        family: the family name.
        modality: one of :data:`TOWER_MODALITIES`; ``Datum.media[modality]`` feeds this tower.
        build: lazy reference to ``build(hf_config: dict) -> torch.nn.Module``. The module maps
            one tensor ``[n, ...]`` (the media items of a batch concatenated on dim 0; each
            row fills one placeholder token) to embeddings ``[n, hidden]``; with
            ``item_token_dims > 1`` it takes the *list* of items instead (items of different
            grids cannot be concatenated) and returns ``[sum of their token counts, hidden]``.
        placeholder_token_id: token id whose positions receive the tower's embeddings; or
        placeholder_config_key: the HF config key holding that id (e.g. ``"image_token_id"``,
            read from the top-level config). Exactly one of the two is set.
        name: module name under ``towers.`` (default: ``modality``); mcore parameter names
            start with :attr:`mcore_prefix`.
        hf_prefix: HF checkpoint key prefix of the tower's tensors (e.g. ``"model.visual."``);
            the family's mapping table maps them, ``""`` if the tower has no parameters.
        frozen: True if the tower's parameters are not trained (its own forward then runs under
            ``torch.no_grad``; the scatter and everything after it keep the graph).
        update_group: the key of the family's update group that carries this tower's
            parameters to the rollout engine on every weight sync (default ``"<name>_tower"``);
            the registry checks the family's table has it.
        hf_input: keyword of the family's transformers model ``forward`` that takes this
            modality's items concatenated on dim 0 (embedded rollout; Inkling: ``pixel_values``,
            ``audio_input_ids``); ``""``: the embedded engine refuses this modality.
        preprocess: lazy reference to ``preprocess(source, hf_config: dict) -> torch.Tensor``:
            one media part of a chat message (a file path, bytes, a PIL image, ...) -> the
            tower's input item (dim 0 = its placeholder count); raises ``ValueError`` for bad
            input. ``""``: chat messages cannot carry this modality (callers pass tensors).
        item_token_dims: how many leading dims of an item index its placeholder tokens (their
            product is its token count, row-major = placeholder order). 1 (default): dim 0, the
            items of a batch are concatenated for the tower; 2: an image as a grid of tokens
            ``[rows, cols, ...]`` (Inkling-2), the tower gets the list of items.
        hf_inputs: lazy reference to ``hf_inputs(items: list[Tensor], hf_config: dict) -> dict[str,
            Tensor]``, the transformers model's ``forward`` keywords for the items of one forward
            (e.g. ``pixel_values`` + ``image_grid_thw``); ``""``: the items concatenated on dim 0
            under ``hf_input``. Required when ``item_token_dims > 1``.
    """

    family: str
    modality: str
    build: str
    placeholder_token_id: int | None = None
    placeholder_config_key: str | None = None
    name: str = ""
    hf_prefix: str = ""
    frozen: bool = True
    update_group: str = ""
    hf_input: str = ""
    preprocess: str = ""
    item_token_dims: int = 1
    hf_inputs: str = ""

    def __post_init__(self) -> None:
        _check_name("TowerSpec", "family", self.family)
        if self.modality not in TOWER_MODALITIES:
            raise SpecError(f"TowerSpec.modality={self.modality!r}; expected one of {list(TOWER_MODALITIES)}.")
        _check_ref("TowerSpec", "build", self.build)
        if (self.placeholder_token_id is None) == (self.placeholder_config_key is None):
            raise SpecError(f"TowerSpec({self.family}/{self.modality}): set exactly one of placeholder_token_id and "
                            f"placeholder_config_key (the HF config key holding the placeholder id).")
        if self.placeholder_token_id is not None and (
                not isinstance(self.placeholder_token_id, int) or self.placeholder_token_id < 0):
            raise SpecError(f"TowerSpec.placeholder_token_id={self.placeholder_token_id!r}; expected a token id >= 0.")
        if not self.name:
            object.__setattr__(self, "name", self.modality)
        _check_name("TowerSpec", "name", self.name)
        if self.hf_prefix and not self.hf_prefix.endswith("."):
            raise SpecError(f"TowerSpec({self.family}/{self.name}).hf_prefix={self.hf_prefix!r}; write a dotted "
                            f"prefix ending with '.', e.g. 'model.visual.'.")
        if not self.update_group:
            object.__setattr__(self, "update_group", f"{self.name}_tower")
        _check_ref("TowerSpec", "preprocess", self.preprocess or None, optional=True)
        _check_ref("TowerSpec", "hf_inputs", self.hf_inputs or None, optional=True)
        if not isinstance(self.item_token_dims, int) or isinstance(self.item_token_dims, bool) \
                or self.item_token_dims < 1:
            raise SpecError(f"TowerSpec({self.family}/{self.name}).item_token_dims={self.item_token_dims!r}; expected "
                            f"an int >= 1 (the leading dims of an item that count its placeholder tokens).")
        if self.item_token_dims > 1 and not self.hf_inputs:
            raise SpecError(f"TowerSpec({self.family}/{self.name}): item_token_dims={self.item_token_dims} needs "
                            f"hf_inputs (items of different grids cannot be concatenated under hf_input).")

    def item_tokens(self, item: Any) -> int:
        """Placeholder tokens one input item fills: the product of its first ``item_token_dims`` dims
        (0 if the item has fewer dims)."""
        shape = tuple(getattr(item, "shape", ()))
        if len(shape) < self.item_token_dims:
            return 0
        return int(math.prod(shape[:self.item_token_dims]))

    @property
    def mcore_prefix(self) -> str:
        """Prefix of the tower's mcore parameter names (``"towers.<name>."``)."""
        return f"towers.{self.name}."

    def placeholder_id(self, hf_config: Any) -> int:
        """The placeholder token id for a model with ``hf_config`` (a dict).

        Raises:
            SpecError: ``placeholder_config_key`` is missing from the config or not an int.
        """
        if self.placeholder_token_id is not None:
            return self.placeholder_token_id
        value = hf_config.get(self.placeholder_config_key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SpecError(f"tower {self.family}/{self.name}: HF config key {self.placeholder_config_key!r} is "
                            f"{value!r}; expected the placeholder token id (an int >= 0).")
        return value


@dataclass(frozen=True, kw_only=True)
class CommandSpec:
    """A ``ferrule`` CLI sub-command contributed by a plugin (``register_commands``).

    Attributes:
        name: the sub-command name (``ferrule NAME ...``), lowercase with ``-`` or ``_``.
        app: lazy reference to a ``typer.Typer`` app (mounted as a command group) or to a
            plain function (mounted as one command, its parameters typer options/arguments).
        help: one line for ``ferrule --help``.
    """

    name: str
    app: str
    help: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.match(r"^[a-z][a-z0-9_-]*$", self.name):
            raise SpecError(f"CommandSpec.name={self.name!r}; use a lowercase command name such as 'assets'.")
        _check_ref(f"CommandSpec({self.name})", "app", self.app)


@dataclass(frozen=True, kw_only=True)
class EnvironmentSpec:
    """A named multi-turn environment for the RL launcher (``register_environments``).

    Attributes:
        name: the environment's name (``agent.environment`` in a train config), lower-case
            letters, digits and ``_``; unique across plugins.
        factory: lazy reference to ``factory(**agent.environment_kwargs) -> Environment`` (the
            protocol of :mod:`ferrule.rl.envs`): one object that serves every episode of a run.
        description: one line for ``ferrule plugins`` and the docs.
    """

    name: str
    factory: str
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("EnvironmentSpec", "name", self.name)
        _check_ref(f"EnvironmentSpec({self.name})", "factory", self.factory)


@dataclass(frozen=True, kw_only=True)
class ToolParserSpec:
    """How one family's model writes tool calls (``register_tool_parsers``).

    Attributes:
        family: the family whose turns this parser reads, or ``"*"`` (the default for families
            without their own parser).
        parse: lazy reference to ``parse(text: str) -> ferrule.chat.tool_calls.ParsedTurn``; ``text`` is
            one model turn decoded with its special tokens kept (the stop token removed). A
            malformed call must come back in ``ParsedTurn.errors``, never as an exception.
    """

    family: str
    parse: str

    def __post_init__(self) -> None:
        if self.family != "*":
            _check_name("ToolParserSpec", "family", self.family)
        _check_ref(f"ToolParserSpec({self.family})", "parse", self.parse)
