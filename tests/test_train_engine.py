"""TrainEngine (ferrule.megatron.engine) on tiny random Qwen models, CPU + gloo, fp32.

Referees: HF transformers (logprobs), torch.optim.Adam on a copy (per-call lr), a float64 loss
reference written here from the Tinker loss formulas, and the engine itself under a different
call split / a fresh process (bit-identical invariants). World size 1 runs in this process;
every 2-process check (DP=2, DP=2 + distributed optimizer, TP=2, DP=2 resume) runs in ONE
torchrun launch (tests/dist/train_engine_worker.py) whose JSON results are asserted here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402

from ferrule.megatron.engine import Datum, OptimizerSettings, TrainEngine  # noqa: E402
from ferrule.megatron.parallel import ParallelLayout  # noqa: E402

HF_ATOL = 1e-5
LOSS_ATOL = 1e-6
HF_CLASSES = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_engine")
    return {f: w.make_hf_dir(root / f, family=f) for f in ("qwen2", "qwen3")}


def main_grads(engine) -> dict:
    return {n: p.main_grad.detach().clone() for n, p in engine.model[0].module.named_parameters()}


def engine_for(hf_dir, **opt) -> TrainEngine:
    return TrainEngine.from_hf(hf_dir, ParallelLayout(), optimizer=OptimizerSettings(**{"lr": w.LR, **opt}))


def test_split_invariance_world_size_1(hf_dirs):
    res = w.split_invariance(hf_dirs["qwen2"], ParallelLayout())
    assert res["identical"], res


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_logprobs_equal_forward_and_hf(hf_dirs, family):
    engine = engine_for(hf_dirs[family])
    batch = w.make_batch(seed=3)
    out = engine.forward_backward(batch, "cross_entropy")
    fwd = engine.forward_logprobs(batch)
    hf = HF_CLASSES[family].from_pretrained(hf_dirs[family], dtype=torch.float32).eval()
    with torch.no_grad():
        for d, o, lp in zip(batch, out.loss_fn_outputs, fwd):
            assert torch.equal(o["logprobs"], lp)
            ref = torch.log_softmax(hf(torch.tensor([d.model_input])).logits[0].double(), -1)
            ref = ref.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0]
            assert float((ref - lp.double()).abs().max()) <= HF_ATOL


def _ref_loss(name: str, t: float, x: dict, cfg: dict) -> float:
    """Float64 per-token loss (Tinker docs formulas; PPO: Schulman 2017; CISPO: MiniMax-M1)."""
    w_ = x.get("weights", 1.0)
    if name == "cross_entropy":
        return -w_ * t
    q, a = x["logprobs"], x["advantages"]
    r = math.exp(t - q)
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if name == "importance_sampling":
        return w_ * (-r * a)
    if name == "ppo":
        return w_ * -min(r * a, min(max(r, lo), hi) * a)
    if name == "cispo":
        return w_ * -(min(max(r, lo), hi) * a * t)
    return w_ * -(t * a - 0.5 * cfg.get("beta", 0.05) * (t - q) ** 2)  # dro


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_loss_values_match_float64_reference(hf_dirs, loss):
    engine = engine_for(hf_dirs["qwen2"])
    cfg = {"dro": {"beta": 0.1}, "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}.get(loss, {})
    batch = w.make_batch(seed=5, loss=loss)
    out = engine.forward_backward(batch, loss, cfg)
    total = 0.0
    for d, o in zip(batch, out.loss_fn_outputs):
        x = {k: v.double().tolist() for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        ref = [_ref_loss(loss, t, {k: v[i] for k, v in x.items()}, cfg) for i, t in enumerate(o["logprobs"].double().tolist())]
        assert max(abs(a - b) for a, b in zip(ref, o["elementwise_loss"].double().tolist())) <= LOSS_ATOL
        total += sum(ref)
    assert out.metrics["loss:sum"] == pytest.approx(total, abs=1e-5)
    assert out.metrics["tokens:sum"] == sum(len(d.model_input) for d in batch)


def test_per_request_loss_selection_in_one_window(hf_dirs):
    ce, rl = w.make_batch(seed=7), w.make_batch(seed=8, loss="ppo")
    a = engine_for(hf_dirs["qwen2"])
    out_ce = a.forward_backward(ce, "cross_entropy")
    out_ppo = a.forward_backward(rl, "ppo")
    together = main_grads(a)
    b = engine_for(hf_dirs["qwen2"])
    b.forward_backward(ce, "cross_entropy")
    g1 = main_grads(b)
    b.zero_grad()
    out_ppo_b = b.forward_backward(rl, "ppo")
    g2 = main_grads(b)
    assert any(float(g.abs().max()) > 0 for g in g2.values())
    # equal up to fp32 summation order: (g1 + p1) + p2 ... vs g1 + (p1 + p2 ...) per micro-batch
    for name in together:
        torch.testing.assert_close(together[name], g1[name] + g2[name], rtol=1e-5, atol=1e-6, msg=name)
    # the ppo call saw the pre-step weights (no step happened between the calls)
    for o, ob in zip(out_ppo.loss_fn_outputs, out_ppo_b.loss_fn_outputs):
        assert torch.equal(o["logprobs"], ob["logprobs"])
    assert "loss:sum" in out_ce.metrics and "clipped_tokens:sum" in out_ppo.metrics


def test_per_call_lr_matches_torch_adam_and_leaves_scheduler(hf_dirs):
    engine = engine_for(hf_dirs["qwen2"], clip_grad=0.0, lr_decay_style="linear", lr_decay_steps=10)
    engine.forward_backward(w.make_batch(), "cross_entropy")
    params = dict(engine.model[0].module.named_parameters())
    grads = main_grads(engine)
    copies = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    ref = torch.optim.Adam(list(copies.values()), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for n, c in copies.items():
        c.grad = grads[n].clone()
    ref.step()
    lr_before = [g["lr"] for g in engine.optimizer.param_groups]
    res = engine.optim_step(learning_rate=3e-3)
    assert res["success"] and res["learning_rate"] == 3e-3
    for n, p in params.items():
        assert torch.equal(p.detach(), copies[n].detach()), n
    assert engine.scheduler.num_steps == 0
    assert [g["lr"] for g in engine.optimizer.param_groups] == lr_before == [w.LR] * len(lr_before)
    engine.forward_backward(w.make_batch(seed=2), "cross_entropy")
    res = engine.optim_step()  # scheduled lr: used, then the scheduler advances
    assert res["learning_rate"] == w.LR and engine.scheduler.num_steps == 1 and engine.step == 2


def test_nonfinite_gradients_skip_the_step(hf_dirs):
    engine = engine_for(hf_dirs["qwen2"])
    before = w.weights(engine)
    batch = w.make_batch()
    for d in batch:
        d.loss_fn_inputs["weights"] = torch.full_like(d.loss_fn_inputs["weights"], 3e38)  # finite input, inf grads
    engine.forward_backward(batch, "cross_entropy")
    res = engine.optim_step()
    assert res["success"] is False and not math.isfinite(res["grad_norm"])
    assert w.same(w.weights(engine), before) and engine.step == 0 and engine.adam_step() == 0
    assert engine.scheduler.num_steps == 0
    assert all(float(g.abs().max()) == 0 for g in main_grads(engine).values())
    _, after, _ = w.split_run(hf_dirs["qwen2"], ParallelLayout(), (8,))
    engine.forward_backward(w.make_batch(), "cross_entropy")
    engine.optim_step()
    assert w.same(w.weights(engine), after)


def test_bad_input_is_rejected_before_any_gradient(hf_dirs):
    engine = engine_for(hf_dirs["qwen2"])
    good = w.make_batch()

    def variant(i, **changes):
        d = Datum(list(good[i].model_input), dict(good[i].loss_fn_inputs))
        for k, v in changes.items():
            if k == "model_input":
                d.model_input = v
            else:
                d.loss_fn_inputs[k] = v
        return good[:i] + [d] + good[i + 1:]

    n = len(good[2].model_input)
    cases = [
        ((variant(2, model_input=[w.VOCAB] * n), "cross_entropy"), "outside"),
        ((variant(2, target_tokens=torch.full((n,), w.VOCAB + 3)), "cross_entropy"), "vocab_size"),
        ((variant(2, weights=torch.ones(n + 1)), "cross_entropy"), "shape"),
        ((variant(2, model_input=[1] * (n - 1)), "cross_entropy"), "token-aligned"),
        ((good, "not_a_loss"), "unknown loss_fn"),
        (([], "cross_entropy"), "empty batch"),
        ((w.make_batch(loss="ppo")[:3] + [Datum([1, 2], {"target_tokens": torch.tensor([3, 4]),
                                                         "logprobs": torch.zeros(2),
                                                         "advantages": torch.tensor([0.5, float("nan")])})], "ppo"),
         "not finite"),
    ]
    for (batch, loss), msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.forward_backward(batch, loss)
        assert all(float(g.abs().max()) == 0 for g in main_grads(engine).values())
    _, after, _ = w.split_run(hf_dirs["qwen2"], ParallelLayout(), (8,))
    engine.forward_backward(good, "cross_entropy")
    engine.optim_step()
    assert w.same(w.weights(engine), after)


def test_exact_resume_world_size_1(hf_dirs, tmp_path):
    opt = {"lr_decay_style": "linear", "lr_decay_steps": 20}
    a = engine_for(hf_dirs["qwen2"], **opt)
    w.train_steps(a, 2, seed0=10)
    a.save(tmp_path / "ckpt")
    cont_a = w.train_steps(a, 3, seed0=20)
    b = engine_for(hf_dirs["qwen2"], **opt)
    w.train_steps(b, 1, seed0=99)
    state = b.load(tmp_path / "ckpt")
    assert state["step"] == 2 and b.adam_step() == 2 and b.scheduler.num_steps == 2
    cont_b = w.train_steps(b, 3, seed0=20)
    assert cont_a == cont_b and cont_b[-1][2] == 5
    assert w.same(w.weights(a), w.weights(b))
    assert not list(tmp_path.glob(".ckpt.tmp-*")), "temporary checkpoint directory left behind"


@pytest.mark.timeout(200)
def test_two_process_checks_and_cross_dp_load(dist_pool, hf_dirs, tmp_path):
    os.symlink(hf_dirs["qwen2"], tmp_path / "qwen2")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = dist_pool.run([str(REPO / "tests" / "dist" / "train_engine_worker.py"), str(tmp_path)],
                         timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "results.json").read_text())
    ws1 = w.split_invariance(hf_dirs["qwen2"], ParallelLayout())["grad_norm"]
    for case in ("dp2", "dp2_distopt", "tp2"):
        assert r[case]["identical"], (case, r[case])
        # DP ranks' gradients are summed (not averaged); TP shards add up to the full norm
        assert r[case]["grad_norm"] == pytest.approx(ws1, rel=1e-6), case
    assert r["tp2_logprobs_vs_hf"]["max_abs_diff"] <= HF_ATOL and r["tp2_logprobs_vs_hf"]["fb_equals_forward"]
    fused = r["tp2_fused_logprobs"]
    assert fused["max_abs_diff_vs_hf"] <= HF_ATOL and fused["fb_close_to_forward"], fused
    assert fused["max_rel_grad_diff_vs_plain"] <= 1e-5, fused
    res = r["dp2_resume"]
    assert res["loaded_weights_identical"] and res["continuation_identical"] and res["weights_identical"]
    assert res["step"] == 4 and res["adam_step"] == 4
    # the DP=2 distributed-optimizer checkpoint loads at DP=1 (weights and Adam step exact)
    from safetensors.torch import load_file

    c = engine_for(hf_dirs["qwen2"], use_distributed_optimizer=True, lr_decay_style="linear", lr_decay_steps=20)
    c.load(tmp_path / "ckpt_dp2")
    assert w.same(w.weights(c), load_file(str(tmp_path / "ckpt_dp2_weights.safetensors")))
    assert c.step == 2 and c.adam_step() == 2 and c.scheduler.num_steps == 2
    cont = w.train_steps(c, 2, seed0=20)
    for mine, theirs in zip(cont, res["continuation"]):
        assert mine[0] == pytest.approx(theirs[0], rel=1e-5) and mine[1] == pytest.approx(theirs[1], rel=1e-5)
        assert mine[2] == theirs[2]


def test_entropy_bonus_uses_the_exact_entropy_of_the_logits(hf_dirs):
    """``entropy_coef`` > 0: the engine's ``entropy:mean`` is the float64 entropy of HF's logits at the
    trained positions, the loss drops by ``c * sum(w * H)``, and the gradient of the final norm
    weight changes by HF's float64 gradient of ``-c * sum(w * H)``."""
    coef, batch = 0.5, w.make_batch(seed=5, loss="ppo")
    for d in batch:
        d.loss_fn_inputs["weights"] = torch.full((len(d.model_input),), 0.01)
    runs = {}
    for c in (0.0, coef):
        engine = engine_for(hf_dirs["qwen2"])
        out = engine.forward_backward(batch, "ppo", {"entropy_coef": c} if c else None)
        runs[c] = (out, main_grads(engine)["decoder.final_layernorm.weight"])
    hf = Qwen2ForCausalLM.from_pretrained(hf_dirs["qwen2"], dtype=torch.float64)
    ent_sum, bonus = 0.0, torch.zeros((), dtype=torch.float64)
    for d in batch:
        logits = hf(torch.tensor([d.model_input])).logits[0]
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # [T] nats
        ent_sum += float(h.detach().sum())
        bonus = bonus - coef * (d.loss_fn_inputs["weights"].double() * h).sum()
    bonus.backward()
    tokens = sum(len(d.model_input) for d in batch)
    assert runs[coef][0].metrics["entropy:mean"] == pytest.approx(ent_sum / tokens, abs=1e-5)
    assert "entropy:mean" not in runs[0.0][0].metrics  # no entropy is computed without the bonus
    drop = runs[0.0][0].metrics["loss:sum"] - runs[coef][0].metrics["loss:sum"]
    assert drop == pytest.approx(-float(bonus.detach()), abs=1e-5)
    grad_diff = (runs[coef][1] - runs[0.0][1]).double()
    torch.testing.assert_close(grad_diff, hf.model.norm.weight.grad, rtol=1e-4, atol=1e-7)
