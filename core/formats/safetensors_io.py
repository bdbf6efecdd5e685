"""Streaming safetensors reading and sharded writing (HF checkpoint layout): ``ferrule.formats.safetensors_io``.

Shared by the train engine (loading HF weights) and the converters (the old path
``ferrule.converters.safetensors_io`` is a moved module of :mod:`ferrule.compat`).

Reading: :class:`SafetensorsReader` opens an HF checkpoint directory (``model.safetensors``
or ``model.safetensors.index.json`` + shards) and returns one tensor at a time, memory-mapped
by the ``safetensors`` library, so reading costs about one tensor of memory. Every shard is
validated when the reader is opened (present, header parseable, data section as long as the
header says) so that a missing or truncated shard fails *before* any output is written.

Writing: :class:`ShardedSafetensorsWriter` packs tensors into ``model-0000i-of-0000n.safetensors``
files of at most ``max_shard_bytes`` and writes ``model.safetensors.index.json`` (the layout
``transformers.PreTrainedModel.save_pretrained`` writes).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CheckpointError", "SafetensorsReader", "ShardedSafetensorsWriter", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class CheckpointError(ValueError):
    """An input or output checkpoint is missing, truncated, inconsistent or refused."""


def _read_header(path: Path) -> dict:
    """Parse a safetensors header and check the file holds every byte the header promises.

    Raises:
        CheckpointError: file missing, header unreadable, or data section shorter than declared.
    """
    if not path.is_file():
        raise CheckpointError(f"safetensors shard {path} is missing; re-download or re-export the checkpoint.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"safetensors shard {path} is truncated ({size} bytes, no header).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"safetensors shard {path} is truncated: header says {n} bytes, file has {size}.")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"safetensors shard {path} has a corrupt header: {exc}.") from exc
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        end = max(end, int(info["data_offsets"][1]))
    if 8 + n + end > size:
        raise CheckpointError(
            f"safetensors shard {path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}; "
            f"re-download or re-export it."
        )
    return header


class SafetensorsReader:
    """Random-access, one-tensor-at-a-time reader over an HF checkpoint directory.

    Args:
        path: a directory holding ``model.safetensors.index.json`` (sharded) or
            ``model.safetensors`` (single file), or a path to one ``.safetensors`` file.

    Raises:
        CheckpointError: no safetensors files, an index naming a missing shard or not naming a
            ``model-*-of-*.safetensors`` shard of the folder, a truncated
            or corrupt shard, or a key listed in the index but absent from its shard.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.root = path if path.is_dir() else path.parent
        self._key_to_file: dict[str, Path] = {}
        self._headers: dict[Path, dict] = {}
        if path.is_file():
            files = [path]
        elif (path / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{path / INDEX_FILE} is not a valid safetensors index ({exc}).") from exc
            files = sorted({path / f for f in weight_map.values()})
            unlisted = sorted(q.name for q in path.glob("model-*-of-*.safetensors") if q not in files)
            if unlisted:  # its tensors would be reported missing without the reason
                raise CheckpointError(
                    f"{path / INDEX_FILE} does not name the shard(s) {unlisted} that are in {path}; the index is "
                    f"incomplete: re-save the model (save_pretrained), or add those shards' tensors to its weight_map.")
            for f in files:
                self._headers[f] = _read_header(f)
            absent = [k for k, f in weight_map.items() if k not in self._headers[path / f]]
            if absent:
                raise CheckpointError(
                    f"{path / INDEX_FILE} lists {len(absent)} keys that are not in their shard, e.g. {sorted(absent)[:5]}; "
                    f"the checkpoint is inconsistent."
                )
            omitted = {f.name: sorted(k for k in self._headers[f] if k != "__metadata__" and weight_map.get(k) != f.name)
                       for f in files}
            omitted = {name: keys for name, keys in omitted.items() if keys}
            if omitted:  # transformers loads by the index and drops them silently: a model missing a tensor
                name, keys = next(iter(omitted.items()))
                raise CheckpointError(
                    f"{path / name} holds {len(keys)} tensor(s) that {path / INDEX_FILE} does not map to it, e.g. "
                    f"{keys[:5]}; transformers loads by the index and would drop them silently, and so would a "
                    f"conversion: add them to the index's weight_map if the model needs them, or re-save the model "
                    f"(save_pretrained) to write a consistent folder.")
            self._key_to_file = {k: path / f for k, f in weight_map.items()}
            return
        elif (path / SINGLE_FILE).is_file():
            files = [path / SINGLE_FILE]
        elif not path.exists():
            raise CheckpointError(f"HF checkpoint directory {path} does not exist.")
        else:
            found = sorted(p.name for p in path.glob("*.safetensors")) if path.is_dir() else []
            raise CheckpointError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {path}"
                + (f" (found {found}; an index file is needed for several shards)" if found else "")
                + "; point at an HF checkpoint directory."
            )
        for f in files:
            header = self._headers[f] = _read_header(f)
            for k in header:
                if k != "__metadata__":
                    self._key_to_file[k] = f

    def keys(self) -> list[str]:
        """All tensor names, in a stable order (sorted)."""
        return sorted(self._key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_file

    def __len__(self) -> int:
        return len(self._key_to_file)

    def _header(self, key: str) -> dict:
        f = self._key_to_file[key]
        if f not in self._headers:
            self._headers[f] = _read_header(f)
        return self._headers[f][key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header(key)["shape"])

    def dtype_name(self, key: str) -> str:
        """The safetensors dtype string (``"BF16"``, ``"F32"``, ...)."""
        return self._header(key)["dtype"]

    def nbytes(self, key: str) -> int:
        info = self._header(key)
        n = _DTYPE_BYTES.get(info["dtype"], 1)
        for s in info["shape"]:
            n *= s
        return n

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._key_to_file)

    def get(self, key: str) -> "torch.Tensor":
        """Read one tensor (a fresh CPU tensor, not a view of the file).

        Raises:
            KeyError: the checkpoint has no such key (message names the directory).
        """
        from safetensors import safe_open

        if key not in self._key_to_file:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.root}")
        with safe_open(str(self._key_to_file[key]), framework="pt") as f:
            return f.get_tensor(key)

    def iter_tensors(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Yield ``(key, tensor)`` file by file, one tensor at a time."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k, f in self._key_to_file.items():
            by_file.setdefault(f, []).append(k)
        for f in sorted(by_file):
            with safe_open(str(f), framework="pt") as h:
                for k in sorted(by_file[f]):
                    yield k, h.get_tensor(k)


class ShardedSafetensorsWriter:
    """Write tensors into size-bounded safetensors shards plus an index json.

    Tensors are buffered until ``max_shard_bytes`` would be exceeded, then written; memory
    is bounded by one shard. Shards are first written as ``model-XXXXX.safetensors`` and
    renamed to ``model-0000i-of-0000n.safetensors`` by :meth:`close`, which also writes the
    index (or a single ``model.safetensors`` when one shard suffices).

    Args:
        out_dir: an existing (temporary) directory.
        max_shard_bytes: shard size bound in bytes (a single larger tensor gets its own shard).
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self._buf: dict[str, "torch.Tensor"] = {}
        self._buf_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: "torch.Tensor") -> None:
        """Queue one tensor; flush the current shard first if it would overflow.

        Raises:
            CheckpointError: the key was already written.
        """
        if key in self._buf or any(key in s for s in self._shards):
            raise CheckpointError(f"HF key {key!r} written twice; the mapping table exports it from two parameters.")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[key] = tensor.detach().contiguous()
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        idx = len(self._shards)
        save_file(self._buf, str(self.out_dir / f"model-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf = {}
        self._buf_bytes = 0

    def close(self) -> list[str]:
        """Flush, name the shards, write the index; return the file names written."""
        self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.out_dir / "model-00000.safetensors", self.out_dir / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map: dict[str, str] = {}
        names = []
        for i, keys in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"model-{i:05d}.safetensors", self.out_dir / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names + [INDEX_FILE]
