"""Plugin loading: entry points of group ``ferrule``, each loaded in isolation, and the errors
of the plugin layer. :mod:`ferrule.registry` builds its lookups on it and re-exports every
public name here.

- an entry point that fails to import, registers a hookimpl that matches no hookspec (caught by
  ``pm.check_pending()``) is recorded as a :class:`LoadFailure` and the rest keep working;
- ``FERRULE_STRICT_PLUGINS=1`` turns every such failure into an exception (CI sets it);
- ``FERRULE_PLUGINS=a,b`` loads only the entry points (or distributions) named.

Imports neither torch nor megatron.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from ferrule import envs
from ferrule import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from ferrule.hook_parts import ALL_HOOKS

__all__ = ["STRICT_ENV", "ALLOW_ENV", "PluginError", "PluginLoadError", "DuplicateClaimError", "UnknownModelError",
           "IncompleteFamilyError", "LoadFailure", "PluginInfo", "get_plugin_manager", "register_object",
           "strict_plugins"]

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
