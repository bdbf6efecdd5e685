"""The attention of one decode step of :func:`ferrule.rollout._fast_decode.decode_logits`.

One query token per batch row attends over the key slots ``[0, kv_len)`` of a static KV cache
that ``allowed`` marks visible, query head ``h`` reading kv head ``h // rep`` (transformers'
``repeat_kv`` grouping). The kinds (:data:`KINDS`, picked by ``RolloutEngineSettings.attention``):

- "eager": transformers' ``eager_attention_forward`` (``modeling_qwen2.py``): ``q @ k^T`` in the
  model dtype, times ``scaling``, masked with the dtype's minimum, ``softmax(dtype=float32)``
  rounded to the model dtype, ``@ v``;
- "fp32" (default): the same with the scores kept in fp32 (``bmm(..., out_dtype=float32)`` on
  CUDA: model-dtype products summed in fp32, as SDPA's kernels keep them; upcast operands on CPU);
- "triton": the "fp32" formula as one fused Triton kernel on CUDA
  (:mod:`ferrule.rollout._decode_attn_triton`, imported only here; its docstring states where it
  can round differently); elsewhere the "fp32" formula;
- "triton_rope": the same kernel also applying RoPE to q and the new key and writing the new
  key/value into the cache (:func:`attend_rope`; the step's separate RoPE and cache-write kernels
  go away); elsewhere the "fp32" formula.
"""

from __future__ import annotations

import torch

from ferrule import envs

KINDS = ("eager", "fp32", "triton", "triton_rope")
#: run the Triton kernel on CPU tensors too (Triton's interpreter, ``TRITON_INTERPRET=1``): a dev aid
TRITON_ON_CPU = envs.get("TRITON_INTERPRET") == "1"


def uses_triton(attn: str, device: torch.device) -> bool:
    """True when :func:`attend` runs the Triton kernel for this kind and device."""
    return attn in ("triton", "triton_rope") and (device.type == "cuda" or TRITON_ON_CPU)


def fuses_rope(attn: str, device: torch.device) -> bool:
    """True when :func:`attend_rope` replaces RoPE + cache write + :func:`attend` for this kind and device."""
    return attn == "triton_rope" and uses_triton(attn, device)


def attend_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slot: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, allowed: torch.Tensor, kv_len: int,
                scaling: float) -> torch.Tensor:
    """RoPE on ``q [batch, q_heads, head_dim]`` and the new key ``k [batch, kv_heads, head_dim]``
    (``cos``/``sin [batch, head_dim]``), the rotated key and ``v`` written into ``kc``/``vc`` at
    ``slot [batch]``, then :func:`attend`'s "fp32" formula, in one Triton kernel (CUDA;
    :func:`fuses_rope` must hold) -> ``[batch, q_heads * head_dim]``."""
    from ferrule.rollout._decode_attn_triton import decode_attention_rope, splits_for

    b, hq, d = q.shape
    return decode_attention_rope(q, k, v, cos, sin, slot, kc, vc, allowed, kv_len, scaling,
                                 splits_for(b, kc.shape[1])).reshape(b, hq * d)


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, allowed: torch.Tensor, hidden: torch.Tensor,
           kv_len: int, scaling: float, attn: str) -> torch.Tensor:
    """``q [batch, q_heads, head_dim]`` (model dtype), caches ``kc``/``vc`` ``[batch, kv_heads,
    max_len, head_dim]``, ``allowed [batch, max_len]`` bool and ``hidden = ~allowed[:, None, None,
    :kv_len]`` (computed once per step by the caller) -> ``[batch, q_heads * head_dim]`` in the
    model dtype, by the formula of ``attn`` (module docstring)."""
    b, hq, d = q.shape
    hkv = kc.shape[1]
    rep = hq // hkv
    if uses_triton(attn, q.device):
        from ferrule.rollout._decode_attn_triton import decode_attention, splits_for

        return decode_attention(q, kc, vc, allowed, kv_len, scaling, splits_for(b, hkv)).reshape(b, hq * d)
    L = kv_len
    fp32_scores = attn in ("fp32", "triton", "triton_rope") and q.dtype != torch.float32
    if fp32_scores and q.is_cuda:
        s = torch.bmm(q.reshape(b * hkv, rep, d), kc[:, :, :L].reshape(b * hkv, L, d).transpose(-1, -2),
                      out_dtype=torch.float32).view(b, hkv, rep, L) * scaling
    elif fp32_scores:  # CPU has no bmm(out_dtype=): the same products from upcast operands
        s = torch.matmul(q.view(b, hkv, rep, d).float(), kc[:, :, :L].transpose(-1, -2).float()) * scaling
    else:
        s = torch.matmul(q.view(b, hkv, rep, d), kc[:, :, :L].transpose(-1, -2)) * scaling
    s = s.masked_fill(hidden, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, vc[:, :, :L]).reshape(b, hq * d)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, kv_len: int,
              scaling: float, compute: torch.dtype = torch.float64) -> torch.Tensor:
    """The "fp32" formula in ``compute`` precision for tests: products and sums in float64 (exact
    to ~1e-16), ``p`` still rounded to ``q``'s dtype as the formula rounds it; returns ``[batch,
    q_heads, head_dim]`` in ``compute``, not rounded to the model dtype."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.to(compute).view(b, hkv, hq // hkv, d)
    s = torch.matmul(qq, k[:, :, :kv_len].to(compute).transpose(-1, -2)) * scaling
    s = s.masked_fill(~allowed[:, None, None, :kv_len], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype).to(compute)
    return torch.matmul(p, v[:, :, :kv_len].to(compute)).reshape(b, hq, d)
