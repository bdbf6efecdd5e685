"""``ferrule train`` GRPO on a tiny random Inkling with the shipped example config (CPU).

Config: ``examples/configs/inkling_tiny.yaml`` (family inkling_text, embedded rollout running
``InklingForCausalLM``, reward = share of the response's characters that are "7",
:func:`ferrule_examples.inkling_synthetic.target_token_share`). A near-uniform random policy
starts at ~0.02; measured on 2 CPU cores (2026-11-30): 0.65 at step 15, 0.97 at step 21, 1.0 from
step 26. Independent checks: rewards recomputed here from the logged responses; rollout weights
verified equal to the trained weights after every sync (``check_weight_update_equal``); resume
compared with an uninterrupted run, metric by metric, for this config and for
``examples/configs/inkling2_tiny.yaml`` (the same task on a tiny random Inkling-2, family inkling2_text;
its reward curve is in docs/results.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# transformers' modeling code must be imported before ferrule's megatron CPU patches
from transformers import GenerationMixin, Inkling2ForCausalLM, InklingForCausalLM  # noqa: F401

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "configs" / "inkling_tiny.yaml"
CONFIG2 = REPO / "examples" / "configs" / "inkling2_tiny.yaml"
STEPS = 20            # the issue allows 40; the measured run passes 0.5 by step 15
WINDOW = 3
TIMING = re.compile(r"^(time.*|.*_per_s|memory_.*|mfu)$")  # timings, memory and mfu (from time) vary run to run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ferrule_examples.inkling_synthetic import build_tiny_inkling

    return build_tiny_inkling(tmp_path_factory.mktemp("inkling_rl"))


@pytest.fixture(scope="module")
def assets2(tmp_path_factory):
    from ferrule_examples.inkling2_synthetic import build_tiny_inkling2

    return build_tiny_inkling2(tmp_path_factory.mktemp("inkling2_rl"))


def _overrides(assets: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", f"train.steps={steps}", "logging.plot_at_end=false"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_reward_rises_above_half(assets, tmp_path):
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    run_dir = tmp_path / "run"
    train(load_config(CONFIG, _overrides(assets, run_dir, STEPS)), check_weight_update_equal=True)
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    rewards = [e["reward_mean"] for e in entries]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert first < 0.2 and last > 0.5, f"reward did not rise above 0.5: {rewards}"
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # the reward is what it claims: share of '7' among the response characters
        text = s["response"]
        assert s["reward"] == pytest.approx(text.count("7") / len(text) if text else 0.0, abs=1e-12), s
    # train vs rollout logprobs of the sampled tokens after each sync (fp32)
    diffs = [e["train_rollout_logprob_abs_diff"] for e in entries]
    assert max(diffs) <= 1e-5, diffs
    assert entries[-1]["weights_version"] == STEPS


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config, assets_fixture", [(CONFIG, "assets"), (CONFIG2, "assets2")], ids=["inkling", "inkling2"])
def test_resume_is_bit_identical(config, assets_fixture, request, tmp_path):
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    assets = request.getfixturevalue(assets_fixture)

    steps, stop_at = 4, 2
    full, split = tmp_path / "full", tmp_path / "split"
    train(load_config(config, _overrides(assets, full, steps)))
    first = train(load_config(config, _overrides(assets, split, steps)), stop_after=stop_at)
    assert first.interrupted and first.last_step == stop_at
    second = train(load_config(config, _overrides(assets, split, steps) + ["checkpoint.resume=true"]))
    assert second.start_step == stop_at and second.last_step == steps
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    strip = [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in a]
    assert strip == [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in b]
    assert (full / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
    assert len({e["reward_mean"] for e in a}) > 1
