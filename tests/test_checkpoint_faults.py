"""Faults around ``ferrule train``'s checkpoints: a kill inside a save, damaged files, a full disk (issue 28).

The run is the tiny random Qwen3 of tests/test_rl_e2e.py (character tokenizer, 2 layers). Each
fault is injected from outside ferrule: a kill -9 from the test, bytes changed in a written file,
``shutil.disk_usage`` / a write that raises ``ENOSPC`` in a wrapper script around the CLI.
"""

from __future__ import annotations

import io
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
from inproc import run_ferrule  # noqa: E402

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


# ------------------------------------------------------------------ damaged checkpoints (checksums)
@pytest.fixture(scope="module")
def trained_run(assets, tmp_path_factory):
    """A 2-step run with a checkpoint after each step (step_000001, step_000002)."""
    from rich.console import Console

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    run_dir = tmp_path_factory.mktemp("damaged") / "run"
    train(load_config(assets / "tiny.yaml", _overrides(assets, run_dir, "train.steps=2", "checkpoint.interval=1",
                                                        "checkpoint.keep=0")), console=Console(file=io.StringIO()))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    return run_dir


def _overrides(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", "logging.plot_at_end=false", *extra]


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif how == "zero64":  # 64 zeroed bytes in the middle: same size, other content
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(64) + data[mid + 64:])
    elif how == "garble":  # valid UTF-8, one digit changed (still JSON)
        text = data.decode()
        i = next(i for i, c in enumerate(text) if c.isdigit())
        path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])
    elif how == "torn":
        path.write_bytes(data[:len(data) // 3])
    else:
        raise ValueError(how)


DAMAGES = [("engine/rng/rank_0.pt", "truncate"), ("engine/engine_state.json", "garble"),
           ("loop_state.json", "torn"), ("loop_state.json", "garble"), ("engine/__0_0.distcp", "zero64")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rel,how", DAMAGES, ids=[f"{r.split('/')[-1]}-{h}" for r, h in DAMAGES])
def test_resume_names_the_damaged_file_and_offers_the_previous_checkpoint(assets, trained_run, tmp_path, rel, how):
    import shutil

    from rich.console import Console

    from ferrule.fs.run_layout import RunCheckpointError
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(str(trained_run),
                                                                                     str(run_dir)))
    step2 = run_dir / "checkpoints" / "step_000002"
    assert (step2 / rel).is_file(), sorted(p.name for p in (step2 / "engine").iterdir())
    _damage(step2 / rel, how)
    cfg = load_config(assets / "tiny.yaml", _overrides(assets, run_dir, "train.steps=3", "checkpoint.interval=1",
                                                        "checkpoint.keep=0", "checkpoint.resume=true"))
    with pytest.raises(RunCheckpointError) as info:
        train(cfg, console=Console(file=io.StringIO()))
    message = str(info.value)
    assert "\n" not in message
    assert f"checkpoint file {step2 / rel} is damaged" in message, message
    assert f"the previous complete checkpoint is step 1 ({run_dir / 'checkpoints' / 'step_000001'})" in message


@pytest.mark.timeout(300)
def test_export_of_a_distcp_with_64_zeroed_bytes_is_refused_naming_the_file(trained_run, tmp_path):
    """The damage that converted silently into a wrong model: exit 2, one line naming the file, nothing written."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    engine = run_dir / "checkpoints" / "step_000002" / "engine"
    shards = sorted(engine.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _damage(shards[-1], "zero64")
    out = tmp_path / "exported"
    res = run_ferrule(["export", run_dir, out], env=_env(), cwd=tmp_path)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert lines[-1].startswith(f"error: checkpoint file {shards[-1]} is damaged: its content differs"), lines[-3:]
    assert "Traceback" not in res.stderr and not out.exists()


def test_checksums_name_a_missing_resized_or_changed_file_and_skip_folders_without_them(tmp_path):
    """ferrule.fs.integrity against facts computed here: file sizes, and xxhash's digest of the bytes."""
    import xxhash

    from ferrule.fs.integrity import CHECKSUMS_FILE, CheckpointIntegrityError, record_checksums, verify_checksums

    (tmp_path / "sub").mkdir()
    files = {"a.bin": b"\x00" * 1000, "sub/b.json": b'{"x": 1}\n', "c.txt": b"hello"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    table = record_checksums(tmp_path)
    assert table == {n: {"bytes": len(d), "xxh3_64": xxhash.xxh3_64(d).hexdigest()} for n, d in files.items()}
    assert verify_checksums(tmp_path) is True
    (tmp_path / "c.txt").write_bytes(b"hellO")
    with pytest.raises(CheckpointIntegrityError, match=r"c.txt is damaged: its content differs"):
        verify_checksums(tmp_path)
    (tmp_path / "c.txt").write_bytes(b"hello")
    (tmp_path / "a.bin").write_bytes(b"\x00" * 999)
    with pytest.raises(CheckpointIntegrityError, match=r"a.bin is damaged \(truncated\): 999 bytes, the save wrote 1000"):
        verify_checksums(tmp_path)
    (tmp_path / "a.bin").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"a.bin is missing"):
        verify_checksums(tmp_path)
    (tmp_path / CHECKSUMS_FILE).write_text('{"files": ')
    with pytest.raises(CheckpointIntegrityError, match=rf"{CHECKSUMS_FILE} is damaged"):
        verify_checksums(tmp_path)
    (tmp_path / CHECKSUMS_FILE).unlink()
    assert verify_checksums(tmp_path) is False  # written before checksums existed: not verified


# ------------------------------------------------------------------ a full disk
def _fake_free(monkeypatch, free_bytes: int) -> None:
    import shutil

    real = shutil.disk_usage

    def disk_usage(path):
        u = real(path)
        return type(u)(u.total, u.total - free_bytes, free_bytes)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


@pytest.mark.timeout(300)
def test_a_save_that_does_not_fit_is_refused_before_writing_with_the_sizes(assets, trained_run, tmp_path, monkeypatch):
    """Free space is checked before the save (simulated: shutil.disk_usage reports 0.1 MB free); the needed
    size is compared with what a real save of the same run wrote (the .distcp shards)."""
    from rich.console import Console

    from ferrule.fs.util import DiskFullError
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    written = sum(p.stat().st_size for p in (trained_run / "checkpoints" / "step_000001" / "engine").glob("*.distcp"))
    _fake_free(monkeypatch, 100_000)
    run_dir = tmp_path / "run"
    with pytest.raises(DiskFullError) as info:
        train(load_config(assets / "tiny.yaml", _overrides(assets, run_dir, "train.steps=1", "checkpoint.interval=1")),
              console=Console(file=io.StringIO()))
    message = str(info.value)
    ckpt = run_dir / "checkpoints" / "step_000001"
    m = __import__("re").match(rf"no space left on {ckpt / 'engine'} \(needed ~([0-9,.]+) MB, free 0.1 MB\)", message)
    assert m, message
    assert abs(float(m.group(1).replace(",", "")) - written / 1e6) <= 0.1 * written / 1e6 + 0.05, (m.group(1), written)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], "the temporary folder is removed"


@pytest.mark.timeout(300)
def test_enospc_inside_the_torch_dist_writer_is_reported_as_a_full_disk(assets, tmp_path, monkeypatch):
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    from rich.console import Console

    from ferrule.fs.util import DiskFullError
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fa, "_write_item", full)
    run_dir = tmp_path / "run"
    engine = run_dir / "checkpoints" / "step_000001" / "engine"
    with pytest.raises(DiskFullError, match=rf"^no space left on {engine} \(needed ~[0-9,.]+ MB, free [0-9,.]+ MB\).*"
                                            r"a write of the save failed: No space left on device\)$"):
        train(load_config(assets / "tiny.yaml", _overrides(assets, run_dir, "train.steps=1", "checkpoint.interval=1")),
              console=Console(file=io.StringIO()))


