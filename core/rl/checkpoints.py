"""Checkpoint folders of the RL loop: the resume config check, atomic small-file writes.

The folder layout itself (listing, finding a run's checkpoint) is :mod:`ferrule.fs.run_layout`
(its names, once re-exported here, still resolve here for one release with a DeprecationWarning:
:data:`ferrule.compat.RENAMED_NAMES`).

``CKPT_DIR/step_NNNNNN/`` holds ``engine/`` (:meth:`ferrule.megatron.engine.TrainEngine.save`)
and :data:`~ferrule.fs.run_layout.LOOP_STATE_FILE` (``{"step", "sampler", "engine_step", "config"}``), which is written
last and atomically: a folder without it is incomplete and ignored by :func:`~ferrule.fs.run_layout.list_checkpoints`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ferrule.fs.util import apply_default_mode, fsync_dir
from ferrule.compat import renamed_name

#: Keys that may change between a run and its resume (everything else must match).
#: ``parallel.*`` may change: the train engine's torch_dist checkpoint reshards (or its load
#: names what cannot be), and the rollout depends on ``rollout.prompts_per_shard``, not the layout.
#: The engine settings (``train_engine.*``, ``rollout_engine.*``, ``weight_sync.*``) change speed and
#: memory, and at most the rounding of bf16 results, so a resume may pick other ones.
RESUME_MUTABLE = ("train.steps", "train.colocate", "checkpoint.", "logging.", "eval.", "parallel.", "train_engine.",
                  "rollout_engine.", "weight_sync.")


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (never half-written;
    fsynced before the rename, the folder after it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename publishes it (loop_state.json completes a checkpoint)
    apply_default_mode(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


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


def __getattr__(name: str):
    # PEP 562: the run-layout names this module re-exported before they moved to ferrule.fs.run_layout
    # (ferrule.compat.RENAMED_NAMES: for users' code written against the previous release)

    return renamed_name(__name__, name)
