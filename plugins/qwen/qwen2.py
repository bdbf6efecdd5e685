"""Qwen2 / Qwen2.5 dense (HF ``model_type='qwen2'``): config translation and provider.

Architecture (HF ``transformers/models/qwen2/modeling_qwen2.py``): RMSNorm pre-norm, SwiGLU
MLP, RoPE, GQA, q/k/v projections *with* bias and o_proj without (so megatron
``add_qkv_bias=True``, ``add_bias_linear=False``), no q/k norm, optional tied embeddings. The
HF config has no ``head_dim`` key: the head width is ``hidden_size // num_attention_heads``.

Module-level data only; torch and megatron are imported inside :func:`build_provider`
(``plugin.py`` imports this module at discovery).
"""

from __future__ import annotations

from typing import Any, Mapping

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


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """Build this rank's megatron ``GPTModel`` chunks for a Qwen2 HF config.

    ``ProviderSpec.build`` target. Requires ``ferrule.megatron.parallel.init_distributed(layout)``.
    ``options`` are :func:`ferrule.megatron.gpt_builder.build_from_hf_config`'s keywords
    (``params_dtype``, ``core_attention``, ``parallel_output``, ...).

    Returns:
        ``list[GPTModel]``, one per virtual pipeline stage.
    """
    from ferrule.megatron.gpt_builder import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, **options)


# ---- parameter mapping (MAPPING) and update groups (UPDATE_GROUPS) are appended below ----

from ferrule.mapping import FuseGateUp, FuseQKV, Ignore, MappingTable, OutputLayer, Rename, TPSplit  # noqa: E402
from ferrule.specs import UpdateGroup  # noqa: E402

#: Mappings every Qwen variant shares: embedding, output layer (tied or untied), norms,
#: attention output projection. Keys are global mcore names (``*`` = layer index).
QWEN_COMMON_MAPPINGS = (
    Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp=TPSplit.VOCAB),
    OutputLayer("output_layer.weight", hf="lm_head.weight", tied_hf="model.embed_tokens.weight"),
    Rename("decoder.final_layernorm.weight", "model.norm.weight"),
    Rename("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
    Rename("decoder.layers.*.self_attention.linear_proj.weight", "model.layers.*.self_attn.o_proj.weight",
           tp=TPSplit.ROW),
    Rename("decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"),
)
#: Fused q/k/v projection weight (layout: :class:`ferrule.mapping.FuseQKV`).
QWEN_QKV_WEIGHT = FuseQKV("decoder.layers.*.self_attention.linear_qkv.weight",
                          q="model.layers.*.self_attn.q_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
                          v="model.layers.*.self_attn.v_proj.weight")
#: Dense SwiGLU MLP (``linear_fc1 = [gate; up]``, ``linear_fc2`` row-parallel).
QWEN_DENSE_MLP = (
    FuseGateUp("decoder.layers.*.mlp.linear_fc1.weight", gate="model.layers.*.mlp.gate_proj.weight",
               up="model.layers.*.mlp.up_proj.weight"),
    Rename("decoder.layers.*.mlp.linear_fc2.weight", "model.layers.*.mlp.down_proj.weight", tp=TPSplit.ROW),
)
#: HF keys older Qwen checkpoints carry that hold no weights.
QWEN_IGNORES = (
    Ignore("model.layers.*.self_attn.rotary_emb.inv_freq",
           reason="RoPE inverse frequencies are recomputed from rope_theta by both HF and megatron", unused_by_hf=True),
)

#: Qwen2 / Qwen2.5 mapping table: QKV with bias (``attention_bias`` is implied for Qwen2).
MAPPING = MappingTable(
    family="qwen2",
    mappings=(
        *QWEN_COMMON_MAPPINGS,
        QWEN_QKV_WEIGHT,
        FuseQKV("decoder.layers.*.self_attention.linear_qkv.bias",
                q="model.layers.*.self_attn.q_proj.bias", k="model.layers.*.self_attn.k_proj.bias",
                v="model.layers.*.self_attn.v_proj.bias"),
        *QWEN_DENSE_MLP,
    ),
    ignores=QWEN_IGNORES,
)

#: Update groups shared by the Qwen variants (embedding/output may be absent on a PP stage).
QWEN_EDGE_GROUPS = (
    UpdateGroup(key="embedding", suffixes=("embedding.word_embeddings.weight",), optional=True),
    UpdateGroup(key="final_norm", suffixes=("decoder.final_layernorm.weight",), optional=True),
    UpdateGroup(key="output_layer", suffixes=("output_layer.weight",), optional=True),
)
#: Weight-sync groups: one unit per layer for attention and for the dense MLP.
UPDATE_GROUPS = (
    QWEN_EDGE_GROUPS[0],
    UpdateGroup(key="attention", suffixes=("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                           "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight")),
    UpdateGroup(key="mlp", suffixes=("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")),
    *QWEN_EDGE_GROUPS[1:],
)

#: A tiny random config for conformance tests (``transformers.Qwen2Config`` kwargs): GQA with
#: 2 KV heads, untied output layer. Keys are HF config keys.
TINY_HF_CONFIG = {
    "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
