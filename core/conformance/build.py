"""The cheap build check ``ferrule plugins`` runs for every family (no torch, no megatron, no weights).

:func:`family_build_check` resolves the family's lazy references (provider build, mapping table, config
translation, update-group table) and, for the default build, checks the model options the translation's rows
produce against the names the builder knows (:mod:`ferrule.megatron.option_names`); with ``parse=True``
(``ferrule plugins --check``) it also translates ``TINY_HF_CONFIG`` as transformers parses it
(``ConfigTranslation.to_mcore``: untranslated keys, unread ``rope_parameters`` fields, refused values).
What it catches is what made a published package unusable without
``ferrule plugins`` saying so: a renamed option (round 3's Gemma-3 ``local_rotary_base``), a row that names
a key the new transformers parses differently, a reference to a moved attribute.
"""

from __future__ import annotations

import warnings
from ferrule.config_translation import Constant, Derived, Field
from ferrule.contract import registry
from ferrule.contract.specs import DEFAULT_PROVIDER_BUILD, resolve_ref
from ferrule.megatron.option_names import DEPRECATED_OPTION_NAMES, unknown_model_options

__all__ = ["family_build_check"]


def _option_names(translation) -> set[str]:
    """The model-option names the translation's rows produce (``target="option"``), read from the rows: no
    config needed."""
    return {e.mcore for e in translation.entries
            if isinstance(e, (Field, Constant, Derived)) and getattr(e, "target", "config") == "option"}


def family_build_check(family: str, *, parse: bool = False) -> tuple[str, str]:
    """``(verdict, detail)``: ``("ok", "")``, ``("deprecated", what to change)`` (builds, with a warning), or
    ``("broken", the first error as one line)``. Never raises for a plugin's error.

    Always (``ferrule plugins``; no torch): the lazy references resolve, and, for the default build, every
    model option the translation's rows produce is one the builder knows. ``parse=True`` (``ferrule plugins
    --check``) also translates ``TINY_HF_CONFIG`` as transformers parses it (``to_mcore``: the unknown-key
    check, refused values; importing transformers imports torch, seconds per call)."""
    try:
        provider = registry.get_provider(family)
        converter = registry.get_converter(family)
        if provider.build not in (None, DEFAULT_PROVIDER_BUILD):
            resolve_ref(provider.build)
        converter.resolved_mapping()
        translation = converter.resolved_config_translation()
        registry.get_update_groups(family).groups  # noqa: B018 - resolves a lazy table
        if parse:
            from ferrule.conformance.numeric import tiny_hf_config

            tiny = tiny_hf_config(family)
            if tiny is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # shared-row overlaps are reported when the plugin loads
                    translation.to_mcore(tiny)
    except Exception as exc:  # noqa: BLE001 - a plugin's error is the verdict
        return "broken", " ".join(f"{type(exc).__name__}: {exc}".split())
    if provider.build not in (None, DEFAULT_PROVIDER_BUILD):
        return "ok", ""  # a custom provider may read options of its own

    options = _option_names(translation)
    unknown = unknown_model_options(options)
    if unknown:
        return "broken", (f"translation {translation.name!r} produces model option(s) {unknown} that the default "
                          f"build does not know (docs/plugins.md, section 4b)")
    old = sorted(options & set(DEPRECATED_OPTION_NAMES))
    if old:
        return "deprecated", "; ".join(f"model option {k!r} is deprecated: use {DEPRECATED_OPTION_NAMES[k]}"
                                       for k in old)
    return "ok", ""
