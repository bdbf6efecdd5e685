"""Inkling-2 text config (HF ``Inkling2TextConfig``) <-> Megatron ``TransformerConfig`` + Inkling-2 model options.

Source of every field: ``transformers/models/inkling2/configuration_inkling2.py``
(``Inkling2TextConfig``, transformers 5.24) and how ``modeling_inkling2.py`` reads it. Each field is
translated (``Field`` / ``Derived``), checked equal to a supported value (``Require``), or listed as
harmless with a reason; none is silently ignored (``plugins/inkling2/tests/test_inkling2.py`` checks every dataclass
field of ``Inkling2TextConfig`` against :meth:`ConfigTranslation.hf_keys`).

``to_mcore`` returns ``(transformer_config_kwargs, model_options)``: the kwargs describe the full
(``"hybrid"``) attention layers and the MoE sizes megatron's MoE machinery needs; the Inkling-2
numbers (sliding-window heads, windows, relative extent, clip thresholds, soft-caps, block size of
the attention residuals, per-layer types) are model options read by
:func:`ferrule.plugins.inkling2.model.build_inkling2_model`. Layer-type parsing is the core's, shared with
Inkling (:func:`ferrule.config_translation.layer_types.sliding_layers_from_hf`: same ``layer_types`` values
and default).

Importing this module imports neither torch, megatron nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.config_translation import (
    COMMON_HARMLESS,
    ConfigTranslation,
    ConfigTranslationError,
    Constant,
    Derived,
    Field,
    Harmless,
    Require,
)
from ferrule.config_translation.layer_types import sliding_layers_from_hf, sliding_layers_to_hf

__all__ = ["Inkling2ConfigTranslation", "TEXT_ENTRIES", "HF_DEFAULTS", "normalize_text_config"]

#: Aliases ``Inkling2TextConfig.attribute_map`` resolves (alias -> field).
_ATTRIBUTE_MAP = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "route_scale",
}

#: ``Inkling2TextConfig`` field defaults (transformers 5.24) for keys a raw ``config.json`` omits.
HF_DEFAULTS = {
    "vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 4608, "num_hidden_layers": 48,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 48,
    "swa_num_key_value_heads": 8, "swa_head_dim": 128, "sliding_window_size": 1024, "d_rel": 16,
    "rel_extent": 1024, "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1, "layer_types": None,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "hidden_act": "silu",
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 8, "route_scale": 8.0,
    "attention_dropout": 0.0, "initializer_range": 0.02, "pad_token_id": None, "bos_token_id": None,
    "eos_token_id": 200006, "qk_l2_clip_threshold": 22.627416997969522, "rel_l2_clip_threshold": 8.0,
    "n_layers_per_attn_res_block": 6, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
    "final_logit_softcapping": 30.0, "scoring_func": "sigmoid", "use_cache": True,
}


def normalize_text_config(text: Mapping[str, Any], defaults: Mapping[str, Any] = HF_DEFAULTS) -> dict[str, Any]:
    """Apply ``Inkling2TextConfig.attribute_map`` and the field defaults to a raw config dict.

    Raises:
        ConfigTranslationError: an alias and its field are both present with different values.
    """
    out = dict(text)
    for alias, name in _ATTRIBUTE_MAP.items():
        if alias in out:
            value = out.pop(alias)
            if out.get(name) is not None and value is not None and out[name] != value:
                raise ConfigTranslationError(
                    f"inkling2: HF config has {alias}={value!r} and {name}={out[name]!r}; they are the same field "
                    f"(Inkling2TextConfig.attribute_map), remove one.")
            if out.get(name) is None:
                out[name] = value
    for key, value in defaults.items():
        out.setdefault(key, value)
    return out


def _unpadded_vocab(hf: Mapping[str, Any]) -> int:
    """``unpadded_vocab_size``: rows of ``lm_head`` (the checkpoint's unembedding is zero-padded to ``vocab_size``).

    Raises:
        ConfigTranslationError: not an integer in ``[1, vocab_size]``.
    """
    value, vocab = hf.get("unpadded_vocab_size"), hf.get("vocab_size")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= int(vocab):
        raise ConfigTranslationError(
            f"inkling2: HF key 'unpadded_vocab_size'={value!r} must be an integer in [1, vocab_size={vocab}].")
    return value


def _unpadded_vocab_to_hf(value, _cfg, _opts) -> dict:
    return {"unpadded_vocab_size": value}


def _padding_idx(hf: Mapping[str, Any]) -> int | None:
    """``pad_token_id``: the embedding row ``nn.Embedding(padding_idx=...)`` never updates (None: none)."""
    value = hf.get("pad_token_id")
    return None if value is None else int(value)


def _padding_idx_to_hf(value, _cfg, _opts) -> dict:
    return {"pad_token_id": value}


def _positive_int(key: str):
    def derive(hf: Mapping[str, Any]) -> int:
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigTranslationError(f"inkling2: HF key {key!r}={value!r} must be an integer >= 1.")
        return value

    def to_hf(value, _cfg, _opts) -> dict:
        return {key: value}

    derive.__name__ = f"{key}_from_hf"
    return derive, to_hf


def _written_by_option(_value, _cfg, _opts) -> dict:
    """The HF key is written back by the model-option entry that carries the same value."""
    return {}


def _same(key: str, cast):
    def derive(hf: Mapping[str, Any]):
        return cast(hf[key])

    derive.__name__ = f"{key}_for_megatron"
    return derive


#: Entries applied to the (normalised) text config.
TEXT_ENTRIES: tuple = (
    Require("model_type", ("inkling2_text",), reason="the text model of the Inkling-2 family"),
    *(h for h in COMMON_HARMLESS if h.hf != "model_type"),
    Harmless("use_cache", "KV / convolution caching of HF generation; training and logprobs run without a cache"),
    # -- the full ("hybrid") attention layers and widths: megatron TransformerConfig --
    Field("num_hidden_layers", "num_layers", cast=int),
    Field("hidden_size", "hidden_size", cast=int),
    Field("num_attention_heads", "num_attention_heads", cast=int),
    Field("num_key_value_heads", "num_query_groups", cast=int),
    Field("head_dim", "kv_channels", cast=int),
    Field("rms_norm_eps", "layernorm_epsilon", cast=float),
    Field("initializer_range", "init_method_std", default=0.02, cast=float),
    Require("attention_dropout", (0.0, 0), default=0.0,
            reason="attention dropout is not implemented in the Inkling-2 attention (RL post-training runs without it)"),
    Require("hidden_act", ("silu",), default="silu",
            reason="the Inkling-2 experts are the soft-capped SwiGLU; transformers reads hidden_act nowhere else"),
    Require("scoring_func", ("sigmoid",), default="sigmoid",
            reason="the released checkpoints route with sigmoid scores; only sigmoid is implemented"),
    Require("number_of_conv_states", (4,), default=4,
            reason="an Inkling-2 layer has exactly 4 short convolutions (k, v, attention output, MLP output)"),
    Constant("hidden_dropout", 0.0),
    Constant("attention_dropout", 0.0),
    Constant("normalization", "RMSNorm"),
    Constant("gated_linear_unit", True),
    Constant("add_bias_linear", False),
    Constant("add_qkv_bias", False),
    Derived("ffn_hidden_size", _same("moe_intermediate_size", int), _written_by_option, hf_keys=()),
    Derived("num_moe_experts", _same("n_routed_experts", int), _written_by_option, hf_keys=()),
    Derived("moe_ffn_hidden_size", _same("moe_intermediate_size", int), _written_by_option, hf_keys=()),
    Derived("moe_router_topk", _same("num_experts_per_tok", int), _written_by_option, hf_keys=()),
    Constant("moe_grouped_gemm", False),
    Constant("moe_aux_loss_coeff", 0.0),
    Constant("moe_router_load_balancing_type", "none"),
    # sliding and full layers have different shapes: torch_dist keys per layer, not stacked
    Constant("hetereogenous_dist_checkpoint", True),
    # -- model options (ferrule.plugins.inkling2.model) --
    Field("vocab_size", "vocab_size", target="option", cast=int),
    Derived("unpadded_vocab_size", _unpadded_vocab, _unpadded_vocab_to_hf, hf_keys=("unpadded_vocab_size",),
            target="option"),
    Field("max_position_embeddings", "max_sequence_length", target="option", cast=int),
    Require("tie_word_embeddings", (False, True), default=False,
            reason="Inkling2ForCausalLM never ties embed and unembed (its _tied_weights_keys is empty)",
            write_back=False),
    Field("swa_num_attention_heads", "swa_num_attention_heads", target="option", cast=int),
    Field("swa_num_key_value_heads", "swa_num_key_value_heads", target="option", cast=int),
    Field("swa_head_dim", "swa_head_dim", target="option", cast=int),
    Field("sliding_window_size", "sliding_window_size", target="option", cast=int),
    Field("d_rel", "d_rel", target="option", cast=int),
    Field("rel_extent", "rel_extent", target="option", cast=int),
    Derived("log_scaling_n_floor", *_positive_int("log_scaling_n_floor"), hf_keys=("log_scaling_n_floor",),
            target="option"),
    Field("log_scaling_alpha", "log_scaling_alpha", target="option", cast=float),
    Field("qk_l2_clip_threshold", "qk_l2_clip_threshold", target="option", cast=float),
    Field("rel_l2_clip_threshold", "rel_l2_clip_threshold", target="option", cast=float),
    Derived("n_layers_per_attn_res_block", *_positive_int("n_layers_per_attn_res_block"),
            hf_keys=("n_layers_per_attn_res_block",), target="option"),
    Field("mlp_gate_softcap", "mlp_gate_softcap", target="option", cast=float),
    Field("mlp_up_softcap", "mlp_up_softcap", target="option", cast=float),
    Field("final_logit_softcapping", "final_logit_softcapping", target="option", cast=float),
    Derived("sliding_layers", sliding_layers_from_hf, sliding_layers_to_hf, hf_keys=("layer_types",), target="option"),
    Field("conv_kernel_size", "conv_kernel_size", target="option", cast=int),
    Field("n_routed_experts", "n_routed_experts", target="option", cast=int),
    Field("num_experts_per_tok", "num_experts_per_tok", target="option", cast=int),
    Field("moe_intermediate_size", "moe_intermediate_size", target="option", cast=int),
    Field("route_scale", "route_scale", target="option", cast=float),
    # generation-side token ids: no effect on the network, carried through for the exported config
    Field("bos_token_id", "bos_token_id", target="option", default=None),
    Field("eos_token_id", "eos_token_id", target="option", default=None),
    Derived("padding_idx", _padding_idx, _padding_idx_to_hf, hf_keys=("pad_token_id",), target="option"),
)


@dataclass(frozen=True)
class Inkling2ConfigTranslation(ConfigTranslation):
    """:class:`ConfigTranslation` over an Inkling-2 text config (a multimodal config's ``text_config`` too).

    ``to_mcore`` takes the nested ``text_config`` when the config has one and its ``model_type`` is
    not in ``model_types``, applies :func:`normalize_text_config` with ``defaults`` and translates
    ``entries``.
    """

    model_types: tuple[str, ...] = ("inkling2_text",)
    defaults: tuple = tuple(HF_DEFAULTS.items())

    def to_mcore(self, hf_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(hf_config, Mapping):
            raise ConfigTranslationError(f"{self.name}: expected the HF config as a dict, got {type(hf_config).__name__}.")
        text = hf_config
        if text.get("model_type") not in self.model_types and isinstance(text.get("text_config"), Mapping):
            text = text["text_config"]
        if text.get("model_type") not in self.model_types:
            raise ConfigTranslationError(
                f"{self.name}: HF config has model_type={text.get('model_type')!r}; this translation reads "
                f"{list(self.model_types)}.")
        return super().to_mcore(normalize_text_config(text, dict(self.defaults)))
