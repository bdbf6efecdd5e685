"""Move a set of tensors' memory to host memory and back, bit for bit, keeping every tensor valid.

Colocated training (docs/train.md "Colocation"): the train engine and the rollout engine share
one device and take turns. :class:`HostStash` is the mechanism both use: it works on *storages*,
not tensors, so every tensor object, parameter, view and alias of a stashed storage (megatron's
DDP buckets and ``main_grad`` views into one gradient buffer, the distributed optimizer's shard
views, tied embeddings) stays the same Python object and sees its bytes again after
:meth:`~HostStash.onload`:

- :meth:`~HostStash.offload` copies each storage's bytes into a host buffer (page-locked on
  CUDA, so the copies run at PCIe/NVLink-C2C speed and can be asynchronous), then resizes the
  device storage to 0 bytes, which returns its memory to the caching allocator;
- :meth:`~HostStash.onload` resizes each storage back to its size (a new device allocation: data
  pointers change, so nothing may hold a raw pointer across a round trip, e.g. a captured CUDA
  graph) and copies the bytes back.

The host buffers are allocated once, on the first offload, and reused (page-locking memory is
far slower than copying into it). They are slices of ONE host allocation per stash, each
storage at a 4 KiB-aligned offset, page-locked with ``cudaHostRegister``: torch's own pinned
allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to a power of two, which
for a 6.7 B-parameter train state (per-parameter fp32 masters and Adam moments of 192 MiB, 384 MiB
and 2.3 GiB) asks for about 38 % more page-locked memory than the bytes moved -- more than the
H200 machine's host has. Where registering fails, the stash falls back to torch's pinned
allocator (``pinned`` says which). On CPU the same code runs with host-to-host copies, so the
CPU tests exercise the exact code path of the GPU (only the memory does not go anywhere).

Chosen over torch-memory-saver (``torch_memory_saver``, what miles and slime use): that library
swaps the CUDA allocator for its own (allocations must happen inside its ``region()``, so every
engine would be built under it), keeps virtual addresses across pause/resume (captured graphs
survive, but only in its ``LD_PRELOAD`` mode), and has no CPU path. Measured side by side on the
H200: docs/benchmarks.md "Colocation".
"""

from __future__ import annotations

import time
import weakref
from typing import Iterable

import torch

__all__ = ["HostStash", "unique_storages"]

_ALIGN = 4096  # bytes: each storage's offset in the host allocation (a page; divisible by every dtype)


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device,
                    exclude: Iterable[int] = ()) -> dict[int, torch.UntypedStorage]:
    """``{data_ptr: storage}`` of the non-empty storages of ``tensors`` that live on ``device``.

    Views and aliases of one storage count once. ``exclude``: data pointers to leave out (another
    stash's storages).
    """
    skip = set(exclude)
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device != device:
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in skip or ptr in out:
            continue
        out[ptr] = st
    return out


class _HostBuffers:
    """One host allocation holding every storage of a stash at a 4 KiB-aligned offset.

    On CUDA it is page-locked with ``cudaHostRegister`` (exact size) and unregistered when the
    last stash using it is gone; if registering fails, each slice is a separate block of torch's
    pinned allocator instead (rounded up to a power of two). ``host_bytes``: bytes of host memory
    held (the allocation, or the rounded blocks).
    """

    def __init__(self, sizes: list[int], pin: bool):
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        self.pinned = "none"
        flat = torch.empty(max(total, 1), dtype=torch.uint8)
        if pin and total and _register(flat):
            self.pinned = "registered"
            weakref.finalize(self, _unregister, flat)  # the callback holds ``flat``: freed only after it
        elif pin:
            self.pinned, flat = "torch", None
            self.slices = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
            self.host_bytes = sum(1 << max(n - 1, 0).bit_length() for n in sizes)
            return
        self.slices = [flat[o:o + n] for o, n in zip(offsets, sizes)]
        self.host_bytes = total


def _register(flat: torch.Tensor) -> bool:
    """Page-lock ``flat`` in place (``cudaHostRegister``); False where the driver refuses."""
    return int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)) == 0


