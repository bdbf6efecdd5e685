"""The metrics sinks of ``ferrule train``: TensorBoard event files and a W&B offline run, read back.

References: TensorBoard's own reader (``EventAccumulator``) for the event files; for W&B the
run's ``run-ID.wandb`` file, read here with a reader of its record format written for this test
(LevelDB log records: a 7-byte file header ``:W&B`` + magic + version, then 32 KiB blocks of
chunks ``crc32 u32, length u16, type u8`` with FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), each record
parsed with W&B's own ``wandb_internal_pb2.Record``. Both must equal ``metrics.jsonl``.
Both packages come with the ``metrics`` extra that ./install.sh installs: no importorskip here.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorboard  # noqa: F401  (installed by ./install.sh: the metrics extra)
import wandb  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import test_rl_e2e as e2e  # noqa: E402

WANDB_BLOCK = 32768


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value)]}`` of every scalar in a TensorBoard log folder (TensorBoard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(ev.step, ev.value) for ev in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path):
    """The protobuf records of a W&B ``.wandb`` file (see the module docstring)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _finished_wandb_files(run_dir: Path, timeout_s: float = 60.0) -> list[Path]:
    """The runs' ``.wandb`` files once each ends with its ``exit`` record: W&B's writer (the
    wandb-core process) may still be flushing when ``wandb.finish()`` returns."""
    deadline = time.time() + timeout_s
    while True:
        files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        done = [any(r.WhichOneof("record_type") == "exit" for r in wandb_records(f)) for f in files]
        if (files and all(done)) or time.time() > deadline:
            return files
        time.sleep(0.2)


def wandb_history(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """``({step: {metric: value}}, run config)`` of the W&B offline runs under ``RUN_DIR/wandb``."""
    history, config = {}, {}
    for f in _finished_wandb_files(run_dir):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                history.setdefault(row.pop("_step"), {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return history, config


def numeric(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics_sinks")
    e2e._build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n")
    (root / "tiny.yaml").write_text(e2e.CONFIG)
    return root


@pytest.mark.timeout(300)
def test_a_run_logs_to_tensorboard_and_wandb_offline_what_metrics_jsonl_holds(assets, tmp_path, monkeypatch):
    from rich.console import Console

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = load_config(assets / "tiny.yaml", [
        f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}", f"logging.run_dir={run_dir}",
        "train.steps=2", "checkpoint.enabled=false", "logging.plot_at_end=false", "logging.tensorboard=true",
        "logging.wandb=true", "logging.wandb_project=ferrule-test"])
    train(cfg, console=Console(file=io.StringIO()))
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2]

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    expected_tags = set().union(*(numeric(e) for e in entries))
    assert {"reward_mean", "loss", "grad_norm", "reward_errors", "lr"} <= expected_tags
    assert set(scalars) == expected_tags
    for tag, events in scalars.items():  # TensorBoard keeps float32 scalars
        want = [(e["step"], np.float32(e[tag])) for e in entries if tag in numeric(e)]
        assert [(s, np.float32(v)) for s, v in events] == want, tag

    history, config = wandb_history(run_dir)
    assert sorted(history) == [1, 2]
    for e in entries:
        assert history[e["step"]] == numeric(e), e["step"]  # JSON floats: exact
    assert config["reward"]["function"] == "task" and config["train"]["steps"] == 2
    assert (run_dir / "wandb_run_id").read_text().strip() in {
        p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}


@pytest.mark.timeout(120)
def test_a_resume_purges_tensorboard_steps_after_the_checkpoint_and_keeps_the_wandb_run(tmp_path, monkeypatch):
    """A resume from step 2 of a run that had logged step 3: TensorBoard drops the old step 3 (purge_step),
    so its scalars equal the rewritten metrics.jsonl; the W&B run id is the first run's."""
    from ferrule.rl.metrics import MetricsLogger, read_metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, tensorboard=True, wandb=True) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward_mean": 0.1 * step, "reward_errors": step, "skipped": None,
                           "reward_error_types": {"ValueError": step}, "grad_norm": float("nan")})
    first_id = (tmp_path / "wandb_run_id").read_text()
    time.sleep(1.1)  # W&B names an offline run's folder by the second and the id: a real resume is seconds later
    with MetricsLogger(tmp_path, resume_step=2, tensorboard=True, wandb=True) as log:
        for step in (3, 4):
            log.log(step, {"reward_mean": -0.5 * step, "reward_errors": 10 * step})
    entries = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3, 4] and entries[2]["reward_mean"] == -1.5
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward_mean", "reward_errors"}  # None, dicts and NaN are not scalars
    for tag in scalars:
        assert [(s, np.float32(v)) for s, v in scalars[tag]] == [(e["step"], np.float32(e[tag])) for e in entries]
    assert (tmp_path / "wandb_run_id").read_text() == first_id
    assert {p.name.rsplit("-", 1)[-1] for p in (tmp_path / "wandb").glob("offline-run-*")} == {first_id.strip()}
    history, _ = wandb_history(tmp_path)
    assert history[1] == {"reward_mean": 0.1, "reward_errors": 1} and history[4] == {"reward_mean": -2.0,
                                                                                   "reward_errors": 40}
