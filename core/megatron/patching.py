"""The mechanics shared by ferrule's megatron patch tables (:mod:`ferrule.megatron.cpu_compat`,
its literal patches in :mod:`ferrule.megatron.cpu_compat_literals`): a recording ``setattr`` and
its undo, and the CUDA-device test the patches use.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MEGATRON_CORE_VERSION", "MISSING", "set_attr", "undo", "is_cuda_device"]

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
