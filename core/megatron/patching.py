"""The mechanics shared by ferrule's megatron patch tables (:mod:`ferrule.megatron.cpu_compat`,
its literal patches in :mod:`ferrule.megatron.cpu_compat_literals`, :mod:`ferrule.megatron.te_compat`):
a recording ``setattr`` and its undo, the installed state of a table (:class:`PatchSet`: apply,
applied, revert) and the CUDA-device test the patches use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["MEGATRON_CORE_VERSION", "MISSING", "set_attr", "undo", "is_cuda_device", "PatchSet"]

#: The megatron-core release the patches were written and tested against.
MEGATRON_CORE_VERSION = "0.16.1"

#: the original of an attribute that did not exist (``undo`` deletes it again)
MISSING = object()


def set_attr(record: list, owner: Any, attr: str, value: Any) -> None:
    """setattr that remembers the original (or its absence) in ``record`` for :func:`undo`."""
    original = owner.__dict__.get(attr, MISSING) if isinstance(owner, type) else getattr(owner, attr, MISSING)
    record.append((owner, attr, original))
    setattr(owner, attr, value)


def undo(record: list) -> None:
    """Restore every ``(owner, attr, original)`` of ``record``, newest first."""
    for owner, attr, original in reversed(record):
        if original is MISSING:
            try:
                delattr(owner, attr)
            except AttributeError:
                pass
        else:
            setattr(owner, attr, original)


class PatchSet:
    """Which patches of one table are installed, with the undo record of each, under one lock.

    ``patches`` is the table in installation order: objects with ``name`` and ``install(record)``
    (which patches through :func:`set_attr` on ``record``). ``label`` names the table in errors.
    """

    def __init__(self, label: str, patches: Sequence[Any]) -> None:
        self.label = label
        self.patches = tuple(patches)
        self.names = tuple(p.name for p in self.patches)
        self._lock = threading.RLock()
        self._applied: dict[str, list] = {}  # patch name -> [(owner, attr, original)]

    def apply(self, exclude: Iterable[str] = (), needed: Callable[[Any], bool] = lambda patch: True) -> tuple[str, ...]:
        """Install every patch not in ``exclude``, not installed yet and ``needed`` (idempotent); a patch
        whose install raises is undone before the error propagates. Returns :meth:`applied`.

        Raises:
            ValueError: ``exclude`` names an unknown patch.
        """
        exclude = set(exclude)
        unknown = exclude - set(self.names)
        if unknown:
            raise ValueError(f"{self.label}.apply: unknown patch names {sorted(unknown)}; known: {list(self.names)}.")
        with self._lock:
            for patch in self.patches:
                if patch.name in exclude or patch.name in self._applied or not needed(patch):
                    continue
                record: list = []
                try:
                    patch.install(record)
                except BaseException:
                    undo(record)
                    raise
                self._applied[patch.name] = record
            return self.applied()

    def applied(self) -> tuple[str, ...]:
        """Names of the patches currently installed, in table order."""
        return tuple(n for n in self.names if n in self._applied)

    def revert(self, names: Iterable[str] | None = None) -> None:
        """Undo installed patches (all by default, newest first), restoring the original attributes."""
        wanted = None if names is None else set(names)
        with self._lock:
            for name in reversed(self.names):
                if name in self._applied and (wanted is None or name in wanted):
                    undo(self._applied.pop(name))


def is_cuda_device(device: Any) -> bool:
    """True for ``'cuda'``, ``'cuda:N'``, ``torch.device('cuda', N)`` and bare ints (CUDA ordinals)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False
