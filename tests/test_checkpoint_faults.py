"""Faults around ``ferrule train``'s checkpoints: a kill inside a save, damaged files, a full disk (issue 28).

The run is the tiny random Qwen3 of tests/test_rl_e2e.py (character tokenizer, 2 layers). Each
fault is injected from outside ferrule: a kill -9 from the test, bytes changed in a written file,
``shutil.disk_usage`` / a write that raises ``ENOSPC`` in a wrapper script around the CLI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import test_rl_e2e as e2e  # noqa: E402

#: Runs ``ferrule train`` (``ferrule.cli.main``) after the patches named by environment variables:
#: FAULT_SLOW_WRITE=MARKER makes every torch_dist tensor write touch MARKER, then sleep.
RUNNER = """\
import os, sys, time
from pathlib import Path

marker = os.environ.get("FAULT_SLOW_WRITE")
if marker:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    real_write_item = fa._write_item

    def slow_write_item(*args, **kwargs):
        Path(marker).write_text(str(os.getpid()))
        time.sleep(300)
        return real_write_item(*args, **kwargs)

    fa._write_item = slow_write_item
from ferrule.cli import main
sys.argv = ["ferrule", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_faults")
    e2e._build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n")
    (root / "tiny.yaml").write_text(e2e.CONFIG)
    (root / "runner.py").write_text(RUNNER)
    return root


def _train_cmd(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(assets / "runner.py"), "train", str(assets / "tiny.yaml"),
            f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", "logging.plot_at_end=false", *extra]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", FERRULE_PLUGINS="qwen", **extra)


def _group_members(pgid: int) -> list[str]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error):
            continue
    return out


@pytest.mark.timeout(240)
def test_no_process_outlives_a_ferrule_train_killed_inside_a_checkpoint_save(assets, tmp_path):
    """kill -9 while the torch_dist writer is inside a tensor write: the process group is empty after.

    megatron-core 0.16.1 forks one writer process per bucket; those survived the kill (reparented
    to PID 1, waiting on a queue whose reader died). ferrule writes the buckets in threads instead.
    """
    marker = tmp_path / "writing"
    proc = subprocess.Popen(_train_cmd(assets, tmp_path / "run", "train.steps=1", "checkpoint.interval=1"),
                            env=_env(FAULT_SLOW_WRITE=str(marker)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the save never started writing: {proc.stderr.read().decode()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _group_members(proc.pid)
        for _ in range(25):  # children of a killed parent need a moment to be reaped or reparented
            if not left:
                break
            time.sleep(0.2)
            left = _group_members(proc.pid)
        assert left == [], f"processes outlived the killed ferrule train: {left}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stderr.close()
