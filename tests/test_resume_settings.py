"""A resume uses the configured optimizer settings, not the checkpoint's (issue 9).

megatron-core's ``OptimizerParamScheduler.load_state_dict`` takes the checkpoint's lr, min_lr,
warmup, decay steps / style and weight decay over the configured ones, and torch's
``Optimizer.load_state_dict`` puts the saved betas / eps / weight decay / max_lr back into every
param group. ``ferrule train`` with cosine decay over ``train.steps=4``, resumed with
``train.steps=6``, then trained steps 5-6 at lr 0.0.

One checkpoint is saved after :data:`SAVED_STEPS` steps with :data:`BASE`; each case resumes
from it with one setting kind changed and trains two more steps. Referees, both independent of
megatron's scheduler: the lr of each step from the schedule formulas written out below
(linear warmup from 0, then cosine / linear decay to ``min_lr``; megatron's
``OptimizerParamScheduler.get_lr`` documents the same schedule), and the parameters after the
first resumed step from ``torch.optim.AdamW`` run on copies with the configured betas, eps,
weight decay and that lr, starting from the engine's Adam moments (checked on both resumed steps).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM  # noqa: F401  (HF modeling before ferrule's CPU patches)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402

from ferrule.megatron.engine import OptimizerSettings, TrainEngine  # noqa: E402
from ferrule.megatron.parallel import ParallelLayout  # noqa: E402

SAVED_STEPS = 4
BASE = dict(lr=1e-3, min_lr=1e-5, lr_warmup_steps=2, lr_decay_steps=8, lr_decay_style="cosine",
            weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=0.0)
#: one case per setting kind a checkpoint carries and a resume may change
CHANGES = {
    "lr": {"lr": 2e-3},
    "min_lr": {"min_lr": 2e-4},
    "warmup": {"lr_warmup_steps": 6},
    "decay_steps": {"lr_decay_steps": 12},
    "decay_style": {"lr_decay_style": "linear"},
    "weight_decay": {"weight_decay": 0.1},
    "betas": {"adam_beta1": 0.5, "adam_beta2": 0.99},
    "eps": {"adam_eps": 1e-4},
}


def scheduled_lr(n: int, s: dict) -> float:
    """lr after ``n`` scheduler steps: linear warmup from 0 over ``lr_warmup_steps``, then decay
    from ``lr`` to ``min_lr`` at step ``lr_decay_steps`` (cosine: half a cosine period)."""
    lr, lo, warm, decay = s["lr"], s["min_lr"], s["lr_warmup_steps"], s["lr_decay_steps"]
    if warm and n <= warm:
        return lr * n / warm
    if n > decay:
        return lo
    frac = (n - warm) / (decay - warm)
    if s["lr_decay_style"] == "cosine":
        return lo + (lr - lo) * (1 + math.cos(math.pi * frac)) / 2
    assert s["lr_decay_style"] == "linear"
    return lo + (lr - lo) * (1 - frac)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_settings")
    hf = w.make_hf_dir(root / "hf")
    engine = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(**BASE))
    lrs = []
    for i in range(SAVED_STEPS):
        engine.forward_backward(w.make_batch(seed=10 + i), "cross_entropy")
        lrs.append(engine.optim_step()["learning_rate"])
    assert lrs == pytest.approx([scheduled_lr(n, BASE) for n in range(SAVED_STEPS)], rel=1e-12)  # the referee
    engine.save(root / "ckpt")
    return hf, root / "ckpt"


def _adamw_reference(engine: TrainEngine, lr: float, s: dict) -> dict[int, torch.Tensor]:
    """One torch AdamW step on copies of the engine's params (current grads and Adam state)."""
    groups, copies = [], {}
    state = {}
    for opt in (o.optimizer for o in engine.optimizer.chained_optimizers):
        for g in opt.param_groups:
            params = []
            for p in g["params"]:
                c = p.detach().clone().requires_grad_(True)
                c.grad = p.main_grad.detach().clone()
                st = opt.state[p]
                state[c] = {"step": st["step"].clone(), "exp_avg": st["exp_avg"].clone(),
                            "exp_avg_sq": st["exp_avg_sq"].clone()}
                copies[id(p)] = c
                params.append(c)
            groups.append({"params": params, "weight_decay": s["weight_decay"] * g["wd_mult"]})
    ref = torch.optim.AdamW(groups, lr=lr, betas=(s["adam_beta1"], s["adam_beta2"]), eps=s["adam_eps"],
                            foreach=False)
    for c, st in state.items():
        ref.state[c] = st
    ref.step()
    return copies


