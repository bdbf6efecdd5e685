"""Qwen2 / Qwen2.5 dense (HF ``model_type='qwen2'``): config translation and provider.

Architecture (HF ``transformers/models/qwen2/modeling_qwen2.py``): RMSNorm pre-norm, SwiGLU
MLP, RoPE, GQA, q/k/v projections *with* bias and o_proj without (so megatron
``add_qkv_bias=True``, ``add_bias_linear=False``), no q/k norm, optional tied embeddings. The
HF config has no ``head_dim`` key: the head width is ``hidden_size // num_attention_heads``.

Module-level data only (``plugin.py`` names it at discovery). No provider function: the
family's ``ProviderSpec`` uses the default build driven by :data:`CONFIG_TRANSLATION`.
"""

from __future__ import annotations

from ferrule.config_translation import (
    DECODER_ENTRIES,
    ConfigTranslation,
    Constant,
    Derived,
    Harmless,
    Require,
    head_dim_from_hf,
    head_dim_to_hf_implicit,
    rope_theta_from_hf,
    rope_theta_to_hf,
)

#: Entries every Qwen dense/MoE variant shares (HF key -> TransformerConfig kwarg / model option).
QWEN_COMMON_ENTRIES = (
    Require("hidden_act", ("silu",), reason="megatron's gated MLP is built with silu (SwiGLU)"),
    Require("use_sliding_window", (False,), default=False,
            reason="Qwen's per-layer windows (max_window_layers) are not validated against HF yet"),
    Harmless("max_window_layers", "HF reads it only when use_sliding_window is true, which is refused"),
    *DECODER_ENTRIES,
    Derived("rotary_base", rope_theta_from_hf, rope_theta_to_hf,
            hf_keys=("rope_parameters", "rope_theta", "rope_scaling"), target="option"),
)

#: HF ``qwen2`` config <-> megatron (see :mod:`ferrule.config_translation`).
CONFIG_TRANSLATION = ConfigTranslation(
    name="qwen2",
    entries=(
        Require("model_type", ("qwen2",)),
        *QWEN_COMMON_ENTRIES,
        Derived("kv_channels", head_dim_from_hf, head_dim_to_hf_implicit, hf_keys=("head_dim",)),
        Constant("add_qkv_bias", True),
        Constant("qk_layernorm", False),
    ),
)


# ---- parameter mapping (MAPPING) and update groups (UPDATE_GROUPS) ----

from ferrule.mapping import MappingTable  # noqa: E402
from ferrule.mapping.decoder import (  # noqa: E402
    DECODER_ATTENTION,
    DECODER_EDGE,
    DECODER_IGNORES,
    DECODER_MLP,
    DECODER_QKV_BIAS,
    decoder_update_groups,
)

#: Qwen2 attention rows: the shared decoder rows plus the fused QKV bias (implied for Qwen2).
QWEN2_ATTENTION = (*DECODER_ATTENTION[:2], DECODER_QKV_BIAS, *DECODER_ATTENTION[2:])

#: Qwen2 / Qwen2.5 mapping table: the shared Llama-shaped decoder rows (:mod:`ferrule.mapping.decoder`)
#: with a QKV bias.
MAPPING = MappingTable(family="qwen2", mappings=(*DECODER_EDGE, *QWEN2_ATTENTION, *DECODER_MLP),
                       ignores=DECODER_IGNORES)

#: Weight-sync groups, derived from the same rows: one unit per layer for attention and for the MLP.
UPDATE_GROUPS = decoder_update_groups(QWEN2_ATTENTION)

#: A tiny random config for conformance tests (``transformers.Qwen2Config`` kwargs): GQA with
#: 2 KV heads, untied output layer. Keys are HF config keys.
TINY_HF_CONFIG = {
    "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
