"""megatron-core's ``torch.compile`` decorations left uncompiled on a machine without CUDA.

megatron-core 0.16.1 decorates ~38 fused elementwise functions with ``megatron.core.jit.jit_fuser``
(``torch.compile``) at import, and the first ``torch.compile`` call imports torch's inductor
(``torch._inductor.compile_fx``): 2-5 s of every interpreter that imports megatron. ferrule turns
megatron's fusions on only on CUDA (:mod:`ferrule.megatron.gpu_fusions`), but a CPU run still calls a
few of these functions: every MoE layer's router calls ``TopKRouter._apply_expert_bias`` on each forward,
and a family whose activation is megatron's ``quick_gelu`` (gpt-oss) calls it in every expert. Compiled,
each costs the inductor import plus a C++ kernel build (measured on the 2-core test machine: a gpt-oss
``ferrule check`` at TP=1 took 22.7 s in a fresh interpreter, 7.3 s with them uncompiled; a planted
mistake that changes a guarded value compiled again, +5.6 s), for elementwise work on tensors of a few
kilobytes.

:func:`install` (called once by ``ferrule/__init__.py``, next to :func:`ferrule.compat.install`) puts an
import hook on ``sys.meta_path`` that runs :func:`defer_jit_fuser` right after ``megatron.core.jit``
executes, so every interpreter that imports ferrule before megatron (every ferrule entry point, the
conversion ranks, the kit's programs, the test workers) has it in place: megatron's fused functions are
then the plain Python functions (:func:`eager_fuser`), which compute the same expression eagerly (as HF's
reference does). An interpreter that imported megatron first keeps megatron's ``torch.compile``. On CUDA
nothing changes. :func:`lazy_compile` (``torch.compile`` made at the first call) stays for code that wants
a deferred compile.

Importing this module imports nothing but the standard library (``import ferrule`` stays torch-free);
torch is imported only when megatron's ``jit`` module executes (megatron has imported torch by then).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

__all__ = ["defer_jit_fuser", "eager_fuser", "install", "lazy_compile"]


def lazy_compile(fn=None, **options):
    """``torch.compile(fn, **options)`` made on ``fn``'s first call instead of at decoration (``fn`` runs
    compiled from its first call on, exactly as under ``torch.compile``, which compiles at the first call
    too); usable bare (``@lazy_compile``) or with options, as ``torch.compile`` is."""
    if fn is None:
        return functools.partial(lazy_compile, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def eager_fuser(fn=None, **options):
    """megatron's ``jit_fuser`` on a machine without CUDA: ``fn`` itself, uncompiled (``options``, those of
    ``torch.compile``, are ignored); usable bare (``@eager_fuser``) or with options, as ``torch.compile`` is."""
    if fn is None:
        return eager_fuser
    return fn


def defer_jit_fuser(jit_module) -> bool:
    """Replace ``megatron.core.jit.jit_fuser`` (``torch.compile``) by :func:`eager_fuser` on a machine
    without CUDA, before megatron's fused functions are decorated with it. True if replaced."""
    import torch

    if torch.cuda.is_available() or getattr(jit_module, "jit_fuser", None) is not torch.compile:
        return False
    jit_module.jit_fuser = eager_fuser
    return True


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finder does and runs :func:`defer_jit_fuser` right after it
    executes (megatron's modules take ``jit_fuser`` from it as they are imported, after it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            defer_jit_fuser(module)

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _DeferJitFuser()


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (idempotent; nothing to do once megatron's ``jit`` module
    has been imported: its functions are decorated already)."""
    if "megatron.core.jit" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
