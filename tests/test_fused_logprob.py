"""The fused (hidden-state, chunked) logprob path, ferrule.megatron.fused_logprob, and the CPU-checkable
parts of the opt-in CUDA train paths (ferrule.megatron.gpu_fusions).

Referees: a float64 ``log_softmax`` of the explicit logits and float64 autograd for the gradients
(unit level); the engine's plain logits path and HF transformers (engine level, fp32, CPU). The
TP=2 case (vocab-parallel reductions) runs in tests/dist/train_engine_worker.py's launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM  # noqa: F401  (import before ferrule's CPU patches)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402

from ferrule.megatron.engine import OptimizerSettings, TrainEngine  # noqa: E402
from ferrule.megatron.fused_logprob import linear_logprobs  # noqa: E402
from ferrule.megatron.parallel import ParallelLayout  # noqa: E402

T, H, V_PADDED, VOCAB = 23, 16, 40, 37  # 3 padded rows, a token count no chunk size divides


def _reference(hidden, weight, labels, g):
    h = hidden.detach().double().requires_grad_()
    wt = weight.detach().double().requires_grad_()
    lp = torch.log_softmax(h @ wt[:VOCAB].t(), -1).gather(1, labels[:, None])[:, 0]
    (lp * g.double()).sum().backward()
    return lp.detach(), h.grad, wt.grad


@pytest.mark.parametrize("chunk", [1, 5, 23, 4096])
def test_linear_logprobs_match_float64_reference(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen, requires_grad=True)
    weight = torch.randn(V_PADDED, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, VOCAB, (T,), generator=gen)
    g = torch.randn(T, generator=gen)  # an arbitrary upstream gradient (RL losses are non-linear)
    lp = linear_logprobs(hidden, weight, labels, VOCAB, chunk_tokens=chunk)
    (lp * g).sum().backward()
    ref_lp, ref_h, ref_w = _reference(hidden, weight, labels, g)
    assert lp.dtype == torch.float32 and lp.shape == (T,)
    assert float((lp.double() - ref_lp).abs().max()) <= 1e-5
    assert float((hidden.grad.double() - ref_h).abs().max()) <= 1e-5
    assert float((weight.grad.double() - ref_w).abs().max()) <= 1e-5
    assert float(weight.grad[VOCAB:].abs().max()) == 0.0  # padded rows get no gradient


@pytest.mark.parametrize("chunk", [5, 4096])
def test_linear_logprobs_accumulate_into_main_grad(chunk):
    """With ``main_grad`` the weight gradient is added into that fp32 buffer (on top of what it
    holds) and none goes through autograd; fp32 and bf16 weights against the float64 reference."""
    from ferrule.megatron.gpu_fusions import wgrad_accumulate

    gen = torch.Generator().manual_seed(1)
    g = torch.randn(T, generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        hidden = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
        weight = torch.randn(V_PADDED, H, generator=gen).to(dtype).requires_grad_()
        labels = torch.randint(0, VOCAB, (T,), generator=gen)
        prior = torch.randn(V_PADDED, H, generator=gen)
        main_grad = prior.clone()
        lp = linear_logprobs(hidden, weight, labels, VOCAB, chunk_tokens=chunk, main_grad=main_grad)
        (lp * g).sum().backward()
        ref_lp, ref_h, ref_w = _reference(hidden, weight, labels, g)
        assert weight.grad is None
        assert float((main_grad.double() - prior.double() - ref_w).abs().max()) <= tol * max(1.0, float(ref_w.abs().max()))
        assert torch.equal(main_grad[VOCAB:], prior[VOCAB:])  # padded rows untouched
        assert float((hidden.grad.double() - ref_h).abs().max()) <= tol * max(1.0, float(ref_h.abs().max()))
    # the helper on its own: same dtype (addmm_) and bf16 operands into an fp32 buffer
    a, b = torch.randn(7, 3, generator=gen), torch.randn(7, 4, generator=gen)
    acc = torch.ones(3, 4)
    wgrad_accumulate(acc, a, b)
    assert float((acc - 1 - a.t() @ b).abs().max()) <= 1e-6
    acc = torch.ones(3, 4)
    wgrad_accumulate(acc, a.bfloat16(), b.bfloat16())
    assert acc.dtype == torch.float32
    assert float((acc - 1 - a.bfloat16().double().t() @ b.bfloat16().double()).abs().max()) <= 2e-2
    with pytest.raises(ValueError, match="main_grad"):
        linear_logprobs(hidden, weight, labels, VOCAB, main_grad=torch.zeros(3, 3))


def test_linear_logprobs_reject_bad_shapes():
    with pytest.raises(ValueError, match="hidden"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), 5, chunk_tokens=0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return w.make_hf_dir(tmp_path_factory.mktemp("fused") / "qwen2")


def _grads(engine):
    return {n: p.main_grad.detach().clone() for n, p in engine.model[0].module.named_parameters()}


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_engine_fused_path_equals_plain_path(hf_dir, loss):
    """Same logprobs (1e-6) and gradients (1e-5 relative) as the plain logits path, with a
    non-linear loss too, and the padded vocabulary (96 -> 128 rows) excluded."""
    batch = w.make_batch(seed=5, loss=loss)
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} if loss == "ppo" else None
    results = {}
    for fused in (False, True):
        e = TrainEngine.from_hf(hf_dir, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR))
        assert e.fused_logprobs is False  # the CPU default stays the exact plain path
        e.fused_logprobs = fused
        out = e.forward_backward(batch, loss, cfg)
        results[fused] = ([o["logprobs"] for o in out.loss_fn_outputs], _grads(e), e.forward_logprobs(batch))
    for a, b in zip(results[False][0], results[True][0]):
        assert float((a - b).abs().max()) <= 1e-6
    for a, b in zip(results[False][2], results[True][2]):
        assert float((a - b).abs().max()) <= 1e-6
    for n, ga in results[False][1].items():
        gb = results[True][1][n]
        assert float((ga - gb).abs().max()) <= 1e-5 * max(float(ga.abs().max()), 1e-12), n


@pytest.mark.parametrize("fused", [False, True])
def test_packed_sequences_equal_padded_microbatches(hf_dir, monkeypatch, fused):
    """Megatron's ``thd`` packing (data concatenated in one row, attention within each datum,
    positions restarting per datum) gives the padded layout's logprobs and gradients (fp32)."""
    batch = w.make_batch(seed=6, loss="ppo")
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    results = {}
    from ferrule.engine_settings import TrainEngineSettings

    for packed in ("0", "1"):
        e = TrainEngine.from_hf(hf_dir, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR),
                                max_tokens_per_microbatch=40,
                                settings=TrainEngineSettings(packed_sequences=packed == "1"))
        assert e.packed_sequences is (packed == "1")
        e.fused_logprobs = fused
        out = e.forward_backward(batch, "ppo", cfg)
        results[packed] = ([o["logprobs"] for o in out.loss_fn_outputs], _grads(e), e.forward_logprobs(batch))
    for a, b in zip(results["0"][0] + results["0"][2], results["1"][0] + results["1"][2]):
        assert float((a - b).abs().max()) <= 1e-5
    for n, ga in results["0"][1].items():
        gb = results["1"][1][n]
        assert float((ga - gb).abs().max()) <= 1e-5 * max(float(ga.abs().max()), 1e-12), n


