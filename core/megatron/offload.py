"""Offload / onload of a :class:`~ferrule.megatron.engine.TrainEngine`'s device memory (colocation).

What moves (per process, on this rank's device; :class:`ferrule.offload.HostStash` does the
copies, storage by storage, so every parameter, DDP bucket view and optimizer reference stays
valid and comes back bit for bit):

- **optimizer state**: the torch optimizers' parameters (fp32 master weights of a bf16 model,
  the distributed optimizer's shards) and every tensor of their ``state`` (Adam's ``exp_avg``,
  ``exp_avg_sq``); always.
- **gradient buffers**: DDP's ``grad_data`` (what ``main_grad`` views). Between accumulation
  windows they are all zeros, so they are only freed and zero-filled again on onload (no copy);
  inside an open window (after ``forward_backward``, before ``optim_step``) their bytes travel.
- **weights** (``offload(weights=True)``): the model's parameters and buffers (bf16 or fp32;
  for fp32 models, which are their own optimizer masters, these storages count as weights).

After :meth:`TrainOffload.offload` the device holds only what megatron allocated elsewhere
(RNG trackers, small scalars); the caching allocator's free blocks are released with
``torch.cuda.empty_cache`` so another process could use them too.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ferrule.offload import HostStash, unique_storages
from .optim import _torch_optimizers

__all__ = ["TrainOffload"]


def _ddp_buffers(engine: Any) -> list:
    return [b for chunk in engine.model for b in (list(getattr(chunk, "buffers", []) or [])
                                                  + list(getattr(chunk, "expert_parallel_buffers", []) or []))]


def _weight_tensors(engine: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for chunk in engine.model:
        out.extend(p.data for p in chunk.parameters())
        out.extend(torch.nn.Module.buffers(chunk))  # DDP's own ``buffers`` attribute is its param/grad buffer list
    out.extend(b.param_data for b in _ddp_buffers(engine) if getattr(b, "param_data", None) is not None)
    return out


def _optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for opt in _torch_optimizers(engine.optimizer):
        for group in opt.param_groups:
            out.extend(p.data for p in group["params"])
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


class TrainOffload:
    """The offload state of one engine (``engine._offload``); see the module docstring.

    Args:
        engine: the :class:`~ferrule.megatron.engine.TrainEngine`.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.device = next(engine.model[0].parameters()).device
        self.stashes: list[HostStash] = []
        self._previous: dict[str, HostStash] = {}
        self.weights = False

    @property
    def offloaded(self) -> bool:
        return bool(self.stashes)

    def offload(self, *, weights: bool, window_open: bool) -> dict[str, float]:
        """Move optimizer state, gradients and (``weights``) the weights off the device.

        Returns:
            ``{"offload_s": seconds, "offload_bytes": bytes copied to host}``.

        Raises:
            RuntimeError: already offloaded.
        """
        if self.offloaded:
            raise RuntimeError("TrainEngine.offload(): already offloaded; call onload() first.")
        t0 = time.perf_counter()
        dev = self.device
        weight_st = unique_storages(_weight_tensors(self.engine), dev)
        grads = unique_storages([b.grad_data for b in _ddp_buffers(self.engine)], dev, exclude=weight_st)
        optim = unique_storages(_optimizer_tensors(self.engine), dev, exclude=set(weight_st) | set(grads))
        plan = [("optimizer state", optim, False), ("gradient buffers", grads, not window_open)]
        if weights:
            plan.append(("weights", weight_st, False))
        stashes = [HostStash(st, dev, f"train {name}", discard=discard, reuse=self._previous.get(name))
                   for name, st, discard in plan]
        done: list[HostStash] = []
        try:
            for s in stashes:
                s.offload()
                done.append(s)
        except BaseException:
            for s in reversed(done):
                s.onload()
            raise
        self.stashes, self.weights = stashes, weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return {"offload_s": time.perf_counter() - t0, "offload_bytes": float(sum(s.nbytes for s in stashes))}

    def onload(self) -> dict[str, float]:
        """Bring everything :meth:`offload` moved back onto the device, bit for bit.

        Returns:
            ``{"onload_s": seconds, "onload_bytes": bytes copied to the device}``.

        Raises:
            RuntimeError: not offloaded.
        """
        if not self.offloaded:
            raise RuntimeError("TrainEngine.onload(): the engine is not offloaded.")
        t0 = time.perf_counter()
        for s in reversed(self.stashes):
            s.onload()
        moved = sum(s.nbytes for s in self.stashes)
        self._previous = {s.name.removeprefix("train "): s for s in self.stashes}
        self.stashes = []
        return {"onload_s": time.perf_counter() - t0, "onload_bytes": float(moved)}

    def check_onloaded(self, what: str) -> None:
        """Raise a clear error when ``what`` is called while offloaded."""
        if self.offloaded:
            raise RuntimeError(f"TrainEngine.{what}() while the engine is offloaded; call engine.onload() first.")
