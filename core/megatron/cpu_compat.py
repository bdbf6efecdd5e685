"""Runtime patches that let megatron-core 0.16.1 train on CPU with gloo.

Imported and applied only by :func:`ferrule.megatron.device.get_backend` when CUDA is absent
(never on a GPU machine). Fixes for TransformerEngine / Apex being absent, on any device, are
not here: they are in :mod:`ferrule.megatron.te_compat`, applied on CUDA machines too. Every patch is a named function with the upstream site it works
around and the error upstream raises without it; :data:`PATCHES` lists them in the order
:func:`apply` installs them. ``tests/test_megatron_cpu_compat.py`` checks, for each patch, that
upstream 0.16.1 *still* fails the documented way without it (so the test fails, and the patch
can be retired, once upstream is fixed) and that the patched path works.

The measurements behind each patch are in ``shared/reference/megatron_cpu_lab.md``. Narrowest
fix first: device literals are rewritten only inside the megatron modules that hard-code
``device="cuda"`` (a module-local ``torch`` proxy, zero cost elsewhere), and the
``Tensor.type() == 'torch.cuda.FloatTensor'`` checks are satisfied only inside the few
optimizer functions that make them (a scoped ``TorchFunctionMode``), not by a global
``TorchFunctionMode`` over every op (the lab measured +80 % step time for that).

Patches are process-global monkeypatches; :func:`revert` undoes them (used by tests).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ferrule.compat import renamed_name

from .cpu_compat_literals import (patch_causal_mask_device_literal, patch_embedding_group_cuda,
                                  patch_optimizer_device_literals, patch_optimizer_type_checks,
                                  patch_schedules_device_literal)
from .patching import set_attr as _set
from .patching import PatchSet

__all__ = ["Patch", "PATCHES", "apply", "revert", "applied"]


def __getattr__(name: str):
    # MEGATRON_CORE_VERSION / is_cuda_device (ferrule.megatron.patching) were re-exported here; ferrule.compat lists them
    return renamed_name(__name__, name)


# ----------------------------------------------------------------------------------------
# P-dev, P-sync, P-stream: the torch.cuda entry points megatron calls unconditionally.
# ----------------------------------------------------------------------------------------

def patch_current_device(record: list) -> None:
    """``torch.cuda.current_device()`` returns ``"cpu"``.

    Upstream: megatron allocates at ``torch.cuda.current_device()`` in many places, e.g.
    ``megatron/core/utils.py`` ``GlobalMemoryBuffer.get_tensor`` (attention matmul buffer),
    RoPE ``inv_freq`` placement, DDP grad buffers (``distributed/param_and_grad_buffer.py``).
    Without the patch: ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    _set(record, torch.cuda, "current_device", lambda: "cpu")


