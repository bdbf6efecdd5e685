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
from dataclasses import dataclass
from typing import Callable, Iterable

from .patching import PatchSet, set_attr

__all__ = ["TEPatch", "PATCHES", "PATCH_NAMES", "apply", "revert", "applied"]

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
    set_attr(record, importlib.import_module(_MOE_UTILS), "te_general_gemm", None)


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


_TABLE = PatchSet("te_compat", PATCHES)


def apply(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Install every patch whose ``needed()`` holds and is not installed yet (idempotent).

    Runs on any device. Returns the names installed now or before.

    Raises:
        ValueError: ``exclude`` names an unknown patch.
    """
    return _TABLE.apply(exclude, needed=lambda patch: patch.needed())


def applied() -> tuple[str, ...]:
    """Names of the patches currently installed, in table order."""
    return _TABLE.applied()


def revert(names: Iterable[str] | None = None) -> None:
    """Undo installed patches (all by default), restoring the original attributes."""
    _TABLE.revert(names)
