"""Where ``ferrule serve`` computes: the sampler's device and dtype, and the CPU threads of the
worker and of the event loop.

- **Sampler device**: the training device. On a CUDA machine the train engines are on the GPU
  (:func:`ferrule.megatron.device.default_kind`), and so is every base's embedded rollout engine
  (with its CUDA-graph / compiled fast decode path, :class:`ferrule.rollout.embedded.EmbeddedEngine`);
  the CPU only on a machine without CUDA.
- **Sampler dtype** (``--sampler-dtype``): ``auto`` is bfloat16 on CUDA (the dtype the fast decode
  path is built and measured for) and float32 on CPU (the exact path the numerics tests compare with
  HF in fp32); ``float32`` on a GPU gives fp32 sampling logprobs at about half the decode speed.
- **Threads** (``--worker-threads``): the single worker thread that runs every operation sets its
  own torch intra-op thread count at start (default: the CPUs this process may use, minus one
  for the event loop; at least 1); the event-loop thread uses 1. torch's OpenMP thread count is
  per thread, so neither setting changes the other's, and neither depends on ``OMP_NUM_THREADS``.
  (An in-process server, as the tests start, sets neither: its worker keeps the count of the thread
  that built it, so its results are bit-identical to references computed in the test's thread.)
  Measured before this (issue 46, 2-core machine): the 8 x 200 load test ran at 3.14 requests/s
  with the default thread count and 31.5 with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["SamplerPlacement", "sampler_placement", "default_worker_threads", "available_cpus", "set_thread_count",
           "DTYPES"]

#: ``--sampler-dtype`` values -> torch dtype names (``auto``: bfloat16 on CUDA, float32 on CPU)
DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}


@dataclass(frozen=True)
class SamplerPlacement:
    """The device (``"cuda"`` / ``"cpu"``) and dtype name (``"bfloat16"`` / ``"float16"`` /
    ``"float32"``) of a base's sampler (its embedded rollout engine)."""

    device: str
    dtype: str

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def as_json(self) -> dict[str, str]:
        return {"device": self.device, "dtype": self.dtype}


def sampler_placement(dtype: str | None = "auto", device: str | None = None) -> SamplerPlacement:
    """The sampler's placement for ``--sampler-dtype dtype`` on this machine (``device``: for tests
    only; default :func:`ferrule.megatron.device.default_kind`).

    Raises:
        ValueError: a dtype not in :data:`DTYPES`, naming the accepted ones.
    """
    key = "auto" if dtype is None else str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ValueError(f"--sampler-dtype {dtype!r} is not one of {', '.join(DTYPES)}; use auto (bfloat16 on CUDA, "
                         "float32 on CPU) or a dtype name.")
    if device is None:
        from ferrule.megatron.device import default_kind

        device = default_kind()
    name = DTYPES[key] or ("bfloat16" if device == "cuda" else "float32")
    return SamplerPlacement(device, name)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def default_worker_threads() -> int:
    """torch intra-op threads of the worker: :func:`available_cpus` minus one for the event loop, >= 1."""
    return max(1, available_cpus() - 1)


def set_thread_count(threads: int) -> None:
    """``torch.set_num_threads(threads)`` for the calling thread (OpenMP's count is per thread)."""
    import torch

    torch.set_num_threads(int(threads))