def patch_synchronize(record: list) -> None:
    """``torch.cuda.synchronize()`` is a no-op (CPU ops are synchronous).

    Upstream: ``dist_checkpointing/strategies/filesystem_async.py`` (torch_dist save) and
    ``distributed_data_parallel.py`` call it unconditionally.
    Without the patch: ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    _set(record, torch.cuda, "synchronize", lambda device=None: None)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``/``Event`` on CPU: every wait/record is a no-op."""

    device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuStreamClass(_CpuStream):
    """Replaces the class ``torch.cuda.Stream``: constructing it returns the one CPU stream.

    A class, not a function, so that annotations such as ``torch.cuda.Stream | None``
    (evaluated at import time by transformers) and ``isinstance`` checks keep working.
    ``Stream()``, ``current_stream()`` and ``default_stream()`` must be the *same* object, or
    the MoE dispatcher believes it runs on a side stream and calls ``Tensor.record_stream``
    (which fails on CPU tensors).
    """

    _instance: "_CpuStreamClass | None" = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "_CpuStreamClass":
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _CpuEventClass(_CpuStream):
    """Replaces the class ``torch.cuda.Event``: a no-op event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


_THE_STREAM = _CpuStreamClass()


def patch_streams(record: list) -> None:
    """``torch.cuda.Stream/Event/stream/current_stream/default_stream`` become no-op stubs.

    Upstream: ``transformer/moe/token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher`` builds a
    ``torch.cuda.Stream``), ``distributed_data_parallel.py`` (``overlap_grad_reduce``
    communication stream). Without the patch: ``RuntimeError: torch.cuda.Stream requires CUDA
    support`` (or the "not compiled with CUDA" assertion).
    """
    _set(record, torch.cuda, "Stream", _CpuStreamClass)
    _set(record, torch.cuda, "Event", _CpuEventClass)
    _set(record, torch.cuda, "current_stream", lambda device=None: _THE_STREAM)
    _set(record, torch.cuda, "default_stream", lambda device=None: _THE_STREAM)
    _set(record, torch.cuda, "stream", lambda stream=None: _THE_STREAM)


# ----------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------

def patch_moe_split_sizes(record: list) -> None:
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns a numpy array for CPU tensors too.

    Upstream: ``transformer/moe/moe_utils.py`` converts only CUDA tensors; on CPU the alltoall
    dispatcher (``token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher.preprocess``) passes
    torch tensors as ``input_split_sizes`` to ``torch.distributed.all_to_all_single``, which
    raises ``TypeError: ... incompatible function arguments`` (expects ``list[int]``). Applied
    at both the definition and the dispatcher's imported name.
    """
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set(record, moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _set(record, dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# ----------------------------------------------------------------------------------------
# gloo
# ----------------------------------------------------------------------------------------

def patch_gloo_scatter_contiguous(record: list) -> None:
    """``torch.distributed.scatter`` makes every tensor of ``scatter_list`` contiguous.

    Upstream (torch's gloo backend, not megatron): scattering non-contiguous views (e.g.
    ``weight.chunk(tp, dim=1)``, the row-parallel split) sends the wrong elements **without an
    error**; NCCL code paths usually get contiguous copies from ``.to('cuda')``, which is a
    no-op on CPU. Found with megatron-bridge TP=2 loads (o_proj/down_proj off by ~0.1).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.scatter

    @functools.wraps(original)
    def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, **kwargs):
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return original(tensor, scatter_list, src, group, async_op, **kwargs)

    _set(record, dist, "scatter", scatter)
    _set(record, c10d, "scatter", scatter)


def patch_gloo_uneven_all_gather(record: list) -> None:
    """``torch.distributed.all_gather`` accepts a ``tensor_list`` whose tensors differ in their first dimension.

    Upstream (torch's gloo backend, not megatron): ``ProcessGroupGloo::allgather`` needs every output tensor
    to have the input's size and raises ``RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at
    index 1 (expected (2), got (3))``; NCCL gathers uneven sizes. megatron's alltoall dispatcher at expert
    TP > 1 (``token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher.token_dispatch`` ->
    ``mappings.py`` ``_gather_along_first_dim(output_split_sizes=...)``) gathers a different token count
    from each TP rank, so MoE training at TP > 1 (:mod:`ferrule.megatron.moe`) needs it. The patched call
    pads every rank's tensor to the longest first dimension, gathers, and copies each rank's rows out.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.all_gather

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] if t.dim() else None for t in tensor_list]
        if async_op or len(set(rows)) <= 1 or any(t.shape[1:] != tensor.shape[1:] for t in tensor_list):
            return original(tensor_list, tensor, group, async_op)
        longest = max(rows)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        out = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
        original(out, padded, group, False)
        for t, o, n in zip(tensor_list, out, rows):
            t.copy_(o[:n])
        return None

    _set(record, dist, "all_gather", all_gather)
    _set(record, c10d, "all_gather", all_gather)


# ----------------------------------------------------------------------------------------
# Table, apply, revert
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Patch:
    """One CPU patch: its name, the function that installs it and the upstream site it covers."""

    name: str
    install: Callable[[list], None]
    upstream_site: str

    @property
    def reason(self) -> str:
        """The patch function's docstring (the upstream error and why)."""
        return (self.install.__doc__ or "").strip()


#: Every patch, in installation order.
PATCHES: tuple[Patch, ...] = (
    Patch("current_device", patch_current_device, "megatron/core/utils.py:GlobalMemoryBuffer.get_tensor"),
    Patch("synchronize", patch_synchronize, "megatron/core/dist_checkpointing/strategies/filesystem_async.py"),
    Patch("streams", patch_streams, "megatron/core/transformer/moe/token_dispatcher.py:MoEAlltoAllTokenDispatcher"),
    Patch("moe_split_sizes", patch_moe_split_sizes, "megatron/core/transformer/moe/moe_utils.py:maybe_move_tensor_to_cpu"),
    Patch("gloo_scatter_contiguous", patch_gloo_scatter_contiguous, "torch/distributed/distributed_c10d.py:scatter (gloo)"),
    Patch("gloo_uneven_all_gather", patch_gloo_uneven_all_gather,
          "torch/distributed/distributed_c10d.py:all_gather (gloo), megatron/core/tensor_parallel/mappings.py"),
    Patch("optimizer_device_literals", patch_optimizer_device_literals, "megatron/core/optimizer/{optimizer,clip_grads,grad_scaler}.py"),
    Patch("optimizer_type_checks", patch_optimizer_type_checks, "megatron/core/optimizer/{distrib_optimizer,optimizer,clip_grads}.py"),
    Patch("schedules_device_literal", patch_schedules_device_literal, "megatron/core/pipeline_parallel/schedules.py"),
    Patch("causal_mask_device_literal", patch_causal_mask_device_literal, "megatron/core/transformer/utils.py:get_default_causal_mask"),
    Patch("embedding_group_cuda", patch_embedding_group_cuda,
          "megatron/core/models/common/language_module/language_module.py:setup_embeddings_and_output_layer"),
)

PATCH_NAMES = tuple(p.name for p in PATCHES)


_TABLE = PatchSet("cpu_compat", PATCHES)


def apply(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Install every patch not already installed (idempotent); returns the installed names.

    Args:
        exclude: patch names to leave out (tests use it to show upstream still needs a patch).

    Raises:
        RuntimeError: CUDA is available (the patches are for CUDA-less machines only).
        ValueError: ``exclude`` names an unknown patch.
    """
    if torch.cuda.is_available() and not set(exclude) - set(PATCH_NAMES):
        raise RuntimeError("ferrule cpu_compat must not be applied on a machine with CUDA; use DeviceBackend('cuda').")
    return _TABLE.apply(exclude)


def applied() -> tuple[str, ...]:
    """Names of the patches currently installed, in table order."""
    return _TABLE.applied()


def revert(names: Iterable[str] | None = None) -> None:
    """Undo installed patches (all by default), restoring the original attributes."""
    _TABLE.revert(names)
