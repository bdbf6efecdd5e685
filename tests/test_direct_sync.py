"""Direct weight sync (:mod:`ferrule.sync.direct`, issue 25 item 4) against the bucketed path, on CPU.

For each family (Qwen2 untied with QKV bias, Qwen3 tied, Qwen3-MoE, the out-of-tree Llama example,
Inkling with routed + shared experts, Inkling-2): a TrainEngine and two EmbeddedEngines boot from
one tiny random checkpoint; the train weights are moved (seeded noise on every parameter); one
engine is synced through the bucketed path (``direct=False``, the independent reference: the
family's mapping table, ``update_weights``), the other through the direct path. The two engines'
HF tensors must be equal bit for bit, differ from the boot weights, and pass
``check_weight_update_equal``; again after a second move (the cached plan, re-used). Every
in-tree family is planned completely (no tensor falls back).

Then: the fused q/k/v and gate/up buffers of the fast decode path as destinations (fused on CPU
by hand), a row the probe cannot plan (falls back for that tensor only, logged), a row that
deceives the probe (caught by the one-time check, the plan dropped, buckets used), the sleeping
engine (update_weights), and versions.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

SEED = 0
NOISE = 0.05


def _save(cls_name: str, cfg: dict, out):
    import transformers
    from transformers import AutoConfig

    torch.manual_seed(SEED)
    getattr(transformers, cls_name)(AutoConfig.for_model(**cfg)).float().save_pretrained(out)
    return out


def _qwen(mod_name: str, cls_name: str):
    def build(out):
        import importlib

        mod = importlib.import_module(f"ferrule.plugins.qwen.{mod_name}")
        return _save(cls_name, mod.TINY_HF_CONFIG, out)
    return build


def _llama(out):
    from ferrule_llama import llama

    return _save("LlamaForCausalLM", llama.TINY_HF_CONFIG, out)


def _inkling(out):
    from inkling_fixtures import CONFIGS, tiny_inkling_dir

    return tiny_inkling_dir(out, CONFIGS["moe_2_shared"])


def _inkling2(out):
    from inkling2_fixtures import CONFIGS, tiny_inkling2_dir

    return tiny_inkling2_dir(out, CONFIGS["mqa_full_first_softcaps"])


FAMILIES = [
    pytest.param(_qwen("qwen2", "Qwen2ForCausalLM"), id="qwen2"),
    pytest.param(_qwen("qwen3", "Qwen3ForCausalLM"), id="qwen3"),
    pytest.param(_qwen("qwen3_moe", "Qwen3MoeForCausalLM"), id="qwen3_moe"),
    pytest.param(_llama, id="llama"),
    pytest.param(_inkling, id="inkling"),
    pytest.param(_inkling2, id="inkling2"),
]


def _move(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in engine.model:
            for p in chunk.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * NOISE)


def _snapshot(rollout) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rollout.get_hf_state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert differ == [], f"direct and bucketed rollout weights differ in {differ}"


def _plan(rollout):
    from ferrule.sync import direct

    return direct._PLANS[rollout][1]


def _engines(build, tmp_path, **rollout_kw):
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout.embedded import EmbeddedEngine

    hf_dir = build(tmp_path / "hf")
    engine = TrainEngine.from_hf(hf_dir)
    return engine, EmbeddedEngine(hf_dir=hf_dir, **rollout_kw), EmbeddedEngine(hf_dir=hf_dir, **rollout_kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("build", FAMILIES)
def test_direct_sync_equals_bucketed_sync(build, tmp_path):
    from ferrule.sync import WeightSyncError, check_weight_update_equal, sync_weights

    engine, ref, fast = _engines(build, tmp_path)
    boot = _snapshot(fast)
    for version, seed in ((1, 11), (2, 12)):
        _move(engine, seed)
        s_ref = sync_weights(engine, ref, version, direct=False)
        s_fast = sync_weights(engine, fast, version, direct=True)
        assert not s_ref.direct and s_ref.buckets >= 1
        assert s_fast.direct and s_fast.buckets == 0 and fast.weights_version == version
        assert s_fast.tensors == s_ref.tensors and s_fast.bytes == s_ref.bytes
        got = _snapshot(fast)
        _assert_same(got, _snapshot(ref))
        assert any(not torch.equal(got[k], boot[k]) for k in got)
        verdicts = []  # the verifier says the same of both (Inkling-2: the moved padding rows of the
        for r in (ref, fast):  # unembedding are exported but never served, by either path)
            try:
                verdicts.append(check_weight_update_equal(engine, r).compared)
            except WeightSyncError as exc:
                verdicts.append(str(exc))
        assert verdicts[0] == verdicts[1]
        boot = got
    plan = _plan(fast)
    assert plan.fallback == {} and plan.verified


@pytest.mark.timeout(120)
def test_direct_sync_into_fused_buffers(tmp_path, monkeypatch):
    """The fast decode path's fused q/k/v and gate/up buffers (fused by hand on CPU) are written in place:
    gate and up become one copy per layer, q/k/v one row gather per layer (``WeightSyncSettings.row_gathers``),
    and the fused buffers hold the synced weights."""
    from ferrule.rollout._fast_decode import fuse_weights
    from ferrule.sync import sync_weights

    engine, ref, fast = _engines(_qwen("qwen2", "Qwen2ForCausalLM"), tmp_path)
    fast._fuse_weights()
    from ferrule.engine_settings import WeightSyncSettings

    for version, (rows, foreach) in enumerate(((False, True), (True, True), (True, False), (False, False)), start=1):
        settings = WeightSyncSettings(row_gathers=rows, foreach_copies=foreach)
        _move(engine, 20 + version)
        sync_weights(engine, ref, version, direct=False)
        assert sync_weights(engine, fast, version, settings=settings).direct
        _assert_same(_snapshot(fast), _snapshot(ref))
    layers = fast.model.config.num_hidden_layers
    plan = _plan(fast)
    merged = [c.hf_name for c in plan.copies if "+" in c.hf_name]
    assert len(merged) == layers and all("gate_proj" in n and "up_proj" in n for n in merged), merged
    assert len(plan.gathers) == 2 * layers and all(c.contiguous() for c in plan.rest)  # q/k/v weights, biases
    layout = fuse_weights(fast.model)  # idempotent: the same buffers, now holding the synced weights
    a = ref.model.model.layers[1]
    assert torch.equal(layout.weights[11 + 1], torch.cat([a.self_attn.q_proj.weight, a.self_attn.k_proj.weight,
                                                         a.self_attn.v_proj.weight]))
    assert torch.equal(layout.weights[11 + 8], torch.cat([a.mlp.gate_proj.weight, a.mlp.up_proj.weight]))


def _custom_table(engine, row_cls):
    """The engine's mapping table with the final-norm row replaced by ``row_cls`` (same fields)."""
    from ferrule.mapping import MappingTable

    rows = tuple(row_cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
                 if m.mcore == "decoder.final_layernorm.weight" else m for m in engine.mapping_table.mappings)
    return MappingTable(engine.mapping_table.family, rows, engine.mapping_table.ignores)


