"""``ferrule train`` multimodal GRPO on a tiny random Inkling-2 (vision tower) with the shipped example config (CPU).

Config: ``examples/configs/inkling2_mm_tiny.yaml`` (family inkling2, TMLv0 prompts holding a
PIL-drawn picture and "how many squares?", exact-answer reward
:func:`ferrule.plugins.inkling.shapes.square_count_reward`; the task and a random
``Inkling2ForConditionalGeneration`` from :func:`ferrule.plugins.inkling2.shapes.build_inkling2_shapes_task`). Independent checks: the picture's
square count is re-counted from the PNG here (the answer is right), rewards are recomputed from the
logged responses, the rollout weights are verified equal to the trained weights after every sync
(``check_weight_update_equal``, the tower included), train vs rollout logprobs of the sampled tokens
agree to 1e-5, and a resumed run equals an uninterrupted one metric by metric. The 20-step run is
recorded in docs/families/inkling2.md; this test runs 4 steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# transformers' modeling code must be imported before ferrule's megatron CPU patches
from transformers import GenerationMixin, Inkling2ForConditionalGeneration  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "inkling2_mm_tiny.yaml"
TIMING = re.compile(r"^(time.*|.*_per_s|memory_.*|mfu)$")  # timings, memory and mfu (from time) vary run to run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ferrule.plugins.inkling2.shapes import build_inkling2_shapes_task

    return build_inkling2_shapes_task(tmp_path_factory.mktemp("inkling2_mm_rl"), prompts=8)


def _overrides(assets: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", f"train.steps={steps}", "train.prompts_per_step=2",
            "checkpoint.interval=2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multimodal_grpo_runs_and_resumes_bit_identical(assets, tmp_path):
    from ferrule.plugins.inkling.shapes import square_count_reward
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    steps, stop_at = 4, 2
    full, split = tmp_path / "full", tmp_path / "split"
    train(load_config(CONFIG, _overrides(assets, full, steps)), check_weight_update_equal=True)
    entries = read_metrics(full / "metrics.jsonl")
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    assert all(e["media_vision_parts"] == 2 and e["media_vision_tokens"] == 2 * 16 for e in entries)
    assert max(e["train_rollout_logprob_abs_diff"] for e in entries) <= 1e-5
    answers = {json.loads(ln)["id"]: json.loads(ln)["answer"] for ln in (assets / "task.jsonl").read_text().splitlines()}
    for s in (json.loads(ln) for ln in (full / "samples.jsonl").read_text().splitlines()):
        m = re.search(r"\d+", s["response"])
        assert s["reward"] == float(m is not None and m.group(0) == answers[s["prompt_id"]]), s
    assert square_count_reward("2 squares", type("P", (), {"answer": "2"})()) == 1.0

    first = train(load_config(CONFIG, _overrides(assets, split, steps)), stop_after=stop_at)
    assert first.interrupted and first.last_step == stop_at
    second = train(load_config(CONFIG, _overrides(assets, split, steps) + ["checkpoint.resume=true"]))
    assert second.start_step == stop_at and second.last_step == steps
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    strip = [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in a]
    assert strip == [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in b]
    assert (full / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
