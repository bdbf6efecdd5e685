"""Core attention for megatron's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materializes ``[b*np, sq, sk]`` scores with ``baddbmm``
(measured 2.7x slower than HF's SDPA on an H200, DESIGN.md §6). :class:`SDPAttention` is a
drop-in replacement for the ``core_attention`` submodule of
``get_gpt_layer_local_spec(...)``: same constructor, same tensors in and out, so parameter
names and checkpoints are unchanged (it holds no parameters).

Layouts (megatron's, ``transformer/dot_product_attention.py``):
    query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (``np`` query heads and ``ng`` KV
    groups on this TP rank, ``np % ng == 0``; query head ``i`` reads KV group
    ``i // (np // ng)``, i.e. ``repeat_interleave`` order) -> context ``[sq, b, np * hn]``.

Packed sequences (megatron's ``thd`` format, ``packed_seq_params.qkv_format == 'thd'``): the
data of a micro-batch are concatenated into one row of ``t`` tokens; query ``[t, np, hn]``,
key/value ``[t, ng, hn]`` and ``cu_seqlens_q == cu_seqlens_kv`` ``[n_docs + 1]`` (int32) mark
the documents. Each token attends causally within its own document only. On CUDA this runs
through FlexAttention (``torch.nn.attention.flex_attention``, compiled) with a block mask built
once per micro-batch and shared by every layer; elsewhere through SDPA with the dense
``[t, t]`` block-diagonal causal mask (the exact reference the CPU tests use).

Mask convention (megatron's): ``attention_mask`` is boolean, ``True`` = *masked out*,
broadcastable to ``[b, np, sq, sk]``. A given mask is used as is (megatron does not combine it
with the causal mask); with ``attention_mask=None`` and a causal layer the mask is causal
(``is_causal=True``, which lets SDPA pick the flash kernel on GPU). Masked scores get -10000,
like megatron's ``attention_mask_func``, so a fully masked (padding) row stays finite.

Sliding windows (``config.window_size = (left, right)``, on the layers that megatron's
``is_layer_window_attention`` selects through ``window_attn_skip_freq``): query at absolute
position ``i`` (the last ``sq`` of ``sk`` positions) sees keys ``j`` with ``i - left <= j <= i +
right``; the window mask is OR-ed into the causal or given mask. This is HF's
``sliding_window_overlay`` with ``left = sliding_window - 1``, ``right = 0``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = ["SDPAttention", "CORE_ATTENTION_CHOICES", "core_attention_class"]

#: -10000, the value megatron's ``attention_mask_func`` writes into masked scores.
MASKED_SCORE = -10000.0


class SDPAttention(DotProductAttention):
    """Megatron core attention computed by ``F.scaled_dot_product_attention``.

    Construction is :class:`megatron.core.transformer.dot_product_attention.DotProductAttention`'s
    (same arguments from the layer spec). Supported: causal / no-mask / explicit boolean masks,
    GQA/MQA (``enable_gqa``), attention dropout in training, sliding windows (module docs), packed
    (``thd``) sequences (windows included). ``softcap=c`` (a ``ModuleSpec`` param) caps the scores
    at ``c * tanh(s / c)`` on an explicit matmul path (SDPA has no soft-capping). Not supported
    (raise ``NotImplementedError``): ``softmax_type`` other than ``'vanilla'``, attention bias,
    dropout with packed sequences on CUDA, soft-capping with packed sequences.
    """

    #: copy V out of the fused QKV projection before attention (which saves V for backward): a
    #: view would keep the whole ``[tokens, (np + 2 ng) hn]`` projection alive until backward
    #: (:func:`ferrule.megatron.gpu_fusions.enable_lean_activations`)
    compact_value = False

    def __init__(self, *args, softcap: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: attention logit soft-cap ``c``: scores become ``c * tanh(scores / c)`` (None: off).
        self.softcap = None if softcap is None else float(softcap)
        #: ``(left, right)`` tokens this layer's queries see around themselves, or None.
        self.window: tuple[int, int] | None = None
        if is_layer_window_attention(self.config.window_size, self.config.window_attn_skip_freq, self.layer_number):
            left, right = self.config.window_size
            self.window = (int(left), int(right))
        if self.config.softmax_type not in ("vanilla", "learnable", "off-by-one"):
            raise NotImplementedError(
                f"SDPAttention supports softmax_type 'vanilla', 'learnable' and 'off-by-one', got "
                f"{self.config.softmax_type!r}."
            )
        if isinstance(self.softmax_offset, torch.nn.Parameter) and not getattr(self.softmax_offset,
                                                                               "tensor_model_parallel", False):
            # one sink logit per head of this rank: split over TP with the heads (megatron sets no TP
            # attributes on it, so its gradient-norm share would be counted once per rank as a duplicate)
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        # DotProductAttention divides softmax_scale by layer_number under
        # apply_query_key_layer_scaling and multiplies it back inside the softmax: net scale.
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = float(self.softmax_scale * coeff)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias.")
        if self.compact_value and torch.is_grad_enabled() and \
                value.untyped_storage().nbytes() > 2 * value.numel() * value.element_size():
            value = value.contiguous()
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type

        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)    # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)

        attn_mask = None
        is_causal = False
        if self.window is not None:
            blocked = window_blocked(sq, sk, self.window, causal=mask_type == AttnMaskType.causal, device=q.device)
            attention_mask = blocked if attention_mask is None else (attention_mask.to(q.device) | blocked)
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(
                    f"attention_mask must be boolean (True = masked out, megatron's convention), "
                    f"got {attention_mask.dtype}."
                )
            attn_mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            attn_mask = attn_mask.masked_fill(attention_mask.to(q.device), MASKED_SCORE)
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"causal attention without a mask needs sq == sk, got sq={sq}, sk={sk}.")
            is_causal = True

        dropout_p = self.attention_dropout.p if self.training else 0.0
        if self.softcap is not None or self.softmax_offset is not None:
            context = self._explicit(q, k, v, attn_mask, is_causal, dropout_p)
            return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        context = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=self.sdpa_scale,
            enable_gqa=k.shape[1] != np_,
        )  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _explicit(self, q, k, v, attn_mask, is_causal, dropout_p):
        """Explicit attention with logit soft-capping (HF Gemma-2 ``eager_attention_forward``) and/or
        attention sinks (HF gpt-oss ``eager_attention_forward``: one extra logit per head in each row's
        softmax, dropped after it).

        q ``[b, np, sq, hn]``, k/v ``[b, ng, sk, hn]``, attn_mask additive ``[.., sq, sk]`` or None ->
        ``[b, np, sq, hn]``; softmax in fp32.
        """
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.sdpa_scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if is_causal:
            sq, sk = scores.shape[-2:]
            attn_mask = torch.zeros(sq, sk, dtype=scores.dtype, device=scores.device).masked_fill(
                window_blocked(sq, sk, (-1, -1), causal=True, device=scores.device), MASKED_SCORE)
        if attn_mask is not None:
            scores = scores + attn_mask
        probs = self._softmax(scores).to(q.dtype)
        probs = F.dropout(probs, p=dropout_p, training=self.training)
        return torch.matmul(probs, v)

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """fp32 softmax over the last dim of ``scores [b, np, sq, sk]``, with this rank's sink logit per head
        (``softmax_offset [np]``) as one more column, dropped after the softmax."""
        if self.softmax_offset is None:
            return torch.softmax(scores, dim=-1, dtype=torch.float32)
        b, np_, sq, _ = scores.shape
        sink = self.softmax_offset.to(scores.dtype).reshape(1, np_, 1, 1).expand(b, np_, sq, 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """``thd``: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np * hn]``."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention supports packed sequences in 'thd' format only, "
                                      f"got qkv_format={params.qkv_format!r}.")
        if self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("packed sequences need a causal attention layer.")
        if self.softcap is not None:
            raise NotImplementedError("attention logit soft-capping with packed (thd) sequences is not implemented; "
                                      "train with padded micro-batches for this family.")
        if self.softmax_offset is not None and query.is_cuda:
            raise NotImplementedError("attention sinks with packed (thd) sequences on CUDA are not implemented "
                                      "(FlexAttention has no sink column); train with padded micro-batches.")
        t, np_, hn = query.shape
        q = query.transpose(0, 1).unsqueeze(0)  # [1, np, t, hn]
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        gqa = k.shape[1] != np_
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if q.is_cuda:
            if dropout_p:
                raise NotImplementedError("attention dropout with packed sequences is not supported on CUDA "
                                          "(FlexAttention has no dropout); set attention_dropout=0.")
            out = _flex()(q, k, v, block_mask=document_block_mask(params, t, self.window), scale=self.sdpa_scale,
                          enable_gqa=gqa)
        else:
            doc = document_ids(params.cu_seqlens_q, t)
            pos = torch.arange(t, device=q.device)
            allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
            if self.window is not None and self.window[0] >= 0:  # documents are contiguous: same distances
                allowed &= pos[:, None] - pos[None, :] <= self.window[0]
            if self.softmax_offset is not None:
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, MASKED_SCORE)
                out = self._explicit(q, k, v, mask, False, dropout_p)
                return out[0].transpose(0, 1).reshape(t, np_ * hn)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 scale=self.sdpa_scale, enable_gqa=gqa)
        return out[0].transpose(0, 1).reshape(t, np_ * hn)


