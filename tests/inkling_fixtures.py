"""Tiny random InklingForCausalLM checkpoints for the Inkling tests (saved with transformers' save_pretrained).

``CONFIGS`` names the tiny configurations the issue asks for: MoE with 2 shared experts (local +
global layers, one dense layer), dense-only, one KV head, local layers only, global layers only
(with log scaling), and sliding-window layers with their own head shape.
"""

from __future__ import annotations

from pathlib import Path

from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG

#: Weights are drawn with this seed and perturbed by N(0, PERTURB) so logits are O(1).
SEED, PERTURB = 1234, 0.3

CONFIGS = {
    "moe_2_shared": {},
    "dense_only": {"mlp_layer_types": ["dense"] * 3},
    "one_kv_head": {"num_key_value_heads": 1, "swa_num_key_value_heads": 1},
    "local_only": {"layer_types": ["hybrid_sliding"] * 3},
    "global_only_log_scaling": {"layer_types": ["hybrid"] * 3, "log_scaling_n_floor": 3},
    "swa_head_shape": {"swa_num_attention_heads": 2, "swa_head_dim": 16, "swa_num_key_value_heads": 1,
                       "sliding_window_size": 5},
}


def tiny_inkling_dir(out_dir, overrides=None, *, seed: int = SEED) -> Path:
    """Save a random tiny ``InklingForCausalLM`` (fp32) to ``out_dir``; router biases are non-zero."""
    import torch
    from transformers import InklingForCausalLM, InklingTextConfig

    cfg = dict(TINY_HF_CONFIG)
    cfg.pop("model_type")
    cfg.update(overrides or {})
    torch.manual_seed(seed)
    model = InklingForCausalLM(InklingTextConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
