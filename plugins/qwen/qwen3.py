"""Qwen3 dense (HF ``model_type='qwen3'``): config translation and provider.

Architecture (HF ``transformers/models/qwen3/modeling_qwen3.py``): like Qwen2 but with RMSNorm
on each query and key head before RoPE (megatron ``qk_layernorm=True``), no q/k/v bias
(``attention_bias`` must be false: megatron's ``add_bias_linear`` would also add MLP biases),
and an explicit ``head_dim`` that may differ from ``hidden_size // num_attention_heads``
(megatron ``kv_channels``).

Module-level data only. No provider function: the family's ``ProviderSpec`` uses the default
build driven by :data:`CONFIG_TRANSLATION`.
"""

from __future__ import annotations

from ferrule.config_translation import (
    ConfigTranslation,
    Constant,
    Derived,
    Require,
    head_dim_from_hf,
    head_dim_to_hf,
)
from ferrule.plugins.qwen.qwen2 import QWEN_COMMON_ENTRIES

#: HF ``qwen3`` config <-> megatron (see :mod:`ferrule.config_translation`).
CONFIG_TRANSLATION = ConfigTranslation(
    name="qwen3",
    entries=(
        Require("model_type", ("qwen3",)),
        Require("attention_bias", (False,), default=False,
                reason="Qwen3 attention bias would need o_proj bias; megatron ties it to MLP biases"),
        *QWEN_COMMON_ENTRIES,
        Derived("kv_channels", head_dim_from_hf, head_dim_to_hf, hf_keys=("head_dim",)),
        Constant("add_qkv_bias", False),
        Constant("qk_layernorm", True),
    ),
)


# ---- parameter mapping (MAPPING) and update groups (UPDATE_GROUPS) ----

from ferrule.mapping import MappingTable, Rename  # noqa: E402
from ferrule.mapping.decoder import (  # noqa: E402
    DECODER_ATTENTION,
    DECODER_EDGE,
    DECODER_IGNORES,
    DECODER_MLP,
    decoder_update_groups,
)

#: q/k per-head RMSNorm weights ``[head_dim]`` (replicated over TP).
QWEN3_QK_NORMS = (
    Rename("decoder.layers.*.self_attention.q_layernorm.weight", "model.layers.*.self_attn.q_norm.weight"),
    Rename("decoder.layers.*.self_attention.k_layernorm.weight", "model.layers.*.self_attn.k_norm.weight"),
)
#: Qwen3 attention rows: the shared decoder rows (no QKV bias) plus the q/k norms.
QWEN3_ATTENTION = (*DECODER_ATTENTION[:2], *QWEN3_QK_NORMS, *DECODER_ATTENTION[2:])

#: Qwen3 dense mapping table (shared decoder rows, :mod:`ferrule.mapping.decoder`; q/k norms).
MAPPING = MappingTable(family="qwen3", mappings=(*DECODER_EDGE, *QWEN3_ATTENTION, *DECODER_MLP),
                       ignores=DECODER_IGNORES)

#: Weight-sync groups, derived from the same rows: one unit per layer for attention and for the MLP.
UPDATE_GROUPS = decoder_update_groups(QWEN3_ATTENTION)

#: A tiny random config for conformance tests (``transformers.Qwen3Config`` kwargs):
#: head_dim 16 != hidden/heads = 8, one KV head (MQA), tied embeddings.
TINY_HF_CONFIG = {
    "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}
#: The kit's TP=2 run needs KV heads divisible by 2 (megatron splits KV groups over TP).
TINY_TP2_OVERRIDES = {"num_key_value_heads": 2}
