"""A float64 run of code written for float32 (HF modelling code and ferrule's plugins alike), for reference checks.

Both transformers' Inkling-2 code and ferrule's plugin upcast to float32 by name (``x.float()``,
``.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``, fp32 parameters), so ``model.double()`` alone
still computes partly in fp32. Inside :func:`promoted_to_fp64` every float32 the code names is float64
(``torch.float32`` / ``torch.float`` point at ``torch.float64``, ``Tensor.float()`` gives float64, the default
dtype is float64); :class:`Float32Watch` (a ``TorchDispatchMode``: sees every aten op, backward included) records
any op that still returns a float32 tensor, so a test can assert that the whole run was float64.

Use only around forward / backward of models already ``.double()``-ed: safetensors' dtype table reads
``torch.float32`` too, so loading or saving inside the context misreads the bytes (load before, save after).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FLOAT32 = torch.float32  # the real one, kept before any patching


@contextlib.contextmanager
def promoted_to_fp64():
    """Within: float32 as named by code means float64 (see the module docstring). Restores everything on exit."""
    saved = torch.float32, torch.float, torch.Tensor.float, torch.get_default_dtype()
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = lambda self, memory_format=torch.preserve_format: self.to(torch.float64)
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float, default = saved
        torch.set_default_dtype(default)


class Float32Watch(TorchDispatchMode):
    """Records (in ``self.ops``) the aten ops that returned a float32 tensor while active."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == FLOAT32:
                self.ops.add(str(func))
        return out


@contextlib.contextmanager
def fp64_run():
    """:func:`promoted_to_fp64` plus a :class:`Float32Watch`; raises ``AssertionError`` naming the ops if any
    returned float32 (the run was then not a float64 reference)."""
    watch = Float32Watch()
    with promoted_to_fp64(), watch:
        yield watch
    assert not watch.ops, f"float32 ops inside the float64 run: {sorted(watch.ops)}"


def relative_errors(got: dict, want: dict) -> dict:
    """``{key: max |got - want| / max |want|}`` in float64 (0/0 -> 0), over ``want``'s keys."""
    out = {}
    for k, w in want.items():
        d = (got[k].double() - w.double()).abs().max().item()
        s = w.abs().max().item()
        out[k] = d / s if s > 0 else d
    return out
