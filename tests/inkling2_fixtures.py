"""Tiny Inkling-2 / Inkling-2-Loop text models for the tests (shared by the family's tests beside its
plugin, plugins/inkling2/tests, and core tests that run Inkling-2: LoRA, serve, sync, MoE TP).

:data:`CONFIGS`: three ``Inkling2TextConfig`` / ``Inkling2LoopTextConfig`` keyword sets;
:func:`tiny_inkling2_dir` saves a random model of one in the released layout.
"""

from __future__ import annotations

import torch

BASE = {
    "vocab_size": 100, "unpadded_vocab_size": 90, "hidden_size": 32, "num_attention_heads": 4, "head_dim": 8,
    "swa_head_dim": 8, "sliding_window_size": 4, "d_rel": 4, "rel_extent": 6, "moe_intermediate_size": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64, "eos_token_id": 1,
}
CONFIGS = {
    # full layer first, one KV head on full layers, blocks of 2 layers, soft-caps and clips that bite
    "mqa_full_first_softcaps": dict(BASE, num_hidden_layers=4, num_key_value_heads=1, swa_num_attention_heads=2,
                                    swa_num_key_value_heads=2, layer_types=["hybrid", "hybrid_sliding",
                                                                            "hybrid_sliding", "hybrid"],
                                    n_layers_per_attn_res_block=2, log_scaling_n_floor=3, mlp_gate_softcap=1.5,
                                    mlp_up_softcap=2.0, final_logit_softcapping=3.0, qk_l2_clip_threshold=0.5,
                                    rel_l2_clip_threshold=0.3),
    # odd layer count, blocks of 3, one KV head on sliding layers, unpadded head, default soft-caps
    "block3_sliding_mqa": dict(BASE, unpadded_vocab_size=100, num_hidden_layers=5, num_key_value_heads=2,
                               swa_num_attention_heads=4, swa_num_key_value_heads=1,
                               layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
                               n_layers_per_attn_res_block=3, log_scaling_n_floor=1, num_experts_per_tok=3),
    # Inkling-2-Loop: layers 2..5 (two blocks of 2, sliding and full layers) run 3 times, one KV head on full layers
    # (two blocks, so the messages attend over more than one source and the message queries get gradients)
    "loop_2_6_x3": dict(BASE, num_hidden_layers=7, num_key_value_heads=1, swa_num_attention_heads=2,
                        swa_num_key_value_heads=2, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid",
                                                                "hybrid", "hybrid_sliding", "hybrid"],
                        n_layers_per_attn_res_block=2, log_scaling_n_floor=3, final_logit_softcapping=3.0,
                        loop_layer_index_start=2, loop_layer_index_end=6, loop_num_passes=3, loop_gate_rank=5),
}


def _is_loop(config: dict) -> bool:
    return "loop_num_passes" in config


def tiny_inkling2_dir(path, config: dict, seed: int = 0):
    """Save a tiny random ``Inkling2ForCausalLM`` (released layout) with its zero-initialised parts perturbed."""
    import transformers

    torch.manual_seed(seed)
    prefix = "Inkling2Loop" if _is_loop(config) else "Inkling2"
    config_cls, model_cls = (getattr(transformers, prefix + n) for n in ("TextConfig", "ForCausalLM"))
    model = model_cls(config_cls(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            big = name.endswith(("query", "static_weight"))
            p.add_(torch.randn_like(p) * (0.5 if big else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    return path