def test_packed_microbatch_planning_counts_real_tokens():
    from ferrule.megatron.batching import pack_microbatches

    lengths = [5, 9, 3, 12, 7, 4, 10, 6]
    mbs = pack_microbatches(range(8), lengths, 20, packed=True)
    assert mbs == [[0, 1, 2], [3, 4], [5, 6, 7]]  # 17, 19, 20 real tokens; arrival order kept


def test_lean_activations_are_bit_identical_and_save_less(hf_dir):
    """The lean-activation recomputes (norm outputs, compact V; the SwiGLU one needs megatron's
    compiled SwiGLU, on the GPU) leave logprobs and gradients bit-identical and save fewer bytes
    for backward (counted with saved-tensor hooks)."""
    from ferrule.megatron.gpu_fusions import enable_lean_activations

    batch = w.make_batch(seed=7, loss="ppo")
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU attention backward sums across threads in no fixed order (CI runs 2)
    try:
        _lean_runs(hf_dir, batch, cfg, results, enable_lean_activations)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(results[False][0], results[True][0]):
        assert torch.equal(a, b)
    for n, ga in results[False][1].items():
        assert torch.equal(ga, results[True][1][n]), n
    assert results[True][2] < results[False][2], (results[True][2], results[False][2])


def _lean_runs(hf, batch, cfg, results, enable_lean_activations):
    for lean in (False, True):
        e = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR))
        if lean:
            assert enable_lean_activations(e.model) == ["compact_v", "norms"]
        saved, held = {}, []

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in saved:
                saved[storage.data_ptr()] = storage.nbytes()
                # held until the count is taken: once a micro-batch's backward freed a storage, the allocator could
                # give its address to a later one, which the count by address would then miss (a CI run counted
                # the lean run 142 bytes over the plain one that way)
                held.append(storage)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = e.forward_backward(batch, "ppo", cfg)
        params = {p.untyped_storage().data_ptr() for p in e.model[0].parameters()}
        results[lean] = ([o["logprobs"] for o in out.loss_fn_outputs], _grads(e),
                         sum(n for k, n in saved.items() if k not in params))


