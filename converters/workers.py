"""Running conversion workers: one rank in this process (an in-process store), several in spawned
processes that meet through a ``FileStore`` (no TCP port). A worker's error comes back to the
caller as the same exception type where it is a known one (:class:`ConversionError` otherwise).
Used by :mod:`ferrule.converters.checkpoint` (which re-exports these names) and ``ferrule check``.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path
from typing import Callable

from ferrule.safetensors_io import CheckpointError

__all__ = ["ConversionError"]


class ConversionError(RuntimeError):
    """A conversion failed; the message carries the worker's error (nothing was written)."""


_DIST_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "FERRULE_DIST_INIT_METHOD")


def _spawn_entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, err_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      FERRULE_DIST_INIT_METHOD=f"file://{init_file}")
    try:
        fn(rank, *args)
    except BaseException as exc:  # report the worker's error text to the parent
        Path(err_dir, f"error-rank{rank}.txt").write_text(
            f"{type(exc).__name__}\n{exc}\n---\n{traceback.format_exc()}")
        raise


def _run(world: int, fn: Callable, args: tuple, tmp: Path) -> None:
    """Run ``fn(rank, *args)`` on ``world`` ranks; re-raise the first worker error in the caller.

    No TCP port is taken: one rank runs in this process (an in-process store,
    :func:`ferrule.megatron.parallel.init_distributed`), several meet through a ``FileStore`` in ``tmp``.
    """
    import torch.distributed as dist

    if world == 1 and not dist.is_initialized():
        saved = {k: os.environ.pop(k, None) for k in _DIST_KEYS}  # the single-process branch, whatever the env
        try:
            fn(0, *args)
        finally:
            from ferrule.megatron.parallel import destroy_distributed

            destroy_distributed()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return
    import torch.multiprocessing as mp

    err_dir = tmp / ".errors"
    err_dir.mkdir(exist_ok=True)
    try:
        mp.start_processes(_spawn_entry, args=(world, str(err_dir / "rendezvous"), fn, args, str(err_dir)),
                           nprocs=world, join=True, start_method="spawn")
    except Exception as exc:
        reports = sorted(err_dir.glob("error-rank*.txt"))
        if not reports:
            raise ConversionError(f"a conversion worker died without a report: {exc}") from None
        kind, _, rest = reports[0].read_text().partition("\n")
        message = rest.split("\n---\n")[0]
        from ferrule.mapping import MappingError

        known = {"MappingError": MappingError, "CheckpointError": CheckpointError,
                 "FileExistsError": FileExistsError, "ValueError": ValueError}
        raise known.get(kind, ConversionError)(f"[{reports[0].stem}] {message}") from None
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)
