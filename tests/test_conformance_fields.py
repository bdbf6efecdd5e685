"""The kit's rotary and field readers on HF layouts other than Llama's (cheap: HF modules only, no megatron).

References: the rotate-half RoPE table computed by hand (``inv_freq = theta ** -(2i / d)``, ``cat(freqs,
freqs)``), and the tiny config's own ``intermediate_size``.
"""

from __future__ import annotations

import types

import torch

from ferrule.conformance.fields import _hf_ffn_width, full_width, rotary_tables_hf

HEAD_DIM, THETA, SEQ = 16, 150000.0, 6


def _gpt_oss_config(**kw):
    from transformers import GptOssConfig

    return GptOssConfig(**{"hidden_size": 48, "intermediate_size": 32, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": HEAD_DIM, "num_hidden_layers": 2,
                           "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64,
                           "rope_parameters": {"rope_type": "default", "rope_theta": THETA}, **kw})


def test_half_width_rotary_table_is_widened_to_rotate_half():
    """gpt-oss's rotary embedding returns one column per rotated pair (8 of 16): read as 8 rotated channels,
    a correct family failed the kit; widened, it equals the hand-computed rotate-half table."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = types.SimpleNamespace(model=types.SimpleNamespace(rotary_emb=GptOssRotaryEmbedding(_gpt_oss_config())))
    cos, sin = rotary_tables_hf(hf, SEQ)
    inv_freq = THETA ** -(torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(SEQ, dtype=torch.float64)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    assert cos.shape == (SEQ, HEAD_DIM)
    assert (cos - angles.cos()).abs().max() < 1e-6 and (sin - angles.sin()).abs().max() < 1e-6
    # a rotate-half table (Llama's) is left as it is
    assert full_width(angles.cos(), angles.sin())[0].shape == (SEQ, HEAD_DIM)


def test_stacked_expert_width_in_either_layout():
    """gpt-oss stacks experts ``down_proj [E, ffn, hidden]`` (Qwen3-MoE ``[E, hidden, ffn]``): the width read was
    ``shape[-1]`` (48, the hidden size) instead of 32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(_gpt_oss_config())
    layer = types.SimpleNamespace(mlp=types.SimpleNamespace(experts=experts))
    assert _hf_ffn_width(layer, 48) == 32
    bare = types.SimpleNamespace(down_proj=torch.empty(4, 32, 48))  # no recorded width: the shape decides
    assert _hf_ffn_width(types.SimpleNamespace(mlp=types.SimpleNamespace(experts=bare)), 48) == 32
    qwen_like = types.SimpleNamespace(down_proj=torch.empty(4, 48, 24))
    assert _hf_ffn_width(types.SimpleNamespace(mlp=types.SimpleNamespace(experts=qwen_like)), 48) == 24
