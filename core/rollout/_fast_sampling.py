"""A fused sampler for the embedded engine's common case on CUDA: temperature only, or greedy.

:func:`ferrule.rollout._sampling.sample_next` runs about ten passes over the ``[batch, vocab]``
logits per step (fp32 cast, temperature, ``log_softmax``, ``softmax``, ``multinomial``'s
noise / divide / argmax, gathers): at batch 256 and Qwen's 151,936-entry vocabulary that is
~0.6 ms per decode step on an H200, over 10% of the step. When no top-k / top-p / min-p
truncation is asked for, :func:`sample_plain` computes the same quantities in one
``torch.compile``\\ d function (inductor fuses the cast, the temperature and the reductions):

- the token is drawn exactly as ``torch.multinomial(probs, 1, generator=g)`` draws it:
  ATen's single-sample path takes ``argmax(probs / q)`` with ``q`` exponential(1) noise from
  ``g`` (``aten/src/ATen/native/Distributions.cpp``, ``multinomial``: "s = argmax( p / q )
  where q ~ Exp(1)"); we draw ``q`` from the same generator with the same call
  (``exponential_``), so a seed consumes the generator identically. ``probs`` are computed
  as ``exp(x - logsumexp(x))`` instead of ATen's softmax kernel, so the two can differ by
  float rounding in the last bit; a token differs only where two candidates' ``p / q`` are
  within that rounding.
- ``logprobs = x[token] - logsumexp(x)`` with ``x = logits.float() / temperature``: the
  convention of :mod:`ferrule.rollout.base` (before truncation, which this case has none of).

Anything with truncation keeps the eager :func:`~ferrule.rollout._sampling.sample_next`.
:func:`sample_record` is the same formulas plus the per-step bookkeeping, compiled into the fast
decode step (:mod:`ferrule.rollout._fast_decode`), optionally with chunked reductions on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from ferrule.rollout.base import SamplingParams

_COMPILED: dict[str, Any] = {}

def vocab_chunks(vocab: int, want: int) -> int:
    """The largest power of two ``<= want`` dividing ``vocab`` with chunks of at least 1024
    entries (1: no chunking). 151,936 (Qwen2) -> 128 for ``want=128``."""
    c = 1
    while c * 2 <= want and vocab % (c * 2) == 0 and vocab // (c * 2) >= 1024:
        c *= 2
    return c


def logsumexp_chunked(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """``torch.logsumexp(x, -1, keepdim=True)`` for ``x [batch, vocab]`` fp32, as ``chunks`` partial
    log-sum-exps combined by a second one (the same quantity; fp32 rounding in another order): at
    batch 64 and Qwen's vocabulary one program per row leaves most of an H200 idle (docs/benchmarks.md)."""
    if chunks <= 1:
        return torch.logsumexp(x, dim=-1, keepdim=True)
    return torch.logsumexp(torch.logsumexp(x.view(x.shape[0], chunks, -1), dim=-1), dim=-1, keepdim=True)


