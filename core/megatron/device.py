"""The one device abstraction of the train engine: CUDA + NCCL or CPU + gloo.

This module is the only place in ferrule allowed to call ``torch.cuda.*``. Two patch tables,
each on its own condition: :mod:`ferrule.megatron.te_compat` (upstream paths broken because
TransformerEngine / Apex are absent) on every machine where a patch's condition holds, CUDA or
not; :mod:`ferrule.megatron.cpu_compat` (megatron-core 0.16.1 hard-codes CUDA in places) only on a
machine without CUDA: on a CUDA machine that module is never imported.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from ferrule import envs

__all__ = ["DeviceBackend", "get_backend", "default_kind"]


@dataclass(frozen=True)
class DeviceBackend:
    """Device, process-group backend and RNG policy for one process.

    Attributes:
        kind: ``'cuda'`` or ``'cpu'``.
        dist_backend: ``'nccl'`` (cuda) or ``'gloo'`` (cpu).
    """

    kind: Literal["cuda", "cpu"]
    dist_backend: Literal["nccl", "gloo"]

    @property
    def device(self) -> torch.device:
        """The torch device parameters and activations live on (``cuda:<LOCAL_RANK>`` or ``cpu``)."""
        if self.kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its GPU (``torch.cuda.set_device``); a no-op on CPU."""
        if self.kind == "cuda":
            torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        """Wait for queued device work (``torch.cuda.synchronize``); a no-op on CPU."""
        if self.kind == "cuda":
            torch.cuda.synchronize()

    def seed_all(self, seed: int) -> None:
        """Seed every RNG megatron uses, identically on every rank of a model-parallel group.

        - ``torch.manual_seed(seed)`` seeds the CPU generator (on CPU it is the only generator,
          and megatron's ``use_cpu_initialization`` draws the full master weight from it before
          splitting, so TP ranks agree).
        - ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` registers the
          data-parallel / tensor-parallel / expert-parallel RNG states that megatron forks
          (``DotProductAttention`` forks the tracker even at dropout 0). On CPU the tracker is
          the inference tracker (``inference_rng_tracker=True``): its ``fork()`` is a null
          context, so dropout inside TP regions is not decorrelated across TP ranks. ferrule's
          families train with dropout 0.

        Must run after ``initialize_model_parallel`` (it reads the TP/EP ranks).
        """
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        if self.kind == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)

    def allocated_bytes(self) -> int | None:
        """Bytes in tensors now on CUDA (``torch.cuda.memory_allocated``'s counter), None on CPU; one
        counter read from the nested statistics, without flattening every allocator statistic as
        ``memory_allocated`` does (~0.1 ms each), and without a device synchronisation (the caching
        allocator counts on the host when a tensor is made or freed)."""
        if self.kind != "cuda":
            return None
        stats = torch.cuda.memory_stats_as_nested_dict()
        return int(stats.get("allocated_bytes", {}).get("all", {}).get("current", 0))

    def memory_stats(self) -> dict[str, int]:
        """Memory use in bytes: ``allocated``/``reserved``/``peak_allocated`` on CUDA; on CPU the
        process ``rss`` and ``peak_rss`` (``ru_maxrss``)."""
        if self.kind == "cuda":
            return {
                "allocated": int(torch.cuda.memory_allocated()),
                "reserved": int(torch.cuda.memory_reserved()),
                "peak_allocated": int(torch.cuda.max_memory_allocated()),
            }
        import resource

        import psutil

        return {
            "rss": int(psutil.Process(os.getpid()).memory_info().rss),
            "peak_rss": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        }

    def total_memory(self) -> int | None:
        """Bytes of memory of this process's device (CUDA); None on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return None

    def reset_peak_memory(self) -> None:
        """Reset the CUDA peak counter; a no-op on CPU (``ru_maxrss`` cannot be reset)."""
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()


def default_kind() -> Literal["cuda", "cpu"]:
    """The device kind :func:`get_backend` picks on this machine (``'cuda'`` when CUDA is
    available), without choosing the backend or applying any patch: for code that places
    tensors beside the train engine (``ferrule serve``'s sampler) before or without one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


_BACKEND: DeviceBackend | None = None
_LOCK = threading.Lock()


def get_backend(kind: str | None = None) -> DeviceBackend:
    """The process's backend: CUDA+NCCL when CUDA is available, otherwise CPU+gloo.

    The first call fixes the backend for the process. It applies
    :func:`ferrule.megatron.te_compat.apply` on every device (each patch only where its
    condition holds) and, on CPU only, :func:`ferrule.megatron.cpu_compat.apply` (both idempotent).

    Args:
        kind: ``'cuda'`` or ``'cpu'`` to insist on one; None picks automatically. The
            environment variable ``FERRULE_DEVICE`` (``cuda``/``cpu``) does the same.

    Raises:
        RuntimeError: ``'cuda'`` requested without a CUDA device, or a request conflicts with
            the backend already chosen in this process.
        ValueError: an unknown kind.
    """
    global _BACKEND
    kind = kind or envs.get("FERRULE_DEVICE")
    if kind not in (None, "cuda", "cpu"):
        raise ValueError(f"device kind {kind!r} is unknown; use 'cuda' or 'cpu' (or unset FERRULE_DEVICE).")
    with _LOCK:
        if _BACKEND is not None:
            if kind is not None and kind != _BACKEND.kind:
                raise RuntimeError(
                    f"device backend already chosen as {_BACKEND.kind!r} in this process; cannot switch to {kind!r}."
                )
            return _BACKEND
        has_cuda = torch.cuda.is_available()
        if kind == "cuda" and not has_cuda:
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False; use 'cpu'.")
        if kind == "cpu" and has_cuda:
            raise RuntimeError(
                "device 'cpu' requested on a CUDA machine; ferrule's CPU patches are for CUDA-less "
                "machines only (hide the GPUs with CUDA_VISIBLE_DEVICES='' to train on CPU)."
            )
        from . import te_compat

        te_compat.apply()
        if has_cuda:
            _BACKEND = DeviceBackend(kind="cuda", dist_backend="nccl")
        else:
            from . import cpu_compat

            cpu_compat.apply()
            _BACKEND = DeviceBackend(kind="cpu", dist_backend="gloo")
        return _BACKEND