def test_foreach_optimizer_helpers_match_megatron_fallbacks():
    """The multi-tensor stand-ins for megatron's no-Apex grad-norm and scale helpers (used on CUDA
    with ``train_engine.fused_adam``): the scale / copy bit-identical, the norm within fp32 rounding
    of a float64 reference."""
    from megatron.core import utils as mutils

    from ferrule.megatron.gpu_fusions import _foreach_l2_norm, _foreach_scale

    gen = torch.Generator().manual_seed(4)
    ts = [torch.randn(n, generator=gen) for n in (5, 1000, 37, 1)]
    norm, _ = _foreach_l2_norm(0, None, [ts], False)
    ref = torch.cat([t.double() for t in ts]).norm()
    assert norm.shape == (1,) and abs(float(norm) - float(ref)) <= 1e-6 * float(ref)
    for scale in (1.0, 0.37):
        for cast in (torch.float32, torch.bfloat16):
            ours = [torch.zeros_like(t, dtype=cast) for t in ts]
            theirs = [torch.zeros_like(t, dtype=cast) for t in ts]
            _foreach_scale(0, None, [ts, ours], scale)
            mutils.local_multi_tensor_scale(0, None, [ts, theirs], scale)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        inplace = [t.clone() for t in ts]
        _foreach_scale(0, None, [inplace, inplace], scale)
        assert all(torch.equal(a, t * scale) for a, t in zip(inplace, ts))


