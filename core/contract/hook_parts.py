"""The one table of hook parts: which ``register_*`` hook yields which spec, and how the registry files it.

:data:`HOOK_PARTS` drives everything that used to keep its own list: registration and lookup
in :mod:`ferrule.contract.registry` (which hook to call, which spec type it must return, where the spec
is indexed, what a duplicate claim is called, which parts a family must have), the
conformance kit's list of a family's specs (:func:`ferrule.conformance.kit.family_specs`) and the
hook-doc meta-test. Adding a collect hook is one row here, one hookspec in
:mod:`ferrule.contract.hookspecs` and one section in ``docs/hooks.md``.

Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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

__all__ = ["HookPart", "HOOK_PARTS", "COLLECT_HOOKS", "FIRST_RESULT_HOOKS", "ALL_HOOKS", "part_for_spec"]


@dataclass(frozen=True)
class HookPart:
    """One collect hook and the registry table it fills.

    Attributes:
        hook: the hook name (``register_*``).
        spec_type: the spec class every returned item must be.
        attr: the :class:`~ferrule.contract.registry.Registry` attribute (a dict) that indexes the specs.
        key: the dict key of a spec (a family name, ``(family, kind)``, a template name).
        claim: what a duplicate claim is called in :class:`~ferrule.contract.registry.DuplicateClaimError`.
        part: the part's name in ``missing_parts`` (``provider``, ``lora``, ...).
        family: the family a spec belongs to (None: not a per-family part, e.g. a CLI command).
        required: ``"always"`` (a VALIDATED/UNSTABLE family must have it), ``"feature"`` (only
            when the family lists ``part`` in ``ModelFamilySpec.features``) or ``"never"``.
        callables: fields holding lazy ``"module:attr"`` references to callables (the kit
            resolves them and checks they are callable).
        data: fields that may hold lazy references to data (tables); the kit resolves them.
    """

    hook: str
    spec_type: type
    attr: str
    key: Callable[[Any], Any]
    claim: str
    part: str
    family: Callable[[Any], str] | None
    required: Literal["always", "feature", "never"] = "never"
    callables: tuple[str, ...] = ()
    data: tuple[str, ...] = ()

    def claim_key(self, spec: Any) -> str:
        """The claimed key as text (``family/kind`` for pair keys)."""
        key = self.key(spec)
        return "/".join(key) if isinstance(key, tuple) else str(key)


#: Every collect hook, in registration order (families first: other parts are joined to them).
HOOK_PARTS: tuple[HookPart, ...] = (
    HookPart("register_model_families", ModelFamilySpec, "families", lambda s: s.name, "family", "family",
             lambda s: s.name, callables=("hf_model_class",)),
    HookPart("register_providers", ProviderSpec, "providers", lambda s: s.family, "provider for family",
             "provider", lambda s: s.family, "always", callables=("build",)),
    HookPart("register_converters", ConverterSpec, "converters", lambda s: s.family, "converter for family",
             "converter", lambda s: s.family, "always", data=("mapping", "config_translation")),
    HookPart("register_update_groups", UpdateGroupTable, "update_groups", lambda s: s.family,
             "update-group table for family", "update_groups", lambda s: s.family, "always", data=("groups",)),
    HookPart("register_lora_appliers", LoRAApplierSpec, "lora_appliers", lambda s: (s.family, s.kind),
             "LoRA applier", "lora", lambda s: s.family, "feature", callables=("apply", "export", "load")),
    HookPart("register_chat_templates", ChatTemplateSpec, "chat_templates", lambda s: s.name, "chat template",
             "chat_template", lambda s: s.family, "feature", callables=("tokenizer",)),
    HookPart("register_towers", TowerSpec, "towers", lambda s: (s.family, s.modality), "tower", "towers",
             lambda s: s.family, "feature", callables=("build",)),
    HookPart("register_commands", CommandSpec, "commands", lambda s: s.name, "CLI command", "command", None),
    HookPart("register_environments", EnvironmentSpec, "environments", lambda s: s.name, "environment",
             "environment", None, callables=("factory",)),
    HookPart("register_tool_parsers", ToolParserSpec, "tool_parsers", lambda s: s.family,
             "tool-call parser for family", "tool_parser", None, callables=("parse",)),
)

COLLECT_HOOKS: tuple[str, ...] = tuple(p.hook for p in HOOK_PARTS)
#: Hooks where the first non-None answer wins (not part of the table: they return no specs).
FIRST_RESULT_HOOKS: tuple[str, ...] = ("resolve_model_family",)
#: Every hook of :mod:`ferrule.contract.hookspecs`.
ALL_HOOKS: tuple[str, ...] = COLLECT_HOOKS + FIRST_RESULT_HOOKS

_BY_TYPE = {p.spec_type: p for p in HOOK_PARTS}


def part_for_spec(spec: Any) -> HookPart:
    """The row whose ``spec_type`` is the spec's class.

    Raises:
        TypeError: not a spec of any hook.
    """
    try:
        return _BY_TYPE[type(spec)]
    except KeyError:
        raise TypeError(f"{type(spec).__name__} is not a spec any ferrule hook returns; "
                        f"expected one of {[t.__name__ for t in _BY_TYPE]}.") from None
