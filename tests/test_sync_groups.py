"""Update-group tables over mcore names (ferrule.sync.groups) and byte-budget bucketing (ferrule.sync.buckets).

Names are the parameter names megatron-core 0.16.1 gives the tiny Qwen3 / Qwen3-MoE models
built by ferrule's provider (local spec, ``SequentialMLP`` experts), written out by hand; the
tables are the real ones from ``ferrule.plugins.qwen``. Expected units and bucket contents /
byte counts are computed by hand from the tiny configs (fp32 = 4 bytes per element).
"""

from __future__ import annotations

import pytest
import torch

from ferrule.mapping import MappingContext
from ferrule.plugins.qwen import qwen3, qwen3_moe
from ferrule.contract.specs import UpdateGroup, UpdateGroupTable
from ferrule.sync.buckets import FullUnit, hf_unit_tensors, iter_hf_buckets, pack_buckets
from ferrule.sync.groups import UpdateGroupError, build_update_units, is_routed_expert_param

QWEN3 = UpdateGroupTable(family="qwen3", groups=qwen3.UPDATE_GROUPS)
QWEN3_MOE = UpdateGroupTable(family="qwen3_moe", groups=qwen3_moe.UPDATE_GROUPS)
N_LAYERS = 2
N_EXPERTS = 4

ATTN = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def qwen3_names(layers=range(N_LAYERS), first=True, last=True, tied=True):
    names = ["embedding.word_embeddings.weight"] if first else []
    for i in layers:
        names += [f"decoder.layers.{i}.{s}" for s in ATTN]
        names += [f"decoder.layers.{i}.{s}" for s in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                                                        "mlp.linear_fc2.weight")]
    if last:
        names.append("decoder.final_layernorm.weight")
        if not tied:
            names.append("output_layer.weight")
    return names


def qwen3_moe_names(layers=range(N_LAYERS), experts=range(N_EXPERTS), first=True, last=True):
    names = ["embedding.word_embeddings.weight"] if first else []
    for i in layers:
        names += [f"decoder.layers.{i}.{s}" for s in ATTN]
        names += [f"decoder.layers.{i}.pre_mlp_layernorm.weight", f"decoder.layers.{i}.mlp.router.weight"]
        for e in experts:
            names += [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
                      f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"]
    if last:
        names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return names


def summary(units):
    return [(u.group, u.prefix, len(u.names), u.routed) for u in units]


# ---------------------------------------------------------------------------------------
# units
# ---------------------------------------------------------------------------------------


def test_qwen3_units_per_layer_and_edges():
    units = build_update_units(qwen3_names(), QWEN3)
    assert summary(units) == [
        ("embedding", "", 1, False),
        ("attention", "decoder.layers.0.", 5, False),
        ("mlp", "decoder.layers.0.", 3, False),
        ("attention", "decoder.layers.1.", 5, False),
        ("mlp", "decoder.layers.1.", 3, False),
        ("final_norm", "", 1, False),
    ]
    assert units[2].names == ("decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                              "decoder.layers.0.mlp.linear_fc2.weight")


def test_qwen3_moe_one_unit_per_routed_expert():
    units = build_update_units(qwen3_moe_names(), QWEN3_MOE)
    expected = [("embedding", "", 1, False)]
    for i in range(N_LAYERS):
        expected += [("attention", f"decoder.layers.{i}.", 5, False), ("moe_router", f"decoder.layers.{i}.", 2, False)]
        expected += [("routed_expert", f"decoder.layers.{i}.mlp.experts.local_experts.{e}.", 2, True)
                     for e in range(N_EXPERTS)]
    expected += [("final_norm", "", 1, False), ("output_layer", "", 1, False)]
    assert summary(units) == expected


@pytest.mark.parametrize("table,names", [
    (QWEN3, qwen3_names(tied=False)),
    (QWEN3_MOE, qwen3_moe_names()),
    (QWEN3_MOE, qwen3_moe_names(layers=[5, 6], experts=[2, 3], first=False)),  # EP rank 1 of 2, PP stage 2
])
def test_every_parameter_in_exactly_one_unit(table, names):
    units = build_update_units(names, table)
    flat = [n for u in units for n in u.names]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))