@pytest.mark.parametrize("case", list(CHANGES))
def test_resume_uses_the_configured_setting(saved, case):
    hf, ckpt = saved
    settings = {**BASE, **CHANGES[case]}
    engine = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(**settings))
    state = engine.load(ckpt)
    assert engine.step == SAVED_STEPS and engine.adam_step() == SAVED_STEPS
    assert state["settings_changed"] == {k: [BASE[k], v] for k, v in CHANGES[case].items()}

    expected = [scheduled_lr(n, settings) for n in (SAVED_STEPS, SAVED_STEPS + 1)]
    assert expected != [scheduled_lr(n, BASE) for n in (SAVED_STEPS, SAVED_STEPS + 1)] or case in (
        "weight_decay", "betas", "eps")  # the lr cases would fail with the checkpoint's schedule

    for i, lr in enumerate(expected):
        engine.forward_backward(w.make_batch(seed=20 + i), "cross_entropy")
        reference = _adamw_reference(engine, lr, settings)
        res = engine.optim_step()
        assert res["learning_rate"] == pytest.approx(lr, rel=1e-12, abs=0)
        for p in (p for c in engine.model for p in c.module.parameters()):
            torch.testing.assert_close(p.detach(), reference[id(p)].detach(), rtol=1e-6, atol=1e-9)


def test_resume_with_the_same_settings_reports_no_change(saved):
    hf, ckpt = saved
    engine = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(**BASE))
    assert engine.load(ckpt)["settings_changed"] == {}
    engine.forward_backward(w.make_batch(seed=20), "cross_entropy")
    assert engine.optim_step()["learning_rate"] == pytest.approx(scheduled_lr(SAVED_STEPS, BASE), rel=1e-12, abs=0)


def test_distributed_optimizer_resume_uses_the_configured_settings(saved, tmp_path):
    """Same check through megatron's DistributedOptimizer (its own state-dict load path)."""
    hf, _ = saved
    base = {**BASE, "use_distributed_optimizer": True}
    engine = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(**base))
    for i in range(SAVED_STEPS):
        engine.forward_backward(w.make_batch(seed=10 + i), "cross_entropy")
        engine.optim_step()
    engine.save(tmp_path / "ckpt")

    changed = {"lr_decay_steps": 12, "adam_beta1": 0.5, "adam_eps": 1e-4, "weight_decay": 0.1}
    settings = {**base, **changed}
    resumed = TrainEngine.from_hf(hf, ParallelLayout(), optimizer=OptimizerSettings(**settings))
    assert resumed.load(tmp_path / "ckpt")["settings_changed"] == {k: [base[k], v] for k, v in changed.items()}
    groups = [g for o in resumed.optimizer.chained_optimizers for g in o.optimizer.param_groups]
    assert groups and all(g["betas"] == (0.5, 0.999) and g["eps"] == 1e-4 for g in groups)
    assert sorted({g["weight_decay"] / 0.1 for g in groups if g["wd_mult"]}) == [1.0]
    for n in (SAVED_STEPS, SAVED_STEPS + 1):
        resumed.forward_backward(w.make_batch(seed=20 + n), "cross_entropy")
        lr = resumed.optim_step()["learning_rate"]
        assert lr == pytest.approx(scheduled_lr(n, settings), rel=1e-12, abs=0)
