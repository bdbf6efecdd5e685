"""Shared config rows for decoders with one RoPE per layer type (Gemma-3 text; Inkling-2-style families).

HF configs of this shape carry ``layer_types`` (one name per decoder layer, e.g.
``"sliding_attention"`` / ``"full_attention"``) and a ``rope_parameters`` dict keyed by those
names, each value a flat RoPE dict (``rope_type``, ``rope_theta``, ``factor``,
``partial_rotary_factor``); e.g. transformers 5.24 ``Gemma3TextConfig.convert_rope_params_to_dict``
and ``Gemma3RotaryEmbedding``, which computes one inverse-frequency table per type and gives layer
``i`` the table of ``layer_types[i]``.

:data:`LAYER_TYPE_ROPE_ENTRIES` translate that into the builder option ``layer_rope`` (one entry
per layer: ``{"layer_type", "rotary_base", "rope_scaling", "rotary_percent"}``,
:mod:`ferrule.megatron.layer_options`), validating each type's RoPE like the flat rows do
(:data:`ferrule.config_translation.SUPPORTED_ROPE_TYPES`), and write ``rope_parameters`` back per
type. A family uses them *instead of* its own ``Derived("rotary_base", ...)`` row; the flat
:data:`~ferrule.config_translation.ROPE_SCALING_ENTRIES` inside ``DECODER_ENTRIES`` recognise
the per-type form and stay neutral. The rows also declare transformers' private
``_sliding_window_pattern`` (Gemma-3's legacy layer pattern, already folded into ``layer_types``)
harmless, so no family has to.

Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

from typing import Any, Mapping

from .decoder import (
    is_per_layer_type_rope,
    rope_scaling_from_hf,
    rope_theta_from_hf,
    rope_theta_to_hf,
    rotary_percent_from_hf,
)
from .vocabulary import ConfigTranslationError, Derived, Harmless, register_shared_rows

__all__ = ["LAYER_TYPE_ROPE_ENTRIES", "layer_rope_from_hf", "layer_rope_to_hf"]


def layer_rope_from_hf(hf: Mapping[str, Any]) -> tuple[dict, ...]:
    """Model option ``layer_rope`` from HF ``rope_parameters.{type}`` and ``layer_types``.

    Raises:
        ConfigTranslationError: no ``layer_types``, ``rope_parameters`` not keyed by every layer
            type, or a type whose RoPE megatron cannot reproduce (naming the type and the key).
    """
    if not is_per_layer_type_rope(hf):
        raise ConfigTranslationError(
            f"HF config needs 'layer_types' and a 'rope_parameters' dict keyed by each layer type "
            f"(got layer_types={hf.get('layer_types')!r}, rope_parameters={hf.get('rope_parameters')!r}); this "
            f"family translates one RoPE per layer type.")
    per_type = {}
    for layer_type in dict.fromkeys(hf["layer_types"]):
        flat = {"rope_parameters": dict(hf["rope_parameters"][layer_type])}
        try:
            per_type[layer_type] = {"layer_type": layer_type, "rotary_base": rope_theta_from_hf(flat),
                                    "rope_scaling": rope_scaling_from_hf(flat),
                                    "rotary_percent": rotary_percent_from_hf(flat)}
        except ConfigTranslationError as exc:
            raise ConfigTranslationError(f"HF 'rope_parameters.{layer_type}': {exc}") from None
    return tuple(per_type[t] for t in hf["layer_types"])


def layer_rope_to_hf(value: tuple, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`layer_rope_from_hf`: ``rope_parameters`` with one flat RoPE dict per layer type
    (``layer_types`` itself is written by the window rows / kept from ``base``)."""
    params = {}
    for entry in value:
        flat = rope_theta_to_hf(entry["rotary_base"], {}, {"rope_scaling": entry.get("rope_scaling"),
                                                           "rotary_percent": entry.get("rotary_percent", 1.0)})
        params[entry["layer_type"]] = flat["rope_parameters"]
    return {"rope_parameters": params}


#: One RoPE per layer type (module docs): the ``layer_rope`` option and the harmless private pattern key.
LAYER_TYPE_ROPE_ENTRIES: tuple = (
    Derived("layer_rope", layer_rope_from_hf, layer_rope_to_hf, hf_keys=("rope_parameters",), target="option",
            reads=("layer_types",)),
    Harmless("_sliding_window_pattern", "transformers' legacy sliding/full pattern; transformers folds it into "
             "layer_types, which the window rows and layer_rope translate"),
    Harmless("sliding_window_pattern", "legacy spelling of the layer pattern, folded into layer_types by transformers"),
)
register_shared_rows("LAYER_TYPE_ROPE_ENTRIES", LAYER_TYPE_ROPE_ENTRIES)
