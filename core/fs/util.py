"""Small filesystem helpers shared by the converters, the train engine's checkpoints and plugins' caches."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import uuid
from pathlib import Path

from ferrule import envs

__all__ = ["commit_dir", "apply_default_mode", "default_cache_dir", "find_package_file", "fsync_tree", "fsync_dir",
           "DiskFullError", "check_free_space", "disk_full_message", "is_disk_full", "remove_stale_temp_dirs",
           "temp_dir_name", "sigterm_as_exit"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_default_mode(path: str | os.PathLike, *, recursive: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open()``/``mkdir()`` would have (0666/0777 minus umask).

    ``tempfile.mkstemp``/``mkdtemp`` (and safetensors' writer) create private 0600/0700 entries;
    files renamed into place from them would otherwise stay unreadable to other users of a
    shared cluster. With ``recursive`` every entry below a directory is fixed too.
    """
    mask = _umask()
    root = Path(path)
    entries = [root]
    if recursive and root.is_dir():
        entries += list(root.rglob("*"))
    for p in entries:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a directory, so the entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """``fsync`` every file under ``root`` (a file: itself), then each directory bottom-up.

    Run before the rename that publishes ``root``: without it a crash soon after the rename can
    leave a published checkpoint whose files were never written to disk (zero-length or holes),
    because the rename reaches the disk before the data does (ext4 ``data=ordered`` aside).
    """
    root = Path(root)
    if root.is_file():
        with open(root, "rb") as f:
            os.fsync(f.fileno())
        return
    dirs = []
    for here, _, files in os.walk(root):
        dirs.append(here)
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
    for here in reversed(dirs):
        fsync_dir(here)


