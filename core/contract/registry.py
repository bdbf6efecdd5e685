"""Plugin discovery and the typed facade over ferrule's hooks.

This is the only module that calls ``pm.hook``. Everything else asks the facade:
:func:`get_family`, :func:`family_for_hf_config`, :func:`get_provider`,
:func:`get_converter`, :func:`get_update_groups`, :func:`get_chat_template`,
:func:`chat_templates_for`, :func:`get_towers`, :func:`iter_lora_appliers`.

Loading rules (DESIGN.md §3):

- entry points of group ``ferrule`` are loaded one at a time, each isolated: an entry point
  that fails to import, registers a hookimpl that matches no hookspec (a misspelling,
  caught by ``pm.check_pending()``), or raises inside a ``register_*`` hook is recorded in
  :attr:`Registry.failures` (distribution, version, entry point, traceback) and the rest keep
  working;
- ``FERRULE_STRICT_PLUGINS=1`` turns every such failure into an exception (CI sets it);
- ``FERRULE_PLUGINS=a,b`` loads only the entry points (or distributions) named;
- two plugins claiming the same family name, model_type, chat-template name, or the same
  per-family part raise :class:`DuplicateClaimError` naming both distributions.

Discovery imports neither torch nor megatron (a test checks it).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata  # tests patch registry.metadata.entry_points
from typing import Any

import pluggy

from ferrule import ENTRY_POINT_GROUP, PROJECT_NAME, envs
from ferrule.contract import hookspecs
from ferrule.contract.hook_parts import ALL_HOOKS, COLLECT_HOOKS, HOOK_PARTS, part_for_spec
from ferrule.contract.specs import (
    DEFAULT_PROVIDER_BUILD,
    LORA_KINDS,
    ChatTemplateSpec,
    CommandSpec,
    ConverterSpec,
    EnvironmentSpec,
    FamilyStatus,
    LoRAApplierSpec,
    ModelFamilySpec,
    ProviderSpec,
    SpecError,
    ToolParserSpec,
    TowerSpec,
    UpdateGroupTable,
)
from ferrule.contract.specs import resolve_ref

__all__ = [
    "PluginError",
    "PluginLoadError",
    "DuplicateClaimError",
    "UnknownModelError",
    "IncompleteFamilyError",
    "LoadFailure",
    "PluginInfo",
    "Registry",
    "get_plugin_manager",
    "get_registry",
    "reset_registry",
    "get_family",
    "list_families",
    "family_for_hf_config",
    "hf_model_class",
    "get_provider",
    "provider_build",
    "get_converter",
    "get_update_groups",
    "get_chat_template",
    "chat_templates_for",
    "get_towers",
    "iter_lora_appliers",
    "list_commands",
    "list_environments",
    "get_environment",
    "get_tool_parser",
    "missing_parts",
    "register_object",
    "strict_plugins",
    "STRICT_ENV",
    "ALLOW_ENV",
]

# -- loading: entry points, each in isolation, and the plugin layer's errors

STRICT_ENV = "FERRULE_STRICT_PLUGINS"
ALLOW_ENV = "FERRULE_PLUGINS"


class PluginError(RuntimeError):
    """Base class of registry errors."""


class PluginLoadError(PluginError):
    """A plugin failed to load or register (raised in strict mode; recorded otherwise)."""


class DuplicateClaimError(PluginError):
    """Two plugins claim the same family, model_type, template name or family part."""


class UnknownModelError(PluginError, KeyError):
    """No registered family matches the requested name, model_type or HF config."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class IncompleteFamilyError(PluginError):
    """A family lacks a part it needs (provider, converter, update groups, or a declared feature)."""


def _strict() -> bool:
    return envs.flag(STRICT_ENV)


def strict_plugins() -> bool:
    """True when ``FERRULE_STRICT_PLUGINS`` makes every plugin failure fatal."""
    return _strict()


def _allow_list() -> set[str] | None:
    raw = (envs.get(ALLOW_ENV) or "").strip()
    if not raw:
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


