"""Tiny Inkling-2 multimodal configs and media for the vision-tower tests (shared by the test files).

Odd shapes on purpose: 3 vision heads of 8, native patch 3, merge 2 (token squares of 6 x 6
pixels), a 5 x 5 learned position grid, projector biases on; images of different token grids.
"""

from __future__ import annotations

import torch

#: image placeholder id inside the tiny vocabulary
IMAGE_TOKEN = 249

#: sliding + full layers, one KV head on the full layers, attention-residual blocks of 2, log scaling from
#: position 3, soft-caps and clips that bite, a padded unembedding (250 of 256 rows)
TEXT = dict(vocab_size=256, unpadded_vocab_size=250, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=8,
            sliding_window_size=4, d_rel=4, rel_extent=6, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, layer_types=["hybrid_sliding", "hybrid",
                                                                               "hybrid_sliding"],
            log_scaling_n_floor=3, mlp_gate_softcap=1.5, mlp_up_softcap=2.0, final_logit_softcapping=3.0,
            qk_l2_clip_threshold=0.5, rel_l2_clip_threshold=0.3, max_position_embeddings=64, eos_token_id=1)

VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3, patch_size=3,
              spatial_merge_size=2, posemb_grid_size=5, projection_hidden_dim=20, projector_bias=True,
              text_hidden_size=32, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})

#: a second vision config: no merge, tanh GELU, no projector bias, 1 head
VISION_NO_MERGE = dict(VISION, spatial_merge_size=1, num_attention_heads=1, hidden_act="gelu_pytorch_tanh",
                       projector_bias=False, posemb_grid_size=3, num_hidden_layers=1)


def config_dict(vision: dict | None = None, text: dict | None = None) -> dict:
    """An ``inkling2`` HF config dict (what ``config.json`` holds) with the tiny text + vision configs."""
    from transformers import Inkling2Config

    return Inkling2Config(text_config=dict(text or TEXT), vision_config=dict(vision or VISION),
                          image_token_id=IMAGE_TOKEN).to_dict()


def hf_model(cfg: dict, seed: int = 0, std: float = 0.2):
    """A random ``Inkling2ForConditionalGeneration`` (fp32, eager), every parameter ~ N(0, std) so that
    layer scales, biases and the class token are all non-trivial."""
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    torch.manual_seed(seed)
    model = Inkling2ForConditionalGeneration(Inkling2Config(**{k: v for k, v in cfg.items() if k != "model_type"}))
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            p.normal_(0.0, std)
        # the text model's zero-initialised parts (attention-residual queries, dynamic-conv static taps, router
        # bias) are perturbed so that every block is exercised
        for name, p in model.named_parameters():
            if name.startswith("model.vision_tower."):
                continue
            p.add_(torch.randn_like(p) * (0.5 if name.endswith(("query", "static_weight")) else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model.eval()


def images(token_size: int, grids=((2, 3), (1, 1), (3, 2)), seed: int = 1) -> list[torch.Tensor]:
    """Tower items ``[R, C, S, S, 3]`` in ``[-1, 1]``, one per ``(R, C)`` grid."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(r, c, token_size, token_size, 3, generator=g) * 2 - 1 for r, c in grids]