def test_optional_groups_may_be_absent_on_a_middle_pipeline_stage():
    # a middle PP stage: no embedding, no final norm, no output layer (all optional in the Qwen tables)
    units = build_update_units(qwen3_names(layers=[2, 3], first=False, last=False), QWEN3)
    assert [u.group for u in units] == ["attention", "mlp", "attention", "mlp"]
    assert units[0].prefix == "decoder.layers.2."


def test_required_group_matching_nothing_is_an_error():
    # a stage that only holds the edges: 'attention' and 'mlp' are required
    with pytest.raises(UpdateGroupError) as exc:
        build_update_units(["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"], QWEN3)
    msg = str(exc.value)
    assert "non-optional groups that match no parameter (2)" in msg
    assert "attention" in msg and "mlp (suffixes" in msg


def test_typo_in_suffix_names_the_group_and_every_unclaimed_parameter():
    groups = tuple(UpdateGroup(key=g.key, suffixes=tuple(s.replace("linear_qkv.weight", "linear_qkv.weigth")
                                                          for s in g.suffixes), optional=g.optional)
                   for g in qwen3.UPDATE_GROUPS)
    with pytest.raises(UpdateGroupError) as exc:
        build_update_units(qwen3_names(), UpdateGroupTable(family="qwen3", groups=groups))
    msg = str(exc.value)
    assert "parameters no update group claims (2)" in msg
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in msg
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in msg
    # the attention units are now incomplete: the typo'd suffix never appears
    assert "missing suffixes ['self_attention.linear_qkv.weigth']" in msg


def test_unclaimed_parameter_is_an_error_not_a_singleton():
    names = qwen3_names() + ["decoder.layers.0.mlp.xlinear_fc1.weight"]  # whole components only
    with pytest.raises(UpdateGroupError, match=r"no update group claims \(1\):\n  - decoder.layers.0.mlp.xlinear"):
        build_update_units(names, QWEN3)


def test_incomplete_unit_and_duplicates_are_errors():
    names = [n for n in qwen3_names() if n != "decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(UpdateGroupError) as exc:
        build_update_units(names + ["decoder.layers.0.input_layernorm.weight"], QWEN3)
    msg = str(exc.value)
    assert "group 'mlp' prefix 'decoder.layers.1.'" in msg and "missing suffixes ['mlp.linear_fc2.weight']" in msg
    assert "given more than once (1):\n  - decoder.layers.0.input_layernorm.weight" in msg


# ---------------------------------------------------------------------------------------
# routed vs shared experts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,routed", [
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", True),   # SequentialMLP
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", True),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", True),                  # TEGroupedMLP
    ("decoder.layers.7.mlp.experts.weight2", True),                             # legacy GroupedMLP
    ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", False),           # Qwen2-MoE / DeepSeek shared
    ("decoder.layers.0.mlp.shared_experts.gate_weight", False),
    ("decoder.layers.0.mlp.shared_experts.experts.0.linear_fc1.weight", False),  # Inkling: nested experts list
    ("decoder.layers.0.mlp.router.weight", False),
    ("decoder.layers.0.mlp.router.expert_bias", False),
    ("decoder.layers.0.mlp.linear_fc1.weight", False),
    ("decoder.layers.0.mlp.my_experts.linear_fc1.weight", False),             # components compared whole
])
def test_is_routed_expert_param(name, routed):
    assert is_routed_expert_param(name) is routed


