"""Per-token logprobs straight from the last hidden states, without ``[tokens, vocab]`` fp32 logits.

The plain path (``model(...) -> logits -> logits.float() -> vocab_parallel_cross_entropy``)
materialises the logits of every token in the parameter dtype *and* in fp32, then runs several
elementwise passes over them; for Qwen2-0.5B at 16k tokens that is 10 GB per fp32 copy and, on an
H200, about a fifth of the train step (profile in docs/benchmarks.md). :func:`linear_logprobs`
computes the same quantity chunk by chunk (``chunk_tokens`` rows at a time) and recomputes each
chunk's logits in the backward pass, the scheme of "fused linear cross entropy" kernels (Liger's
``LigerFusedLinearCrossEntropy``, Megatron's ``cross_entropy_fusion``), but with an arbitrary
upstream gradient per token, since RL losses (``ppo``, ``cispo``, ...) are non-linear in the
logprobs.

Math, for token ``t`` with hidden ``h_t``, output weight ``W`` (``[V, H]``) and target ``y_t``::

    z_t = W h_t                         (computed in W's dtype, reduced in fp32)
    logprob_t = z_t[y_t] - logsumexp(z_t)                      (padded vocab rows excluded)
    d logprob_t / d z_t = onehot(y_t) - softmax(z_t)

so with upstream gradients ``g_t``: ``dz = g[:, None] * (onehot - softmax)``, ``dh = dz W`` and
``dW = dz^T h``. Under tensor parallelism ``W`` is split by vocabulary rows (Megatron's
``ColumnParallelLinear`` output layer, ``parallel_output=True``); the max, the sum of exponentials
and the target logit are all-reduced over the TP group, as in
``megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy``, and ``dh`` is
all-reduced in the backward pass (the output layer's input is TP-replicated when sequence
parallelism is off, which is how ferrule builds models).

Numerics: logits are rounded to ``W``'s dtype (as the plain path's matmul output is) and every
reduction is fp32; on CPU in fp32 the result equals the plain path to ~1e-6 (tested). ``dW`` is
accumulated over chunks in fp32 and cast to ``W``'s dtype once; with ``main_grad`` (the
weight's fp32 DDP gradient buffer) each chunk's ``dz^T h`` is accumulated straight into that buffer
instead (:func:`~ferrule.megatron.gpu_fusions.wgrad_accumulate`: one fp32-accumulating GEMM on
CUDA) and no ``[V, H]`` weight gradient is returned, which saves the fp32 ``[V, H]`` scratch, its
bf16 cast and DDP's add.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .gpu_fusions import compile_dynamic, wgrad_accumulate

__all__ = ["linear_logprobs", "DEFAULT_CHUNK_TOKENS"]

#: Rows per chunk: 1024 tokens x 151936 vocab in bf16 is 0.31 GB of transient logits (the train engine's
#: default, :class:`~ferrule.engine_settings.TrainEngineSettings` ``logprob_chunk_tokens``; 4096 before
#: issue 40 measured the same speed with 3.58 GB of transients on an H200)
DEFAULT_CHUNK_TOKENS = 1024


def _chunk_max(z: torch.Tensor) -> torch.Tensor:
    """``[c, V]`` logits (param dtype) -> ``[c]`` fp32 row max."""
    return z.float().amax(dim=-1)


def _chunk_sumexp(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum_v exp(z - m)`` in fp32, ``[c]``."""
    return torch.exp(z.float() - m[:, None]).sum(dim=-1)


def _chunk_max_sumexp(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`_chunk_max`, :func:`_chunk_sumexp` at that max) in one function: one compiled kernel
    on CUDA (inductor's online-softmax reduction reads the chunk's logits once), the same two
    eager ops on CPU."""
    zf = z.float()
    m = zf.amax(dim=-1)
    return m, torch.exp(zf - m[:, None]).sum(dim=-1)


def _chunk_grad(z: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor,
                in_range: torch.Tensor) -> torch.Tensor:
    """``g * (onehot(y) - softmax(z))`` in z's dtype, ``[c, V]`` (one pass on CUDA when compiled)."""
    cols = torch.arange(z.shape[1], device=z.device)
    onehot = ((cols[None, :] == y[:, None]) & in_range[:, None]).float()
    return ((onehot - torch.exp(z.float() - lse[:, None])) * g[:, None]).to(z.dtype)