@pytest.mark.timeout(120)
def test_a_row_the_probe_cannot_plan_falls_back_alone(tmp_path, caplog):
    from ferrule.mapping import Rename
    from ferrule.sync import sync_weights

    @dataclasses.dataclass(frozen=True)
    class ComputedRename(Rename):  # to_hf computes in floating point: not a layout the probe can read
        def to_hf(self, full, ctx, wildcards=()):
            return (full * 1.0,) if full.is_floating_point() else (full.float(),)

    engine, ref, fast = _engines(_qwen("qwen3", "Qwen3ForCausalLM"), tmp_path)
    table = _custom_table(engine, ComputedRename)
    _move(engine, 31)
    with caplog.at_level(logging.WARNING, logger="ferrule.sync"):
        sync_weights(engine, ref, 1, mapping=table, direct=False)
        assert sync_weights(engine, fast, 1, mapping=table).direct
    _assert_same(_snapshot(fast), _snapshot(ref))
    assert _plan(fast).fallback.keys() == {"decoder.final_layernorm.weight"}
    assert "decoder.final_layernorm.weight go(es) through update_weights" in caplog.text


@pytest.mark.timeout(120)
def test_a_row_that_deceives_the_probe_is_caught_once(tmp_path, caplog):
    from ferrule.mapping import Rename
    from ferrule.sync import direct, sync_weights

    @dataclasses.dataclass(frozen=True)
    class Doubling(Rename):  # a layout on integers, a value change on weights
        def to_hf(self, full, ctx, wildcards=()):
            return (full * 2 if full.is_floating_point() else full,)

    engine, ref, fast = _engines(_qwen("qwen3", "Qwen3ForCausalLM"), tmp_path)
    table = _custom_table(engine, Doubling)
    _move(engine, 41)
    with caplog.at_level(logging.WARNING, logger="ferrule.sync"):
        sync_weights(engine, ref, 1, mapping=table, direct=False)
        assert not sync_weights(engine, fast, 1, mapping=table).direct  # redone through buckets
        assert not sync_weights(engine, fast, 2, mapping=table).direct  # and for good
    _assert_same(_snapshot(fast), _snapshot(ref))
    assert direct._PLANS[fast][1] is False
    assert "direct weight sync disabled" in caplog.text and "model.norm.weight" in caplog.text


