"""Inkling text config (HF ``InklingTextConfig``) <-> Megatron ``TransformerConfig`` + Inkling model options.

Source of every field: ``transformers/models/inkling/configuration_inkling.py``
(``InklingTextConfig``, transformers 5.24) and how ``modeling_inkling.py`` reads it. Each field
is either translated (:class:`~ferrule.config_translation.Field` / ``Derived``), checked equal
to a supported value (``Require``, naming the key and the reason), or refused by name; none is
silently ignored (``plugins/inkling/tests/test_inkling_config.py`` checks every dataclass field of
``InklingTextConfig`` against :meth:`ConfigTranslation.hf_keys`).

``to_mcore`` returns ``(transformer_config_kwargs, model_options)``. The ``TransformerConfig``
kwargs describe the *global* (``"hybrid"``) attention layers and the MoE sizes megatron's
MoE machinery needs; the Inkling-only numbers (sliding-window heads, windows, relative extent,
ShortConv width, shared experts, route scale, logit multiplier, per-layer types) are model
options read by :func:`ferrule.plugins.inkling.model.build_inkling_model`. The local / global layer
pattern (``layer_types``) is parsed as Inkling-2's is, by the core
(:func:`ferrule.config_translation.layer_types.sliding_layers_from_hf`).

The multimodal model type ``inkling_mm_model`` nests the text config under ``text_config``
(and may carry the MTP block under a top-level ``mtp_config``); :class:`InklingConfigTranslation`
reads that nested dict. Legacy spellings that ``InklingTextConfig.__post_init__`` rewrites
(``dense_mlp_idx``, ``dense_intermediate_size``, ``sconv_kernel_size``, ``sliding_window``,
``num_local_experts``, ``model_max_length``, ``embedding_multiplier``) are normalised the same way.

Importing this module imports neither torch, megatron nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.compat import renamed_name
from ferrule.config_translation import (
    COMMON_HARMLESS,
    ConfigTranslation,
    ConfigTranslationError,
    Constant,
    Derived,
    Field,
    Require,
)
from ferrule.config_translation.layer_types import sliding_layers_from_hf, sliding_layers_to_hf

__all__ = ["InklingConfigTranslation", "TEXT_ENTRIES", "HF_DEFAULTS", "text_config_of", "normalize_text_config",
           "MLP_LAYER_TYPES"]

#: ``mlp_layer_types`` values.
MLP_LAYER_TYPES = ("dense", "sparse")


def __getattr__(name: str):  # LAYER_TYPES: ferrule.config_translation.layer_types.HYBRID_LAYER_TYPES (ferrule.compat)
    return renamed_name(__name__, name)

#: Aliases ``InklingTextConfig.attribute_map`` resolves (legacy/checkpoint spelling -> field).
_ATTRIBUTE_MAP = {
    "embedding_multiplier": "logits_mup_width_multiplier",
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
}


#: ``InklingTextConfig`` field defaults (transformers 5.24), applied to keys a raw ``config.json`` omits
#: (``plugins/inkling/tests/test_inkling_config.py`` checks them against the dataclass).
HF_DEFAULTS = {
    "vocab_size": 201024, "unpadded_vocab_size": None, "hidden_size": 6144, "num_hidden_layers": 66,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 16, "swa_head_dim": 128, "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024,
    "log_scaling_n_floor": None, "log_scaling_alpha": 0.1, "local_layer_ids": None, "layer_types": None,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "conv_kernel_size": 4, "mlp_layer_types": None,
    "intermediate_size": 24576, "hidden_act": "silu", "moe_intermediate_size": 3072, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "shared_expert_sink": True, "route_scale": 8.0,
    "logits_mup_width_multiplier": 24.0, "rms_norm_eps_moe_gate": 1e-06, "attention_dropout": 0.0,
    "initializer_range": 0.02, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "num_mtp_layers": None,
    "chain_hidden_post_norm": False, "mtp_hidden_states_first": True, "mtp_local_layer_ids": None,
}


def text_config_of(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The Inkling *text* config dict of an ``inkling_text`` or ``inkling_mm_model`` config.

    For ``inkling_mm_model`` this is ``text_config`` with the MTP fields that
    ``InklingConfig.__post_init__`` copies from a top-level ``mtp_config`` block
    (``num_nextn_predict_layers`` -> ``num_mtp_layers``, ``chain_hidden_post_norm``,
    ``local_layer_ids`` -> ``mtp_local_layer_ids``).

    Raises:
        ConfigTranslationError: an ``inkling_mm_model`` config without a ``text_config`` dict.
    """
    if hf_config.get("model_type") != "inkling_mm_model":
        return dict(hf_config)
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigTranslationError("inkling_mm_model config has no 'text_config' dict; it is not an Inkling checkpoint.")
    text = dict(text)
    text.setdefault("model_type", "inkling_text")
    mtp = hf_config.get("mtp_config") or {}
    if mtp:
        text.setdefault("num_mtp_layers", mtp.get("num_nextn_predict_layers"))
        text.setdefault("chain_hidden_post_norm", mtp.get("chain_hidden_post_norm", False))
        text.setdefault("mtp_local_layer_ids", mtp.get("local_layer_ids"))
    return text


