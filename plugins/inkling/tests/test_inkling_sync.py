"""Inkling update groups (weight sync units) over the parameters the provider builds.

Sync itself (train engine -> embedded engine, every tensor compared after each train step with
``check_weight_update_equal``) is exercised by plugins/inkling/tests/test_inkling_rl.py.
"""

from __future__ import annotations

import pytest

from inkling_fixtures import CONFIGS


def _names(overrides):
    from transformers import InklingTextConfig

    from ferrule.conformance.numeric import single_rank
    from ferrule.megatron.param_gather import global_param_names
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG, build_provider

    cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"}
    cfg.update(overrides)
    with single_rank():
        chunks = build_provider(InklingTextConfig(**cfg).to_dict(), ParallelLayout())
        return [g for c in chunks for g in global_param_names(c).values()]


def test_units_of_the_moe_model():
    from ferrule.plugins.inkling.inkling_text import UPDATE_GROUPS
    from ferrule.sync.groups import build_update_units

    names = _names(CONFIGS["moe_2_shared"])
    units = build_update_units(names, UPDATE_GROUPS)
    by_group = {}
    for u in units:
        by_group.setdefault(u.group, []).append(u)
    assert sorted(by_group) == ["attention", "dense_mlp", "embedding", "mlp_io", "moe_router", "output",
                                "routed_expert", "shared_experts"]
    assert [u.prefix for u in by_group["attention"]] == [f"decoder.layers.{i}." for i in range(3)]
    assert all(len(u.names) == 12 for u in by_group["attention"])
    assert [u.prefix for u in by_group["dense_mlp"]] == ["decoder.layers.0."]
    assert [u.prefix for u in by_group["moe_router"]] == ["decoder.layers.1.", "decoder.layers.2."]
    # routed experts: one unit per (layer, global expert), gathered on the expert groups
    assert len(by_group["routed_expert"]) == 2 * 4 and all(u.routed for u in by_group["routed_expert"])
    # shared experts travel as one dense unit per layer: never routed / expert-parallel
    shared = by_group["shared_experts"]
    assert [u.names for u in shared] == [(f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
                                          f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight") for i in (1, 2)]
    assert not any(u.routed for u in shared)
    assert sorted(n for u in units for n in u.names) == sorted(names)


def test_dense_only_model_needs_no_moe_groups():
    from ferrule.plugins.inkling.inkling_text import UPDATE_GROUPS
    from ferrule.sync.groups import build_update_units

    units = build_update_units(_names(CONFIGS["dense_only"]), UPDATE_GROUPS)
    assert {u.group for u in units} == {"attention", "dense_mlp", "embedding", "mlp_io", "output"}


def test_a_missing_attention_group_is_an_error():
    from ferrule.plugins.inkling.inkling_text import UPDATE_GROUPS
    from ferrule.sync.groups import UpdateGroupError, build_update_units

    names = [n for n in _names(CONFIGS["dense_only"]) if ".self_attention." not in n and "input_layernorm" not in n]
    with pytest.raises(UpdateGroupError, match="attention"):
        build_update_units(names, UPDATE_GROUPS)