def _unregister(flat: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    except Exception:  # interpreter shutdown: the process's memory goes anyway
        pass


def _bytes_view(st: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (nbytes,), (1,))


class HostStash:
    """The storages of a fixed set of tensors, movable between their device and host memory.

    Args:
        storages: :func:`unique_storages` output (taken once, at construction: a storage created
            later is not part of the stash).
        device: where the storages live (``cuda:N`` or ``cpu``).
        name: for messages (``"train weights"``).
        discard: the bytes are all zeros and need no copy: offload only frees them, onload
            reallocates and zero-fills (gradient buffers between accumulation windows).
        reuse: a previous stash whose host buffers to take over when its storage sizes are the
            same (page-locked host memory is allocated once per layout, not per offload).

    Attributes:
        nbytes: bytes moved by one offload or onload.
        host_bytes: host memory the stash's buffers hold once allocated (0 before the first
            offload; ``nbytes`` rounded up to 4 KiB per storage when page-locked by registration).
        pinned: ``"registered"`` (one page-locked allocation), ``"torch"`` (torch's pinned
            allocator, the fallback), ``"none"`` (CPU, or not allocated yet).
        freed_bytes: device bytes an offload releases (all of them, except for storages that
            cannot be resized, such as memory-mapped CPU weights, which stay in place).
        offloaded: True between :meth:`offload` and :meth:`onload`.
    """

    def __init__(self, storages: dict[int, torch.UntypedStorage], device: torch.device, name: str, *,
                 discard: bool = False, reuse: "HostStash | None" = None):
        self.device = torch.device(device)
        self.name = name
        self.discard = discard
        self._storages = list(storages.values())
        self._sizes = [st.nbytes() for st in self._storages]
        self._ptrs = list(storages)
        self._buffers: _HostBuffers | None = None
        if reuse is not None and reuse._buffers is not None and reuse._sizes == self._sizes and not reuse.offloaded:
            self._buffers = reuse._buffers  # same layout as last time: no new page-locked allocation
        # a storage that cannot be resized (memory-mapped from a file, e.g. weights transformers loaded on
        # CPU) keeps its bytes in place: it is copied out and back like the others, only not freed
        self._resizable = [st.resizable() for st in self._storages]
        self.nbytes = 0 if discard else sum(self._sizes)
        self.freed_bytes = sum(n for n, r in zip(self._sizes, self._resizable) if r)
        self.offloaded = False

    @property
    def _host(self) -> list[torch.Tensor] | None:
        return None if self._buffers is None else self._buffers.slices

    @property
    def host_bytes(self) -> int:
        return 0 if self._buffers is None else self._buffers.host_bytes

    @property
    def pinned(self) -> str:
        return "none" if self._buffers is None else self._buffers.pinned

    def __len__(self) -> int:
        return len(self._storages)

    def ptrs(self) -> set[int]:
        """Data pointers of the stashed storages as taken at construction (for ``exclude``)."""
        return set(self._ptrs)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def offload(self) -> float:
        """Copy every storage to host memory and free its device bytes; returns seconds taken.

        Raises:
            RuntimeError: already offloaded, or a storage was resized by someone else meanwhile.
        """
        if self.offloaded:
            raise RuntimeError(f"{self.name}: offload() called twice; call onload() first.")
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        for st, n in zip(self._storages, self._sizes):
            if st.nbytes() != n:
                raise RuntimeError(f"{self.name}: a stashed storage changed size ({st.nbytes()} != {n} bytes) "
                                   "since the stash was built; rebuild it.")
        if not self.discard:
            if self._buffers is None:
                self._buffers = _HostBuffers(self._sizes, pin)
            for st, n, host in zip(self._storages, self._sizes, self._host):
                host.copy_(_bytes_view(st, n), non_blocking=pin)
        self._sync()  # the bytes are on the host before the device memory is given back
        for st, resizable in zip(self._storages, self._resizable):
            if resizable:
                st.resize_(0)
        self.offloaded = True
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Reallocate every storage on its device and copy its bytes back; returns seconds taken.

        Raises:
            RuntimeError: not offloaded.
        """
        if not self.offloaded:
            raise RuntimeError(f"{self.name}: onload() without a previous offload().")
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        for i, (st, n) in enumerate(zip(self._storages, self._sizes)):
            if self._resizable[i]:
                st.resize_(n)
            if self.discard:
                _bytes_view(st, n).zero_()
            else:
                _bytes_view(st, n).copy_(self._host[i], non_blocking=pin)
        self._sync()
        self.offloaded = False
        return time.perf_counter() - t0

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """While offloaded: a host tensor aliasing the bytes of ``t`` (same dtype, shape, strides),
        so that writes land in what :meth:`onload` brings back.

        Raises:
            RuntimeError: not offloaded. KeyError: ``t`` is not a view of a stashed storage.
        """
        if not self.offloaded or self.discard:
            raise RuntimeError(f"{self.name}: host_view() needs the stash offloaded with its bytes kept.")
        st = t.untyped_storage()
        for own, host in zip(self._storages, self._host):
            if own._cdata == st._cdata:  # ``host`` is a slice at a 4 KiB-aligned byte offset
                offset = host.storage_offset() // t.element_size() + t.storage_offset()
                return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), offset, t.shape, t.stride())
        raise KeyError(f"{self.name}: tensor of shape {tuple(t.shape)} is not in this stash.")