def normalize_text_config(text: Mapping[str, Any]) -> dict[str, Any]:
    """Apply ``InklingTextConfig``'s attribute map and ``__post_init__`` rewrites to a raw dict.

    - alias keys (``sconv_kernel_size``, ``sliding_window``, ...) become the field names;
    - absent fields take :data:`HF_DEFAULTS`;
    - without ``mlp_layer_types``: the first ``dense_mlp_idx`` (default 0) layers are dense,
      the rest sparse;
    - with ``dense_intermediate_size``: ``intermediate_size`` was the routed experts' width
      (becomes ``moe_intermediate_size``) and ``dense_intermediate_size`` the dense MLP width.

    Raises:
        ConfigTranslationError: an alias and its field are both present with different values.
    """
    out = dict(text)
    for alias, name in _ATTRIBUTE_MAP.items():
        if alias in out:
            value = out.pop(alias)
            if out.get(name) is not None and value is not None and out[name] != value:
                raise ConfigTranslationError(
                    f"inkling: HF config has {alias}={value!r} and {name}={out[name]!r}; they are the same field "
                    f"(InklingTextConfig.attribute_map), remove one.")
            if out.get(name) is None:
                out[name] = value
    for key, value in HF_DEFAULTS.items():
        out.setdefault(key, value)
    dense_mlp_idx = out.pop("dense_mlp_idx", None)
    if out.get("mlp_layer_types") is None and "num_hidden_layers" in out:
        k = int(dense_mlp_idx or 0)
        out["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(int(out["num_hidden_layers"]))]
    dense_width = out.pop("dense_intermediate_size", None)
    if dense_width is not None:
        out["moe_intermediate_size"] = out.get("intermediate_size")
        out["intermediate_size"] = dense_width
    return out


# ---- named derivations ----------------------------------------------------------------------


def _num_layers(hf: Mapping[str, Any]) -> int:
    n = hf.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigTranslationError(f"inkling: HF key 'num_hidden_layers'={n!r} must be an integer >= 1.")
    return n


def local_layer_ids_from_hf(hf: Mapping[str, Any]) -> list[int] | None:
    """``local_layer_ids`` as given (validated against ``layer_types`` by :func:`sliding_layers_from_hf`)."""
    value = hf.get("local_layer_ids")
    return None if value is None else [int(i) for i in value]


def local_layer_ids_to_hf(value, _cfg, _opts) -> dict:
    return {"local_layer_ids": value}


def sparse_layers_from_hf(hf: Mapping[str, Any]) -> tuple[bool, ...]:
    """Per layer: True for an MoE (``"sparse"``) MLP, False for a dense one (``mlp_layer_types``).

    Raises:
        ConfigTranslationError: wrong length or an unknown MLP type.
    """
    n = _num_layers(hf)
    types = hf.get("mlp_layer_types")
    if types is None:
        types = ["sparse"] * n
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigTranslationError(f"inkling: HF key 'mlp_layer_types'={types!r} must list one type per layer ({n}).")
    bad = sorted({t for t in types if t not in MLP_LAYER_TYPES})
    if bad:
        raise ConfigTranslationError(
            f"inkling: HF key 'mlp_layer_types' holds {bad}; supported MLP types: {list(MLP_LAYER_TYPES)}.")
    return tuple(t == "sparse" for t in types)


def sparse_layers_to_hf(value: tuple[bool, ...], _cfg, _opts) -> dict:
    return {"mlp_layer_types": ["sparse" if s else "dense" for s in value]}


def _moe_or_none(key: str, cast):
    def derive(hf: Mapping[str, Any]):
        if not any(sparse_layers_from_hf(hf)):
            return None
        value = hf.get(key)
        if value is None:
            raise ConfigTranslationError(f"inkling: HF config has sparse layers but no {key!r}.")
        return cast(value)

    derive.__name__ = f"{key}_if_moe"
    derive.__doc__ = f"``{key}`` for megatron's MoE machinery, or None when every MLP is dense."
    return derive


def _written_by_option(_value, _cfg, _opts) -> dict:
    """The HF key is written back by the model-option entry that carries the same value."""
    return {}


def log_scaling_n_floor_from_hf(hf: Mapping[str, Any]) -> int | None:
    """Position from which global-layer logits are scaled by ``1 + alpha * log(n / n_floor)`` (None: off)."""
    value = hf.get("log_scaling_n_floor")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigTranslationError(f"inkling: HF key 'log_scaling_n_floor'={value!r} must be null or an integer >= 1.")
    return value


def log_scaling_n_floor_to_hf(value, _cfg, _opts) -> dict:
    return {"log_scaling_n_floor": value}


def padding_idx_from_hf(hf: Mapping[str, Any]) -> int | None:
    """``pad_token_id``: the embedding row ``nn.Embedding(padding_idx=...)`` never updates (None: none)."""
    value = hf.get("pad_token_id")
    return None if value is None else int(value)


def padding_idx_to_hf(value, _cfg, _opts) -> dict:
    return {"pad_token_id": value}


def unpadded_vocab_from_hf(hf: Mapping[str, Any]) -> None:
    """``unpadded_vocab_size`` must be null or equal ``vocab_size`` (logit slicing is not implemented).

    Raises:
        ConfigTranslationError: a smaller unembedding than ``vocab_size``.
    """
    value = hf.get("unpadded_vocab_size")
    if value is not None and value != hf.get("vocab_size"):
        raise ConfigTranslationError(
            f"inkling: HF config has unpadded_vocab_size={value} < vocab_size={hf.get('vocab_size')}, which ferrule "
            f"does not support yet (InklingForCausalLM drops logits past it; the Megatron output layer would need "
            f"the same slice). Use a checkpoint whose unembedding has vocab_size rows.")
    return value


def unpadded_vocab_to_hf(value, _cfg, _opts) -> dict:
    return {"unpadded_vocab_size": value}


_NO_MTP = ("multi-token-prediction layers are not implemented (InklingForCausalLM does not run them either and "
           "drops model.mtp.* on load); converting would lose those tensors")

#: Entries shared by both Inkling model types, applied to the (normalised) text config.
TEXT_ENTRIES: tuple = (
    Require("model_type", ("inkling_text",), reason="the text model of the Inkling family"),
    # provenance / HF-switch keys every transformers config carries (architectures, dtype, ...)
    *(h for h in COMMON_HARMLESS if h.hf != "model_type"),
    # -- the global ("hybrid") attention layers and widths: megatron TransformerConfig --
    Field("num_hidden_layers", "num_layers", cast=int),
    Field("hidden_size", "hidden_size", cast=int),
    Field("intermediate_size", "ffn_hidden_size", cast=int),
    Field("num_attention_heads", "num_attention_heads", cast=int),
    Field("num_key_value_heads", "num_query_groups", cast=int),
    Field("head_dim", "kv_channels", cast=int),
    Field("rms_norm_eps", "layernorm_epsilon", cast=float),
    Field("initializer_range", "init_method_std", default=0.02, cast=float),
    Require("attention_dropout", (0.0, 0), default=0.0,
            reason="attention dropout is not implemented in the Inkling attention (RL post-training runs without it)"),
    Require("hidden_act", ("silu",), default="silu", reason="InklingMLP/experts are SwiGLU; only silu is implemented"),
    Constant("hidden_dropout", 0.0),
    Constant("attention_dropout", 0.0),
    Constant("normalization", "RMSNorm"),
    Constant("gated_linear_unit", True),
    Constant("add_bias_linear", False),
    Constant("add_qkv_bias", False),
    # q/k RMSNorm per head: megatron sums q_layernorm/k_layernorm grads over TP only when this is on
    Constant("qk_layernorm", True),
    Derived("num_moe_experts", _moe_or_none("n_routed_experts", int), _written_by_option, hf_keys=()),
    Derived("moe_ffn_hidden_size", _moe_or_none("moe_intermediate_size", int), _written_by_option, hf_keys=()),
    Derived("moe_router_topk", _moe_or_none("num_experts_per_tok", int), _written_by_option, hf_keys=()),
    Constant("moe_grouped_gemm", False),
    Constant("moe_aux_loss_coeff", 0.0),
    Constant("moe_router_load_balancing_type", "none"),
    # local and global layers have different head counts / extents: torch_dist keys per layer, not stacked
    Constant("hetereogenous_dist_checkpoint", True),
    # -- model options (ferrule.plugins.inkling.model) --
    Field("vocab_size", "vocab_size", target="option", cast=int),
    Derived("unpadded_vocab_size", unpadded_vocab_from_hf, unpadded_vocab_to_hf,
            hf_keys=("unpadded_vocab_size",), target="option"),
    Field("max_position_embeddings", "max_sequence_length", target="option", cast=int),
    Require("tie_word_embeddings", (False, True), default=False,
            reason="InklingForCausalLM never ties embed and unembed (its _tied_weights_keys is empty)",
            write_back=False),
    Constant("share_embeddings_and_output_weights", False, target="option"),
    Constant("position_embedding_type", "none", target="option"),
    Constant("activation", "silu", target="option"),
    Field("swa_num_attention_heads", "swa_num_attention_heads", target="option", cast=int),
    Field("swa_num_key_value_heads", "swa_num_key_value_heads", target="option", cast=int),
    Field("swa_head_dim", "swa_head_dim", target="option", cast=int),
    Field("sliding_window_size", "sliding_window_size", target="option", cast=int),
    Field("d_rel", "d_rel", target="option", cast=int),
    Field("rel_extent", "rel_extent", target="option", cast=int),
    Derived("log_scaling_n_floor", log_scaling_n_floor_from_hf, log_scaling_n_floor_to_hf,
            hf_keys=("log_scaling_n_floor",), target="option"),
    Field("log_scaling_alpha", "log_scaling_alpha", target="option", default=0.1, cast=float),
    Derived("sliding_layers", sliding_layers_from_hf, sliding_layers_to_hf, hf_keys=("layer_types",), target="option"),
    Derived("local_layer_ids", local_layer_ids_from_hf, local_layer_ids_to_hf, hf_keys=("local_layer_ids",),
            target="option"),
    Derived("sparse_layers", sparse_layers_from_hf, sparse_layers_to_hf, hf_keys=("mlp_layer_types",),
            target="option"),
    Field("conv_kernel_size", "conv_kernel_size", target="option", default=4, cast=int),
    Require("number_of_conv_states", (4,), default=4,
            reason="an Inkling layer has exactly 4 ShortConvs (k, v, attention output, MLP output)"),
    Field("n_routed_experts", "n_routed_experts", target="option", cast=int),
    Field("num_experts_per_tok", "num_experts_per_tok", target="option", cast=int),
    Field("moe_intermediate_size", "moe_intermediate_size", target="option", cast=int),
    Field("n_shared_experts", "n_shared_experts", target="option", cast=int),
    Require("shared_expert_sink", (True,), default=True,
            reason="transformers' InklingTopkRouter always scores the shared experts in the routing softmax"),
    Field("route_scale", "route_scale", target="option", cast=float),
    Field("logits_mup_width_multiplier", "logits_mup_width_multiplier", target="option", cast=float),
    # read by no transformers module (InklingTopkRouter applies no norm): carried through unchanged
    Field("rms_norm_eps_moe_gate", "rms_norm_eps_moe_gate", target="option", default=1e-6, cast=float),
    # generation-side token ids: no effect on the network, carried through for the exported config
    Field("bos_token_id", "bos_token_id", target="option", default=None),
    Field("eos_token_id", "eos_token_id", target="option", default=None),
    Derived("padding_idx", padding_idx_from_hf, padding_idx_to_hf, hf_keys=("pad_token_id",), target="option"),
    Require("num_mtp_layers", (None,), default=None, reason=_NO_MTP),
    Require("mtp_local_layer_ids", (None,), default=None, reason=_NO_MTP),
    Require("chain_hidden_post_norm", (False,), default=False, reason=_NO_MTP),
    Require("mtp_hidden_states_first", (True,), default=True, reason=_NO_MTP),
)


@dataclass(frozen=True)
class InklingConfigTranslation(ConfigTranslation):
    """:class:`ConfigTranslation` over the Inkling text config of either model type.

    ``to_mcore`` first takes :func:`text_config_of` (the nested ``text_config`` of an
    ``inkling_mm_model`` config) and applies :func:`normalize_text_config`; it then checks
    ``model_type`` is one of ``model_types`` and translates :data:`TEXT_ENTRIES`. ``to_hf``
    writes a text config dict (for ``inkling_mm_model`` the caller nests it under ``text_config``).
    """

    model_types: tuple[str, ...] = ("inkling_text",)

    def to_mcore(self, hf_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(hf_config, Mapping):
            raise ConfigTranslationError(f"{self.name}: expected the HF config as a dict, got {type(hf_config).__name__}.")
        model_type = hf_config.get("model_type")
        if model_type not in self.model_types:
            raise ConfigTranslationError(
                f"{self.name}: HF config has model_type={model_type!r}; this translation reads {list(self.model_types)}.")
        return super().to_mcore(normalize_text_config(text_config_of(hf_config)))

    def to_hf(self, transformer_config_kwargs, model_options, base=None) -> dict[str, Any]:
        """The HF config dict; for an ``inkling_mm_model`` ``base`` the text keys go under ``text_config``."""
        if base is not None and base.get("model_type") == "inkling_mm_model":
            out = dict(base)
            out["text_config"] = super().to_hf(transformer_config_kwargs, model_options, base.get("text_config") or {})
            return out
        return super().to_hf(transformer_config_kwargs, model_options, base)
