"""Per-layer ``layer_types`` in HF configs: one RoPE per layer type (Gemma-3 text; Inkling-2-style families)
and the local / global pattern of the Inkling lineage (Inkling, Inkling-2).

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

:func:`sliding_layers_from_hf` / :func:`sliding_layers_to_hf` translate the ``"hybrid_sliding"`` (local,
sliding-window) / ``"hybrid"`` (global) ``layer_types`` of ``InklingTextConfig`` and
``Inkling2TextConfig`` (transformers 5.24; both default to every sixth layer global) into the model
option ``sliding_layers``, one bool per layer; both families' config rows use them.

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

__all__ = ["LAYER_TYPE_ROPE_ENTRIES", "layer_rope_from_hf", "layer_rope_to_hf", "HYBRID_LAYER_TYPES",
           "sliding_layers_from_hf", "sliding_layers_to_hf"]

#: ``layer_types`` values of the Inkling lineage: ``"hybrid_sliding"`` = local (sliding-window) attention,
#: ``"hybrid"`` = global.
HYBRID_LAYER_TYPES = ("hybrid", "hybrid_sliding")


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


def sliding_layers_from_hf(hf: Mapping[str, Any]) -> tuple[bool, ...]:
    """Per layer: True for a local (sliding-window, ``"hybrid_sliding"``) layer, False for global.

    ``layer_types`` wins; without it, ``local_layer_ids`` lists the local layers; without both,
    every layer whose ``index + 1`` is not a multiple of 6 is local (``InklingTextConfig``,
    ``Inkling2TextConfig``).

    Raises:
        ConfigTranslationError: no ``num_hidden_layers``, a ``layer_types`` of the wrong length or with
            an unknown type, or ``local_layer_ids`` disagreeing with ``layer_types``.
    """
    n = hf.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigTranslationError(f"HF key 'num_hidden_layers'={n!r} must be an integer >= 1.")
    types, local = hf.get("layer_types"), hf.get("local_layer_ids")
    if types is None:
        ids = set(local) if local is not None else {i for i in range(n) if (i + 1) % 6}
        types = ["hybrid_sliding" if i in ids else "hybrid" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigTranslationError(f"HF key 'layer_types'={types!r} must list one type per layer ({n}).")
    bad = sorted({t for t in types if t not in HYBRID_LAYER_TYPES})
    if bad:
        raise ConfigTranslationError(
            f"HF key 'layer_types' holds {bad}; supported layer types: {list(HYBRID_LAYER_TYPES)}.")
    sliding = tuple(t == "hybrid_sliding" for t in types)
    if local is not None and set(local) != {i for i, s in enumerate(sliding) if s}:
        raise ConfigTranslationError(
            f"HF keys 'local_layer_ids'={list(local)} and 'layer_types'={list(types)} disagree; "
            f"transformers uses 'layer_types' (remove 'local_layer_ids' or make them agree).")
    return sliding


def sliding_layers_to_hf(value: tuple[bool, ...], _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`sliding_layers_from_hf`: ``layer_types`` (``local_layer_ids`` is kept from ``base``)."""
    return {"layer_types": ["hybrid_sliding" if s else "hybrid" for s in value]}
