"""The capture points of ``ferrule check``'s divergence report mean the same on both sides (cheap, no megatron).

Reference: what the residual stream receives, computed by hand (``output + bias`` for megatron's ``(output, bias)``
pairs, whose bias the layer's bias-dropout-add adds; HF's ``o_proj`` adds its own).
"""

from __future__ import annotations

import torch

from ferrule.converters.check_points import capture, compare, first_departure


class _PairOut(torch.nn.Module):
    """A megatron-style block: returns ``(output [s, b, h], bias [h])`` with the bias left out of ``output``."""

    def __init__(self, bias: torch.Tensor | None):
        super().__init__()
        self.bias = bias

    def forward(self, x):
        return x * 2, self.bias


class _HFOut(torch.nn.Module):
    """An HF-style attention: returns ``(output [b, s, h] with the bias added, attention weights)``."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = bias

    def forward(self, x):
        return x * 2 + self.bias, torch.ones(x.shape[0], 1, x.shape[1], x.shape[1])


def test_megatron_attention_point_includes_linear_proj_bias():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)  # [b, s, h]
    bias = torch.randn(4)
    pair, hf = _PairOut(bias), _HFOut(bias)
    mc_store, hf_store = {}, {}
    handles = capture({(0, "attention"): pair}, mc_store, layout="sbh")
    handles += capture({(0, "attention"): hf}, hf_store, layout="bsh")
    pair(x.transpose(0, 1))  # megatron runs [s, b, h]
    hf(x)
    for h in handles:
        h.remove()
    rows = compare([(0, "attention")], hf_store, mc_store)
    assert rows == [(0, "attention", 0.0, "")], rows  # before: differed by max |bias| in every layer
    assert first_departure(rows, 1e-6) is None


def test_a_pair_without_bias_is_the_output():
    x = torch.randn(3, 2, 4)
    store = {}
    mod = _PairOut(None)
    capture({(1, "mlp"): mod}, store, layout="sbh")
    mod(x)
    assert torch.equal(store[(1, "mlp")], (x * 2).transpose(0, 1).double())
