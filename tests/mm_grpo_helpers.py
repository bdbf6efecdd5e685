"""Shared body of the multimodal GRPO tests (plugins/inkling/tests/test_inkling_mm_rl.py, plugins/inkling2/tests/test_inkling2_mm_rl.py).

Both families train Inkling's "how many squares?" task (:func:`ferrule_examples.inkling_shapes.build_shapes_task`
draws the pictures and writes the TMLv0 prompts; the Inkling-2 builder swaps the model). The checks are
independent of the code under test: each picture's square count is re-counted from its PNG with scipy's
connected-component labelling, rewards are recomputed from the logged responses, the rollout weights are
checked equal to the trained ones after every sync, and a resumed run must equal an uninterrupted one
metric by metric (timings excluded) and sample by sample.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TIMING = re.compile(r"^(time.*|.*_per_s|memory_.*|mfu)$")  # timings, memory and mfu (from time) vary run to run


def overrides(assets: Path, run_dir: Path, steps: int) -> list[str]:
    """Config overrides for a short run of the example config on the task in ``assets``."""
    return [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", f"train.steps={steps}", "train.prompts_per_step=2",
            "checkpoint.interval=2",
            "logging.plot_at_end=false"]  # the example config draws the reward curve; no test here reads it


def count_squares(png: Path) -> int:
    """Connected regions of a picture whose bounding box they fill (squares; circles leave corners white)."""
    import numpy as np
    from PIL import Image
    from scipy import ndimage

    a = np.asarray(Image.open(png).convert("RGB")).astype(int)
    count = 0
    for colour in {tuple(c) for c in a.reshape(-1, 3)} - {(255, 255, 255)}:
        labels, n = ndimage.label((a == colour).all(-1))
        for k in range(1, n + 1):
            ys, xs = np.nonzero(labels == k)
            count += (np.ptp(ys) + 1) * (np.ptp(xs) + 1) == len(ys)
    return count


def check_task_answers(assets: Path) -> None:
    """Every prompt's answer is the square count of its picture, and the answers are not all equal."""
    answers = []
    for line in (assets / "task.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert count_squares(assets / rec["messages"][0]["content"][0]["image"]) == int(rec["answer"]), rec
        answers.append(rec["answer"])
    assert len(set(answers)) > 1


def check_grpo_runs_and_resumes(config: Path, assets: Path, tmp_path: Path, *, image_tokens: int) -> None:
    """4 GRPO steps (2 prompts x 1 picture each, ``image_tokens`` placeholder tokens per picture) with weight
    checks after every sync; then 2 steps, stop, ``checkpoint.resume=true``, 2 more: equal to the 4-step run."""
    from ferrule_examples.inkling_shapes import square_count_reward
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    steps, stop_at = 4, 2
    full, split = tmp_path / "full", tmp_path / "split"
    train(load_config(config, overrides(assets, full, steps)), check_weight_update_equal=True)
    entries = read_metrics(full / "metrics.jsonl")
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    assert all(e["media_vision_parts"] == 2 and e["media_vision_tokens"] == 2 * image_tokens for e in entries)
    assert max(e["train_rollout_logprob_abs_diff"] for e in entries) <= 1e-5
    answers = {json.loads(ln)["id"]: json.loads(ln)["answer"] for ln in (assets / "task.jsonl").read_text().splitlines()}
    for s in (json.loads(ln) for ln in (full / "samples.jsonl").read_text().splitlines()):
        m = re.search(r"\d+", s["response"])
        assert s["reward"] == float(m is not None and m.group(0) == answers[s["prompt_id"]]), s
    assert square_count_reward("2 squares", type("P", (), {"answer": "2"})()) == 1.0

    first = train(load_config(config, overrides(assets, split, steps)), stop_after=stop_at)
    assert first.interrupted and first.last_step == stop_at
    second = train(load_config(config, overrides(assets, split, steps) + ["checkpoint.resume=true"]))
    assert second.start_step == stop_at and second.last_step == steps
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    strip = [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in a]
    assert strip == [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in b]
    assert (full / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
