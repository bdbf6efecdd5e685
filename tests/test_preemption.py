"""Preemption and a changed model folder (issue 45.1, 45.2).

- SIGTERM (the preemption signal of Slurm and Kubernetes) and SIGUSR1 (Slurm's warning before a time
  limit) stop ``ferrule train`` as Ctrl-C does: the step in progress finishes, a checkpoint is written,
  the resume command is printed, the exit code is 128 + the signal; a signal during a checkpoint save
  lets the save complete and stops there. ``--resume`` then equals an uninterrupted run bit for bit.
- A resume whose model folder changed in place (weights, tokenizer) is refused naming the file, unless
  ``--allow-model-change``; a folder that moved is accepted at its new path when its files are the same.

The model is test_rl_e2e's tiny random Qwen3; the reference is an uninterrupted in-process run of the
same config. SIGTERM is sent to a ``ferrule train`` subprocess (the process behaviour under test);
everything else runs in-process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import test_rl_e2e as e2e  # noqa: E402

STEPS = 4

#: ``ferrule train`` after test patches chosen by environment variables (numerics untouched):
#: FAULT_STEP_SLEEP_S=S sleeps S seconds at the start of every step (so that a signal sent after step k is
#: logged lands inside step k+1); FAULT_SLOW_WRITE=MARKER makes the first torch_dist tensor write of a save
#: touch MARKER, then sleep FAULT_SLOW_WRITE_S seconds (a signal sent then lands inside the save).
RUNNER = """\
import os, sys, time
from pathlib import Path

pause = float(os.environ.get("FAULT_STEP_SLEEP_S", "0"))
if pause:
    from ferrule.rl.loop import GRPOTrainer
    real_step = GRPOTrainer.train_step

    def slow_step(self, step):
        time.sleep(pause)
        return real_step(self, step)

    GRPOTrainer.train_step = slow_step
marker = os.environ.get("FAULT_SLOW_WRITE")
if marker:
    import functools
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    real_write_item = fa._write_item

    @functools.wraps(real_write_item)  # megatron reads its signature
    def slow_write_item(*args, **kwargs):
        if not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            time.sleep(float(os.environ["FAULT_SLOW_WRITE_S"]))
        return real_write_item(*args, **kwargs)

    fa._write_item = slow_write_item
from ferrule.cli import main
sys.argv = ["ferrule", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    e2e._build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n")
    (root / "tiny.yaml").write_text(e2e.CONFIG)
    (root / "runner.py").write_text(RUNNER)
    return root


def _overrides(assets: Path, run_dir: Path, *extra: str, model: Path | None = None) -> list[str]:
    return [f"model.hf_dir={model or assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", "logging.plot_at_end=false", f"train.steps={STEPS}", *extra]


def _train(assets: Path, run_dir: Path, *extra: str, model: Path | None = None, stop_after: int | None = None):
    from rich.console import Console

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    log = io.StringIO()
    result = train(load_config(assets / "tiny.yaml", _overrides(assets, run_dir, *extra, model=model)),
                   console=Console(file=log, width=400), stop_after=stop_after)
    return result, log.getvalue()


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run: its metrics (timings left out) and samples."""
    from ferrule.rl.metrics import read_metrics

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _train(assets, run_dir)
    return e2e._comparable(read_metrics(run_dir / "metrics.jsonl")), (run_dir / "samples.jsonl").read_text()


def _resume_equals_reference(assets: Path, run_dir: Path, reference) -> None:
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics
    from rich.console import Console

    cfg = load_config(run_dir / "config.yaml", ["checkpoint.resume=true"])
    train(cfg, console=Console(file=io.StringIO()))
    assert e2e._comparable(read_metrics(run_dir / "metrics.jsonl")) == reference[0]
    assert (run_dir / "samples.jsonl").read_text() == reference[1]


def _env(**extra: str) -> dict[str, str]:
    import torch

    # the reference and the resume run in this process: the same CPU thread count gives the same sums
    return dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), FERRULE_PLUGINS="qwen", **extra)


def _start(assets: Path, run_dir: Path, env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(assets / "runner.py"), "train", str(assets / "tiny.yaml"),
           *_overrides(assets, run_dir, *extra)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(what, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while not what() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert what(), f"never happened; the run said: {proc.stderr.read()[-3000:] if proc.poll() is not None else ''}"


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=240)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(600)
def test_sigterm_after_a_logged_step_saves_it_and_resume_equals_an_uninterrupted_run(assets, reference, tmp_path):
    """Before: SIGTERM ended the process at once (exit -15), no checkpoint: the logged steps were lost."""
    from ferrule.fs.run_layout import list_checkpoints

    run_dir = tmp_path / "run"
    proc = _start(assets, run_dir, _env(FAULT_STEP_SLEEP_S="1.5"), "checkpoint.interval=1000")
    _wait_for(lambda: 2 in _logged_steps(run_dir), proc)
    os.kill(proc.pid, signal.SIGTERM)  # inside step 3's pause: step 3 finishes, is saved, the run stops
    code, err = _stop(proc)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM: finishing the current step, then saving a checkpoint" in err
    last = _logged_steps(run_dir)[-1]
    assert 3 <= last < STEPS
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [last]
    assert f"stopped after step {last}" in err and f"ferrule train --resume --run-dir {run_dir}" in err
    assert "Traceback" not in err
    _resume_equals_reference(assets, run_dir, reference)


@pytest.mark.timeout(600)
def test_sigterm_during_a_checkpoint_save_completes_it_and_stops_there(assets, reference, tmp_path):
    """Before: the process died inside the save; step 2's checkpoint was incomplete and ignored."""
    from ferrule.fs.run_layout import list_checkpoints

    run_dir, marker = tmp_path / "run", tmp_path / "writing"
    proc = _start(assets, run_dir, _env(FAULT_SLOW_WRITE=str(marker), FAULT_SLOW_WRITE_S="3"),
                  "checkpoint.interval=2", "checkpoint.keep=0")
    _wait_for(marker.exists, proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = _stop(proc)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert _logged_steps(run_dir)[-1] == 2
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]
    assert "Traceback" not in err
    _resume_equals_reference(assets, run_dir, reference)


@pytest.mark.timeout(300)
def test_sigusr1_stops_the_cli_run_with_a_checkpoint_and_exit_138(assets, tmp_path, monkeypatch):
    """In-process through typer's runner: SIGUSR1 raised by the loop's own step 2 (as Slurm's
    ``--signal=USR1@T`` would) stops after step 2 with a checkpoint; before, SIGUSR1 killed the process."""
    from typer.testing import CliRunner

    from ferrule.cli import app
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.fs.run_layout import list_checkpoints

    real_step = GRPOTrainer.train_step

    def step_then_signal(self, step):
        out = real_step(self, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    monkeypatch.setattr(GRPOTrainer, "train_step", step_then_signal)
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(assets / "tiny.yaml"),
                                   *_overrides(assets, run_dir, "checkpoint.interval=1000")])
    assert res.exit_code == 128 + signal.SIGUSR1, res.output[-3000:]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored after the run
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ------------------------------------------------------------------ the model folder changed since the checkpoint
@pytest.fixture(scope="module")
def one_step_run(assets, tmp_path_factory):
    """A 1-step run (checkpoint at step 1) of a copy of the model folder: ``(run_dir, model_dir)``."""
    root = tmp_path_factory.mktemp("identity")
    model = root / "model"
    shutil.copytree(assets / "model", model)
    _train(assets, root / "run", "checkpoint.interval=1", model=model, stop_after=1)
    return root / "run", model


