"""Micro-batch planning (ferrule.megatron.batching.pack_microbatches): invariants, and the padding
it leaves on an RL-shaped batch compared with packing in arrival order (computed here)."""

from __future__ import annotations

import random

import pytest

from ferrule.megatron.batching import pack_microbatches


def _padded(mbs, lengths):
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in mbs)


def _arrival_order_packing(indices, lengths, budget):
    out, cur = [], []
    for i in indices:
        if cur and (len(cur) + 1) * max(max(lengths[j] for j in cur), lengths[i]) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def test_no_budget_keeps_one_datum_per_microbatch_in_order():
    assert pack_microbatches([4, 1, 3], [5, 6, 7, 8, 9], None) == [[4], [1], [3]]


@pytest.mark.parametrize("seed", range(5))
def test_budget_invariants_and_less_padding_than_arrival_order(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(256, 1536) for _ in range(64)]
    idx = list(range(64))
    mbs = pack_microbatches(idx, lengths, 16384)
    assert sorted(i for mb in mbs for i in mb) == idx  # every datum exactly once
    assert all(len(mb) * max(lengths[i] for i in mb) <= 16384 for mb in mbs)
    assert _padded(mbs, lengths) < _padded(_arrival_order_packing(idx, lengths, 16384), lengths)
    assert _padded(mbs, lengths) <= 1.2 * sum(lengths)


def test_oversized_datum_gets_its_own_microbatch():
    assert pack_microbatches([0, 1, 2], [10, 50, 10], 20) == [[1], [0, 2]]


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_microbatches([0], [1], 0)
