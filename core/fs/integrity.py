"""Checksums of the files a checkpoint save writes, verified when the checkpoint is read (issue 28).

A torch_dist checkpoint (``TrainEngine.save``, ``ferrule convert`` HF -> torch_dist) holds
``checksums.json`` (:data:`CHECKSUMS_FILE`)::

    {"format": "ferrule-checksums-v1", "algorithm": "xxh3_64",
     "files": {"<path relative to the folder>": {"bytes": int, "xxh3_64": "<16 hex digits>"}, ...}}

covering every regular file of the folder written before it (the torch_dist ``.distcp`` shards,
``.metadata``, ``common.pt``, ``metadata.json``, ``engine_state.json``, ``rng/rank_R.pt``,
``lora/*``, ``hf/*``). Without it, damage is read silently or as a traceback from deep inside
torch: 64 zeroed bytes inside a ``.distcp`` load as a wrong model; a truncated ``rng/rank_0.pt``
fails in ``torch.load`` without naming the file. :func:`verify_checksums` names the first file
that is missing, shorter or longer than written, or whose content differs, in one line
(:class:`CheckpointIntegrityError`, a ``CheckpointError``: ``ferrule`` exits with code 2). A
folder without the file (written before it existed) is not verified.

The hash is XXH3-64 (``xxhash``: measured 4.4 GB/s on one busy core of the 2-core CPU machines,
where sha256 gave 0.17 GB/s); it detects damage, it is no signature. Several ranks share the work
(file ``i`` of the sorted list is hashed by rank ``i % world``) and gather the results.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrule.formats.safetensors_io import CheckpointError

__all__ = ["CHECKSUMS_FILE", "ALGORITHM", "CheckpointIntegrityError", "file_digest", "text_digest",
           "record_checksums", "verify_checksums"]

CHECKSUMS_FILE = "checksums.json"
FORMAT = "ferrule-checksums-v1"
ALGORITHM = "xxh3_64"
#: Bytes read per ``update`` while hashing a file.
CHUNK_BYTES = 16 << 20

#: ``all_gather(obj) -> [obj of rank 0, obj of rank 1, ...]``; None: one process.
Gather = Callable[[Any], list]


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint file is missing, truncated or damaged; ``path`` names it."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


def file_digest(path: str | os.PathLike) -> str:
    """XXH3-64 of a file's bytes as 16 hex digits."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def text_digest(text: str) -> str:
    """XXH3-64 of ``text`` (UTF-8) as 16 hex digits."""
    import xxhash

    return xxhash.xxh3_64(text.encode()).hexdigest()


def _listing(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.name != CHECKSUMS_FILE)


def _shared(items: list, rank: int, world: int, gather: Gather | None, fn: Callable[[Any], Any]) -> list:
    """``[fn(item) for item in items]``, item ``i`` computed on rank ``i % world`` and gathered."""
    mine = {i: fn(item) for i, item in enumerate(items) if i % world == rank}
    parts = gather(mine) if gather is not None and world > 1 else [mine]
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    return [merged[i] for i in range(len(items))]


def record_checksums(directory: str | os.PathLike, *, rank: int = 0, world: int = 1,
                     gather: Gather | None = None) -> dict[str, dict[str, Any]]:
    """Hash every file of ``directory`` and write :data:`CHECKSUMS_FILE` into it (rank 0).

    Collective when ``world > 1`` (every rank calls it with the same ``gather``; the folder must
    be on a filesystem all ranks see). Returns the ``files`` table.
    """
    directory = Path(directory)
    names = _listing(directory)
    digests = _shared(names, rank, world, gather,
                      lambda n: {"bytes": (directory / n).stat().st_size, ALGORITHM: file_digest(directory / n)})
    files = dict(zip(names, digests))
    if rank == 0:
        tmp = directory / f".{CHECKSUMS_FILE}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, indent=1) + "\n")
        os.replace(tmp, directory / CHECKSUMS_FILE)
    return files


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    path = directory / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {manifest.get('algorithm')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointIntegrityError(f"checkpoint file {path} is damaged ({type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())[:120]}): the checkpoint cannot be verified",
                                       path) from None
    return files


def _edited_json(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file that still parses (so an edit, not a torn write, changed its size)."""
    if path.suffix != ".json":
        return False
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        return False
    return True


def _check_one(directory: Path, name: str, want: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"checkpoint file {path} is missing (the save wrote {want.get('bytes')} bytes; {CHECKSUMS_FILE})"
    size = path.stat().st_size
    if size != want.get("bytes") and _edited_json(path):
        return (f"checkpoint file {path} was changed since the save: it is valid JSON of {size} bytes where the "
                f"save wrote {want.get('bytes')} (edited by hand?); restore the saved version, or, to load the edited "
                f"one on purpose, delete its entry \"{name}\" from {directory / CHECKSUMS_FILE}")
    if size != want.get("bytes"):
        how = "truncated" if isinstance(want.get("bytes"), int) and size < want["bytes"] else "resized"
        return (f"checkpoint file {path} is damaged ({how}): {size} bytes, the save wrote {want.get('bytes')} "
                f"({CHECKSUMS_FILE})")
    got = file_digest(path)
    if got != want.get(ALGORITHM):
        return (f"checkpoint file {path} is damaged: its content differs from what the save wrote "
                f"({ALGORITHM} {got}, recorded {want.get(ALGORITHM)} in {CHECKSUMS_FILE})")
    return None


def verify_checksums(directory: str | os.PathLike, *, rank: int = 0, world: int = 1,
                     gather: Gather | None = None) -> bool:
    """Check every file :data:`CHECKSUMS_FILE` lists (size, then XXH3-64). Collective like
    :func:`record_checksums`; every rank raises the same error.

    Returns:
        True when verified, False when the folder has no checksums (an older checkpoint).

    Raises:
        CheckpointIntegrityError: one line naming the first damaged file (sorted order), or
            the checksums file itself when it cannot be read.
    """
    directory = Path(directory)
    files = _read_manifest(directory)
    if files is None:
        return False
    names = sorted(files)
    problems = _shared(names, rank, world, gather, lambda n: _check_one(directory, n, files[n]))
    first = next((i for i, p in enumerate(problems) if p is not None), None)
    if first is not None:
        raise CheckpointIntegrityError(problems[first], directory / names[first])
    return True
