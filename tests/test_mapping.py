"""Mapping vocabulary (ferrule.mapping): each mapping against hand-computed layouts.

The expected layouts are written out element by element from Megatron's documented order
(attention.py: per query group [q heads of the group, k, v]; mlp.py: [gate; up]) with
explicit Python loops, independent of the reshape code under test.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from ferrule.mapping import (
    FuseGateUp,
    FuseQKV,
    Ignore,
    MappingContext,
    MappingError,
    MappingTable,
    OutputLayer,
    Rename,
    StackExperts,
    StackExpertsInterleaved,
    TPSplit,
)

HIDDEN = 5
SEED = 0


def _ctx(heads, groups, head_dim, vocab=7, padded=None, tied=False, experts=None):
    return MappingContext(num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                          vocab_size=vocab, padded_vocab_size=padded, tie_word_embeddings=tied,
                          num_experts=experts)


def _qkv_expected(q, k, v, heads, groups, d):
    """Megatron linear_qkv rows built by explicit loops: for each group g: q heads of g, k_g, v_g."""
    rows = []
    per = heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows += [q[h * d + i] for i in range(d)]
        rows += [k[g * d + i] for i in range(d)]
        rows += [v[g * d + i] for i in range(d)]
    return torch.stack(rows)


QKV = FuseQKV("decoder.layers.*.self_attention.linear_qkv.weight",
              q="model.layers.*.self_attn.q_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
              v="model.layers.*.self_attn.v_proj.weight")
QKV_BIAS = FuseQKV("decoder.layers.*.self_attention.linear_qkv.bias",
                   q="model.layers.*.self_attn.q_proj.bias", k="model.layers.*.self_attn.k_proj.bias",
                   v="model.layers.*.self_attn.v_proj.bias")


@pytest.mark.parametrize("heads,groups,d", [(4, 2, 3), (4, 1, 3), (6, 3, 2), (2, 2, 8), (4, 4, 1)])
def test_fuse_qkv_layout_and_round_trip(heads, groups, d):
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(heads * d, HIDDEN, generator=g)
    k = torch.randn(groups * d, HIDDEN, generator=g)
    v = torch.randn(groups * d, HIDDEN, generator=g)
    ctx = _ctx(heads, groups, d)
    fused = QKV.to_mcore([q, k, v], ctx)
    assert torch.equal(fused, _qkv_expected(q, k, v, heads, groups, d))
    q2, k2, v2 = QKV.to_hf(fused, ctx)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    # biases: same order along dim 0
    qb, kb, vb = (torch.randn(n, generator=g) for n in (heads * d, groups * d, groups * d))
    fb = QKV_BIAS.to_mcore([qb, kb, vb], ctx)
    assert torch.equal(fb, _qkv_expected(qb, kb, vb, heads, groups, d))
    assert all(torch.equal(a, b) for a, b in zip(QKV_BIAS.to_hf(fb, ctx), (qb, kb, vb)))


def test_fuse_qkv_tp_shard_holds_whole_groups():
    heads, groups, d = 4, 2, 3
    q, k, v = torch.arange(heads * d * 2.0).view(-1, 2), torch.arange(100, 100 + groups * d * 2.0).view(-1, 2), \
        torch.arange(200, 200 + groups * d * 2.0).view(-1, 2)
    fused = QKV.to_mcore([q, k, v], _ctx(heads, groups, d))
    rank1 = QKV.shard(fused, 1, 2)
    # rank 1 holds group 1: q heads 2,3 then k head 1 then v head 1
    expected = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(rank1, expected)
    assert torch.equal(QKV.gather([QKV.shard(fused, r, 2) for r in range(2)]), fused)


def test_fuse_qkv_rejects_wrong_shapes():
    ctx = _ctx(4, 2, 3)
    with pytest.raises(MappingError, match="k_proj"):
        QKV.to_mcore([torch.zeros(12, 5), torch.zeros(3, 5), torch.zeros(6, 5)], ctx)


def test_fuse_gate_up_layout_and_tp():
    ffn = 4
    gate = torch.arange(ffn * 3.0).view(ffn, 3)
    up = -torch.arange(ffn * 3.0).view(ffn, 3) - 1
    m = FuseGateUp("decoder.layers.*.mlp.linear_fc1.weight", gate="model.layers.*.mlp.gate_proj.weight",
                   up="model.layers.*.mlp.up_proj.weight")
    fused = m.to_mcore([gate, up], None)
    assert torch.equal(fused, torch.tensor([list(r) for r in gate.tolist()] + [list(r) for r in up.tolist()]))
    g2, u2 = m.to_hf(fused, None)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    assert m.tp is TPSplit.GATE_UP
    # TP=2: rank r holds [gate rows of r; up rows of r]
    r0 = m.shard(fused, 0, 2)
    r1 = m.shard(fused, 1, 2)
    assert torch.equal(r0, torch.cat([gate[0:2], up[0:2]]))
    assert torch.equal(r1, torch.cat([gate[2:4], up[2:4]]))
    assert torch.equal(m.gather([r0, r1]), fused)


def test_rename_row_and_column_splits():
    t = torch.arange(24.0).view(4, 6)
    row = Rename("decoder.layers.*.self_attention.linear_proj.weight", "model.layers.*.self_attn.o_proj.weight",
                 tp=TPSplit.ROW)
    col = Rename("x.*.w", "y.*.w", tp=TPSplit.COLUMN)
    rep = Rename("x.*.n", "y.*.n")
    assert torch.equal(row.shard(t, 1, 3), t[:, 2:4])
    assert torch.equal(col.shard(t, 1, 2), t[2:4])
    assert rep.shard(t, 1, 2) is t
    assert torch.equal(row.gather([row.shard(t, r, 3) for r in range(3)]), t)
    with pytest.raises(MappingError, match="not divisible by the TP size 4"):
        row.shard(t, 0, 4)
    assert row.hf_keys("decoder.layers.11.self_attention.linear_proj.weight") == \
        ("model.layers.11.self_attn.o_proj.weight",)


def test_vocab_padding_and_split():
    emb = torch.arange(14.0).view(7, 2)
    m = Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp=TPSplit.VOCAB)
    ctx = _ctx(2, 1, 1, vocab=7, padded=8)
    full = m.to_mcore([emb], ctx)
    assert full.shape == (8, 2) and torch.equal(full[:7], emb) and torch.equal(full[7], torch.zeros(2))
    assert torch.equal(m.shard(full, 1, 2), full[4:8])
    (back,) = m.to_hf(full, ctx)
    assert torch.equal(back, emb)
    with pytest.raises(MappingError, match="vocab_size is 7"):
        m.to_mcore([torch.zeros(6, 2)], ctx)


def test_output_layer_custom_mapping_tied_and_untied():
    """OutputLayer (named custom mapping): untied reads lm_head, tied reads the embedding and exports nothing."""
    m = OutputLayer("output_layer.weight")
    w = torch.randn(7, 2, generator=torch.Generator().manual_seed(SEED))
    untied, tied = _ctx(2, 1, 1, padded=10), _ctx(2, 1, 1, padded=10, tied=True)
    assert m.hf_keys("output_layer.weight", untied) == ("lm_head.weight",)
    assert m.hf_keys("output_layer.weight", tied) == ("model.embed_tokens.weight",)
    assert m.exports(untied) and not m.exports(tied)
    full = m.to_mcore([w], untied)
    assert full.shape == (10, 2) and torch.equal(full[7:], torch.zeros(3, 2))
    assert torch.equal(m.to_hf(full, untied)[0], w)


def test_stack_experts_slice_and_assemble():
    E, rows, cols = 3, 4, 2
    stacked = torch.arange(E * rows * cols * 1.0).view(E, rows, cols)
    m = StackExperts("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                     "model.layers.*.mlp.experts.gate_up_proj", tp=TPSplit.GATE_UP)
    ctx = _ctx(2, 1, 1, experts=E)
    name = "decoder.layers.5.mlp.experts.local_experts.2.linear_fc1.weight"
    assert m.hf_keys(name) == ("model.layers.5.mlp.experts.gate_up_proj",)
    wild = m.match(name)
    assert torch.equal(m.to_mcore([stacked], ctx, wild), stacked[2])
    pieces = {e: m.to_hf(stacked[e], ctx, ("5", str(e)))[0] for e in range(E)}
    assert torch.equal(m.assemble(pieces, ctx), stacked)
    with pytest.raises(MappingError, match=r"experts \[1\] missing"):
        m.assemble({0: stacked[0], 2: stacked[2]}, ctx)
    assert m.expert


def test_transposed_interleaved_stacked_experts_compute_what_gpt_oss_computes():
    """gpt-oss stores experts ``[E, in, out]`` with gate/up columns interleaved (HF ``GptOssExperts``:
    ``gate_up = x @ W[e] + b[e]``, ``gate = gate_up[..., ::2]``, ``up = gate_up[..., 1::2]``, ``down = h @ D[e]``):
    megatron's ``[gate; up]`` fc1 and ``[hidden, ffn]`` fc2 of expert e compute the same, and export back exactly."""
    E, hidden, ffn = 3, HIDDEN, 4
    g = torch.Generator().manual_seed(SEED)
    w, b = torch.randn(E, hidden, 2 * ffn, generator=g), torch.randn(E, 2 * ffn, generator=g)
    down = torch.randn(E, ffn, hidden, generator=g)
    x, h = torch.randn(6, hidden, generator=g), torch.randn(6, ffn, generator=g)
    p = "decoder.layers.*.mlp.experts.local_experts.*."
    fc1 = StackExpertsInterleaved(p + "linear_fc1.weight", "model.layers.*.mlp.experts.gate_up_proj", transposed=True,
                                  tp=TPSplit.GATE_UP)
    fc1_bias = StackExpertsInterleaved(p + "linear_fc1.bias", "model.layers.*.mlp.experts.gate_up_proj_bias",
                                       tp=TPSplit.GATE_UP)
    fc2 = StackExperts(p + "linear_fc2.weight", "model.layers.*.mlp.experts.down_proj", transposed=True, tp=TPSplit.ROW)
    ctx = _ctx(2, 1, 1, experts=E)
    for e in range(E):
        wild = ("0", str(e))
        w1, b1, w2 = fc1.to_mcore([w], ctx, wild), fc1_bias.to_mcore([b], ctx, wild), fc2.to_mcore([down], ctx, wild)
        assert w1.shape == (2 * ffn, hidden) and w2.shape == (hidden, ffn)
        ref = x @ w[e] + b[e]
        out = x @ w1.t() + b1                                    # megatron: [gate; up]
        torch.testing.assert_close(out[:, :ffn], ref[:, ::2], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[:, ffn:], ref[:, 1::2], rtol=0, atol=1e-6)
        torch.testing.assert_close(h @ w2.t(), h @ down[e], rtol=0, atol=1e-6)
        assert torch.equal(fc1.to_hf(w1, ctx, wild)[0], w[e]) and torch.equal(fc1_bias.to_hf(b1, ctx, wild)[0], b[e])
        assert torch.equal(fc2.to_hf(w2, ctx, wild)[0], down[e])


