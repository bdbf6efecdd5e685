"""Where ``ferrule serve`` computes (issue 46): the sampler on the training device in its dtype
(bfloat16 on CUDA, float32 on CPU, or ``--sampler-dtype``), the worker's own torch thread count.

The CPU checks are in-process and cheap; the CUDA one (gpu marker) builds a tiny base's sampler on
the GPU and compares its logprobs with HF transformers in float32 on the CPU."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))


def test_sampler_placement_follows_the_device_and_refuses_unknown_dtypes():
    from ferrule.serve.placement import sampler_placement

    assert sampler_placement("auto", device="cuda").as_json() == {"device": "cuda", "dtype": "bfloat16"}
    assert sampler_placement(None, device="cpu").as_json() == {"device": "cpu", "dtype": "float32"}
    assert sampler_placement("fp32", device="cuda").torch_dtype is torch.float32
    assert sampler_placement("torch.float16", device="cuda").dtype == "float16"
    with pytest.raises(ValueError, match=r"--sampler-dtype 'int8' is not one of auto, bfloat16"):
        sampler_placement("int8")
    if not torch.cuda.is_available():   # this machine: the CPU, in float32
        assert sampler_placement().as_json() == {"device": "cpu", "dtype": "float32"}


class _Store:
    def __init__(self):
        self.results = {}

    def complete(self, request_id, content_type, body):
        self.results[request_id] = body

    def fail(self, request_id, message, category):
        self.results[request_id] = message


def test_the_worker_sets_its_own_thread_count_and_no_other_threads():
    from ferrule.serve.scheduler import Job, Scheduler, json_body

    before = torch.get_num_threads()
    store = _Store()
    sched = Scheduler(store, threads=1)
    try:
        job = Job("r1", "probe", "t", lambda: json_body(torch.get_num_threads()))
        sched.submit(job)
        ev = sched.event("r1")
        assert ev is not None and ev.wait(30)
        assert store.results["r1"] == b"1"
        assert torch.get_num_threads() == before   # this thread's count is its own
    finally:
        sched.shutdown()
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="--worker-threads 0"):
        Scheduler(store, threads=0)


def test_cli_refuses_an_unknown_sampler_dtype_before_loading(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ferrule.cli import app

    keys = tmp_path / "keys"
    keys.write_text("tml-placement-1 alice\n")
    missing = tmp_path / "not-loaded"   # never opened: the dtype is refused first
    (missing / "config.json").parent.mkdir()
    (missing / "config.json").write_text("{}")
    r = CliRunner().invoke(app, ["serve", "--base-model", str(missing), "--api-keys", str(keys),
                                 "--storage", str(tmp_path / "s"), "--sampler-dtype", "int8"])
    assert r.exit_code == 2, r.output
    assert "--sampler-dtype 'int8'" in r.output and "Traceback" not in r.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampler_runs_on_the_gpu_in_bfloat16(tmp_path):
    """On a CUDA machine the served sampler is on the GPU in bfloat16 with the fast decode path, and its
    prompt logprobs match HF transformers (float32, CPU) within bfloat16's rounding."""
    import math

    import train_engine_worker as w
    from transformers import Qwen2ForCausalLM

    from ferrule.rollout.base import SamplingParams
    from ferrule.serve.backend import EngineBackend, SampleSpec

    base = w.make_hf_dir(tmp_path / "tiny-qwen2")
    backend = EngineBackend(base, model_name="tiny")
    info = backend.sampler_info()
    assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16" and info["loaded"], info
    assert info["fast_decode"] and info["cuda_graph"], info
    from ferrule.serve.routes_session import cuda_memory

    mem = cuda_memory()   # /api/v1/healthz's "cuda_memory": at least the sampler's own weights, counted by hand
    held = sum(p.numel() * p.element_size() for p in backend.rollout.model.parameters() if p.is_cuda)
    assert mem is not None and mem["max_allocated"] >= mem["allocated"] >= held > 0, (mem, held)
    prompt = [3, 17, 42, 5, 88, 9, 61]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=7)
    ((seqs, prompt_lp, _),) = backend.sample(None, [SampleSpec(prompt, 2, params, True)])
    assert len(seqs) == 2 and all(1 <= len(toks) <= 8 and len(lps) == len(toks) for toks, lps, _ in seqs)
    assert all(0 <= t < w.VOCAB and math.isfinite(lp) and lp <= 0 for toks, lps, _ in seqs for t, lp in zip(toks, lps))
    hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].double(), -1)
    ref = ref.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    err = (torch.tensor(prompt_lp[1:], dtype=torch.float64) - ref).abs().max().item()
    assert err < 5e-2, err   # bfloat16 weights and activations (8 mantissa bits) vs float32
    fp32 = EngineBackend(base, model_name="tiny32", sampler_dtype="float32")
    assert fp32.sampler_info()["dtype"] == "float32"
    ((_, lp32, _),) = fp32.sample(None, [SampleSpec(prompt, 1, SamplingParams(max_new_tokens=1, n=1), True)])
    assert (torch.tensor(lp32[1:], dtype=torch.float64) - ref).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_merged_sampler_weights_on_the_gpu_equal_the_float64_cpu_merge(tmp_path):
    """A GPU client's merged sampler weights (``--sampler-checkpoints merged``, or an adapter batched decode
    cannot serve) are merged on the GPU in float64 (:func:`ferrule.serve.merge.merged_hf_state`): equal to the
    same merge on the CPU up to the float64 sums' order, so after rounding to the weights' dtype every element
    is within one unit in the last place, and all but a negligible share (rounding ties) are bit-identical."""
    import train_engine_worker as w

    from ferrule.serve.backend import EngineBackend
    from ferrule.serve.merge import merged_hf_state

    backend = EngineBackend(w.make_hf_dir(tmp_path / "tiny-qwen2"), model_name="tiny", eager=False,
                            sampler_checkpoints="merged")
    backend.create("m", backend.lora_settings({"rank": 4}))
    engine = backend.engines["m"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # a non-zero adapter (fresh LoRA B is zero)
        for p in engine.model[0].parameters():
            if p.requires_grad:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    base = {k: v.detach().cpu().clone() for k, v in engine.export_hf_state()}
    assert any(v.is_cuda for _, v in engine.export_hf_state())   # the client's weights are on the GPU
    gpu = backend.sampler_tensors("m")                     # the service's merge: on the engine's device
    cpu = merged_hf_state(engine, *backend._merge_layout, device="cpu")
    assert sorted(gpu) == sorted(cpu) and all(v.device.type == "cpu" for v in gpu.values())
    moved = differ = total = 0
    for k, ref in cpu.items():
        got = gpu[k]
        assert got.dtype == ref.dtype == base[k].dtype, k
        ulp = torch.finfo(ref.dtype).eps * ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny)
        assert bool(((got.double() - ref.double()).abs() <= ulp).all()), k
        differ += int((got != ref).sum())
        moved += int((ref != base[k]).sum())
        total += ref.numel()
    print(f"GPU vs CPU float64 merge: {differ} of {total} elements differ (by 1 ulp); {moved} changed by the adapter")
    assert moved > total // 10 and differ <= max(1, total // 10_000)
