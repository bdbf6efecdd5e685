"""The layout of a ``ferrule train`` run folder, shared by the launcher and the exporters.

::

    RUN_DIR/config.yaml                     the resolved config (:data:`CONFIG_FILE_NAME`)
    CKPT_DIR/step_NNNNNN/engine/            :meth:`ferrule.megatron.engine.TrainEngine.save`
    CKPT_DIR/step_NNNNNN/loop_state.json    :data:`LOOP_STATE_FILE`, written last and atomically

``CKPT_DIR`` is ``checkpoint.dir`` from ``RUN_DIR/config.yaml`` when set, else
``RUN_DIR/checkpoints``. A step folder without ``loop_state.json`` is incomplete and ignored.
The RL launcher (:mod:`ferrule.rl`) writes this layout; ``ferrule export`` and ``ferrule lora
export`` read it, importing this module downward instead of the launcher.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CONFIG_FILE_NAME", "LOOP_STATE_FILE", "CHECKPOINTS_DIR", "RunCheckpointError", "list_checkpoints",
           "run_checkpoint_dir", "find_run_checkpoint", "is_run_folder"]

CONFIG_FILE_NAME = "config.yaml"
LOOP_STATE_FILE = "loop_state.json"
#: the default ``CKPT_DIR`` under ``RUN_DIR`` (``checkpoint.dir`` empty)
CHECKPOINTS_DIR = "checkpoints"


class RunCheckpointError(ValueError):
    """The run folder has no (matching) complete checkpoint; the message says what exists."""


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


def is_run_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a run folder (``config.yaml`` or ``checkpoints/`` in it)."""
    path = Path(path)
    return (path / CONFIG_FILE_NAME).is_file() or (path / CHECKPOINTS_DIR).is_dir()


def run_checkpoint_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``CKPT_DIR`` of a run: ``checkpoint.dir`` from ``RUN_DIR/config.yaml`` when set, else ``RUN_DIR/checkpoints``."""
    import yaml

    run_dir = Path(run_dir)
    cfg_file = run_dir / CONFIG_FILE_NAME
    if cfg_file.is_file():
        configured = ((yaml.safe_load(cfg_file.read_text()) or {}).get("checkpoint") or {}).get("dir") or ""
        if configured:
            return Path(configured)
    return run_dir / CHECKPOINTS_DIR


def find_run_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """``(step, CKPT_DIR/step_NNNNNN)`` of a run: the latest complete checkpoint, or ``step``'s.

    Raises:
        RunCheckpointError: ``run_dir`` does not exist, has no complete checkpoint, or none at ``step``
            (the message lists the steps that exist).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunCheckpointError(f"run folder {str(run_dir)!r} does not exist")
    ckpt_dir = run_checkpoint_dir(run_dir)
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
