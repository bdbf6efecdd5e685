"""Fused kernels for megatron-core's local layer spec on CUDA, without TransformerEngine or Apex.

megatron-core routes two elementwise chains to fused kernels when its config asks for them:

- SwiGLU (``config.bias_activation_fusion``; ``megatron.core.fusions.fused_bias_swiglu``): its
  own ``torch.compile``-d forward and backward (``megatron.core.jit.jit_fuser``), which needs no
  TE. Without the flag, ``silu(gate) * up`` runs as separate kernels with their intermediates
  saved for backward.
- RoPE (``config.apply_rope_fusion``): megatron calls
  ``rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=...)``, which is TE's kernel and
  ``None`` without TE. :func:`enable_cuda_fusions` fills that slot, only where it is empty, with
  ``torch.compile`` of megatron's own unfused ``_apply_rotary_pos_emb_bshd`` (same formula:
  ``t * cos + rotate_half(t) * sin`` on the first ``rot_dim`` channels), so the cos/sin, the
  half rotation, the products and the concatenation become one kernel each way. The packed
  (``thd``) slot, ``fused_apply_rotary_pos_emb_thd``, gets :func:`_rope_thd` likewise.

Both are flags read at forward time, so the engine turns them on after the model is built, on
CUDA only: on CPU the unfused eager path stays the bit-exact reference the tests pin.
``FERRULE_CUDA_FUSIONS=0`` turns them off (for benchmarks and debugging).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["enable_cuda_fusions"]


def _rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
              cp_rank: int = 0) -> torch.Tensor:
    """RoPE for packed (``thd``) tokens, the contract of TE's ``fused_apply_rotary_pos_emb_thd``:
    ``t`` ``[T, h, d]``, ``cu_seqlens`` ``[n + 1]``, ``freqs`` ``[max_s, 1, 1, rot_dim]``; every
    document's positions restart at 0 (megatron's ``_apply_rotary_pos_emb_thd``, without its
    per-document Python loop and host syncs: positions are gathered, then the bshd kernel runs)."""
    if cp_size != 1:
        raise NotImplementedError("packed-sequence RoPE with context parallelism is not supported without TE.")
    total = t.shape[0]
    cu = cu_seqlens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], counts, output_size=total)
    positions = torch.arange(total, device=t.device) - starts
    return _compiled_rope()(t.unsqueeze(1), freqs[positions]).squeeze(1)


@functools.cache
def _compiled_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        """``t`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, rot_dim]`` -> ``[s, b, h, d]`` (megatron's math)."""
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)

    return torch.compile(rope, dynamic=True)


def enable_cuda_fusions(config: Any) -> list[str]:
    """Turn on the fused SwiGLU and RoPE paths of a built model's ``TransformerConfig`` (in place).

    Only where they apply: SwiGLU for ``gated_linear_unit`` with SiLU (megatron's fused kernel
    has no other gated activation without TE); RoPE for ``position_embedding_type='rope'``
    without multi-latent attention (not YaRN: ``apply_rotary_pos_emb``'s fused ``thd`` path
    ignores its ``mscale``). Does nothing when ``FERRULE_CUDA_FUSIONS=0``.

    Returns:
        The names of the fusions now on (``'swiglu'``, ``'rope'``).
    """
    if os.environ.get("FERRULE_CUDA_FUSIONS") == "0":
        return []
    from megatron.core.models.common.embeddings import rope_utils

    enabled = []
    if config.gated_linear_unit and config.activation_func is F.silu and not config.use_te_activation_func:
        config.bias_activation_fusion = True
        enabled.append("swiglu")
    # not with YaRN: megatron's fused path drops its cos/sin factor (mscale) for packed (thd) input
    if getattr(config, "multi_latent_attention", False) is False and getattr(config, "mrope_section", None) is None \
            and not hasattr(config, "yarn_rotary_scaling_factor"):
        if rope_utils.fused_apply_rotary_pos_emb is None:
            rope_utils.fused_apply_rotary_pos_emb = _compiled_rope()
        if rope_utils.fused_apply_rotary_pos_emb_thd is None:
            rope_utils.fused_apply_rotary_pos_emb_thd = _rope_thd
        config.apply_rope_fusion = True
        enabled.append("rope")
    return enabled
