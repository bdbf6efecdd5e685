"""Colocation round trips on CPU (host-to-host copies: the code path of the GPU): TrainEngine
offload / onload and EmbeddedEngine sleep / wake change nothing, bit for bit.

Referees: the same engine driven without any offload (weights, fp32 masters, Adam moments,
gradients compared with ``torch.equal``), HF-free; and the rollout engine's own greedy output
and logprobs before sleeping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402

from ferrule.megatron.engine import OptimizerSettings, TrainEngine  # noqa: E402
from ferrule.offload import HostStash, unique_storages  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return w.make_hf_dir(tmp_path_factory.mktemp("colocate") / "qwen3", family="qwen3")


def _state(engine) -> dict[str, torch.Tensor]:
    """Every tensor the round trip must preserve: weights, grads, optimizer params and state."""
    from ferrule.megatron.optim import _torch_optimizers

    out = {f"w.{n}": p.detach().clone() for n, p in engine.model[0].module.named_parameters()}
    out.update({f"g.{n}": p.main_grad.detach().clone() for n, p in engine.model[0].module.named_parameters()})
    for i, opt in enumerate(_torch_optimizers(engine.optimizer)):
        for j, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"o{i}.{j}.{k}"] = p.detach().clone()
                for key, v in opt.state[p].items():
                    out[f"s{i}.{j}.{k}.{key}"] = v.clone()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def test_host_stash_keeps_views_and_frees_storage():
    base = torch.arange(12.0)
    view, alias = base[3:7], base.view(3, 4)
    other = torch.full((5,), 2.5, dtype=torch.bfloat16)
    other_view = other[1:3]
    stash = HostStash(unique_storages([base, view, alias, other], torch.device("cpu")), torch.device("cpu"), "t")
    assert len(stash) == 2 and stash.nbytes == 12 * 4 + 5 * 2
    stash.offload()
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    stash.host_view(view).fill_(-1.0)  # a write while offloaded lands in what comes back
    stash.host_view(other_view).fill_(7.0)  # the second storage sits at a 4 KiB offset of one host buffer
    assert stash.host_bytes == 2 * 4096
    with pytest.raises(RuntimeError, match="offload\\(\\) called twice"):
        stash.offload()
    stash.onload()
    want = torch.arange(12.0)
    want[3:7] = -1.0
    assert torch.equal(base, want) and torch.equal(alias, want.view(3, 4)) and torch.equal(view, want[3:7])
    assert torch.equal(other, torch.tensor([2.5, 7.0, 7.0, 2.5, 2.5], dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="without a previous offload"):
        stash.onload()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_train_offload_round_trip_is_bit_exact(hf_dir, tmp_path, dtype):
    """Offload between steps (weights too or not) and inside an open accumulation window; then a
    save taken while offloaded resumes into a fresh engine: all bit-identical to no offload."""
    opt = OptimizerSettings(lr=w.LR)
    ref = TrainEngine.from_hf(hf_dir, optimizer=opt, params_dtype=dtype)
    col = TrainEngine.from_hf(hf_dir, optimizer=opt, params_dtype=dtype)
    for step in range(3):
        batch = w.make_batch(seed=10 + step)
        for e in (ref, col):
            e.forward_backward(batch, "cross_entropy")
        stats = col.offload(weights=step != 1)  # step 1: optimizer + grads only
        assert col.offloaded and stats["offload_bytes"] > 0
        assert all(p.untyped_storage().nbytes() == 0 for p in col.model[0].parameters()) is (step != 1)
        with pytest.raises(RuntimeError, match="offloaded; call engine.onload"):
            col.forward_backward(batch, "cross_entropy")
        with pytest.raises(RuntimeError, match="offloaded"):
            col.optim_step()
        col.onload()  # grads of the open window came back too
        for e in (ref, col):
            assert e.optim_step()["success"]
        col.offload(weights=True)  # between windows: grads are freed and zero-filled on onload
        col.onload()
        _assert_same(_state(ref), _state(col))
    col.offload(weights=True)
    col.save(tmp_path / "ckpt")  # taken while offloaded
    assert col.offloaded
    col.onload()
    resumed = TrainEngine.from_torch_dist(tmp_path / "ckpt", optimizer=opt, params_dtype=dtype)
    for e in (ref, resumed):
        e.forward_backward(w.make_batch(seed=20), "cross_entropy")
        e.optim_step()
    _assert_same(_state(ref), _state(resumed))


@pytest.mark.parametrize("source", ["hf_dir", "config"])
def test_rollout_sleep_wake_round_trip(hf_dir, source):
    """Asleep: weights on the host, decode states dropped; updates made while asleep are what
    wakes up; greedy output after the round trip equals the output before it. ``hf_dir``: CPU
    weights memory-mapped by transformers (copied, not freed); ``config``: a model built in memory
    (storages freed while asleep; tied names must still be told apart)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    if source == "hf_dir":
        engine = EmbeddedEngine(hf_dir=hf_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), attn_implementation="sdpa")
        engine = EmbeddedEngine(model=model)
        engine.update_weights(EmbeddedEngine(hf_dir=hf_dir).get_hf_state_dict().items(), version=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    before = engine.generate([[1, 2, 3], [4, 5]], greedy)
    sd0 = {k: v.clone() for k, v in engine.get_hf_state_dict().items()}
    stats = engine.sleep()
    held = list(engine.model.parameters()) + list(engine.model.buffers())  # buffers: RoPE inv_freq
    assert engine.asleep and stats["sleep_bytes"] == sum(t.numel() * t.element_size() for t in held)
    # on CPU transformers' weights are memory-mapped (not resizable: copied out and back, not freed)
    freed = [t for t in held if t.untyped_storage().resizable()]
    assert freed and all(t.untyped_storage().nbytes() == 0 for t in freed)
    assert engine._sleep.stash.freed_bytes == sum(t.numel() * t.element_size() for t in freed)
    assert not engine._states
    with pytest.raises(RuntimeError, match="asleep; call wake"):
        engine.generate([[1, 2, 3]], greedy)
    _assert_same(sd0, engine.get_hf_state_dict())  # readable while asleep
    changed = {k: v * 1.5 for k, v in sd0.items()}
    engine.update_weights(changed.items(), version=1)  # lands in the host copies
    engine.wake()
    _assert_same(changed, engine.get_hf_state_dict())
    engine.update_weights(sd0.items(), version=2)
    engine.sleep(weights=False)  # only the decode states go
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())
    engine.wake()
    after = engine.generate([[1, 2, 3], [4, 5]], greedy)
    assert [(r.token_ids, r.logprobs) for r in after] == [(r.token_ids, r.logprobs) for r in before]
    with pytest.raises(RuntimeError, match="not asleep"):
        engine.wake()