@dataclass(frozen=True)
class LoadFailure:
    """One plugin that did not load (shown by ``ferrule plugins``)."""

    distribution: str
    version: str
    entry_point: str
    stage: str  # "import", "validate" (check_pending) or the hook name that raised
    error: str
    traceback: str


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin."""

    name: str  # entry-point name (also the pluggy plugin name)
    distribution: str
    version: str
    module: str
    hooks: tuple[str, ...]


def get_plugin_manager(load_entrypoints: bool = True) -> tuple[pluggy.PluginManager, list[PluginInfo], list[LoadFailure]]:
    """Build a fresh plugin manager with ferrule's hookspecs.

    Args:
        load_entrypoints: load the ``ferrule`` entry points (isolated, see module docs).

    Returns:
        ``(pm, plugins, failures)``.

    Raises:
        PluginLoadError: in strict mode, the first plugin that fails to load.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    plugins: list[PluginInfo] = []
    failures: list[LoadFailure] = []
    if load_entrypoints:
        allow = _allow_list()
        seen_names: dict[str, str] = {}
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            ver = ep.dist.version if ep.dist is not None else "?"
            if allow is not None and ep.name not in allow and dist not in allow:
                continue
            if ep.name in seen_names and seen_names[ep.name] != dist:
                err = DuplicateClaimError(
                    f"entry point name {ep.name!r} in group {ENTRY_POINT_GROUP!r} is registered by both "
                    f"{seen_names[ep.name]!r} and {dist!r}; rename one of them."
                )
                raise err
            seen_names[ep.name] = dist
            info, failure = _load_one(pm, ep.name, dist, ver, lambda ep=ep: ep.load())
            if info:
                plugins.append(info)
            if failure:
                failures.append(failure)
        if allow is not None:
            known = set(seen_names) | set(seen_names.values())
            all_eps = {e.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP)}
            all_dists = {e.dist.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.dist is not None}
            for name in sorted(allow - known):
                msg = (f"{ALLOW_ENV} names {name!r}, which is no installed entry point or distribution of group "
                       f"{ENTRY_POINT_GROUP!r}; installed: {', '.join(sorted(all_eps | all_dists)) or 'none'}")
                if _strict():
                    raise PluginLoadError(msg)
                failures.append(LoadFailure(name, "", name, "allow-list", msg, ""))
    return pm, plugins, failures


def register_object(pm: pluggy.PluginManager, obj: Any, name: str, distribution: str = "<local>",
                    version: str = "") -> tuple[PluginInfo | None, LoadFailure | None]:
    """Register an in-process plugin object (module or instance) with the same isolation and
    validation as an entry point. Used by tests and by embedding applications."""
    return _load_one(pm, name, distribution, version, lambda: obj)


