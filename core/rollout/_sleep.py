"""Where the embedded rollout engine's weights are while it sleeps (colocated training, docs/train.md "Colocation").

:class:`WeightSleep` is a part of :class:`ferrule.rollout.embedded.EmbeddedEngine` (``engine._sleep``) that
owns its state: whether the engine is asleep, the host stash of the weights
(:class:`ferrule.offload.HostStash`, page-locked on CUDA) and the previous stash, whose host buffers the
next sleep reuses. The engine's :meth:`~ferrule.rollout.embedded.EmbeddedEngine.sleep` /
:meth:`~ferrule.rollout.embedded.EmbeddedEngine.wake` drop and rebuild what the engine owns (decode states,
CUDA-graph pool, a merged adapter copy, the weights serial) around :meth:`WeightSleep.sleep` /
:meth:`WeightSleep.wake`; weight updates and reads while asleep go through :meth:`WeightSleep.live`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from ferrule.offload import HostStash, unique_storages
from ferrule.rollout._checkpoint_names import CheckpointTensor

__all__ = ["WeightSleep"]


class WeightSleep:
    """The asleep flag and the host copies of a model's weights between :meth:`sleep` and :meth:`wake`.

    Args:
        device: the device the weights live on while awake.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asleep = False
        #: :class:`~ferrule.offload.HostStash` of the weights while asleep with ``weights=True``, else None
        self.stash: HostStash | None = None
        self._last_stash: HostStash | None = None  # its host buffers, reused by the next sleep

    def live(self, entry: CheckpointTensor) -> CheckpointTensor:
        """``entry``, or while the weights are on the host (asleep), the same entry over the host
        copies that :meth:`wake` brings back (so weight updates and reads work while asleep)."""
        if self.stash is None:
            return entry
        host, cpu = self.stash.host_view, torch.device("cpu")
        return dataclasses.replace(
            entry, param=host(entry.param), view=None if entry.view is None else host(entry.view),
            index=None if entry.index is None else entry.index.to(cpu),
            parts=tuple((host(p), pos.to(cpu), local.to(cpu)) for p, pos, local in entry.parts))

    def sleep(self, model: torch.nn.Module, *, weights: bool, keep: Iterable[torch.Tensor] = ()) -> int:
        """Mark asleep and, with ``weights``, move ``model``'s parameters and buffers to the host, except the
        storages of ``keep`` (a served LoRA adapter's factors stay on the device).

        Returns:
            bytes moved to the host (0 without ``weights``).

        Raises:
            RuntimeError: already asleep.
        """
        if self.asleep:
            raise RuntimeError("WeightSleep.sleep(): already asleep; wake() first.")
        moved = 0
        if weights:
            adapter = unique_storages(keep, self.device)
            tensors = [p.data for p in model.parameters()] + list(model.buffers())
            stash = HostStash(unique_storages(tensors, self.device, exclude=adapter), self.device, "rollout weights",
                              reuse=self._last_stash)
            stash.offload()
            self.stash, moved = stash, stash.nbytes
        self.asleep = True
        return moved

    def wake(self) -> int:
        """The weights (with every update made while asleep) back on the device; returns the bytes copied.

        Raises:
            RuntimeError: not asleep.
        """
        if not self.asleep:
            raise RuntimeError("EmbeddedEngine.wake(): the engine is not asleep.")
        moved = 0
        if self.stash is not None:
            self.stash.onload()
            self._last_stash, self.stash, moved = self.stash, None, self.stash.nbytes
        self.asleep = False
        return moved
