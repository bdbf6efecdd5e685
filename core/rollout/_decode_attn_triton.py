r"""Fused GQA decode attention for the fast decode step (:mod:`ferrule.rollout._fast_decode`), in Triton.

Imported only by :mod:`ferrule.rollout._decode_attn` when ``rollout_engine.attention`` is ``triton`` or
``triton_rope`` asks for it (triton is not a dependency: CI's CPU install has none; the CUDA machines carry it
with torch).

The formula is the fast step's default "fp32" attention (:mod:`ferrule.rollout._decode_attn`), per
batch row ``b``, query head ``h`` and its kv head ``h // rep`` (transformers' ``repeat_kv``
grouping), over the key slots ``j < kv_len`` with ``allowed[b, j]``::

    s_j = fp32(sum_d q[b, h, d] * k[b, h // rep, j, d]) * scaling     # bf16 products, fp32 sums
    p_j = bf16(exp(s_j - max_j s) / sum_j exp(s_j - max_j s))          # fp32 softmax, then rounded
    o[b, h] = bf16(sum_j fp32(p_j * v[b, h // rep, j]))                 # fp32 sums, rounded once

which is what ``bmm(q, k^T, out_dtype=float32) * scaling``, ``masked_fill``, ``softmax(dtype=
float32).to(bf16)`` and ``matmul(p, v)`` compute. The kernel keeps the normalised, bf16-rounded
``p`` (not flash attention's unnormalised one), so it differs from that chain only in fp32
summation order and in the softmax statistics: the max and the sum of exponentials come from one
online pass (``l = l * exp(m_old - m_new) + sum exp(s - m_new)``), a relative difference in ``l``
of a few fp32 ulps, which changes a ``p_j`` only where it lies that close to a bf16 rounding
boundary. ``exp`` is Triton's ``tl.exp``; inductor's softmax kernel may evaluate it differently
in the last bits.

Work split: one program per (row, kv head, split); the ``rep`` query heads of a kv head are one
``[REP_PAD, D_PAD]`` tile (``REP_PAD >= 16`` and ``D_PAD``, the head dim padded to a power of two,
``>= 16`` for ``tl.dot``; the padding rows and columns are masked). Each
program first sweeps the whole attended prefix for the softmax statistics, then multiplies ``p``
with ``v`` over its own ``1 / splits`` of the prefix; with ``splits > 1`` the fp32 partial sums
are added afterwards (one reduction kernel) and rounded once. The K/V cache is read in place
(``[batch, kv_heads, max_len, head_dim]``, slots ``[0, kv_len)``): no copy, no gather.

:func:`decode_attention_rope` (``attention: triton_rope``) is the same kernel also doing
the step's RoPE on q and on the new key (fp32 arithmetic rounded once, as inductor's fused RoPE
kernel rounds it) and writing the new key/value into the cache; every program of a row uses the
new key/value from registers at the row's slot, so no program waits for another's write. It
attends up to each row's slot (``slot + 1`` slots), so one compiled graph covers every step.

Both are ``torch.library.triton_op``\ s, so ``torch.compile`` keeps the kernel inside the one
compiled step (no graph break; the cache write is re-inplaced, no copy) and CUDA graphs capture it
with the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

#: key slots per loop iteration
BLOCK_N = 64
#: programs the splits aim for (an H200 has 132 SMs): splits = ceil(TARGET_PROGRAMS / (batch * kv_heads)),
#: at most MAX_SPLITS
TARGET_PROGRAMS = 264
MAX_SPLITS = 8


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, a_ptr, o_ptr, part_ptr, kv_len, scaling,
                        sqb, sqh, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sab, sal,
                        sob, soh, sod, spb, sph,
                        kn_ptr, vn_ptr, cos_ptr, sin_ptr, slot_ptr, sknb, sknh, svnb, svnh, scb, ssb,
                        REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # a python float argument is fp64 where inductor passes it (a symbolic float): keep the scores fp32
    scaling = tl.cast(scaling, tl.float32)
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D_PAD)  # head_dim padded to a power of two >= 16 (tl.arange, tl.dot's K); the pad is masked
    dmask = d < D
    heads = kvh * REP + r
    rmask = r < REP
    qmask = rmask[:, None] & dmask[None, :]
    q_rows = q_ptr + row * sqb + heads[:, None] * sqh
    q = tl.load(q_rows + d[None, :] * sqd, mask=qmask, other=0.0)
    k_base = k_ptr + row * skb + kvh * skh
    v_base = v_ptr + row * svb + kvh * svh
    a_base = a_ptr + row * sab
    if ROPE:
        # transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) =
        # cat(-x[half:], x[:half]); fp32 arithmetic, rounded once (as inductor's kernel rounds it)
        half: tl.constexpr = D // 2
        d_rot = (d + half) % D
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + row * scb + d, mask=dmask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + row * ssb + d, mask=dmask, other=0.0).to(tl.float32)
        q_rot = tl.load(q_rows + d_rot[None, :] * sqd, mask=qmask, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * c[None, :] + sign[None, :] * q_rot * sn[None, :]).to(q_ptr.dtype.element_ty)
        kn_row = kn_ptr + row * sknb + kvh * sknh
        k_new = (tl.load(kn_row + d, mask=dmask, other=0.0).to(tl.float32) * c
                 + sign * tl.load(kn_row + d_rot, mask=dmask, other=0.0).to(tl.float32) * sn).to(k_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + row * svnb + kvh * svnh + d, mask=dmask, other=0.0)
        slot = tl.load(slot_ptr + row)
        kv_len = tl.minimum(kv_len, slot + 1)  # nothing past this step's slot is visible
        if split == 0:
            tl.store(k_base + slot * skl + d * skd, k_new, mask=dmask)
            tl.store(v_base + slot * svl + d * svd, v_new, mask=dmask)
    neg = -3.4028234663852886e38  # torch.finfo(torch.float32).min, the masked_fill value
    m = tl.full([REP_PAD], neg, dtype=tl.float32)
    l = tl.zeros([REP_PAD], dtype=tl.float32)
    # sweep 1: softmax statistics over every attended slot
    for start in range(0, kv_len, BLOCK):
        n = start + tl.arange(0, BLOCK)
        valid = n < kv_len
        vis = tl.load(a_base + n * sal, mask=valid, other=0) != 0
        k = tl.load(k_base + n[:, None] * skl + d[None, :] * skd, mask=valid[:, None] & dmask[None, :], other=0.0)
        if ROPE:  # this step's key, whether or not another program has written it yet
            k = tl.where((n == slot)[:, None], k_new[None, :], k)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(vis[None, :], s * scaling, neg)
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    # sweep 2: p @ v over this program's share of the slots
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK) * BLOCK
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    acc = tl.zeros([REP_PAD, D_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        n = start + tl.arange(0, BLOCK)
        valid = n < hi
        vis = tl.load(a_base + n * sal, mask=valid, other=0) != 0
        k = tl.load(k_base + n[:, None] * skl + d[None, :] * skd, mask=valid[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * svl + d[None, :] * svd, mask=valid[:, None] & dmask[None, :], other=0.0)
        if ROPE:
            k = tl.where((n == slot)[:, None], k_new[None, :], k)
            v = tl.where((n == slot)[:, None], v_new[None, :], v)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(vis[None, :], s * scaling, neg)
        p = (tl.exp(s - m[:, None]) / l[:, None]).to(v_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc)
    if SPLITS == 1:
        tl.store(o_ptr + row * sob + heads[:, None] * soh + d[None, :] * sod, acc.to(o_ptr.dtype.element_ty),
                 mask=qmask)
    else:
        tl.store(part_ptr + split * (spb * tl.num_programs(0)) + row * spb + heads[:, None] * sph + d[None, :],
                 acc, mask=qmask)


def splits_for(batch: int, kv_heads: int) -> int:
    """Split count for ``batch * kv_heads`` (row, kv head) pairs: enough programs to fill the GPU."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // (batch * kv_heads))))