def _load_one(pm, name, dist, ver, loader) -> tuple[PluginInfo | None, LoadFailure | None]:
    def fail(stage: str, exc: BaseException) -> tuple[None, LoadFailure]:
        failure = LoadFailure(dist, ver, name, stage, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if _strict():
            raise PluginLoadError(
                f"plugin {name!r} from distribution {dist!r} {ver} failed at {stage}: {failure.error}\n"
                f"(strict mode: {STRICT_ENV}=1; unset it to skip broken plugins)"
            ) from exc
        return None, failure

    try:
        obj = loader()
    except Exception as exc:  # noqa: BLE001 - isolation is the point
        return fail("import", exc)
    try:
        pm.register(obj, name=name)
        _check_pending_for(pm, name)
    except Exception as exc:  # noqa: BLE001
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
        return fail("validate", exc)
    hooks = tuple(sorted(h.name for h in pm.get_hookcallers(obj) or ()))
    module = getattr(obj, "__name__", type(obj).__module__)
    return PluginInfo(name, dist, ver, module, hooks), None


def _check_pending_for(pm: pluggy.PluginManager, name: str) -> None:
    """``pm.check_pending()`` restricted to one plugin, so one misspelling fails one plugin."""
    for hook_name in dir(pm.hook):
        if hook_name.startswith("_"):
            continue
        caller = getattr(pm.hook, hook_name)
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin_name == name and not impl.optionalhook:
                raise pluggy.PluginValidationError(
                    impl.plugin,
                    f"plugin {name!r} implements unknown hook {hook_name!r}; known hooks: "
                    f"{', '.join(ALL_HOOKS)}. Check the spelling.",
                )
    pm.check_pending()


# -- the lookups

#: Collect hooks, in registration order (from the one table, :data:`ferrule.contract.hook_parts.HOOK_PARTS`).
_COLLECT_HOOKS = COLLECT_HOOKS


@dataclass
class Registry:
    """Specs collected from every loaded plugin, indexed and validated.

    Build it with :func:`get_registry` (cached per process) or ``Registry.build(pm, ...)``.
    """

    pm: pluggy.PluginManager
    plugins: list[PluginInfo]
    failures: list[LoadFailure]
    families: dict[str, ModelFamilySpec] = field(default_factory=dict)
    owners: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, key) -> distribution
    model_types: dict[str, str] = field(default_factory=dict)
    providers: dict[str, ProviderSpec] = field(default_factory=dict)
    converters: dict[str, ConverterSpec] = field(default_factory=dict)
    update_groups: dict[str, UpdateGroupTable] = field(default_factory=dict)
    lora_appliers: dict[tuple[str, str], LoRAApplierSpec] = field(default_factory=dict)
    chat_templates: dict[str, ChatTemplateSpec] = field(default_factory=dict)
    towers: dict[tuple[str, str], TowerSpec] = field(default_factory=dict)
    commands: dict[str, CommandSpec] = field(default_factory=dict)
    environments: dict[str, EnvironmentSpec] = field(default_factory=dict)
    tool_parsers: dict[str, ToolParserSpec] = field(default_factory=dict)
    family_plugin: dict[str, str] = field(default_factory=dict)  # family -> entry-point name

    @classmethod
    def build(cls, pm: pluggy.PluginManager, plugins: list[PluginInfo] | None = None,
              failures: list[LoadFailure] | None = None) -> Registry:
        reg = cls(pm=pm, plugins=list(plugins or []), failures=list(failures or []))
        dist_of = {p.name: p.distribution for p in reg.plugins}
        for hook_name in _COLLECT_HOOKS:
            caller = getattr(pm.hook, hook_name)
            # Collect hooks are called implementation by implementation, so that every spec is
            # attributed to its distribution (duplicate claims must name both packages) and a
            # plugin that raises is isolated like a failed import.
            for impl in caller.get_hookimpls():  # registration order
                dist = dist_of.get(impl.plugin_name, impl.plugin_name)
                try:
                    result = impl.function()
                    specs = _as_specs(hook_name, impl.plugin_name, result)
                except Exception as exc:  # noqa: BLE001
                    reg._record_hook_failure(impl.plugin_name, dist, hook_name, exc)
                    continue
                for spec in specs:
                    reg._add(hook_name, spec, dist)
                    if isinstance(spec, ModelFamilySpec):
                        reg.family_plugin[spec.name] = impl.plugin_name
        return reg

    def _record_hook_failure(self, plugin_name: str, dist: str, hook_name: str, exc: Exception) -> None:
        ver = next((p.version for p in self.plugins if p.name == plugin_name), "")
        if _strict():
            raise PluginLoadError(
                f"plugin {plugin_name!r} from {dist!r} raised in {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc
        self.failures.append(LoadFailure(dist, ver, plugin_name, hook_name,
                                         f"{type(exc).__name__}: {exc}", traceback.format_exc()))

    def _claim(self, kind: str, key: str, dist: str) -> None:
        prev = self.owners.get((kind, key))
        if prev is not None:
            raise DuplicateClaimError(
                f"{kind} {key!r} is claimed by both distribution {prev!r} and distribution {dist!r}; "
                f"uninstall one of them or restrict loading with {ALLOW_ENV}=<entry point names>."
            )
        self.owners[(kind, key)] = dist

    def _add(self, hook_name: str, spec: Any, dist: str) -> None:
        part = part_for_spec(spec)
        self._claim(part.claim, part.claim_key(spec), dist)
        if isinstance(spec, ModelFamilySpec):
            for mt in spec.model_types:
                self._claim("model_type", mt, dist)
                self.model_types[mt] = spec.name
        getattr(self, part.attr)[part.key(spec)] = spec

    # -- queries ------------------------------------------------------------------------

    def _unknown(self, what: str) -> UnknownModelError:
        fams = ", ".join(f"{n} (model_types: {', '.join(s.model_types)})" for n, s in sorted(self.families.items()))
        msg = f"{what}. Registered families: {fams or 'none'}."
        if self.failures:
            msg += " Plugins that failed to load: " + "; ".join(
                f"{f.entry_point} from {f.distribution} ({f.stage}: {f.error})" for f in self.failures
            ) + "."
        msg += " Install a plugin package for this model (see docs/plugins.md) or run `ferrule plugins`."
        return UnknownModelError(msg)

    def get_family(self, name_or_model_type: str) -> ModelFamilySpec:
        if name_or_model_type in self.families:
            return self.families[name_or_model_type]
        if name_or_model_type in self.model_types:
            return self.families[self.model_types[name_or_model_type]]
        raise self._unknown(f"no family or model_type named {name_or_model_type!r}")

    def family_for_hf_config(self, hf_config: Mapping[str, Any]) -> ModelFamilySpec:
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"hf_config must be the parsed config.json (a dict), got {type(hf_config).__name__}")
        candidates = [hf_config.get("model_type")]
        text_cfg = hf_config.get("text_config")
        if isinstance(text_cfg, Mapping):
            candidates.append(text_cfg.get("model_type"))
        for mt in candidates:
            if isinstance(mt, str) and mt in self.model_types:
                return self.families[self.model_types[mt]]
        name = self.pm.hook.resolve_model_family(hf_config=dict(hf_config))
        if name is not None:
            if name not in self.families:
                raise self._unknown(f"a plugin resolved this config to family {name!r}, which is not registered")
            return self.families[name]
        shown = [c for c in candidates if c]
        raise self._unknown(f"no plugin supports model_type {shown[0] if shown else None!r}")

    def _part(self, table: Mapping[str, Any], family: str, what: str) -> Any:
        fam = self.get_family(family).name
        if fam not in table:
            spec = self.families[fam]
            raise IncompleteFamilyError(
                f"family {fam!r} has no {what} registered (status {spec.status.name}: {spec.reason or 'n/a'}). "
                f"Its plugin must implement the matching register_* hook."
            )
        return table[fam]

    def get_provider(self, family: str) -> ProviderSpec:
        return self._part(self.providers, family, "provider")

    def get_converter(self, family: str) -> ConverterSpec:
        return self._part(self.converters, family, "converter")

    def get_update_groups(self, family: str) -> UpdateGroupTable:
        """The family's update-group table with ``groups`` resolved (a lazy reference is imported once)."""
        table = self._part(self.update_groups, family, "update-group table")
        if isinstance(table.groups, str):
            table = self.update_groups[table.family] = table.resolved()
        return table

    def provider_build(self, family: str) -> Any:
        """The family's provider: ``build(hf_config, layout, **options)`` building its Megatron model.

        ``ProviderSpec.build`` when given; else :data:`ferrule.contract.specs.DEFAULT_PROVIDER_BUILD`
        with the family's config-translation rows (``ConverterSpec.config_translation``). Towers
        are not attached here (the registry imports no engine):
        :func:`ferrule.megatron.provider.provider_build` composes the two.
        """
        import functools

        spec = self.get_provider(family)
        if spec.build is not None:
            return resolve_ref(spec.build)
        translation = self.get_converter(spec.family).resolved_config_translation()
        return functools.partial(_default_build, resolve_ref(DEFAULT_PROVIDER_BUILD), translation)

    def get_chat_template(self, name: str) -> ChatTemplateSpec:
        if name in self.chat_templates:
            return self.chat_templates[name]
        raise UnknownModelError(
            f"no chat template named {name!r}; registered: {sorted(self.chat_templates) or 'none'}"
        )

    def chat_templates_for(self, family: str) -> list[ChatTemplateSpec]:
        fam = self.get_family(family).name
        return [s for s in self.chat_templates.values() if s.family == fam]

    def get_towers(self, family: str) -> list[TowerSpec]:
        fam = self.get_family(family).name
        return [s for (f, _), s in sorted(self.towers.items()) if f == fam]

    def iter_lora_appliers(self, family: str) -> Iterator[LoRAApplierSpec]:
        fam = self.get_family(family).name
        for kind in LORA_KINDS:
            spec = self.lora_appliers.get((fam, kind)) or self.lora_appliers.get(("*", kind))
            if spec is not None:
                yield spec

    def missing_parts(self, family: str) -> list[str]:
        """Parts the family needs but lacks (empty list = complete), in :data:`HOOK_PARTS` order."""
        spec = self.get_family(family)
        missing = []
        for part in HOOK_PARTS:
            needed = part.required == "always" or (part.required == "feature" and part.part in spec.features)
            if needed and not any(part.family(s) == spec.name for s in getattr(self, part.attr).values()):
                missing.append(part.part)
        return missing

    def check_complete(self) -> None:
        """Raise :class:`IncompleteFamilyError` for any VALIDATED/UNSTABLE family with missing parts,
        and for parts registered for a family that does not exist."""
        problems = []
        for name, spec in sorted(self.families.items()):
            if spec.status is not FamilyStatus.STRUCTURAL:
                missing = self.missing_parts(name)
                if missing:
                    problems.append(f"{name} ({spec.status.name}) lacks {', '.join(missing)}")
        for part in HOOK_PARTS:
            if part.family is None or part.spec_type is ModelFamilySpec:
                continue
            for spec in getattr(self, part.attr).values():
                fam = part.family(spec)
                if fam != "*" and fam not in self.families:
                    problems.append(f"{part.part} {part.claim_key(spec)!r} registered for unknown family {fam!r}")
        if problems:
            raise IncompleteFamilyError("incomplete plugin registrations: " + "; ".join(problems) +
                                        ". A family marked VALIDATED or UNSTABLE must register every part; "
                                        "mark it STRUCTURAL with a reason until it does.")


