"""Token sampling and stop-string matching for the embedded engine (torch only, no model code).

The logprob convention is the one documented in :mod:`ferrule.rollout.base`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ferrule.rollout.base import SamplingParams


def truncate_logits(scaled: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask tokens outside top-k, then outside the top-p nucleus, with ``-inf``.

    Args:
        scaled: ``[batch, vocab]`` float32 tempered logits (``logits / temperature``).
        top_k: keep the ``top_k`` largest logits per row (ties at the k-th value are kept);
            None disables it.
        top_p: keep the smallest prefix of tokens, in descending probability, whose mass
            reaches ``top_p`` (the token that crosses ``top_p`` is kept; at least one token is
            always kept); ``1.0`` disables it. Same rule as HF ``TopPLogitsWarper`` and SGLang.

    Returns:
        ``[batch, vocab]`` float32 logits with removed tokens set to ``-inf``.
    """
    out = scaled
    if top_k is not None and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before > top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sample one token per row and report its logprob.

    Args:
        logits: ``[batch, vocab]`` float32 next-token logits.
        params: sampling parameters (temperature, top_k, top_p, return_raw_logprobs).
        generator: RNG for ``torch.multinomial`` (same device as ``logits``); unused if greedy.

    Returns:
        ``(tokens [batch] int64, logprobs [batch] float32, raw_logprobs [batch] float32 or None)``.
        ``logprobs`` = ``log_softmax(logits / T)[token]`` (``T = 1`` when greedy), taken before
        top-k/top-p truncation; ``raw_logprobs`` = ``log_softmax(logits)[token]``.
    """
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        lp = logp.gather(-1, tokens[:, None])[:, 0]
        return tokens, lp, (lp if params.return_raw_logprobs else None)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    kept = truncate_logits(scaled, params.effective_top_k, params.top_p)
    probs = torch.softmax(kept, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    lp = logp.gather(-1, tokens[:, None])[:, 0]
    raw = None
    if params.return_raw_logprobs:
        raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, lp, raw


class StopStringMatcher:
    """Decide whether the newest token of a sample completes one of the stop strings.

    Only a tail window of the generated tokens is decoded each step (``window`` tokens,
    ``max(len(stop)) + 8``): a match is reported at the first step where it appears in the
    decoded tail, which is the step of the token that completed it.

    Args:
        stops: the stop strings (non-empty).
        decode: ``decode(token_ids: list[int]) -> str``, e.g. an HF tokenizer's ``decode``.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode
        self.window = max(len(s) for s in self.stops) + 8

    def matches(self, generated: Sequence[int]) -> bool:
        """True when ``decode(generated[-window:])`` contains a stop string."""
        text = self.decode(list(generated[-self.window:]))
        return any(s in text for s in self.stops)