def _table():
    return MappingTable(
        family="toy",
        mappings=(
            Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp=TPSplit.VOCAB),
            QKV,
            Rename("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
            StackExperts("decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
                         "model.layers.*.mlp.experts.down_proj", tp=TPSplit.ROW),
            OutputLayer("output_layer.weight"),
        ),
        ignores=(Ignore("model.layers.*.self_attn.rotary_emb.inv_freq", reason="recomputed from rope_theta"),),
    )


def test_table_full_round_trip_with_stacked_experts():
    table = _table()
    ctx = _ctx(4, 2, 3, vocab=7, padded=8, experts=2)
    g = torch.Generator().manual_seed(SEED)
    hf = {
        "model.embed_tokens.weight": torch.randn(7, HIDDEN, generator=g),
        "lm_head.weight": torch.randn(7, HIDDEN, generator=g),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
    }
    for layer in range(2):
        hf[f"model.layers.{layer}.self_attn.q_proj.weight"] = torch.randn(12, HIDDEN, generator=g)
        hf[f"model.layers.{layer}.self_attn.k_proj.weight"] = torch.randn(6, HIDDEN, generator=g)
        hf[f"model.layers.{layer}.self_attn.v_proj.weight"] = torch.randn(6, HIDDEN, generator=g)
        hf[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=g)
        hf[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.randn(2, HIDDEN, 3, generator=g)
    names = ["embedding.word_embeddings.weight", "output_layer.weight"] + [
        n for layer in range(2) for n in (
            f"decoder.layers.{layer}.self_attention.linear_qkv.weight",
            f"decoder.layers.{layer}.input_layernorm.weight",
            f"decoder.layers.{layer}.mlp.experts.local_experts.0.linear_fc2.weight",
            f"decoder.layers.{layer}.mlp.experts.local_experts.1.linear_fc2.weight")]
    mc = table.hf_to_mcore(hf, names, ctx)
    assert mc["embedding.word_embeddings.weight"].shape == (8, HIDDEN)
    assert torch.equal(mc["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.down_proj"][1])
    back = table.mcore_to_hf(mc, ctx)
    expected = {k: v for k, v in hf.items() if "inv_freq" not in k}
    assert sorted(back) == sorted(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_table_lists_every_unmapped_parameter():
    table = _table()
    with pytest.raises(MappingError) as exc:
        table.check_mcore_names(["embedding.word_embeddings.weight", "decoder.layers.0.mlp.router.weight",
                                 "decoder.layers.3.self_attention.q_layernorm.weight", "decoder.final_layernorm.weight"])
    msg = str(exc.value)
    assert "without a mapping (3)" in msg
    for name in ("decoder.layers.0.mlp.router.weight", "decoder.layers.3.self_attention.q_layernorm.weight",
                 "decoder.final_layernorm.weight"):
        assert name in msg
    # each named with the layer and op that ferrule check's divergence report would blame (the modules they live in)
    assert "decoder.layers.0.mlp.router.weight (layer 0 mlp)" in msg
    assert "decoder.layers.3.self_attention.q_layernorm.weight (layer 3 attention)" in msg
    assert "decoder.final_layernorm.weight (final_norm)" in msg


def test_parameter_site_names_the_block_a_tensor_lives_in():
    """Megatron names and HF (Llama-style) keys -> the capture point (ferrule check's op) of the module holding them;
    a TE-fused norm weight belongs to the norm before its linear; an ambiguous HF name gets no site."""
    from ferrule.mapping.vocabulary import parameter_site

    cases = {
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": (2, "input_norm"),
        "decoder.layers.2.self_attention.core_attention.softmax_offset": (2, "attention"),
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight": (2, "pre_mlp_norm"),
        "decoder.layers.2.pre_mlp_layernorm.weight": (2, "pre_mlp_norm"),
        "decoder.layers.12.mlp.experts.local_experts.3.linear_fc2.bias": (12, "mlp"),
        "model.layers.1.input_layernorm.weight": (1, "input_norm"),
        "model.layers.1.self_attn.sinks": (1, "attention"),
        "model.layers.1.mlp.experts.gate_up_proj": (1, "mlp"),
        "model.layers.1.post_attention_layernorm.weight": None,  # pre-MLP norm (Llama) or attention post-norm (OLMo-2)
        "model.embed_tokens.weight": (None, "embedding"),
        "lm_head.weight": (None, "output_layer"),
    }
    assert {name: parameter_site(name) for name in cases} == cases


def test_table_lists_every_missing_and_extra_hf_key():
    table = _table()
    ctx = _ctx(4, 2, 3, vocab=7, tied=True)
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight"]
    present = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
               "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    with pytest.raises(MappingError) as exc:
        table.check_hf_keys(present, names, ctx)
    msg = str(exc.value)
    assert "missing from the checkpoint (2)" in msg
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.layers.0.self_attn.v_proj.weight" in msg
    assert "neither mapped nor ignored (2)" in msg
    assert "lm_head.weight" in msg and "model.layers.0.mlp.gate.weight" in msg
    assert "inv_freq" not in msg


def test_table_is_immutable_and_validated():
    table = _table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.family = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.mappings[0].hf = "x"  # type: ignore[misc]
    with pytest.raises(MappingError, match="more than once"):
        MappingTable(family="t", mappings=(Rename("a.*", "b.*"), Rename("a.*", "c.*")))
    with pytest.raises(MappingError, match="must be tuples"):
        MappingTable(family="t", mappings=[Rename("a.*", "b.*")])  # type: ignore[arg-type]
    with pytest.raises(MappingError, match="needs a reason"):
        Ignore("x.*", reason=" ")
    with pytest.raises(MappingError, match="several entries"):
        MappingTable(family="t", mappings=(Rename("a.*.w", "b.*"), Rename("a.1.w", "c"))).resolve("a.1.w")
    with pytest.raises(MappingError, match="not a parameter-name pattern"):
        Rename("a.*")  # no HF name


def test_context_from_hf_config_and_gqa_check():
    ctx = MappingContext.from_hf_config({"num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 64,
                                         "head_dim": 16, "vocab_size": 100, "tie_word_embeddings": True})
    assert (ctx.num_query_groups, ctx.head_dim, ctx.tie_word_embeddings) == (1, 16, True)
    assert MappingContext.from_hf_config({"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 3}).head_dim == 16
    with pytest.raises(MappingError, match="not a multiple"):
        _ctx(6, 4, 2)


def test_module_imports_no_torch():
    code = "import sys, ferrule.mapping; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hf_assembler_streams_and_names_incomplete_stacks():
    """HFAssembler (shared by export, weight sync and mcore_to_hf) yields a stacked tensor only
    when its last expert arrives, and names the HF tensor and the experts it got when one is left."""
    from ferrule.mapping import HFAssembler

    table = _table()
    ctx = _ctx(4, 2, 3, vocab=7, padded=8, experts=2)
    e0, e1 = torch.randn(HIDDEN, 3), torch.randn(HIDDEN, 3)
    asm = HFAssembler(table, ctx, dtype=torch.float64)
    assert asm.add("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", e1) == []
    ((name, stacked),) = asm.add("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", e0)
    assert name == "model.layers.0.mlp.experts.down_proj" and stacked.dtype == torch.float64
    assert torch.equal(stacked, torch.stack([e0, e1]).double())
    asm.finish()
    assert asm.add("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", e0) == []
    with pytest.raises(MappingError, match=r"model\.layers\.1\.mlp\.experts\.down_proj': \[0\]"):
        asm.finish()


def test_mapping_row_type_renamed_with_a_warning_alias():
    import ferrule.mapping as mapping
    import sys

    from ferrule.mapping import ParamMapping

    sys.modules.pop("ferrule.mapping_table", None)  # an earlier test may have imported the old path
    with pytest.warns(DeprecationWarning, match="ferrule.mapping_table moved to ferrule.mapping.table"):
        from ferrule.mapping_table import MappingTable as OldPathTable

    assert issubclass(Rename, ParamMapping) and OldPathTable is MappingTable
    with pytest.warns(DeprecationWarning, match="renamed ParamMapping"):
        assert mapping.Mapping is ParamMapping


def test_mapping_package_has_no_import_cycle():
    """Inside ferrule.mapping imports run one way: vocabulary <- experts <- table <- package, vocabulary <-
    decoder (read from the sources' import statements; no module-level __getattr__ re-export trick)."""
    import ast
    from pathlib import Path

    import ferrule.mapping

    root = Path(ferrule.mapping.__file__).parent
    imports = {}
    for mod in ("vocabulary", "experts", "table", "decoder"):
        tree = ast.parse((root / f"{mod}.py").read_text())
        imports[mod] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                        and (n.module or "").startswith("ferrule")}
    assert imports["vocabulary"] == set()
    assert imports["experts"] == {"ferrule.mapping.vocabulary"}
    assert imports["table"] == {"ferrule.mapping.vocabulary", "ferrule.mapping.experts"}
    assert imports["decoder"] == {"ferrule.mapping.vocabulary", "ferrule.contract.specs"}
    code = "import sys, ferrule.mapping.decoder, ferrule.mapping.table; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
