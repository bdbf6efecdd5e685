"""Small filesystem helpers shared by the converters, the train engine's checkpoints and plugins' caches."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["commit_dir", "apply_default_mode", "default_cache_dir", "find_package_file", "fsync_tree", "fsync_dir"]


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
    env = os.environ.get("FERRULE_CACHE_DIR")
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

    override = os.environ.get(env_var)
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

