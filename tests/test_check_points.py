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


def test_update_unit_problems_name_a_parameter_a_wrong_group_leaves_out():
    """``ferrule check`` runs the kit's update-unit rules on the checkpoint's model (a wrong group passed the
    check before; only the kit caught it): a table without the MLP group leaves the MLP weights out, named."""
    from ferrule.conformance.numeric import update_unit_problems
    from ferrule.plugins.qwen import qwen2
    from ferrule.sync.groups import as_group_table

    # the tiny Qwen2 model's parameters: its mapping table's rows (which the kit checks cover the model exactly)
    rows = [m.mcore for m in qwen2.MAPPING.mappings]
    names = [r for r in rows if "*" not in r] + [r.replace("*", str(i)) for i in range(2) for r in rows if "*" in r]
    good = as_group_table(qwen2.UPDATE_GROUPS, "qwen2")
    units, problems = update_unit_problems(names, good)
    assert units and not problems, problems
    wrong = as_group_table(tuple(g for g in qwen2.UPDATE_GROUPS if "mlp" not in g.key), "qwen2")
    _, problems = update_unit_problems(names, wrong)
    assert problems and "decoder.layers.0.mlp.linear_fc1.weight" in " ".join(problems), problems


def test_expert_shape_advice_counts_expert_tp_not_tp():
    """At TP=2 with expert TP 1 an expert weight is whole on each rank: the shape advice quoted a full shape
    twice too large (the TP size) and blamed the checkpoint; it now counts the expert-TP group that splits it."""
    import types

    from ferrule.megatron.weights import _shape_suspect

    param = torch.empty(8, 4)
    param.tensor_model_parallel, param.partition_dim = True, 0
    bp = types.SimpleNamespace(param=param, mapping=types.SimpleNamespace(expert=True, tp=types.SimpleNamespace(
        name="COLUMN")))
    # the HF tensors give the whole (8, 4) the expert needs; only a split would differ
    assert _shape_suspect(bp, (8, 4), 1, "fam").startswith("suspect the plugin: the HF tensors have the full shape "
                                                             "(8, 4)")
    assert "over expert TP=2" in _shape_suspect(bp, (16, 4), 2, "fam")
