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


#: Tiny multimodal test model: placeholder ids inside the tiny text vocabulary (96).
MM_IMAGE_TOKEN, MM_AUDIO_TOKEN = 90, 91
MM_PATCH = 8
MM_VISION = {"num_hidden_layers": 2, "patch_size": MM_PATCH}
MM_AUDIO = {"n_mel_bins": 80, "mel_vocab_size": 16}


def tiny_inkling_mm_dir(out_dir, *, seed: int = SEED, vision: dict | None = None) -> Path:
    """Save a random tiny ``InklingForConditionalGeneration`` (fp32, released layout) with both towers perturbed
    (``vision``: the ``vision_config``, default :data:`MM_VISION`)."""
    import torch
    from transformers import InklingConfig, InklingForConditionalGeneration

    text = {k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"}
    cfg = InklingConfig(text_config=text, vision_config=vision or MM_VISION, audio_config=MM_AUDIO,
                        image_token_id=MM_IMAGE_TOKEN, audio_token_id=MM_AUDIO_TOKEN)
    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def tiny_media(seed: int = 0, *, image_hw=(12, 20), audio_seconds: float = 0.3):
    """One random RGB image and one 16 kHz clip, preprocessed for the tiny model.

    Returns ``(pixel_values [n_patches, 2, P, P, 3], dmel_ids [n_frames, 80])`` from
    :func:`ferrule.plugins.inkling.towers.image_to_pixel_values` (patch :data:`MM_PATCH`) and
    :func:`~ferrule.plugins.inkling.towers.audio_to_dmel_ids` (transformers' feature extractor).
    """
    import numpy as np
    from PIL import Image

    from ferrule.plugins.inkling.towers import audio_to_dmel_ids, image_to_pixel_values

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (*image_hw, 3), dtype=np.uint8))
    wave = rng.standard_normal(int(16000 * audio_seconds)).astype(np.float32) * 0.1
    return image_to_pixel_values(image, MM_PATCH), audio_to_dmel_ids(wave, 16000)
