"""The output directory of a conversion or export: one writer (a kernel lock), leftovers of killed
writers removed, the free space checked before writing, a full disk named with the sizes.

A conversion writes ``OUT`` through a hidden temporary sibling ``.OUT.tmp-PID`` that is renamed to
``OUT`` when complete (:func:`ferrule.fs.util.commit_dir`; an ``--overwrite`` renames the old ``OUT``
to ``.OUT.old-HEX`` first); a LoRA export stages its merge in ``.OUT.merge-PID-HEX``. A
``kill -9`` leaves those behind (up to the model's size each); the next writer of ``OUT``
removes them once it holds the lock and says so, keeping any whose PID is alive.
Used by :mod:`ferrule.converters.checkpoint`,
:mod:`ferrule.converters.export` and ``ferrule lora export`` (:mod:`ferrule.cli.lora`); a foundation
module (it needs only :mod:`ferrule.fs.util`), so that the LoRA layer may use it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ferrule.fs.util import DiskFullError, check_free_space, disk_full_message, is_disk_full
from ferrule.fs import locks

__all__ = ["output_lock", "lock_output", "unlock_output", "prepare_out", "remove_stale_outputs",
           "hf_write_bytes", "torch_dist_model_bytes", "disk_full_from", "Notice"]

#: ``notice(message)``: where a conversion tells the user what it did besides writing (``ferrule
#: convert`` prints it; the default logs a warning on the ``ferrule.converters`` logger)
Notice = Callable[[str], None]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_FLOAT_SAFETENSORS = {"F32", "BF16", "F16", "F64", "F8_E4M3", "F8_E5M2"}


def _notify(notice: Notice | None, message: str) -> None:
    (notice or logging.getLogger("ferrule.converters").warning)(message)


def output_lock(out_dir: str | os.PathLike) -> Path:
    """The lock file beside ``out_dir`` (``.NAME.lock``) that one writer of ``out_dir`` holds."""
    out_dir = Path(out_dir).absolute()
    return out_dir.parent / f".{out_dir.name}.lock"


def lock_output(out_dir: str | os.PathLike, overwrite: bool, notice: Notice | None = None) -> None:
    """Become the one writer of ``out_dir`` (:func:`ferrule.fs.locks.acquire` on :func:`output_lock`),
    then remove the leftovers of killed writers of it (:func:`remove_stale_outputs`) and say so
    through ``notice``; release with :func:`unlock_output`.

    Raises:
        ferrule.fs.locks.LockedError: another conversion or export is writing ``out_dir`` (names its pid).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False (checked under the lock, so
            of two conversions started together the second is refused once the first committed).
    """
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    locks.acquire(output_lock(out_dir), f"output directory {out_dir} (another conversion or export writes it)")
    if out_dir.exists() and not overwrite:
        unlock_output(out_dir)
        raise FileExistsError(f"output directory {out_dir} already exists; pass overwrite=True (--overwrite) "
                              f"to replace it, or choose another path.")
    removed = remove_stale_outputs(out_dir)
    if removed:
        _notify(notice, f"removed {len(removed)} temporary folder(s) of interrupted writes of {out_dir} "
                        f"({sum(b for _, b in removed) / 1e6:,.1f} MB): " + ", ".join(p.name for p, _ in removed))


def unlock_output(out_dir: str | os.PathLike) -> None:
    """Release :func:`lock_output` (the lock file is removed)."""
    locks.release(output_lock(out_dir), remove=True)


def _pid_of(tag: str) -> int | None:
    head = tag.split("-")[0]
    return int(head) if head.isdigit() else None


def remove_stale_outputs(out_dir: str | os.PathLike) -> list[tuple[Path, int]]:
    """Delete the hidden siblings that killed writers of ``out_dir`` left: ``.NAME.tmp-PID...`` and
    ``.NAME.merge-PID-HEX`` whose PID is dead, ``.NAME.old-HEX`` (:func:`ferrule.fs.util.commit_dir`), and
    the merge folder's own temporary sibling and lock file (``..NAME.merge-PID-HEX.tmp-PID``,
    ``..NAME.merge-PID-HEX.lock``; the lock files are counted in the result too).
    Call it holding :func:`lock_output` (no other writer of ``out_dir`` is alive then).

    Returns:
        ``[(path, bytes)]`` of the folders removed.
    """
    import psutil

    out_dir = Path(out_dir).absolute()
    removed = []
    if not out_dir.parent.is_dir():
        return removed
    for sub in sorted(out_dir.parent.glob(f".{out_dir.name}.*")):
        kind, _, tag = sub.name[len(out_dir.name) + 2:].partition("-")
        if kind not in ("tmp", "merge", "old") or not sub.is_dir() or sub.is_symlink():
            continue
        pid = _pid_of(tag) if kind != "old" else None
        if pid is not None and pid != os.getpid() and psutil.pid_exists(pid):
            continue  # a live writer's (or a reused pid's): kept
        if pid == os.getpid():
            continue
        size = sum(f.stat().st_size for f in sub.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(sub, ignore_errors=True)
        removed.append((sub, size))
    # a LoRA export converts the base into .NAME.merge-PID-HEX as a conversion of its own, whose temporary
    # sibling and lock are ..NAME.merge-PID-HEX.tmp-PID and ..NAME.merge-PID-HEX.lock (fp32: the model's size)
    for sub in sorted(out_dir.parent.glob(f"..{out_dir.name}.merge-*")):
        pid = _pid_of(sub.name[len(out_dir.name) + len("..") + len(".merge-"):])
        if sub.is_symlink() or pid == os.getpid() or (pid is not None and psutil.pid_exists(pid)):
            continue
        if sub.is_dir():
            size = sum(f.stat().st_size for f in sub.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(sub, ignore_errors=True)
        else:
            size = sub.stat().st_size
            sub.unlink(missing_ok=True)
        removed.append((sub, size))
    return removed


def prepare_out(out_dir: str | os.PathLike, overwrite: bool, needed_bytes: int,
                notice: Notice | None = None) -> Path:
    """Lock ``out_dir`` (:func:`lock_output`), check that ``needed_bytes`` fit, make the temporary
    sibling ``.NAME.tmp-PID`` and return it; the caller unlocks.

    Raises:
        ferrule.fs.util.DiskFullError: the filesystem has less free space than ``needed_bytes``
            (5% margin; "no space left on OUT (needed ~N MB, free M MB)"); the lock is released.
        ferrule.fs.locks.LockedError, FileExistsError: see :func:`lock_output`.
    """
    out_dir = Path(out_dir).absolute()
    lock_output(out_dir, overwrite, notice)
    try:
        check_free_space(out_dir.parent, needed_bytes, name=out_dir)
    except DiskFullError:
        unlock_output(out_dir)
        raise
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _files_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name not in skip) \
        if folder.is_dir() else 0


def hf_write_bytes(reader, dtype: str, hf_dir: str | os.PathLike) -> int:
    """Bytes a torch_dist conversion of ``reader`` (a :class:`~ferrule.formats.safetensors_io.SafetensorsReader`
    of ``hf_dir``) writes: each floating tensor in ``dtype``, other tensors as stored, plus the side
    files of ``hf_dir`` (everything but ``*.safetensors``)."""
    total = 0
    for key in reader.keys():
        if reader.dtype_name(key) in _FLOAT_SAFETENSORS:
            total += math.prod(reader.shape(key)) * _ITEMSIZE.get(dtype, 4)
        else:
            total += reader.nbytes(key)
    side = sum(f.stat().st_size for f in Path(hf_dir).iterdir() if f.is_file() and f.suffix != ".safetensors")
    return total + side


def torch_dist_model_bytes(ckpt_dir: str | os.PathLike, dtype: str, skip_prefixes: tuple[str, ...] = ()) -> int:
    """Bytes of the model tensors of the torch_dist checkpoint ``ckpt_dir`` written in ``dtype`` (read
    from its ``.metadata``: global shapes; keys starting with ``skip_prefixes``, e.g. the optimizer
    state, left out), plus the files of ``ckpt_dir/hf`` (config, tokenizer, passthrough tensors)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    total = sum(math.prod(v.size) * _ITEMSIZE.get(dtype, 4) for k, v in meta.state_dict_metadata.items()
                if hasattr(v, "size") and not k.startswith(skip_prefixes))
    return total + _files_bytes(Path(ckpt_dir) / "hf")


def disk_full_from(exc: BaseException, out_dir: str | os.PathLike, needed_bytes: int | None) -> DiskFullError | None:
    """A :class:`~ferrule.fs.util.DiskFullError` naming ``out_dir`` and the sizes when ``exc`` is (or wraps, or a
    worker reported) ``ENOSPC`` (:func:`ferrule.fs.util.is_disk_full`), or a DiskFullError naming another
    path (a staging folder); None otherwise (``exc`` already says it, or is no full disk)."""
    if isinstance(exc, DiskFullError):
        if str(exc).startswith(f"no space left on {out_dir} "):
            return None
    elif not is_disk_full(exc):
        return None
    return DiskFullError(disk_full_message(out_dir, needed_bytes, write_failed=True)
                         + " (a write failed: No space left on device)")
