"""Continuous batching for the embedded engine: finished rows take the next waiting prompt.

The static path (:meth:`ferrule.rollout.embedded.EmbeddedEngine._run`) decodes all rows of a
call in one batch until the last one finishes, so an RL batch whose response lengths vary
(EOS on) pays for the longest response on every row. Here at most ``max_batch`` rows decode at
once; every :data:`CHECK_EVERY` steps the finished rows are harvested (one host sync), and when
at least :func:`refill_threshold` rows are free (or none is alive) the next waiting prompts are
prefilled into them (:meth:`ferrule.rollout._static_cache.DecodeState.prefill_rows`, one forward
for all of them) while the other rows keep their caches. Every row has its own key slot and
position (``DecodeState.set_step`` with ``[batch]`` slots), so one captured decode graph serves
rows at different points of their sequences.

What a row computes is what the static path computes for it (its keys are its own prompt and
tokens; left padding is masked), so each sample's logprobs equal a full HF forward over its own
tokens (``tests/test_rollout_continuous.py``). Sampling draws from one generator for the whole
batch per step, so a seeded call is reproducible for the same requests, parameters and
``max_batch``, but draws different samples than the static path does with the same seed.

With ``rollout_engine.continuous_fast`` (on by default: verified and measured 1.3-1.5x faster on an H100) and the fast decode
path applying to the call (:func:`_fast_step`), each step runs the fast path's decode forward
(:class:`ferrule.rollout._fast_decode.FastContinuous`: fused weights, attention over the filled key prefix
rounded up to ``kv_bucket``, one CUDA graph per attended length) on the same inputs and KV cache instead
of the state's HF forward; the sampler and the bookkeeping here are the same either way.

Stop strings need the host every step (:class:`~ferrule.rollout._sampling.StopStringMatcher`);
they work here, with one host sync per step.
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ferrule.rollout.base import SamplingParams

if TYPE_CHECKING:
    from ferrule.rollout._sampling import StopStringMatcher
    from ferrule.rollout.embedded import EmbeddedEngine

#: Decode steps between host checks for finished rows (on CPU every step: no device to wait for).
CHECK_EVERY = 8


def refill_threshold(batch: int) -> int:
    """Free rows needed before a refill prefill runs (one prefill forward per refill): 1/8 of the batch."""
    return max(1, batch // 8)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """``(input_ids [k, P], position_ids [k, P], prompt_mask [k, P] bool, prompt_len [k])`` on ``device``."""
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), p), dtype=torch.bool)
    for r, toks in enumerate(prompts):
        ids[r, p - len(toks):] = torch.tensor(toks, dtype=torch.long)
        mask[r, p - len(toks):] = True
    pos = (torch.cumsum(mask.long(), -1) - 1).clamp_(min=0)
    return ids.to(device), pos.to(device), mask.to(device), mask.sum(-1).to(device)


def _put(buf: torch.Tensor, col: torch.Tensor, alive: torch.Tensor, values: torch.Tensor) -> None:
    """``buf[r, col[r]] = values[r]`` for alive rows; other rows keep their entries."""
    idx = col[:, None]
    buf.scatter_(1, idx, torch.where(alive[:, None], values[:, None].to(buf.dtype), buf.gather(1, idx)))


def _fast_step(engine: "EmbeddedEngine", state: Any, params: SamplingParams, stop_ids: list[int],
               matcher: "StopStringMatcher | None") -> tuple[Any, Any]:
    """``(FastContinuous bound to this call, or None for the state's own step; context for the prefills)``.

    The fast step applies where ``rollout_engine.continuous_fast`` is on, no adapters are held for batched
    multi-adapter decode (their per-row mask follows static batches) and ``EmbeddedEngine._fast_layout``
    gives a layout (fast decode on, no stop strings, top-k/top-p/min-p, media, ...). A served adapter is
    merged as on the static fast path: the prefills then run on the merged weights too (``lora_merged``).
    """
    if not engine.settings.continuous_fast or engine._multi.pool is not None:
        return None, contextlib.nullcontext
    layout = engine._fast_layout(params, stop_ids, matcher, None)
    if layout is None:
        return None, contextlib.nullcontext
    from ferrule.rollout._fast_decode import FastContinuous

    fast = getattr(state, "fast_continuous", None)
    if fast is None:
        fast = state.fast_continuous = FastContinuous(state)
    merged = engine._merged_lora if engine._lora is not None and engine.settings.lora_merged else None
    return fast.bind(layout, engine.settings, engine._graph_pool), \
        (merged.merged_modules if merged is not None else contextlib.nullcontext)


@torch.inference_mode()
def run_continuous(engine: "EmbeddedEngine", prompts: list[list[int]], params: SamplingParams, stop_ids: list[int],
                   matcher: "StopStringMatcher | None", max_batch: int):
    """Decode ``prompts`` with at most ``max_batch`` rows at once; return what ``EmbeddedEngine._run`` returns.

    Returns:
        one ``(token_ids, logprobs, raw_logprobs or None, finish_reason)`` per prompt, in order.
    """
    dev = engine.device
    n_new = params.max_new_tokens
    longest = max(len(x) for x in prompts)
    batch, max_len = engine._bucket(max_batch, longest + n_new)
    state = engine._state(batch, max_len)
    fast, prefill_ctx = _fast_step(engine, state, params, stop_ids, matcher)
    sampler = engine._sampler(params, batch)
    gen = engine._generator(params)
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    check_every = CHECK_EVERY if dev.type == "cuda" and matcher is None else 1

    queue = collections.deque(range(len(prompts)))
    owner = [-1] * batch  # prompt index decoded by each row, -1 = free
    results: list = [None] * len(prompts)
    tokens_out = torch.zeros((batch, n_new), dtype=torch.long, device=dev)
    lp_out = torch.zeros((batch, n_new), dtype=torch.float32, device=dev)
    raw_out = torch.zeros_like(lp_out) if params.return_raw_logprobs else None
    count = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens generated for the row's current prompt
    finished = torch.ones(batch, dtype=torch.bool, device=dev)  # free rows count as finished
    stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
    slots = torch.zeros(batch, dtype=torch.long, device=dev)  # key slot of the next decode input
    positions = torch.zeros(batch, dtype=torch.long, device=dev)
    host_tokens: dict[int, list[int]] = {}

    def occupy(rows: list[int], take: list[int], p: int, plen: torch.Tensor) -> None:
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        slots[rows_t] = p
        positions[rows_t] = plen
        count[rows_t] = 0
        finished[rows_t] = False
        stopped[rows_t] = False
        for r, i in zip(rows, take):
            owner[r] = i
            host_tokens[r] = []

    # first fill: one prefill over the whole bucket (it allocates the cache); spare rows hold one pad token
    take = [queue.popleft() for _ in range(min(batch, len(queue)))]
    rows_prompts = [prompts[i] for i in take] + [[engine._pad_id]] * (batch - len(take))
    ids, pos, mask, plen = _left_pad(rows_prompts, engine._pad_id, dev)
    full_mask = torch.zeros((batch, max_len), dtype=torch.bool, device=dev)
    full_mask[:, :ids.shape[1]] = mask
    with prefill_ctx():
        logits = state.prefill(ids, pos, full_mask, engine._shared_prefill(rows_prompts, params, None))
    occupy(list(range(len(take))), take, ids.shape[1], plen[:len(take)])
    # the fast step's attended prefix: every row's slot is base[row] + steps (spare rows: slot 0 <= this)
    base = [ids.shape[1]] * batch
    top = ids.shape[1]

    step = 0
    while True:
        tok, lp, raw = sampler(logits, gen)
        alive = ~finished
        col = count.clamp(max=n_new - 1)
        _put(tokens_out, col, alive, tok)
        _put(lp_out, col, alive, lp)
        if raw_out is not None:
            _put(raw_out, col, alive, raw)
        count += alive.long()
        hit = alive & torch.isin(tok, stop_t) if stop_ids else torch.zeros_like(alive)
        if matcher is not None:
            hit = matcher.mark_hits(tok, alive, host_tokens, [r for r in range(batch) if owner[r] >= 0], hit)
        stopped |= hit
        finished |= hit | (alive & (count >= n_new))
        step += 1
        check = step % check_every == 0
        if check and not queue and bool(finished.all()):
            break
        # decode every row (finished rows too: static shapes); a finished row's writes land in its own
        # slots, which a refill masks out and overwrites
        state.set_step(tok, positions.clamp(max=max_len - 1), slots.clamp(max=max_len - 1))
        # every row's visible slots lie below its staged slot + 1 <= top + step (step - 1 increments so far)
        logits = state.step() if fast is None else fast.step(min(top + step, max_len))
        positions += 1
        slots += 1
        if check and queue:
            free = _harvest(finished, owner, count, stopped, tokens_out, lp_out, raw_out, results, dev)
            if len(free) >= min(refill_threshold(batch), len(queue)):
                take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                rows = free[:len(take)]
                fresh = [prompts[i] for i in take]
                ids, pos, mask, plen = _left_pad(fresh, engine._pad_id, dev)
                rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
                with prefill_ctx():
                    new = state.prefill_rows(rows_t, ids, pos, mask, engine._shared_prefill(fresh, params, None))
                for r in rows:  # slots start at the refill's prompt width after `step` increments
                    base[r] = ids.shape[1] - step
                top = max(base)
                logits = logits.clone()  # under a CUDA graph, logits is the graph's static output buffer
                logits[rows_t] = new.to(logits.dtype)
                occupy(rows, take, ids.shape[1], plen)
    _harvest(finished, owner, count, stopped, tokens_out, lp_out, raw_out, results, dev)
    return results


def _harvest(finished, owner, count, stopped, tokens_out, lp_out, raw_out, results, dev) -> list[int]:
    """Move finished rows' outputs to ``results`` (host); return every free row."""
    done = [r for r, f in enumerate(finished.tolist()) if f and owner[r] >= 0]
    if done:
        d = torch.tensor(done, device=dev)
        n_h, stop_h = count[d].tolist(), stopped[d].tolist()
        tok_h, lp_h = tokens_out[d].tolist(), lp_out[d].tolist()
        raw_h = raw_out[d].tolist() if raw_out is not None else None
        for k, r in enumerate(done):
            n = n_h[k]
            results[owner[r]] = (tok_h[k][:n], lp_h[k][:n], None if raw_h is None else raw_h[k][:n],
                                 "stop" if stop_h[k] else "length")
            owner[r] = -1
    return [r for r in range(len(owner)) if owner[r] < 0]
