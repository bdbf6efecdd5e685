"""Model FLOPs of a decoder forward and the model FLOPs utilisation (MFU) of a training phase.

Convention: "model FLOPs" as in PaLM (Chowdhery et al. 2022, appendix B) — the matmul FLOPs
the model needs, independent of how an implementation computes them (no recomputation, no
padding): per token, ``2 * N_matmul`` for the weight matmuls (embedding lookup excluded, the
output projection included) and, per layer, ``4 * s * (num_heads * head_dim)`` for the ``Q K^T``
and ``A V`` products of a sequence of ``s`` tokens (full ``s x s``, the PaLM ``12 L H Q T`` term
over forward + backward; causal kernels skip half of it, so MFU by this count can slightly exceed
what the kernels executed). A backward costs twice the forward. These are exactly the FLOPs
``torch.utils.flop_counter.FlopCounterMode`` counts for one HF forward (``tests/test_flops.py``).

MFU = model FLOPs / (seconds x peak dense bf16 FLOP/s of the device). Peak numbers are the
vendors' dense (no sparsity) bf16 tensor-core figures; ``FERRULE_PEAK_TFLOPS`` overrides them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ferrule import envs

__all__ = ["PEAK_BF16_TFLOPS", "forward_flops", "peak_flops", "training_mfu"]

#: Dense bf16 tensor-core peak, TFLOP/s, by a substring of ``torch.cuda.get_device_name()``
#: (NVIDIA data sheets: H100/H200 SXM 989.4, H100 PCIe 756, A100 312, L40S 362.05, A10 125).
PEAK_BF16_TFLOPS: dict[str, float] = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "H800": 989.4,
                                      "A100": 312.0, "A800": 312.0, "L40S": 362.05, "A10": 125.0}


def _layer_matmul_params(cfg: Mapping[str, Any]) -> int | None:
    """Weight-matmul parameters of one decoder layer (Llama / Qwen2 / Qwen3 / Qwen3-MoE shapes), or None."""
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        moe_ffn = int(cfg.get("moe_intermediate_size") or 0)
        if not top_k or not moe_ffn:
            return None
        mlp = top_k * 3 * hidden * moe_ffn + hidden * int(experts)  # active experts + router
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp += 3 * hidden * shared + (hidden if shared else 0)
    else:
        if "intermediate_size" not in cfg:
            return None
        mlp = 3 * hidden * int(cfg["intermediate_size"])
    return attn + mlp


def forward_flops(hf_config: Mapping[str, Any], seq_lens: Sequence[int]) -> int | None:
    """Model FLOPs of one forward over sequences of ``seq_lens`` tokens (see the module docstring).

    Args:
        hf_config: the HF ``config.json`` dict of a Llama-shaped dense or Qwen3-MoE-shaped decoder.
        seq_lens: tokens per sequence (each attends within itself).

    Returns:
        FLOPs (int), or None for a config this count does not cover (other layer kinds, e.g.
        Inkling's ShortConv blocks, mixed dense/MoE layer schedules).
    """
    cfg = hf_config
    if cfg.get("layer_types") and set(cfg["layer_types"]) - {"full_attention", "sliding_attention"}:
        return None
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) not in (1, None):
        return None
    per_layer = _layer_matmul_params(cfg)
    if per_layer is None:
        return None
    layers = int(cfg["num_hidden_layers"])
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    attn_width = heads * int(cfg.get("head_dim") or hidden // heads)
    tokens = sum(int(s) for s in seq_lens)
    matmul = 2 * tokens * (layers * per_layer + hidden * int(cfg["vocab_size"]))
    attention = layers * sum(4 * int(s) * int(s) * attn_width for s in seq_lens)
    return matmul + attention


def peak_flops(device: Any = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device`` (a CUDA device), ``FERRULE_PEAK_TFLOPS`` if set, else None
    (CPU, or a GPU missing from :data:`PEAK_BF16_TFLOPS`)."""
    env = envs.get("FERRULE_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    import torch

    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def training_mfu(hf_config: Mapping[str, Any], fb_seq_lens: Sequence[int], seconds: float, device: Any,
                 forward_only_seq_lens: Sequence[int] = ()) -> float | None:
    """MFU of a training phase: ``forward_backward`` over ``fb_seq_lens`` (3 forwards' FLOPs) plus
    ``forward_logprobs`` over ``forward_only_seq_lens`` (1 forward), in ``seconds``.

    Returns:
        a fraction in (0, 1] for a device with a known peak, else None.
    """
    peak = peak_flops(device)
    fwd = forward_flops(hf_config, fb_seq_lens)
    extra = forward_flops(hf_config, forward_only_seq_lens) if forward_only_seq_lens else 0
    if peak is None or fwd is None or extra is None or seconds <= 0:
        return None
    return (3 * fwd + extra) / (seconds * peak)