def test_shared_expert_units_are_not_routed_and_longest_suffix_wins():
    shared = ["decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
              "decoder.layers.0.mlp.shared_experts.linear_fc2.weight"]
    names = qwen3_moe_names(layers=[0], experts=[0]) + shared
    # with the Qwen3-MoE table the bare linear_fc* suffixes also claim the shared expert...
    units = {(u.group, u.prefix): u for u in build_update_units(names, QWEN3_MOE)}
    assert units[("routed_expert", "decoder.layers.0.mlp.shared_experts.")].routed is False
    assert units[("routed_expert", "decoder.layers.0.mlp.experts.local_experts.0.")].routed is True
    # ...and a dedicated group with longer suffixes takes it (longest suffix wins)
    table = UpdateGroupTable(family="qwen2_moe_like", groups=qwen3_moe.UPDATE_GROUPS + (
        UpdateGroup(key="shared_expert", suffixes=("shared_experts.linear_fc1.weight",
                                                   "shared_experts.linear_fc2.weight")),))
    got = summary(build_update_units(names, table))
    assert ("shared_expert", "decoder.layers.0.mlp.", 2, False) in got
    assert ("routed_expert", "decoder.layers.0.mlp.experts.local_experts.0.", 2, True) in got


def test_unit_mixing_routed_and_dense_parameters_is_an_error():
    table = UpdateGroupTable(family="bad", groups=(UpdateGroup(key="mixed", suffixes=("router.weight",
                                                                                      "experts.linear_fc1.weight0")),))
    with pytest.raises(UpdateGroupError, match="mixing routed-expert and other parameters"):
        build_update_units(["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.linear_fc1.weight0"],
                           table)


# ---------------------------------------------------------------------------------------
# byte-budget bucketing
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,budget,expected", [
    ([4, 4, 4], 8, [[0, 1], [2]]),
    ([5, 3, 1], 8, [[0, 1], [2]]),
    ([10, 3, 3], 8, [[0], [1, 2]]),     # oversized unit alone, then packing resumes
    ([3, 10, 3], 8, [[0], [1], [2]]),   # oversized unit never shares a bucket
    ([8], 8, [[0]]),
    ([], 8, []),
])
def test_pack_buckets(sizes, budget, expected):
    assert pack_buckets(sizes, budget) == expected


def test_pack_buckets_rejects_bad_budget():
    with pytest.raises(ValueError, match="positive number of bytes"):
        pack_buckets([1], 0)


# Tiny Qwen3 (qwen3.TINY_HF_CONFIG): hidden 32, 4 heads of 16, 1 KV head, ffn 48, vocab 96 (padded 128), tied.
H, HEADS, KV, D, FFN, VOCAB, PADDED = 32, 4, 1, 16, 48, 96, 128
FULL_SHAPES = {
    "embedding.word_embeddings.weight": (PADDED, H),
    "input_layernorm.weight": (H,), "self_attention.linear_proj.weight": (H, HEADS * D),
    "self_attention.linear_qkv.weight": ((HEADS + 2 * KV) * D, H),
    "self_attention.q_layernorm.weight": (D,), "self_attention.k_layernorm.weight": (D,),
    "pre_mlp_layernorm.weight": (H,), "mlp.linear_fc1.weight": (2 * FFN, H), "mlp.linear_fc2.weight": (H, FFN),
    "decoder.final_layernorm.weight": (H,),
}
# HF bytes per unit, by hand (fp32): embedding 96*32*4 (padding rows dropped); attention
# 32*4 + (64+16+16)*32*4 + 16*4 + 16*4 + 32*64*4; mlp 32*4 + 3*48*32*4; final norm 32*4.
EMB, ATTN_B, MLP_B, NORM = 12288, 20736, 18560, 128


def _full_units():
    g = torch.Generator().manual_seed(0)
    out = []
    for u in build_update_units(qwen3_names(), QWEN3):
        shapes = [FULL_SHAPES.get(n) or FULL_SHAPES[n.split(".", 3)[3]] for n in u.names]
        out.append(FullUnit(u.group, u.names, tuple(torch.randn(s, generator=g) for s in shapes)))
    return out