def _resume(assets, run_dir, model, *extra):
    return _train(assets, run_dir, "checkpoint.resume=true", "checkpoint.interval=1", *extra, model=model,
                  stop_after=2)


def _copy_run(run_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.timeout(300)
def test_resume_refuses_weights_changed_in_place_naming_the_file(assets, one_step_run, tmp_path):
    """Before: the resume used the new weights silently (steps after it differ from the run's)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ferrule.rl.config import ConfigError

    run_dir, model = _copy_run(one_step_run[0], tmp_path), one_step_run[1]
    saved = (model / "model.safetensors").read_bytes()
    tensors = load_file(model / "model.safetensors")
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1e-3 * torch.ones_like(tensors[key])  # same path, same shapes, other values
    try:
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError) as exc:
            _resume(assets, run_dir, model)
    finally:
        (model / "model.safetensors").write_bytes(saved)
    text = str(exc.value)
    assert "model.safetensors changed (same size" in text and "--allow-model-change" in text


@pytest.mark.timeout(300)
def test_resume_refuses_a_remapped_tokenizer_and_allow_model_change_continues(assets, one_step_run, tmp_path):
    """Before: the resume tokenized with the folder's new vocabulary although the checkpoint holds the old one."""
    from ferrule.rl.config import ConfigError

    run_dir, model = _copy_run(one_step_run[0], tmp_path), one_step_run[1]
    saved = (model / "tokenizer.json").read_text()
    tok = json.loads(saved)
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    try:
        (model / "tokenizer.json").write_text(json.dumps(tok))
        with pytest.raises(ConfigError) as exc:
            _resume(assets, run_dir, model)
        assert "tokenizer.json changed" in str(exc.value) and str(model) in str(exc.value)
        result, log = _resume(assets, run_dir, model, "checkpoint.allow_model_change=true")
        assert result.last_step == 2
        assert "checkpoint.allow_model_change: resuming on a changed model folder" in log
        assert "tokenizer.json changed" in log
    finally:
        (model / "tokenizer.json").write_text(saved)


@pytest.mark.timeout(300)
def test_a_moved_model_folder_is_given_again_on_the_command_line(assets, one_step_run, tmp_path):
    """Before: a moved folder could not be resumed at all (model.hf_dir differs from the checkpoint's)."""
    from ferrule.rl.config import ConfigError, load_config

    run_dir, model = _copy_run(one_step_run[0], tmp_path), one_step_run[1]
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    missing = tmp_path / "gone"
    with pytest.raises(ConfigError) as exc:  # the recorded path is gone: the message says how to go on
        load_config(run_dir / "config.yaml", ["checkpoint.resume=true", f"model.hf_dir={missing}"]).check_paths()
    assert "if the model folder moved, give its new path" in str(exc.value)
    result, log = _resume(assets, run_dir, moved)
    assert result.last_step == 2
    assert f"the model folder moved from {model} to {moved} (same files)" in log
