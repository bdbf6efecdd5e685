"""A run folder has one trainer and its logs are read back strictly (issue 28.11, 28.12, 28.14; 30.4, 30.5).

- a run that died before its first checkpoint continues with ``ferrule train --resume --run-dir R``
  (restarted at step 0, said so) and ends equal to an uninterrupted run; ``--resume`` on a
  finished run says so without loading a model; ``--resume`` on a folder holding no run is refused;
- a second process on a run folder (or on a conversion's OUT) is refused naming the holder; the
  lock is the kernel's, so a killed holder leaves none;
- a torn last line of metrics.jsonl / samples.jsonl is dropped on resume; any other damaged line,
  and steps that do not strictly increase, are refused naming the file and the line.

The model runs use test_rl_e2e's tiny Qwen3; the reference is an uninterrupted run of the same config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformers import GenerationMixin, Qwen3ForCausalLM  # noqa: F401  (before megatron's CPU patches)

ENV = dict(os.environ, FERRULE_PLUGINS="qwen,inkling")


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``ferrule ARGS`` in-process (tests/inproc.py); the lock holders below are real processes."""
    from inproc import run_ferrule

    return run_ferrule(list(args), env=ENV)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_rl_e2e import CONFIG, _build_model

    root = tmp_path_factory.mktemp("run_folder")
    _build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(32):
            f.write(f'{{"prompt": "say {i}", "answer": "7"}}\n')
    (root / "tiny.yaml").write_text(CONFIG)
    return root


def _overrides(root: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"model.hf_dir={root / 'model'}", f"data.jsonl_path={root / 'task.jsonl'}", f"logging.run_dir={run_dir}",
            f"train.steps={steps}", "eval.interval=1", f"eval.jsonl_path={root / 'task.jsonl'}", "eval.n_prompts=4",
            "checkpoint.interval=1000", "checkpoint.save_on_interrupt=false", "logging.plot_at_end=false"]


@pytest.mark.timeout(600)
def test_a_run_that_died_before_its_first_checkpoint_continues_with_resume(tiny, tmp_path):
    from test_rl_e2e import _comparable

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    steps = 3
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    train(load_config(tiny / "tiny.yaml", _overrides(tiny, full, steps)))
    # killed after step 2 with no checkpoint yet (as an OOM kill or a double Ctrl-C leaves it)
    first = train(load_config(tiny / "tiny.yaml", _overrides(tiny, crashed, steps)), stop_after=2)
    assert first.interrupted and first.checkpoint is None and not (crashed / "checkpoints").exists()
    assert [e["step"] for e in read_metrics(crashed / "metrics.jsonl")] == [0, 1, 2]  # eval at 0, steps 1-2

    res = _cli("train", "--resume", "--run-dir", str(crashed))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restarting the run at step 0 (its 3 logged steps are replaced)" in res.stderr
    assert _comparable(read_metrics(crashed / "metrics.jsonl")) == _comparable(read_metrics(full / "metrics.jsonl"))
    assert (crashed / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()

    # --resume on the finished run: says so, loads no model, trains nothing
    t0 = time.monotonic()
    done = _cli("train", "--resume", "--run-dir", str(crashed))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run {crashed} is complete: its latest checkpoint is step {steps} of train.steps={steps}" in done.stderr
    assert "weight sync" not in done.stderr and "steps 4..3" not in done.stderr
    assert _comparable(read_metrics(crashed / "metrics.jsonl")) == _comparable(read_metrics(full / "metrics.jsonl"))
    assert time.monotonic() - t0 < 60

    # --resume where no run is (a typo in --run-dir) must not start over
    typo = _cli("train", str(tiny / "tiny.yaml"), "--resume", "--run-dir", str(tmp_path / "crashd"),
                f"model.hf_dir={tiny / 'model'}", f"data.jsonl_path={tiny / 'task.jsonl'}")
    assert typo.returncode == 2 and "holds no run" in typo.stderr and "Traceback" not in typo.stderr
    assert not (tmp_path / "crashd").exists()


def test_bare_ferrule_train_prints_a_usage_line():
    res = _cli("train")
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("usage: ferrule train CONFIG"), res.stderr


def _holder(lock: Path, *args: str) -> subprocess.Popen:
    """A process that holds ``lock`` (as the live trainer would) until killed."""
    code = ("import sys, time; from ferrule.fs import locks; locks.acquire(sys.argv[1], 'x'); print('held', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(240)
def test_a_second_trainer_on_a_run_folder_exits_2_naming_the_holder(tiny, tmp_path):
    from ferrule.rl.run_checks import RUN_LOCK_FILE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = _holder(run_dir / RUN_LOCK_FILE)
    try:
        res = _cli("train", str(tiny / "tiny.yaml"), *_overrides(tiny, run_dir, 2))
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"is in use by pid {holder.pid}" in errors[0] and "--run-dir" in errors[0], res.stderr
    assert not (run_dir / "metrics.jsonl").exists()

    # the holder was killed: the kernel dropped its lock, nothing stale is left
    from ferrule.fs import locks

    locks.acquire(run_dir / RUN_LOCK_FILE, "run folder")
    locks.release(run_dir / RUN_LOCK_FILE, remove=True)


@pytest.mark.timeout(240)
def test_a_second_conversion_into_one_out_is_refused(tmp_path):
    from ferrule.conformance import numeric as cn
    from ferrule.fs.output_dir import output_lock
    from ferrule.megatron.parallel import destroy_distributed

    # `ferrule convert` runs in a process without a process group: an earlier test's in-process run left one up,
    # which made the 1-rank conversion spawn an interpreter of its own (~15 s)
    destroy_distributed()
    src = cn.tiny_hf_dir("qwen2", tmp_path / "hf")
    out = tmp_path / "td"
    holder = _holder(output_lock(out))  # a first `ferrule convert` into OUT, still writing
    try:
        res = _cli("convert", "hf-to-torch-dist", str(src), str(out))
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"pid {holder.pid}" in res.stdout + res.stderr and "Traceback" not in res.stdout + res.stderr
    assert not out.exists()
    ok = _cli("convert", "hf-to-torch-dist", str(src), str(out))
    assert ok.returncode == 0 and out.is_dir() and not output_lock(out).exists()


# ------------------------------------------------------------------ damaged logs (no model)
def _metrics_lines(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "time": 0.0, "reward_mean": 0.5}) + "\n" for s in steps)


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    from ferrule.rl.metrics import MetricsLogger, read_metrics
    from ferrule.rl.stages.record import truncate_samples

    (tmp_path / "metrics.jsonl").write_text(_metrics_lines(1, 2, 3) + '{"step": 4, "time": 1.0, "rew')
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"reward_mean": 0.25})
    assert [e["step"] for e in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]

    samples = "".join(json.dumps({"step": s, "response": "7", "reward": 1.0}) + "\n" for s in (1, 1, 2, 2))
    (tmp_path / "samples.jsonl").write_text(samples + '{"step": 3, "resp')  # a full disk tore it
    truncate_samples(tmp_path, 2)
    assert (tmp_path / "samples.jsonl").read_text() == samples