CTX = MappingContext(num_attention_heads=HEADS, num_query_groups=KV, head_dim=D, vocab_size=VOCAB,
                     padded_vocab_size=PADDED, tie_word_embeddings=True)


def test_unit_hf_bytes_match_hand_count():
    sizes = [sum(t.numel() * t.element_size() for _, t in hf)
             for hf in hf_unit_tensors(_full_units(), qwen3.MAPPING, CTX)]
    assert sizes == [EMB, ATTN_B, MLP_B, ATTN_B, MLP_B, NORM]


@pytest.mark.parametrize("budget,expected_units", [
    # 12288+20736=33024; +18560 > 40000 -> close. 18560+20736=39296; +18560 > 40000 -> close. 18560+128.
    (40000, [["embedding", "attention0"], ["mlp0", "attention1"], ["mlp1", "final_norm"]]),
    # every unit but the embedding and the final norm exceeds 15000: alone; 12288+20736 > 15000.
    (15000, [["embedding"], ["attention0"], ["mlp0"], ["attention1"], ["mlp1"], ["final_norm"]]),
    (10**9, [["embedding", "attention0", "mlp0", "attention1", "mlp1", "final_norm"]]),
])
def test_hf_buckets_respect_budget_and_never_split_units(budget, expected_units):
    hf_names = {  # HF keys each unit produces (mapping table, by hand)
        "embedding": ["model.embed_tokens.weight"],
        "final_norm": ["model.norm.weight"],
    }
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        hf_names[f"attention{i}"] = [p + "input_layernorm.weight", p + "self_attn.o_proj.weight",
                                     p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                     p + "self_attn.v_proj.weight", p + "self_attn.q_norm.weight",
                                     p + "self_attn.k_norm.weight"]
        hf_names[f"mlp{i}"] = [p + "post_attention_layernorm.weight", p + "mlp.gate_proj.weight",
                               p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    unit_bytes = {"embedding": EMB, "final_norm": NORM, "attention0": ATTN_B, "attention1": ATTN_B,
                  "mlp0": MLP_B, "mlp1": MLP_B}
    buckets = list(iter_hf_buckets(_full_units(), qwen3.MAPPING, CTX, budget))
    assert [[n for n, _ in b] for b in buckets] == [[k for u in units for k in hf_names[u]]
                                                    for units in expected_units]
    for b, units in zip(buckets, expected_units):
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size == sum(unit_bytes[u] for u in units)
        assert size <= budget or len(units) == 1


def test_hf_bucket_values_are_the_mapping_conversion():
    # the embedding row padding is dropped and q/k/v are cut out of linear_qkv in megatron's order
    units = _full_units()
    (bucket,) = iter_hf_buckets(units[:2], qwen3.MAPPING, CTX, 10**9)
    got = dict(bucket)
    assert torch.equal(got["model.embed_tokens.weight"], units[0].tensors[0][:VOCAB])
    qkv = units[1].tensors[units[1].names.index("decoder.layers.0.self_attention.linear_qkv.weight")]
    # one KV group: rows [q heads 0..3 (64 rows), k (16), v (16)]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], qkv[:HEADS * D])
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], qkv[HEADS * D:HEADS * D + D])
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], qkv[HEADS * D + D:])


def test_sync_takes_the_family_from_the_train_engine():
    """The old form sync_weights(engine, family, rollout, version) is refused with the new call
    form in the message; bare chunks without family or tables are refused too."""
    from ferrule.sync import check_weight_update_equal, sync_weights

    with pytest.raises(TypeError, match=r"sync_weights\(train_engine, rollout_engine, version\)"):
        sync_weights([], "qwen3", object(), 1)
    with pytest.raises(TypeError, match="family beside the engine"):
        check_weight_update_equal([], "qwen3")
    with pytest.raises(ValueError, match="family="):
        sync_weights([], object(), 1, hf_config={"vocab_size": 8})