@functools.cache
def _kernels(cuda: bool):
    """(max, sumexp, grad, max + sumexp): ``torch.compile``-d on CUDA (each one fused pass over the chunk's
    logits instead of an fp32 copy plus several elementwise passes); eager on CPU, where the
    tests compare with fp64 references."""
    fns = (_chunk_max, _chunk_sumexp, _chunk_grad, _chunk_max_sumexp)
    if not cuda:
        return fns
    return tuple(torch.compile(f, dynamic=compile_dynamic()) for f in fns)


def _tp_group_and_rank(tp_group):
    import torch.distributed as dist

    if tp_group is None or not dist.is_initialized() or dist.get_world_size(tp_group) == 1:
        return None, 0
    return tp_group, dist.get_rank(tp_group)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, chunk_tokens, tp_group, main_grad, expected_grad, one_pass):
        import torch.distributed as dist

        group, rank = _tp_group_and_rank(tp_group)
        v_local = weight.shape[0]
        start = rank * v_local
        n_valid = max(0, min(v_local, vocab_size - start))  # unpadded rows on this rank
        t = hidden.shape[0]
        lse = torch.empty(t, dtype=torch.float32, device=hidden.device)
        out = torch.empty(t, dtype=torch.float32, device=hidden.device)
        local_labels = labels - start
        in_range = (local_labels >= 0) & (local_labels < n_valid)
        safe = torch.where(in_range, local_labels, torch.zeros_like(local_labels))
        kmax, ksumexp, kgrad, kmaxsum = _kernels(hidden.is_cuda)
        # gradients formed here, from the logits at hand, when the caller knows the upstream gradient
        pre = expected_grad is not None and main_grad is not None and ctx.needs_input_grad[1]
        pre_grad_h = torch.zeros_like(hidden) if pre else None
        g_pre = expected_grad.float() if pre else None
        # one_pass (TrainEngineSettings.logprob_one_pass): max and sum of exponentials in one compiled kernel
        # on CUDA (on CPU the same two eager ops either way)
        one_pass = not hidden.is_cuda or one_pass
        for a in range(0, t, chunk_tokens):
            b = min(a + chunk_tokens, t)
            z = hidden[a:b] @ weight[:n_valid].t()  # [c, n_valid] in the parameter dtype
            if one_pass and group is None and n_valid:
                m, s = kmaxsum(z)  # one pass over the logits
            else:
                if n_valid:
                    m = kmax(z)
                else:
                    m = torch.full((b - a,), float("-inf"), device=z.device)
                if group is not None:
                    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                s = ksumexp(z, m) if n_valid else torch.zeros(b - a, device=z.device)
            tgt = z.gather(1, safe[a:b, None]).squeeze(1).float() * in_range[a:b]
            if group is not None:
                dist.all_reduce(s, group=group)
                dist.all_reduce(tgt, group=group)
            lse[a:b] = m + torch.log(s)
            out[a:b] = tgt - lse[a:b]
            if pre and n_valid:
                _chunk_backward(z, kgrad, lse, g_pre, safe, in_range, a, b, weight[:n_valid], hidden, pre_grad_h,
                                None, main_grad)
        ctx.save_for_backward(hidden, weight, safe, in_range, lse)
        ctx.meta = (n_valid, chunk_tokens, group)
        ctx.main_grad = main_grad  # not saved_tensors: it is written in place by backward
        ctx.pre = (pre_grad_h, g_pre) if pre else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed as dist

        hidden, weight, safe, in_range, lse = ctx.saved_tensors
        n_valid, chunk_tokens, group = ctx.meta
        t = hidden.shape[0]
        g = grad_out.float()
        main_grad = ctx.main_grad if ctx.needs_input_grad[1] else None
        grad_h = None
        if ctx.pre is not None:
            # the forward pass already added dW(expected) to main_grad and formed dh(expected); both are
            # linear in the upstream gradient, so only a difference (if any) is left to apply
            grad_h, g_pre = ctx.pre
            ctx.pre = None
            if torch.equal(g, g_pre):
                g = None
            else:
                g = g - g_pre
        if g is not None:
            if grad_h is None and ctx.needs_input_grad[0]:
                grad_h = torch.zeros_like(hidden)
            grad_w32 = None
            if ctx.needs_input_grad[1] and main_grad is None:
                grad_w32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            w = weight[:n_valid]
            kgrad = _kernels(hidden.is_cuda)[2]
            for a in range(0, t, chunk_tokens):
                b = min(a + chunk_tokens, t)
                _chunk_backward(hidden[a:b] @ w.t(), kgrad, lse, g, safe, in_range, a, b, w, hidden, grad_h,
                                grad_w32, main_grad)
        else:
            grad_w32 = None
        if not ctx.needs_input_grad[0]:
            grad_h = None
        if grad_h is not None and group is not None:
            dist.all_reduce(grad_h, group=group)
        grad_w = grad_w32.to(weight.dtype) if grad_w32 is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _chunk_backward(z, kgrad, lse, g, safe, in_range, a, b, w, hidden, grad_h, grad_w32, main_grad) -> None:
    """Rows ``a:b``: ``dz = g * (onehot - softmax(z))`` (W's dtype), then ``grad_h[a:b] += dz @ w`` and
    ``dz^T h`` into ``grad_w32`` (fp32 scratch) or straight into ``main_grad``."""
    dz = kgrad(z, lse[a:b], g[a:b], safe[a:b], in_range[a:b])  # [c, n_valid], W's dtype
    if grad_h is not None:
        grad_h[a:b] += dz @ w
    if grad_w32 is not None:
        grad_w32[:w.shape[0]] += dz.t() @ hidden[a:b]  # matmul in W's dtype, summed over chunks in fp32
    elif main_grad is not None and w.shape[0]:
        wgrad_accumulate(main_grad[:w.shape[0]], dz, hidden[a:b])


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, *,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, tp_group: Optional[object] = None,
                    main_grad: Optional[torch.Tensor] = None,
                    expected_grad: Optional[torch.Tensor] = None, one_pass: bool = True) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T)[labels]`` over the unpadded vocabulary, chunked.

    Args:
        hidden: ``[T, H]`` final-norm hidden states (any float dtype; the matmul runs in it).
        weight: ``[V_local, H]`` this TP rank's rows of the output weight (rows
            ``rank * V_local ...``); rows at global index ``>= vocab_size`` are padding and excluded.
        labels: ``[T]`` int64 global token ids in ``[0, vocab_size)``.
        vocab_size: the unpadded vocabulary size (HF ``config.vocab_size``).
        chunk_tokens: rows per chunk (memory ``chunk_tokens * V_local`` fp32 at a time).
        tp_group: the tensor-parallel process group (None or size 1: no communication).
        main_grad: ``weight``'s gradient accumulation buffer (``[V_local, H]``, megatron DDP's
            ``main_grad``): the weight gradient is added into it in backward and ``weight``
            receives none through autograd. None: ``weight.grad`` as usual.
        expected_grad: ``[T]`` the upstream gradient the caller expects for the logprobs (cross
            entropy: ``-weights``); with ``main_grad``, both gradients are formed in the forward
            pass from the logits already computed there (no recompute in backward, the scheme of
            Liger's fused linear cross entropy), and the backward pass applies only the
            difference between the actual and the expected upstream gradient (both gradients
            are linear in it), so any upstream gradient stays correct.
        one_pass: on CUDA, each chunk's max and sum of exponentials in one compiled kernel
            (:class:`~ferrule.engine_settings.TrainEngineSettings` ``logprob_one_pass``); False: two.

    Returns:
        ``[T]`` float32 logprobs, differentiable w.r.t. ``hidden`` and ``weight``.

    Raises:
        ValueError: mismatched shapes or a non-positive ``chunk_tokens``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs needs hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}.")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T] = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}.")
    if main_grad is not None and main_grad.shape != weight.shape:
        raise ValueError(f"main_grad must have weight's shape {tuple(weight.shape)}, got {tuple(main_grad.shape)}.")
    if expected_grad is not None and expected_grad.shape != labels.shape:
        raise ValueError(f"expected_grad must be [T] = {tuple(labels.shape)}, got {tuple(expected_grad.shape)}.")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    if expected_grad is not None and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        expected_grad = None  # no backward will come: nothing may be written into main_grad
    return _LinearLogprobs.apply(hidden, weight, labels.long(), int(vocab_size), int(chunk_tokens), tp_group,
                                 main_grad, expected_grad, bool(one_pass))