def commit_dir(tmp: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Move a completely written directory ``tmp`` to ``out_dir`` (same filesystem).

    An existing ``out_dir`` is first renamed aside and deleted only after the new one is in
    place, so at every moment ``out_dir`` is either the old complete directory or the new
    complete one, never a half-written mix; every file of ``tmp`` is fsynced before the rename and
    the parent directory after it (:func:`fsync_tree`). Entries get default permissions
    (:func:`apply_default_mode`). Callers decide beforehand whether overwriting is allowed.
    Returns the absolute ``out_dir``.
    """
    out = Path(out_dir).absolute()
    apply_default_mode(tmp, recursive=True)
    fsync_tree(tmp)  # the data is on disk before the rename publishes it
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)  # and the rename itself
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    """Where ferrule and its plugins cache downloads: ``$FERRULE_CACHE_DIR`` if set, else ``~/.cache/ferrule``."""
    env = envs.get("FERRULE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ferrule"


def find_package_file(env_var: str, candidates, *, missing_hint: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package.

    Order: the path in ``$env_var`` (must be a file), then each ``(package, relative path)`` of
    ``candidates`` under the package's location (``importlib.util.find_spec``; a package with a
    compiled core or heavy imports is never imported).

    Raises:
        FileNotFoundError: ``$env_var`` names no file, or no candidate exists; the message ends
            with ``missing_hint`` (what to install, which variable to set).
    """
    import importlib.util

    override = envs.plugin_file_override(env_var)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{env_var}={override!r} is not a file; {missing_hint}")
        return Path(override)
    for package, rel in candidates:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            if (Path(root) / rel).is_file():
                return Path(root) / rel
    raise FileNotFoundError(missing_hint)



class DiskFullError(RuntimeError):
    """A write needs more space than the filesystem has; the message names the folder and the sizes."""


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def disk_full_message(path: str | os.PathLike, needed_bytes: int | None, *, write_failed: bool = False) -> str:
    """``"no space left on PATH (needed ~N MB, free M MB)"`` with the free space of ``path``'s filesystem now.

    ``write_failed``: the message is for a write that failed with ``ENOSPC`` (not for the check before
    writing). When the filesystem has room for ``needed_bytes`` again by the time the message is made
    (the disk was full only for an instant: another process was writing, or this write's own
    partial output, since removed, filled it), the message says so instead of only printing a free
    space that contradicts "no space left".
    """
    free = shutil.disk_usage(_existing(path)).free
    need = f"needed ~{_mb(needed_bytes)} MB, " if needed_bytes else ""
    if write_failed and (needed_bytes is None or free >= needed_bytes):
        return (f"no space left on {path} ({need}free {_mb(free)} MB): the filesystem was full at the moment of a "
                "write and has room again now (another process filling it, or this write's own partial output, since "
                "removed); check what else writes there, then retry")
    return f"no space left on {path} ({need}free {_mb(free)} MB): free some space or write elsewhere"


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_free_space(path: str | os.PathLike, needed_bytes: int, *, margin: float = 1.05,
                     name: str | os.PathLike | None = None) -> None:
    """Refuse a write of about ``needed_bytes`` into ``path`` when its filesystem has less free.

    Raises:
        DiskFullError: ``free < needed_bytes * margin`` (:func:`disk_full_message`, naming
            ``name`` or ``path``).
    """
    if shutil.disk_usage(_existing(path)).free < needed_bytes * margin:
        raise DiskFullError(disk_full_message(name or path, needed_bytes))


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps: ``__cause__`` / ``__context__``, torch's
    ``CheckpointException.failures``) is a full disk: ``ENOSPC``, or its text ("No space left
    on device"; torch's zip writer reports a short write as "unexpected pos")."""
    import errno

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = str(e)
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


def _pid_alive(pid: int) -> bool:
    import psutil

    return pid != os.getpid() and psutil.pid_exists(pid)


def remove_stale_temp_dirs(root: str | os.PathLike, depth: int = 2) -> list[tuple[Path, int]]:
    """Delete the temporary folders of killed or failed writes under ``root`` (up to ``depth`` levels).

    A temporary folder is a hidden ``.NAME.tmp-PID-HEX`` (:func:`temp_dir_name`) or ``.NAME.old-HEX``
    (:func:`commit_dir`) folder. One whose PID is still alive (another process writing) is kept.
    Returns ``[(path, bytes)]`` of what was removed.
    """
    root = Path(root)
    out: list[tuple[Path, int]] = []
    if not root.is_dir():
        return out
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            for sub in d.iterdir():
                if not sub.is_dir() or sub.is_symlink():
                    continue
                if sub.name.startswith(".") and (".tmp-" in sub.name or ".old-" in sub.name):
                    tag = sub.name.rsplit(".tmp-", 1)[-1] if ".tmp-" in sub.name else ""
                    pid = tag.split("-")[0]
                    if pid.isdigit() and _pid_alive(int(pid)):
                        continue
                    size = sum(f.stat().st_size for f in sub.rglob("*") if f.is_file() and not f.is_symlink())
                    shutil.rmtree(sub, ignore_errors=True)
                    out.append((sub, size))
                elif not sub.name.startswith("."):
                    nxt.append(sub)
        level = nxt
    return out


def temp_dir_name(name: str) -> str:
    """The hidden temporary sibling name of ``name`` for a write by this process: ``.NAME.tmp-PID-HEX``."""
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class sigterm_as_exit:
    """``with sigterm_as_exit():`` a ``SIGTERM`` (a scheduler's preemption, ``kill``, torchrun's stop) with
    the default action raises ``SystemExit(143)`` in the main thread instead of ending the process at
    once, so the ``finally`` blocks of a writer run: its temporary output is removed and its lock
    released (``ferrule convert`` / ``export`` / ``lora export``). Any other handler, or another
    thread, is left alone; the previous handler is restored on exit. Re-entrant.
    """

    def __enter__(self) -> "sigterm_as_exit":
        self.saved = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_term(signum, frame):
                raise SystemExit(128 + signum)

            self.saved = signal.signal(signal.SIGTERM, on_term)
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            signal.signal(signal.SIGTERM, self.saved)
