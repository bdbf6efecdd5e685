"""Checkpoint folders of the RL loop: listing, the resume config check, atomic small-file writes.

``CKPT_DIR/step_NNNNNN/`` holds ``engine/`` (:meth:`ferrule.megatron.engine.TrainEngine.save`)
and :data:`LOOP_STATE_FILE` (``{"step", "sampler", "engine_step", "config"}``), which is written
last and atomically: a folder without it is incomplete and ignored by :func:`list_checkpoints`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ferrule.fsutil import apply_default_mode

LOOP_STATE_FILE = "loop_state.json"
#: Keys that may change between a run and its resume (everything else must match).
#: ``parallel.*`` may change: the train engine's torch_dist checkpoint reshards (or its load
#: names what cannot be), and the rollout depends on ``rollout.prompts_per_shard``, not the layout.
RESUME_MUTABLE = ("train.steps", "checkpoint.", "logging.", "eval.", "parallel.")


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    apply_default_mode(tmp)
    os.replace(tmp, path)


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints ``[(step, path)]`` in ``ckpt_dir``, oldest first (``loop_state.json`` present)."""
    d = Path(ckpt_dir)
    out = []
    if d.is_dir():
        for sub in d.iterdir():
            if sub.name.startswith("step_") and (sub / LOOP_STATE_FILE).is_file():
                try:
                    out.append((int(sub.name[5:]), sub))
                except ValueError:
                    continue
    return sorted(out)


def _default(section: str, key: str) -> Any:
    from ferrule.rl.config import config_from_dict

    return config_from_dict({}, validate=False).to_dict().get(section, {}).get(key)


def config_differences(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """``section.key`` entries that differ between two config dicts, except :data:`RESUME_MUTABLE`.

    A key missing from ``old`` (a checkpoint written before the key existed) counts as its default.
    """
    diffs = []
    for section in sorted(set(old) | set(new)):
        for key in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
            dotted = f"{section}.{key}"
            if any(dotted == m or (m.endswith(".") and dotted.startswith(m)) for m in RESUME_MUTABLE):
                continue
            a, b = old.get(section, {}).get(key), new.get(section, {}).get(key)
            if key not in old.get(section, {}):
                a = _default(section, key)
            if a != b:
                diffs.append(f"{dotted}: checkpointed run has {a!r}, this config has {b!r}")
    return diffs


class RunCheckpointError(ValueError):
    """The run folder has no (matching) complete checkpoint; the message says what exists."""


def _checkpoint_dir(run_dir: Path) -> Path:
    import yaml

    from ferrule.rl.config import CONFIG_FILE_NAME

    cfg_file = run_dir / CONFIG_FILE_NAME
    if cfg_file.is_file():
        configured = ((yaml.safe_load(cfg_file.read_text()) or {}).get("checkpoint") or {}).get("dir") or ""
        if configured:
            return Path(configured)
    return run_dir / "checkpoints"


def find_run_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """``(step, CKPT_DIR/step_NNNNNN)`` of a run: the latest complete checkpoint, or ``step``'s.

    Raises:
        RunCheckpointError: ``run_dir`` does not exist, has no complete checkpoint, or none at ``step``
            (the message lists the steps that exist).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunCheckpointError(f"run folder {str(run_dir)!r} does not exist")
    ckpt_dir = _checkpoint_dir(run_dir)
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise RunCheckpointError(f"{ckpt_dir} holds no complete checkpoint (step_NNNNNN/ with loop_state.json); "
                          "train with checkpoint.enabled=true, or wait for the first checkpoint.interval")
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    raise RunCheckpointError(f"no checkpoint of step {step} in {ckpt_dir}; complete checkpoints: steps "
                      f"{[s for s, _ in found]} (checkpoint.keep prunes older ones)")