@pytest.mark.parametrize("name, text, line, says", [
    ("metrics.jsonl", _metrics_lines(1) + "garbage\n" + _metrics_lines(2), 2, "not JSON"),
    ("metrics.jsonl", _metrics_lines(1) + "[1, 2]\n" + _metrics_lines(2), 2, "JSON object"),
    ("metrics.jsonl", _metrics_lines(1, 2, 1, 2), 3, "not after step 2 of line 2"),
    ("metrics.jsonl", _metrics_lines(1, 2, 2), 3, "not after step 2 of line 2"),
    ("samples.jsonl", '{"step": 1}\n{"step": 1}\n\x00\x00\n{"step": 2}\n', 3, "not JSON"),
    ("samples.jsonl", '{"step": 1}\n{"step": 2}\n{"step": 1}\n', 3, "not after step 2 of line 2"),
    ("samples.jsonl", '{"step": 1}\n{"response": "7"}\n', 2, "integer"),
], ids=["metrics-garbage", "metrics-not-object", "metrics-twice", "metrics-repeated", "samples-garbage",
        "samples-order", "samples-no-step"])
def test_a_damaged_log_is_refused_naming_the_file_and_line(tmp_path, name, text, line, says):
    from ferrule.user_errors import user_error_message
    from ferrule.rl.metrics import MetricsLogger, RunLogError
    from ferrule.rl.stages.record import truncate_samples

    (tmp_path / name).write_text(text)
    with pytest.raises(RunLogError) as exc:
        if name == "metrics.jsonl":
            MetricsLogger(tmp_path, resume_step=1)
        else:
            truncate_samples(tmp_path, 1)
    assert f"{tmp_path / name}:{line}: " in str(exc.value) and says in str(exc.value)
    assert user_error_message(exc.value) is not None  # the CLI prints one line, exit 2
    assert (tmp_path / name).read_text() == text  # nothing was rewritten


def test_the_files_the_docs_create_are_gitignored():
    """docs/serve.md writes keys.txt (API keys) and docs/train.md exports to out/: neither may be committed."""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(["git", "check-ignore", "keys.txt", "out/policy/config.json", "runs/x", "assets/smollm2"],
                         cwd=root, capture_output=True, text=True, timeout=30)
    if res.returncode == 128:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    assert res.stdout.split() == ["keys.txt", "out/policy/config.json", "runs/x", "assets/smollm2"]
