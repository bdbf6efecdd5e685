"""Kernel-released exclusive locks on files: one writer per run folder or conversion output.

:func:`exclusive` takes a POSIX record lock (``fcntl.lockf``, ``F_SETLK``) on a lock file and
writes the holder (pid, host, command, start time) into it. The kernel drops the lock when the
holding process ends, however it ends (``kill -9`` included), so a lock is never stale. Record
locks belong to a process, not to a file descriptor: a child forked by the holder (megatron's
async checkpoint writer, torch's spawned workers) does not inherit it, and a second lock taken
by the same process on the same file succeeds (here: counted, released with the last).

Used by ``ferrule train`` (``RUN_DIR/.ferrule.lock``) and ``ferrule convert`` / ``ferrule
export`` (``.OUT.lock`` beside ``OUT``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LockedError", "exclusive", "acquire", "release", "holder"]


class LockedError(RuntimeError):
    """Another live process holds the lock; the message names it (pid, host, command, start)."""


#: this process's locks: absolute lock path -> [fd, count]
_HELD: dict[str, list[int]] = {}


def holder(lock_path: str | os.PathLike) -> str:
    """The holder recorded in ``lock_path``, as ``pid N on HOST since TIME (COMMAND)``."""
    try:
        info = json.loads(Path(lock_path).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a process that is just starting"
    return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')} "
            f"({info.get('command', '?')})")


def acquire(lock_path: str | os.PathLike, what: str) -> None:
    """Take the lock on ``lock_path`` (created if missing) without waiting.

    Args:
        lock_path: the lock file.
        what: the locked thing for the message, e.g. ``"run folder runs/x"``.

    Raises:
        LockedError: another process holds it (``"<what> is in use by pid N on HOST since ...
            (COMMAND)"``).
    """
    key = str(Path(lock_path).absolute())
    if key in _HELD:
        _HELD[key][1] += 1
        return
    Path(key).parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LockedError(f"{what} is in use by {holder(key)}; wait for it to finish or stop it") from None
        try:  # the file may have been removed by its last holder between open and lock: lock the new one
            if os.fstat(fd).st_ino == os.stat(key).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _HELD[key] = [fd, 1]


def release(lock_path: str | os.PathLike, *, remove: bool = False) -> None:
    """Drop one hold of ``lock_path``; the last one unlocks (and with ``remove`` deletes the file)."""
    key = str(Path(lock_path).absolute())
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    if remove:
        Path(key).unlink(missing_ok=True)
    else:
        os.ftruncate(held[0], 0)
    os.close(held[0])  # closing the descriptor drops the record lock


@contextmanager
def exclusive(lock_path: str | os.PathLike, what: str, *, remove: bool = False) -> Iterator[None]:
    """``with exclusive(path, what):`` holds the lock for the block (:func:`acquire`, :func:`release`)."""
    acquire(lock_path, what)
    try:
        yield
    finally:
        release(lock_path, remove=remove)