def _default_build(builder: Any, translation: Any, hf_config: Any, layout: Any, **options: Any) -> Any:
    """``builder(hf_config, layout, translation, **options)``: the provider of a family without ``build``."""
    return builder(hf_config, layout, translation, **options)


def _as_specs(hook_name: str, plugin_name: str, result: Any) -> list[Any]:
    if result is None:
        return []
    if not isinstance(result, Iterable) or isinstance(result, (str, bytes)):
        result = [result]
    expected = next(p.spec_type for p in HOOK_PARTS if p.hook == hook_name)
    out = list(result)
    for spec in out:
        if not isinstance(spec, expected):
            raise SpecError(
                f"plugin {plugin_name!r}: {hook_name} returned {type(spec).__name__}; expected {expected.__name__} "
                f"instances (from ferrule.contract.specs)."
            )
    return out


_LOCK = threading.Lock()
_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry (entry points loaded once, then cached)."""
    global _REGISTRY
    with _LOCK:
        if _REGISTRY is None:
            pm, plugins, failures = get_plugin_manager(load_entrypoints=True)
            reg = Registry.build(pm, plugins, failures)
            if _strict():
                reg.check_complete()
            _REGISTRY = reg
        return _REGISTRY


def reset_registry() -> None:
    """Forget the cached registry (tests, or after installing a plugin in-process)."""
    global _REGISTRY
    with _LOCK:
        _REGISTRY = None


# -- module-level facade ----------------------------------------------------------------


def get_family(name_or_model_type: str) -> ModelFamilySpec:
    """The family registered under a family name or an HF ``model_type``.

    Raises:
        UnknownModelError: listing registered families and plugins that failed to load.
    """
    return get_registry().get_family(name_or_model_type)


def list_families() -> list[ModelFamilySpec]:
    """All registered families, sorted by name."""
    reg = get_registry()
    return [reg.families[n] for n in sorted(reg.families)]


def family_for_hf_config(hf_config: Mapping[str, Any]) -> ModelFamilySpec:
    """The family of a checkpoint, from its parsed ``config.json``.

    Looks up ``model_type``, then ``text_config.model_type``, then asks the
    ``resolve_model_family`` hook.

    Raises:
        UnknownModelError: no plugin supports it (lists registered families and load failures).
    """
    return get_registry().family_for_hf_config(hf_config)


def hf_model_class(hf_config: Any) -> Any:
    """The transformers model class the checkpoint's family registers (``ModelFamilySpec.hf_model_class``).

    Args:
        hf_config: the parsed ``config.json`` (a dict) or a transformers ``PretrainedConfig``.

    Returns:
        The resolved class (imports the family's module, and so transformers).

    Raises:
        UnknownModelError: no plugin supports the config.
        IncompleteFamilyError: the family declares no ``hf_model_class``.
    """
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    family = family_for_hf_config(cfg)
    if not family.hf_model_class:
        raise IncompleteFamilyError(f"family {family.name!r} declares no hf_model_class, so no transformers model "
                                    "can be built for it; pass model_class= explicitly or use the sglang engine.")
    return resolve_ref(family.hf_model_class)


def get_provider(family: str) -> ProviderSpec:
    """The provider spec of a family. Raises IncompleteFamilyError / UnknownModelError."""
    return get_registry().get_provider(family)


def provider_build(family: str) -> Any:
    """The family's provider alone, towers not attached (see :meth:`Registry.provider_build`;
    :func:`ferrule.megatron.provider.provider_build` attaches them).

    Raises:
        IncompleteFamilyError / UnknownModelError: no provider (or, for the default build, no converter).
    """
    return get_registry().provider_build(family)


def list_commands() -> list[CommandSpec]:
    """CLI sub-commands contributed by plugins (``register_commands``), sorted by name."""
    reg = get_registry()
    return [reg.commands[n] for n in sorted(reg.commands)]


def list_environments() -> list[EnvironmentSpec]:
    """Environments registered by plugins (``register_environments``), sorted by name."""
    reg = get_registry()
    return [reg.environments[n] for n in sorted(reg.environments)]


def get_environment(name: str) -> EnvironmentSpec:
    """The environment spec called ``name``.

    Raises:
        UnknownModelError: no plugin registers it (the message lists those that do, and the plugins that
            failed to load: a broken environment package registers nothing).
    """
    reg = get_registry()
    if name not in reg.environments:
        known = ", ".join(sorted(reg.environments)) or "none"
        failed = "".join(f" Plugin {f.entry_point!r} of {f.distribution!r} failed to load ({f.stage}: {f.error}); "
                         "it may be the one: `ferrule plugins` shows it." for f in reg.failures)
        raise UnknownModelError(f"no plugin registers an environment called {name!r}; registered: {known}.{failed} "
                                "Install the package that provides it (docs/agents.md) or fix agent.environment.")
    return reg.environments[name]


def get_tool_parser(family: str) -> ToolParserSpec | None:
    """The tool-call parser of ``family``, else the ``"*"`` one, else None."""
    reg = get_registry()
    return reg.tool_parsers.get(family) or reg.tool_parsers.get("*")


def get_converter(family: str) -> ConverterSpec:
    """The converter spec of a family. Raises IncompleteFamilyError / UnknownModelError."""
    return get_registry().get_converter(family)


def get_update_groups(family: str) -> UpdateGroupTable:
    """The update-group table of a family. Raises IncompleteFamilyError / UnknownModelError."""
    return get_registry().get_update_groups(family)


def get_chat_template(name: str) -> ChatTemplateSpec:
    """A chat template by name. Raises UnknownModelError listing registered templates."""
    return get_registry().get_chat_template(name)


def chat_templates_for(family: str) -> list[ChatTemplateSpec]:
    """Chat templates registered for a family (possibly empty)."""
    return get_registry().chat_templates_for(family)


def get_towers(family: str) -> list[TowerSpec]:
    """Towers registered for a family, sorted by modality (possibly empty)."""
    return get_registry().get_towers(family)


def iter_lora_appliers(family: str) -> Iterator[LoRAApplierSpec]:
    """One applier per LoRA kind: the family's own, else the ``"*"`` one."""
    return get_registry().iter_lora_appliers(family)


def missing_parts(family: str) -> list[str]:
    """Parts a family lacks (see :meth:`Registry.missing_parts`)."""
    return get_registry().missing_parts(family)
