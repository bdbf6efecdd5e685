"""Runtime patches for megatron-core 0.16.1 running without TransformerEngine / Apex (any device).

These fix upstream code paths that break because TE (or Apex) is *absent*, not because CUDA is:
a ``pip install`` on a GPU machine has neither, so :func:`ferrule.megatron.device.get_backend`
applies this table on every machine where a patch's condition holds (CUDA or not), and the
CPU-only table (:mod:`ferrule.megatron.cpu_compat`) only where CUDA is absent.

Each :class:`TEPatch` carries ``needed()``, the upstream condition that makes it necessary
(checked at apply time, never the device), and the upstream error it avoids.
``tests/test_megatron_cpu_compat.py`` checks that upstream still fails that way without the
patch, and that the condition, not the device, decides (a simulated CUDA machine without TE
gets the patch; a module that defines the name gets nothing).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["TEPatch", "PATCHES", "PATCH_NAMES", "apply", "revert", "applied"]

_LOCK = threading.RLock()
_APPLIED: dict[str, list[tuple[Any, str, Any]]] = {}  # patch name -> [(owner, attr, original)]
_MISSING = object()

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _moe_lacks_te_general_gemm() -> bool:
    """True when ``moe_utils`` never bound ``te_general_gemm`` (its TE import block failed)."""
    return not hasattr(importlib.import_module(_MOE_UTILS), "te_general_gemm")


def patch_moe_te_general_gemm(record: list) -> None:
    """Define the missing ``te_general_gemm = None`` in ``transformer/moe/moe_utils.py``.

    Upstream bug in 0.16.1: the TransformerEngine import block defines ``te_general_gemm`` only
    when TE is installed, but ``RouterGatingLinearFunction.forward`` tests ``te_general_gemm is
    not None``. Without TE the router raises ``NameError: name 'te_general_gemm' is not
    defined`` on CPU and on CUDA alike (every megatron MoE family: Qwen3-MoE, Inkling).
    """
    moe_utils = importlib.import_module(_MOE_UTILS)
    record.append((moe_utils, "te_general_gemm", _MISSING))
    moe_utils.te_general_gemm = None


@dataclass(frozen=True)
class TEPatch:
    """One TE/Apex-absence patch: name, installer, upstream site and the condition that needs it."""

    name: str
    install: Callable[[list], None]
    upstream_site: str
    needed: Callable[[], bool]

    @property
    def reason(self) -> str:
        """The patch function's docstring (the upstream error and why)."""
        return (self.install.__doc__ or "").strip()


#: Every TE/Apex-absence patch, in installation order.
PATCHES: tuple[TEPatch, ...] = (
    TEPatch("moe_te_general_gemm", patch_moe_te_general_gemm,
            "megatron/core/transformer/moe/moe_utils.py:RouterGatingLinearFunction", _moe_lacks_te_general_gemm),
)

PATCH_NAMES = tuple(p.name for p in PATCHES)


def apply(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Install every patch whose ``needed()`` holds and is not installed yet (idempotent).

    Runs on any device. Returns the names installed now or before.

    Raises:
        ValueError: ``exclude`` names an unknown patch.
    """
    exclude = set(exclude)
    unknown = exclude - set(PATCH_NAMES)
    if unknown:
        raise ValueError(f"te_compat.apply: unknown patch names {sorted(unknown)}; known: {list(PATCH_NAMES)}.")
    with _LOCK:
        for patch in PATCHES:
            if patch.name in exclude or patch.name in _APPLIED or not patch.needed():
                continue
            record: list = []
            try:
                patch.install(record)
            except BaseException:
                _undo(record)
                raise
            _APPLIED[patch.name] = record
        return applied()


def applied() -> tuple[str, ...]:
    """Names of the patches currently installed, in table order."""
    return tuple(n for n in PATCH_NAMES if n in _APPLIED)


def _undo(record: list) -> None:
    for owner, attr, original in reversed(record):
        if original is _MISSING:
            owner.__dict__.pop(attr, None)
        else:
            setattr(owner, attr, original)


def revert(names: Iterable[str] | None = None) -> None:
    """Undo installed patches (all by default), restoring the original attributes."""
    with _LOCK:
        for name in reversed(PATCH_NAMES):
            if name in _APPLIED and (names is None or name in set(names)):
                _undo(_APPLIED.pop(name))