def _tile(n: int) -> int:
    """A ``tl.dot`` operand's side for ``n`` rows or columns: the next power of two (``tl.arange``), at least 16."""
    return max(16, triton.next_power_of_2(n))


def _launch(q, k, v, allowed, kv_len, scaling, splits, rope):
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    part = torch.empty((splits, b, hq, d) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    kn, vn, cos, sin, slot = rope if rope is not None else (q, q, q, q, q)
    wrap_triton(_decode_attn_kernel)[(b, hkv, splits)](
        q, k, v, allowed, out, part, kv_len, scaling,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3), allowed.stride(0), allowed.stride(1),
        out.stride(0), out.stride(1), out.stride(2), hq * d, d,
        kn, vn, cos, sin, slot, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos.stride(0), sin.stride(0),
        REP=hq // hkv, REP_PAD=_tile(hq // hkv), D=d, D_PAD=_tile(d), BLOCK=BLOCK_N, SPLITS=splits,
        IEEE=q.dtype == torch.float32, ROPE=rope is not None)
    if splits == 1:
        return out
    return part.sum(0).to(q.dtype)


@triton_op("ferrule::decode_attention", mutates_args={})
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, kv_len: int,
                     scaling: float, splits: int) -> torch.Tensor:
    """One decode step's attention: ``q [batch, q_heads, head_dim]`` (rotated), ``k``/``v`` caches
    ``[batch, kv_heads, max_len, head_dim]`` (model dtype; slots ``[0, kv_len)`` read in place,
    this step's key/value already written), ``allowed [batch, max_len]`` bool (visible slots; every
    row has at least one below ``kv_len``) -> ``[batch, q_heads, head_dim]`` in ``q``'s dtype, the
    formula in the module docstring. ``splits`` (>= 1): programs per (row, kv head), see
    :func:`splits_for`. Last dims contiguous."""
    return _launch(q, k, v, allowed, kv_len, scaling, splits, None)


@triton_op("ferrule::decode_attention_rope", mutates_args={"k", "v"})
def decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          allowed: torch.Tensor, kv_len: int, scaling: float, splits: int) -> torch.Tensor:
    """:func:`decode_attention` with RoPE and the cache write in the same kernel: ``q [batch, q_heads,
    head_dim]``, ``k_new``/``v_new [batch, kv_heads, head_dim]`` before RoPE (views of the qkv
    projection are fine), ``cos``/``sin [batch, head_dim]`` (the model's ``rotary_emb`` at each row's
    position), ``slot [batch]`` int64; writes the rotated key and ``v_new`` into ``k``/``v`` at
    ``slot`` and attends over slots ``[0, min(kv_len, slot + 1))`` of each row (no slot past this
    step's is visible), so one ``kv_len`` (the whole cache) serves every step."""
    return _launch(q, k, v, allowed, kv_len, scaling, splits, (k_new, v_new, cos, sin, slot))