def test_colocate_setting_is_checked():
    from ferrule.rl.config import ConfigError, load_config

    base = ["model.hf_dir=/nowhere", "data.jsonl_path=/nowhere.jsonl"]
    assert load_config(None, base).train.colocate == "auto"
    assert load_config(None, base + ["train.colocate=true"]).train.colocate is True
    with pytest.raises(ConfigError, match="train.colocate: expected true, false or auto, got 'sometimes'"):
        load_config(None, base + ["train.colocate=sometimes"])
    with pytest.raises(ConfigError, match="train.colocate: true needs rollout.engine: embedded"):
        load_config(None, base + ["train.colocate=true", "rollout.engine=sglang"])


def test_auto_colocation_turns_on_when_both_engines_would_not_fit(monkeypatch):
    """``train.colocate: auto`` on a (stand-in) CUDA device: on iff allocated + Adam moments + the
    rollout batch's KV cache exceed 90 % of the device, computed here from the formula."""
    from types import SimpleNamespace as NS

    from ferrule.rl import colocate
    from ferrule.rl.config import load_config

    cfg = load_config(None, ["model.hf_dir=/nowhere", "data.jsonl_path=/nowhere.jsonl", "model.dtype=bfloat16",
                             "train.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
                             "rollout.max_new_tokens=100", "data.max_prompt_tokens=28"])
    cuda = torch.device("cuda", 0)
    param = NS(device=cuda, numel=lambda: 1000, requires_grad=True)
    engine = NS(model=[NS(parameters=lambda: iter([param, param]))],
                hf_config={"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})
    rollout = NS(kind="embedded", device=cuda)
    allocated = 10_000
    need = allocated + 8 * 2000 + 2 * 3 * 2 * 8 * 2 * (4 * 2 * (28 + 100))  # K and V, bf16
    for total, on in ((need / 0.9 + 1, False), (need / 0.9 - 1, True)):
        monkeypatch.setattr(colocate, "_backend", lambda t=total: NS(memory_stats=lambda: {"allocated": allocated},
                                                                     total_memory=lambda: int(t)))
        assert colocate.projected_bytes(engine, cfg) == need
        assert colocate.resolve_colocate("auto", engine, rollout, cfg, distributed=False)[0] is on
    assert colocate.resolve_colocate("auto", engine, rollout, cfg, distributed=True)[0] is False
    with pytest.raises(ValueError, match="train.colocate: true needs the embedded rollout engine"):
        colocate.resolve_colocate(True, engine, NS(kind="embedded", device=torch.device("cpu")), cfg, distributed=False)


def test_colocate_true_is_refused_with_several_ranks():
    """``train.colocate: true`` under torchrun / ``--nproc N``: refused by the layout check that runs
    before anything is built (in ``ferrule train --nproc`` and in every rank's trainer)."""
    from ferrule.rl.config import ConfigError, config_from_dict
    from ferrule.rl.distributed import check_layout

    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "num_hidden_layers": 2}
    on = config_from_dict({"model": {"hf_dir": "unused"}, "train": {"colocate": True}}, validate=False)
    check_layout(on, hf, 1)
    with pytest.raises(ConfigError, match=r"train.colocate: true runs train and rollout in one process, this launch "
                                          r"has 2 ranks \(torchrun / --nproc\); set train.colocate: false or auto"):
        check_layout(on, hf, 2)
    auto = config_from_dict({"model": {"hf_dir": "unused"}}, validate=False)
    check_layout(auto, hf, 2)  # auto: off with several ranks (resolve_colocate), not an error
