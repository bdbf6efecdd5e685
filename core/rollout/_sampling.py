"""Token sampling and stop-string matching for the embedded engine (torch only, no model code).

The logprob convention is the one documented in :mod:`ferrule.rollout.base`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ferrule.rollout.base import SamplingParams


#: Mass within this of ``top_p`` counts as reaching it. float32 logits carry a relative rounding
#: of about 1e-7, so probabilities such as 0.3 + 0.5 land a few ulps either side of 0.8; without
#: the tolerance an exact boundary would keep one token more or less depending on that noise.
TOP_P_TOLERANCE = 1e-6


def truncate_logits(scaled: torch.Tensor, top_k: int | None, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask tokens outside top-k, then outside the top-p nucleus, then below min-p, with ``-inf``.

    The rules are those of HF's ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` (transformers ``generation/logits_process.py``, applied in that order,
    as HF ``generate`` and SGLang do), with ``min_tokens_to_keep=1``:

    Args:
        scaled: ``[batch, vocab]`` float32 tempered logits (``logits / temperature``).
        top_k: keep the ``top_k`` largest logits per row; every token tied with the k-th value
            is kept too (``logit < kth`` is removed). None disables it.
        top_p: keep a token when the probability mass of the tokens sorted before it (descending
            probability) is still below ``top_p``: the smallest prefix whose mass reaches
            ``top_p``. A prefix that reaches ``top_p`` exactly (within :data:`TOP_P_TOLERANCE`)
            stops there: four equal tokens with ``top_p=0.5`` keep two. Among tied
            probabilities the sort decides which are kept; the count is the rule's. At least one
            token is kept; ``1.0`` disables it. The mass is taken after top-k (over the kept tokens).
        min_p: remove tokens whose probability is below ``min_p * max probability`` (after
            top-k/top-p); ``0`` disables it. The most likely token is always kept.

    Returns:
        ``[batch, vocab]`` float32 logits with removed tokens set to ``-inf``.
    """
    out = scaled
    if top_k is not None and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits.double(), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= top_p - TOP_P_TOLERANCE
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        out = out.masked_fill(remove, float("-inf"))
    return out


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sample one token per row and report its logprob.

    Args:
        logits: ``[batch, vocab]`` float32 next-token logits.
        params: sampling parameters (temperature, top_k, top_p, min_p, return_raw_logprobs).
        generator: RNG for ``torch.multinomial`` (same device as ``logits``); unused if greedy.
        banned: token ids never sampled (the engine passes a multimodal model's media placeholder
            ids); like top-k they only restrict the choice, logprobs keep the full distribution.

    Returns:
        ``(tokens [batch] int64, logprobs [batch] float32, raw_logprobs [batch] float32 or None)``.
        ``logprobs`` = ``log_softmax(logits / T)[token]`` (``T = 1`` when greedy), taken before
        top-k/top-p/min-p truncation; ``raw_logprobs`` = ``log_softmax(logits)[token]``.
    """
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits if banned is None else logits.index_fill(-1, banned, float("-inf")), dim=-1)
        lp = logp.gather(-1, tokens[:, None])[:, 0]
        return tokens, lp, (lp if params.return_raw_logprobs else None)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    kept = truncate_logits(scaled, params.effective_top_k, params.top_p, params.min_p)
    if banned is not None:
        kept = kept.index_fill(-1, banned, float("-inf"))
    probs = torch.softmax(kept, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    lp = logp.gather(-1, tokens[:, None])[:, 0]
    raw = None
    if params.return_raw_logprobs:
        raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, lp, raw


class StopStringMatcher:
    """Decide whether the newest token of a sample completes one of the stop strings.

    Each step decodes a tail window of the generated tokens and looks for the stop strings in
    it; a match is reported at the first step where it appears, which is the step of the token
    that completed it. The window is sized in *tokens* for the worst case: a token carries at
    least one byte, so the tokens overlapping a stop string of ``B`` UTF-8 bytes are at most
    ``B`` (an emoji of 4 bytes can be 3 byte-fragment tokens in Qwen2.5's vocabulary), plus
    one token of left context because decoders may drop a leading space or a partial
    character at the start of what they decode (SentencePiece's ``"▁"``, byte-level
    fragments). Window: ``max(len(stop.encode("utf-8"))) + 1`` tokens.

    Args:
        stops: the stop strings (non-empty).
        decode: ``decode(token_ids: list[int]) -> str``, e.g. an HF tokenizer's ``decode``;
            every token id must decode to at least one byte (true of byte-level BPE and
            byte-fallback SentencePiece vocabularies).
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 1

    def matches(self, generated: Sequence[int]) -> bool:
        """True when ``decode(generated[-window:])`` contains a stop string."""
        text = self.decode(list(generated[-self.window:]))
        return any(s in text for s in self.stops)

    def mark_hits(self, tokens: torch.Tensor, alive: torch.Tensor, history, rows, hit: torch.Tensor) -> torch.Tensor:
        """One decode step on the host: append each alive row's new token to ``history[r]`` and
        mark the rows whose history now :meth:`matches`.

        Args:
            tokens / alive: ``[batch]`` int64 sampled tokens / bool rows still generating.
            history: ``history[r]`` is row ``r``'s generated token list (list or dict of lists).
            rows: the rows to consider (rows holding a request).
            hit: ``[batch]`` bool rows already stopping this step (a stop token).

        Returns:
            ``hit``, or a copy of it with the stop-string rows set.
        """
        tok_host, alive_host = tokens.tolist(), alive.tolist()
        extra = []
        for r in rows:
            if alive_host[r]:
                history[r].append(tok_host[r])
                if self.matches(history[r]):
                    extra.append(r)
        if not extra:
            return hit
        hit = hit.clone()
        hit[torch.tensor(extra, device=hit.device)] = True
        return hit
