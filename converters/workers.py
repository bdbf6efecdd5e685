"""Running conversion workers: one rank in this process (an in-process store), several in spawned
processes that meet through a ``FileStore`` (no TCP port). A worker's error comes back to the
caller as the same exception type where it is a known one (:class:`ConversionError` otherwise).
Used by :mod:`ferrule.converters.checkpoint` (which re-exports these names) and ``ferrule check``.

No worker outlives the command that started it: each spawned rank asks the kernel for a
``SIGKILL`` when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread that
polls the parent pid), so a ``kill -9`` of ``ferrule convert`` takes its ranks with it; an
exception in the parent (Ctrl-C's ``KeyboardInterrupt``, ``SIGTERM`` turned into ``SystemExit``
while the ranks run) kills and reaps the ranks before it propagates, so the caller's cleanup
(removing the temporary output) runs after the last write.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from ferrule import envs
from ferrule.fs.util import sigterm_as_exit
from ferrule.formats.safetensors_io import CheckpointError
from ferrule.mapping import MappingError

__all__ = ["ConversionError"]


class ConversionError(RuntimeError):
    """A conversion failed; the message carries the worker's error (nothing was written)."""


_DIST_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "FERRULE_DIST_INIT_METHOD")


#: seconds between two looks at the parent pid where ``PR_SET_PDEATHSIG`` is not available
PARENT_POLL_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Make this process end (``SIGKILL``) as soon as the process ``parent_pid`` that started it dies.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (the kernel delivers it when the parent thread
    exits, whatever killed it); the parent pid is checked after the call, so a parent that died
    before it is caught too. Elsewhere: a daemon thread compares ``os.getppid()`` with
    ``parent_pid`` every :data:`PARENT_POLL_S` seconds and calls ``os._exit(1)``.
    torch's own spawn wrapper sets ``SIGINT`` as the death signal, which a rank blocked in a C call
    (a gloo collective, a thread join) never acts on: measured, both ranks of a ``--tp 2`` conversion
    stayed alive (reparented to PID 1) after a ``kill -9`` of ``ferrule convert``.
    """
    import ctypes
    import sys

    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent_pid:
                threading.Event().wait(PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="ferrule-parent-watch", daemon=True).start()


def _spawn_entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, err_dir: str,
                 parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    envs.set_vars(dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       FERRULE_DIST_INIT_METHOD=f"file://{init_file}"))
    try:
        fn(rank, *args)
    except BaseException as exc:  # report the worker's error text to the parent
        Path(err_dir, f"error-rank{rank}.txt").write_text(
            f"{type(exc).__name__}\n{exc}\n---\n{traceback.format_exc()}")
        raise


def _kill_all(processes) -> None:
    """``SIGKILL`` and reap every process of ``processes`` still alive."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


#: seconds the other ranks get to exit by themselves after one failed (they report the same, agreed error)
#: before they are killed
FAILED_RANK_GRACE_S = 5.0


class _RankFailed(RuntimeError):
    """A rank exited with a non-zero code (its report, if any, is in the errors folder)."""


def _join(processes) -> None:
    """Wait for every rank; on the first that fails, give the others :data:`FAILED_RANK_GRACE_S` to exit, then
    raise :class:`_RankFailed` (the caller kills what is left). Instead of torch's ``ProcessContext.join``,
    which logs a ``Terminating process N via signal SIGTERM`` warning for every rank still alive, so a
    failed ``ferrule convert --pp 2`` printed that line above its own one-line error."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: p for p in processes}
    while pending:
        for sentinel in wait(list(pending)):
            p = pending.pop(sentinel)
            p.join()
            if p.exitcode != 0:
                deadline = time.monotonic() + FAILED_RANK_GRACE_S
                for other in pending.values():
                    other.join(max(0.0, deadline - time.monotonic()))
                raise _RankFailed(f"a conversion rank (pid {p.pid}) exited with code {p.exitcode}")


def _run(world: int, fn: Callable, args: tuple, tmp: Path) -> None:
    """Run ``fn(rank, *args)`` on ``world`` ranks; re-raise the first worker error in the caller.

    No TCP port is taken: one rank runs in this process (an in-process store,
    :func:`ferrule.megatron.parallel.init_distributed`), several meet through a ``FileStore`` in the sibling
    folder ``<tmp>-ranks`` (beside the output folder ``tmp``, not in it: megatron's ``dist_checkpointing.save``
    warns "Overwriting old incomplete / corrupted checkpoint..." into a non-empty folder, which every
    ``ferrule convert --tp 2`` and ``ferrule check --tp 2`` printed; for a conversion it is named
    ``.OUT.tmp-PID-ranks``, so a killed conversion's is removed with its ``.OUT.tmp-PID``), also holding the
    ranks' error reports; it is removed at the end.
    """
    import torch.distributed as dist

    if world == 1 and not dist.is_initialized():
        with envs.scoped(dict.fromkeys(_DIST_KEYS)):  # the single-process branch, whatever the env
            try:
                fn(0, *args)
            except BaseException as exc:
                # the worker's locals (the model, megatron's process groups with their gloo threads) go now,
                # not when the caller drops the exception: measured, +45 threads held per failed conversion
                # for as long as the error was referenced; file and line of every frame stay in the traceback
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                from ferrule.megatron.parallel import destroy_distributed

                destroy_distributed()
        return
    import torch.multiprocessing as mp

    err_dir = Path(tmp).with_name(Path(tmp).name + "-ranks")
    err_dir.mkdir(exist_ok=True)
    try:
        with sigterm_as_exit():
            context = mp.start_processes(_spawn_entry, args=(world, str(err_dir / "rendezvous"), fn, args,
                                                             str(err_dir), os.getpid()),
                                         nprocs=world, join=False, start_method="spawn")
            try:
                _join(context.processes)
            except BaseException:
                _kill_all(context.processes)
                raise
    except Exception as exc:
        raise rank_error(err_dir, exc) from None
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)


def rank_error(err_dir: Path, exc: BaseException) -> Exception:
    """The exception to raise in the caller for a failed multi-rank run: the first rank's report in
    ``err_dir`` (``error-rankN.txt``, written by :func:`_spawn_entry`) as its own type where it is a
    known one (``MappingError``, ``CheckpointError``, ``FileExistsError``, ``ValueError``), else
    :class:`ConversionError`; ``exc`` (what the join saw) where no rank left a report."""
    reports = sorted(Path(err_dir).glob("error-rank*.txt"))
    if not reports:
        return ConversionError(f"a conversion worker died without a report: {exc}")
    kind, _, rest = reports[0].read_text().partition("\n")
    message = rest.split("\n---\n")[0]

    known = {"MappingError": MappingError, "CheckpointError": CheckpointError,
             "FileExistsError": FileExistsError, "ValueError": ValueError}
    return known.get(kind, ConversionError)(f"[{reports[0].stem}] {message}")
