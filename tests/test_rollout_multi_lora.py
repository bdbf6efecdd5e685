"""Batched multi-adapter decode (ferrule.rollout._multi_lora): several LoRA adapters and the plain base
in ONE decode batch, each row applying its own adapter, against each adapter merged into a float64
copy of the base by hand (``W + scaling * B @ A``, PEFT's scaling: ``lora_alpha / r``, rsLoRA
``lora_alpha / sqrt(r)``), one full-sequence forward of ``prompt + generated`` per sample (CPU)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ferrule.engine_settings import RolloutEngineSettings
from ferrule.rollout import SamplingParams, _fast_decode
from ferrule.rollout.base import GenerateRequest
from ferrule.rollout.embedded import EmbeddedEngine
from test_rollout_lora import PROMPTS, peft_reference, reference_logprobs, tiny_qwen3

TOL = 1e-5
PARAMS = SamplingParams(temperature=0.9, max_new_tokens=6, n=1, seed=11, ignore_eos=True)


def merged_fp64(base, tensors, cfg):
    """``base`` in float64 with the adapter merged into its weights by hand."""
    model = copy.deepcopy(base).double().eval()
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, a in tensors.items():
            if name.endswith(".lora_A.weight"):
                path = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace("lora_A", "lora_B")]
                modules[path].weight += scaling * (b.double() @ a.double())
    return model


@pytest.fixture(scope="module")
def three_adapters():
    base = tiny_qwen3()
    adapters = {  # different ranks, targets and scalings in one batch
        "a": peft_reference(base, seed=1)[1:],
        "b": peft_reference(base, seed=2, rank=2, alpha=16, targets=("q_proj", "down_proj"))[1:],
        "c": peft_reference(base, seed=3, rank=8, use_rslora=True)[1:],
    }
    return base, adapters


def test_three_adapters_and_the_base_in_one_batch_match_merged_fp64(three_adapters):
    base, adapters = three_adapters
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for name, (tensors, cfg) in adapters.items():
        engine.add_lora_adapter(name, tensors, cfg)
    assert engine.lora_adapters == ["a", "b", "c"]
    refs = {name: merged_fp64(base, *adapters[name]) for name in adapters}
    refs[None] = copy.deepcopy(base).double()
    order = ["c", None, "a", "b", "a"]  # adapters repeat and interleave with the base
    reqs = [GenerateRequest(tuple(PROMPTS[i % len(PROMPTS)]), lora_adapter=a) for i, a in enumerate(order)]
    batches = []
    run_batch = engine._run_batch
    engine._run_batch = lambda prompts, *a, **k: batches.append(len(prompts)) or run_batch(prompts, *a, **k)
    results = engine.generate(reqs, PARAMS)
    assert batches == [len(order) * PARAMS.n]  # one decode batch
    for r in results:
        req = reqs[r.prompt_index]
        want = reference_logprobs(refs[req.lora_adapter], req.prompt_token_ids, r.token_ids, PARAMS.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=TOL, rtol=0)
    # the base stays bit-identical and under its own names (hooks, no merge, no renamed modules)
    assert {n: p for n, p in engine.model.named_parameters()}.keys() == original.keys()
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, original[n]), n
    # a direct forward (prompt logprobs) applies the adapter given per row
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    with torch.no_grad(), engine.lora_rows(["b", None]):
        logits = engine.model(input_ids=ids).logits.double()
    for row, name in enumerate(["b", None]):
        with torch.no_grad():
            want = refs[name](input_ids=ids[:1]).logits[0]
        torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=0)


def test_adapter_limit_refuses_up_front_and_removal_restores_the_base(three_adapters):
    base, adapters = three_adapters
    engine = EmbeddedEngine(model=copy.deepcopy(base), settings=RolloutEngineSettings(max_lora_adapters=2))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = engine.model(input_ids=ids).logits
    engine.add_lora_adapter("a", *adapters["a"])
    engine.add_lora_adapter("b", *adapters["b"])
    with pytest.raises(ValueError, match=r"rollout_engine.max_lora_adapters=2 adapters \(a, b\)"):
        engine.add_lora_adapter("c", *adapters["c"])
    assert engine.lora_adapters == ["a", "b"]
    with pytest.raises(ValueError, match="'zz' is not held"):
        engine.generate([GenerateRequest(tuple(PROMPTS[0]), lora_adapter="zz")], PARAMS)
    with pytest.raises(ValueError, match="remove_lora_adapter"):
        engine.update_lora_adapter(*adapters["a"], version=1)
    engine.remove_lora_adapter("a")
    engine.add_lora_adapter("c", *adapters["c"])  # its slot is free again (and its rank is larger: the pool grows)
    (r,) = engine.generate([GenerateRequest(tuple(PROMPTS[1]), lora_adapter="c")],
                           SamplingParams(temperature=0.9, max_new_tokens=6, seed=3, ignore_eos=True))
    want = reference_logprobs(merged_fp64(base, *adapters["c"]), PROMPTS[1], r.token_ids, 0.9)
    torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=TOL, rtol=0)
    engine.remove_lora_adapter("b")
    engine.remove_lora_adapter("c")
    assert engine.lora_adapters == [] and engine._multi.pool is None  # the hooks went with the last adapter
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, before)


def test_fast_decode_step_applies_each_rows_adapter(three_adapters, monkeypatch):
    """The fused fast decode step (CUDA's default path; here run eagerly on CPU, as
    tests/test_rollout_fast_decode.py does) adds each row's adapter terms to its fused projections."""
    from test_rollout_fast_decode import _eager_fast_path

    base, adapters = three_adapters
    engine = EmbeddedEngine(model=copy.deepcopy(base), settings=_eager_fast_path())
    engine.fast_decode = True
    engine._fuse_weights()
    for name, (tensors, cfg) in adapters.items():
        engine.add_lora_adapter(name, tensors, cfg)
    steps = []
    run = _fast_decode.FastStatic.run
    monkeypatch.setattr(_fast_decode.FastStatic, "run", lambda self, *a: steps.append(a[-1]) or run(self, *a))
    order = ["b", None, "c", "a"]
    reqs = [GenerateRequest(tuple(PROMPTS[i % len(PROMPTS)]), lora_adapter=a) for i, a in enumerate(order)]
    results = engine.generate(reqs, PARAMS)
    assert len(steps) == 1 and steps[0] is not None  # the fast path ran, once, with the adapters' factors
    refs = {name: merged_fp64(base, *adapters[name]) for name in adapters}
    refs[None] = copy.deepcopy(base).double()
    for r in results:
        req = reqs[r.prompt_index]
        want = reference_logprobs(refs[req.lora_adapter], req.prompt_token_ids, r.token_ids, PARAMS.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled fast step in a CUDA graph)")