@pytest.mark.timeout(300)
def test_temporary_folders_of_killed_saves_are_removed_on_the_next_run(assets, trained_run, tmp_path):
    import shutil

    from rich.console import Console

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(str(trained_run),
                                                                                     str(run_dir)))
    ckpts = run_dir / "checkpoints"
    import psutil

    dead = next(pid for pid in range(999_999, 900_000, -1) if not psutil.pid_exists(pid))
    stale = [ckpts / "step_000003" / f".engine.tmp-{dead}-0123abcd", ckpts / "step_000002" / ".engine.tmp-89abcdef"]
    live = ckpts / "step_000002" / f".engine.tmp-{os.getppid()}-feedbeef"  # a live writer's: kept
    for d in stale + [live]:
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"\0" * 1_500_000)
    out = io.StringIO()
    train(load_config(assets / "tiny.yaml", _overrides(assets, run_dir, "train.steps=2", "checkpoint.interval=1",
                                                        "checkpoint.keep=0", "checkpoint.resume=true")),
          console=Console(file=out, width=400))
    assert not any(d.exists() for d in stale) and live.is_dir()
    assert "removed 2 temporary folder(s) of interrupted checkpoint saves (3.0 MB)" in out.getvalue(), out.getvalue()


def test_a_hand_edited_json_file_of_a_checkpoint_is_called_changed_not_truncated(tmp_path):
    """Issue 45.7: a shorter but valid ``hf/config.json`` (a key removed by hand) was reported "damaged (truncated)"."""
    from ferrule.fs.integrity import CheckpointIntegrityError, record_checksums, verify_checksums

    (tmp_path / "hf").mkdir()
    config = {"model_type": "qwen3", "vocab_size": 32, "rope_theta": 1e6}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    (tmp_path / "common.pt").write_bytes(b"\1" * 100)
    record_checksums(tmp_path)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rope_theta"}))
    with pytest.raises(CheckpointIntegrityError) as exc:
        verify_checksums(tmp_path)
    said = str(exc.value)
    assert f"checkpoint file {tmp_path / 'hf' / 'config.json'} was changed since the save: it is valid JSON" in said
    assert "truncated" not in said and 'delete its entry "hf/config.json"' in said, said
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config, indent=2)[:20])  # a torn write stays "truncated"
    with pytest.raises(CheckpointIntegrityError, match=r"is damaged \(truncated\)"):
        verify_checksums(tmp_path)
