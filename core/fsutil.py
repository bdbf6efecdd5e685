"""Small filesystem helpers shared by the converters and the train engine's checkpoints."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["commit_dir"]


def commit_dir(tmp: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Move a completely written directory ``tmp`` to ``out_dir`` (same filesystem).

    An existing ``out_dir`` is first renamed aside and deleted only after the new one is in
    place, so at every moment ``out_dir`` is either the old complete directory or the new
    complete one, never a half-written mix. Callers decide beforehand whether overwriting is
    allowed. Returns the absolute ``out_dir``.
    """
    out = Path(out_dir).absolute()
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