def test_linear_logprobs_expected_grad_formed_in_forward():
    """``expected_grad`` + ``main_grad``: the gradients are formed in the forward pass; when the
    upstream gradient is the expected one the result is bit-identical to the recompute path, and
    when it is not, the difference is applied by linearity (float64 reference)."""
    gen = torch.Generator().manual_seed(2)
    hidden0 = torch.randn(T, H, generator=gen)
    weight0 = torch.randn(V_PADDED, H, generator=gen)
    labels = torch.randint(0, VOCAB, (T,), generator=gen)
    expected = -torch.rand(T, generator=gen)

    def run(upstream, expected_grad):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        main_grad = torch.zeros(V_PADDED, H)
        lp = linear_logprobs(hidden, weight, labels, VOCAB, chunk_tokens=5, main_grad=main_grad,
                             expected_grad=expected_grad)
        (lp * upstream).sum().backward()
        return lp.detach(), hidden.grad, main_grad

    plain = run(expected, None)
    pre = run(expected, expected)
    for a, b in zip(plain, pre):
        assert torch.equal(a, b)
    other = expected * 2 + 0.1 * torch.randn(T, generator=gen)  # not what the forward pass assumed
    lp, gh, gw = run(other, expected)
    ref_lp, ref_h, ref_w = _reference(hidden0, weight0, labels, other)
    assert float((lp.double() - ref_lp).abs().max()) <= 1e-5
    assert float((gh.double() - ref_h).abs().max()) <= 1e-5
    assert float((gw.double() - ref_w).abs().max()) <= 1e-5
    with torch.no_grad():  # no backward will follow: nothing is written into main_grad
        mg = torch.zeros(V_PADDED, H)
        linear_logprobs(hidden0, weight0, labels, VOCAB, main_grad=mg, expected_grad=expected)
        assert float(mg.abs().max()) == 0.0
    with pytest.raises(ValueError, match="expected_grad"):
        linear_logprobs(hidden0, weight0, labels, VOCAB, expected_grad=torch.zeros(3))


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_engine_fused_path_into_main_grad_equals_plain_path(hf_dir, loss):
    """The fused path writing the output weight's gradient into ``main_grad`` (CUDA's
    ``grad_accum_fusion``; for cross entropy formed in the forward pass) gives the plain path's
    logprobs and gradients (fp32, CPU)."""
    batch = w.make_batch(seed=8, loss=loss)
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} if loss == "ppo" else None
    results = {}
    for mode in ("plain", "fused_main_grad"):
        e = TrainEngine.from_hf(hf_dir, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR))
        if mode != "plain":
            e.fused_logprobs, e.grad_accum_fusion = True, True
        out = e.forward_backward(batch, loss, cfg)
        results[mode] = ([o["logprobs"] for o in out.loss_fn_outputs], _grads(e))
    for a, b in zip(results["plain"][0], results["fused_main_grad"][0]):
        assert float((a - b).abs().max()) <= 1e-6
    for n, ga in results["plain"][1].items():
        gb = results["fused_main_grad"][1][n]
        assert float((ga - gb).abs().max()) <= 1e-5 * max(float(ga.abs().max()), 1e-12), n


def test_grad_accum_fusion_wiring_equals_plain_path_on_cpu(hf_dir, monkeypatch):
    """megatron's ``gradient_accumulation_fusion`` with ferrule's stand-in for Apex's wgrad kernel
    (and the fused logprobs into ``main_grad``, lean activations) gives the plain path's gradients,
    accumulated over two fb calls (fp32, CPU; megatron allocates its dummy weight gradient on the
    current CUDA device, pointed at the CPU here)."""
    from ferrule.megatron.gpu_fusions import enable_grad_accum_fusion, enable_lean_activations

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    res = {}
    for mode in ("plain", "fused"):
        e = TrainEngine.from_hf(hf_dir, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR))
        if mode == "fused":
            assert enable_grad_accum_fusion(e.model) == 9  # 2 layers x (qkv, proj, fc1, fc2) + output layer
            assert enable_lean_activations(e.model) == ["compact_v", "norms"]
            e.grad_accum_fusion = e.fused_logprobs = True
        for seed, loss in ((8, "ppo"), (9, "cross_entropy")):
            e.forward_backward(w.make_batch(seed=seed, loss=loss), loss, cfg if loss == "ppo" else None)
        res[mode] = (_grads(e), e.optim_step()["grad_norm"])
    for n, ga in res["plain"][0].items():
        gb = res["fused"][0][n]
        assert float((ga - gb).abs().max()) <= 1e-5 * max(float(ga.abs().max()), 1e-12), n
    assert abs(res["plain"][1] - res["fused"][1]) <= 1e-5 * res["plain"][1]