@pytest.mark.timeout(120)
def test_asleep_versions_and_switch(tmp_path, monkeypatch):
    from ferrule.sync import sync_weights

    engine, ref, fast = _engines(_qwen("qwen3", "Qwen3ForCausalLM"), tmp_path)
    _move(engine, 51)
    serial = fast._weights_serial
    assert sync_weights(engine, fast, 3).direct
    assert fast._weights_serial == serial + 1  # a merged LoRA copy (fast decode path) knows to merge again
    with pytest.raises(ValueError, match="backwards"):
        sync_weights(engine, fast, 2)
    assert fast.weights_version == 3
    _move(engine, 52)
    fast.sleep()  # weights on the host: update_weights writes the host copies
    assert not sync_weights(engine, fast, 4).direct and fast.weights_version == 4
    fast.wake()
    sync_weights(engine, ref, 4, direct=False)
    _assert_same(_snapshot(fast), _snapshot(ref))
    _move(engine, 53)
    assert sync_weights(engine, fast, 5).direct  # awake again: the cached plan, still valid
    from ferrule.engine_settings import WeightSyncSettings

    assert not sync_weights(engine, ref, 5, settings=WeightSyncSettings(direct=False)).direct
    _assert_same(_snapshot(fast), _snapshot(ref))


def test_joint_strides():
    from ferrule.sync.strides import joint_strides

    # Megatron linear_qkv rows [q0 q1 k v | q2 q3 k v] (2 groups, 2 query heads each, 1 row a head, 3 columns)
    q_src = torch.tensor([0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17])
    assert joint_strides(q_src, torch.arange(12)) == ((2, 6), (12, 1), 0, (6, 1), 0)
    assert joint_strides(torch.arange(5) + 7, torch.arange(5)) == ((5,), (1,), 7, (1,), 0)
    assert joint_strides(torch.tensor([0, 2, 1, 3]), torch.arange(4)) == ((2, 2), (1, 2), 0, (2, 1), 0)
    assert joint_strides(torch.tensor([3, 2, 1]), torch.arange(3)) is None  # negative stride
    assert joint_strides(torch.tensor([0, 1, 5]), torch.arange(3)) is None  # no shape


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fast decode path's fused buffers)")
def test_direct_sync_on_cuda_into_fused_buffers(tmp_path, monkeypatch):
    """On the GPU in bf16, rollout engines on the fast decode path (fused q/k/v and gate/up, fused at
    construction): the direct sync gives the bucketed sync's weights bit for bit, twice."""
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.sync import sync_weights

    hf_dir = _qwen("qwen2", "Qwen2ForCausalLM")(tmp_path / "hf")
    engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16)
    ref, fast = (EmbeddedEngine(hf_dir=hf_dir, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    from ferrule.engine_settings import WeightSyncSettings

    for version, rows in ((1, False), (2, True)):
        _move(engine, 60 + version)
        sync_weights(engine, ref, version, direct=False)
        stats = sync_weights(engine, fast, version, check_equal=True, settings=WeightSyncSettings(row_gathers=rows))
        assert stats.direct and stats.checked
        _assert_same(_snapshot(fast), _snapshot(ref))
    plan = _plan(fast)
    assert plan.fallback == {} and plan.copies[0].dst.device.type == "cuda"
    if fast.fast_decode:  # fused at construction: gate + up are one copy per layer
        assert sum("+" in c.hf_name for c in plan.copies) == fast.model.config.num_hidden_layers


@pytest.mark.timeout(120)
def test_a_second_train_engine_gets_its_own_plan(tmp_path):
    """One rollout engine synced from two train engines in turn: the plan follows the engine it is given."""
    from ferrule.megatron.engine import TrainEngine
    from ferrule.sync import sync_weights

    engine, ref, fast = _engines(_qwen("qwen3", "Qwen3ForCausalLM"), tmp_path)
    other = TrainEngine.from_hf(tmp_path / "hf")
    _move(engine, 71)
    _move(other, 72)
    for version, src in enumerate((engine, other, engine), start=1):
        sync_weights(src, ref, version, direct=False)
        assert sync_weights(src, fast, version).direct
        _assert_same(_snapshot(fast), _snapshot(ref))
        assert _plan(fast).copies[0].src is next(src.model[0].parameters())