def window_blocked(sq: int, sk: int, window: tuple[int, int], *, causal: bool, device=None) -> torch.Tensor:
    """Boolean ``[sq, sk]`` mask, True = blocked, for a sliding window ``(left, right)``.

    Queries are the last ``sq`` of ``sk`` positions (``i = sk - sq + row``); key ``j`` is visible
    when ``i - left <= j <= i + right`` (a negative bound means unbounded) and, if ``causal``,
    ``j <= i``.
    """
    i = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    left, right = window
    blocked = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        blocked |= j < i - left
    if right >= 0:
        blocked |= j > i + right
    if causal:
        blocked |= j > i
    return blocked


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[t]`` int64 document index of every packed token, from ``cu_seqlens`` ``[n + 1]``."""
    cu = cu_seqlens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts, output_size=total)


def document_block_mask(params, total: int, window: tuple[int, int] | None = None):
    """FlexAttention block mask (causal within each document, and within ``window[0]`` tokens
    back when a sliding window is given) for a ``thd`` micro-batch, built once per window and
    cached on ``params`` so the model's layers share it."""
    left = window[0] if window is not None and window[0] >= 0 else None
    cache = getattr(params, "_ferrule_block_masks", None)
    if cache is None or cache[0] != total:
        cache = (total, {})
        params._ferrule_block_masks = cache
    if left in cache[1]:
        return cache[1][left]
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(params.cu_seqlens_q, total)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def same_doc_causal_window(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    mask_mod = same_doc_causal if left is None else same_doc_causal_window
    mask = create_block_mask(mask_mod, None, None, total, total, device=doc.device)
    cache[1][left] = mask
    return mask


_FLEX = None


def _flex():
    """``torch.compile``-d ``flex_attention`` (compiled once per process; eager flex is a slow
    reference implementation)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


CORE_ATTENTION_CHOICES = ("sdpa", "local")


def core_attention_class(name) -> type:
    """``'sdpa'`` -> :class:`SDPAttention`; ``'local'`` -> megatron's ``DotProductAttention``;
    a ``DotProductAttention`` subclass, or a ``"module:attr"`` reference to one, as is.

    Raises:
        ValueError: an unknown name (lists the choices) or a class that is no ``DotProductAttention``.
    """
    if name == "sdpa":
        return SDPAttention
    if name == "local":
        return DotProductAttention
    if isinstance(name, type) or (isinstance(name, str) and ":" in name):
        from .extensions import resolve_class

        cls = resolve_class(name, "core_attention")
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            return cls
        raise ValueError(f"core_attention={name!r} is not a torch module class (e.g. a DotProductAttention subclass).")
    raise ValueError(f"core_attention={name!r} is unknown; choose one of {list(CORE_ATTENTION_CHOICES)}.")