def test_adapters_and_the_base_in_one_cuda_graph_batch_match_merged_fp64(three_adapters, monkeypatch):
    """CUDA's default path (compiled fast step captured as a CUDA graph, per-row adapter terms in it,
    :class:`ferrule.rollout._multi_lora.HeldAdapters`' CUDA branch) against each adapter merged by hand
    into a float64 CPU copy: sampled logprobs within the CUDA fp32 tolerance of
    tests/test_rollout_continuous.py (1e-4), greedy tokens equal to the reference's argmax."""
    base, adapters = three_adapters
    engine = EmbeddedEngine(model=copy.deepcopy(base).cuda())
    assert engine.cuda_graph and engine.compile_decode and engine.fast_decode
    for name, (tensors, cfg) in adapters.items():
        engine.add_lora_adapter(name, tensors, cfg)
    steps = []
    run = _fast_decode.FastStatic.run
    monkeypatch.setattr(_fast_decode.FastStatic, "run", lambda self, *a, **k: steps.append(k.get("lora", a[-1]))
                        or run(self, *a, **k))
    refs = {name: merged_fp64(base, *adapters[name]) for name in adapters}
    refs[None] = copy.deepcopy(base).double()
    order = ["b", None, "c", "a", "a"]
    reqs = [GenerateRequest(tuple(PROMPTS[i % len(PROMPTS)]), lora_adapter=a) for i, a in enumerate(order)]
    for params in (PARAMS, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)):
        steps.clear()
        results = engine.generate(reqs, params)
        assert len(steps) == 1 and steps[0] is not None  # one fast-path batch, with the adapters' factors
        for r in results:
            req = reqs[r.prompt_index]
            t = params.temperature or 1.0
            want = reference_logprobs(refs[req.lora_adapter], req.prompt_token_ids, r.token_ids, t)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
            if params.greedy:
                ids = torch.tensor([list(req.prompt_token_ids) + list(r.token_ids)])
                with torch.no_grad():
                    logits = refs[req.lora_adapter](input_ids=ids).logits[0, len(req.prompt_token_ids) - 1:-1]
                assert list(r.token_ids) == logits.argmax(-1).tolist()