def argmax_chunked(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """``torch.argmax(x, -1)`` for ``x [batch, vocab]``, per chunk and then over the chunk maxima:
    the same index (the first maximum, as argmax returns it), ``[batch]`` int64."""
    if chunks <= 1:
        return torch.argmax(x, dim=-1)
    best, idx = x.view(x.shape[0], chunks, -1).max(dim=-1)
    c = torch.argmax(best, dim=-1)
    return c * (x.shape[-1] // chunks) + idx.gather(-1, c[:, None])[:, 0]


def fused_applies(params: SamplingParams) -> bool:
    """True when :func:`sample_plain` computes what ``sample_next`` would (no truncation)."""
    return params.greedy or (params.effective_top_k is None and params.top_p >= 1.0 and params.min_p <= 0.0)


def _plain(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor, want_raw: bool):
    raw = logits.float()
    x = raw / temperature
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(x - lse)
    tokens = torch.argmax(probs / noise, dim=-1)
    lp = x.gather(-1, tokens[:, None])[:, 0] - lse[:, 0]
    rlp = None
    if want_raw:
        rlp = raw.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)
    return tokens, lp, rlp


def _greedy(logits: torch.Tensor, want_raw: bool):
    x = logits.float()
    tokens = torch.argmax(x, dim=-1)
    lp = x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    return tokens, lp, (lp if want_raw else None)


def _fn(name: str) -> Any:
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile({"plain": _plain, "greedy": _greedy}[name], dynamic=False)
    return _COMPILED[name]


class FusedSampler:
    """Per-``generate`` sampler state: the temperature as a device scalar and the noise buffer.

    Args:
        params: sampling parameters; :func:`fused_applies` must hold.
        batch / vocab: logits shape. device: the logits' device.
    """

    def __init__(self, params: SamplingParams, batch: int, vocab: int, device: torch.device):
        if not fused_applies(params):
            raise ValueError("FusedSampler: top-k / top-p / min-p need the eager sampler (sample_next).")
        self.params = params
        self.temperature = torch.tensor(float(params.temperature or 1.0), dtype=torch.float32, device=device)
        self.noise = None if params.greedy else torch.empty((batch, vocab), dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None):
        """``logits [batch, vocab]`` (any float dtype) -> ``(tokens [batch] int64, logprobs [batch] fp32,
        raw_logprobs [batch] fp32 or None)``, as :func:`ferrule.rollout._sampling.sample_next` returns them."""
        want_raw = self.params.return_raw_logprobs
        if self.params.greedy:
            return _fn("greedy")(logits, want_raw)
        self.noise.exponential_(1, generator=generator)
        return _fn("plain")(logits, self.temperature, self.noise, want_raw)


def sample_record(logits, prompt_len, p, col, temperature, noise, greedy, stop_t, tokens_out, lp_out, raw_out, lengths,
                  finished, stopped, ids, pos, slot, allowed, chunks: int = 0) -> None:
    """The fast decode step's sampler and bookkeeping (:class:`ferrule.rollout._fast_decode.FastStatic`,
    compiled into its step): from ``logits [batch, vocab]`` sample token ``col``, record it and its logprob at
    column ``col`` of ``tokens_out`` / ``lp_out`` and its raw logprob (temperature 1) in ``raw_out``, count
    ``lengths``, mark rows hitting ``stop_t`` ids as stopped and finished, stage the next step's ``ids`` /
    ``pos`` / ``slot`` / ``allowed``, ``col += 1``. All in place.

    The sampling kind is data, not code, so greedy and sampled calls, with or without raw logprobs, share one
    compiled graph (and one CUDA graph per shape): ``greedy`` is a 0-dim bool tensor; where true the token is
    ``argmax(logits)`` itself (``torch.where`` selects the logits, not the noisy scores, so no exp() rounding
    enters) and ``temperature`` must hold 1 (then ``x == logits.float()`` exactly); ``noise [batch, vocab]``
    fp32 is always passed and is not read where ``greedy`` (stale values are not selected). ``raw_out`` is
    always written (the caller reads it when it asked for raw logprobs)."""
    # the formulas of _plain / _greedy: same draw as torch.multinomial;
    # with chunks > 1 its reductions go per vocabulary chunk first (argmax_chunked, logsumexp_chunked)
    raw = logits.float()
    x = raw / temperature  # temperature 1 for greedy: x == raw bit for bit
    lse = logsumexp_chunked(x, chunks)
    tok = argmax_chunked(torch.where(greedy, x, torch.exp(x - lse) / noise), chunks)
    xt = x.gather(-1, tok[:, None])[:, 0]
    lp = xt - lse[:, 0]
    c = col.view(1)
    tokens_out.index_copy_(1, c, tok[:, None])
    lp_out.index_copy_(1, c, lp[:, None])
    # raw logprobs: greedy's are its logprobs (as before); sampled ones over the raw logits
    rlp = torch.where(greedy, lp, raw.gather(-1, tok[:, None])[:, 0] - logsumexp_chunked(raw, chunks)[:, 0])
    raw_out.index_copy_(1, c, rlp[:, None])
    alive = ~finished
    lengths.add_(alive.long())
    # an explicit compare, not torch.isin: its decomposition picks an algorithm by comparing the two sizes,
    # a guard on the batch size under dynamic shapes (a recompile when a rung crosses it)
    hit = alive & (tok[:, None] == stop_t[None, :]).any(-1)
    stopped.logical_or_(hit)
    finished.logical_or_(hit)
    # stage the next step: token `col` goes to key slot p + col at position prompt_len + col
    ids.copy_(tok)
    pos.copy_(prompt_len + col)
    slot.copy_((p + col).expand_as(slot))
    rows = torch.arange(allowed.shape[0], device=allowed.device)
    if torch.compiler.is_compiling():
        allowed[rows, slot] = True  # a constant in the compiled graph (this form is what the CUDA tests verified)
    else:
        # uncompiled under a CUDA graph capture (rollout_engine.compile_step false) `= True` is a copy from a CPU
        # scalar tensor, which capture refuses (H100, 2026-12-07): the value made on the device instead
        allowed.index_put_((rows, slot), torch.ones((), dtype=torch.bool, device=allowed.device))
    col.add_(1)
