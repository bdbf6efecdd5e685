"""Sleep / wake of the embedded rollout engine (colocated training, docs/train.md "Colocation").

A mixin of :class:`ferrule.rollout.embedded.EmbeddedEngine`: it uses the engine's ``model``,
``device``, ``cuda_graph``, ``_states`` (decode states: KV caches and captured CUDA graphs),
``_graph_pool``, ``_lora``, ``_merged_lora`` (dropped by :meth:`EmbeddedSleep.sleep`),
``_weights_serial`` (counted up by :meth:`EmbeddedSleep.wake`) and ``_closed``, and the attributes
``_asleep``, ``_stash`` and ``_last_stash`` the engine initialises.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ferrule.rollout._checkpoint_names import CheckpointTensor

__all__ = ["EmbeddedSleep"]


class EmbeddedSleep:
    """:meth:`sleep` / :meth:`wake` and the host-side view of the weights while asleep."""

    _asleep = False
    _stash = None
    _last_stash = None

    def _live(self, entry: CheckpointTensor) -> CheckpointTensor:
        """``entry``, or while the weights are on the host (asleep), the same entry over the host
        copies that :meth:`wake` brings back (so weight updates and reads work while asleep)."""
        if self._stash is None:
            return entry
        host, cpu = self._stash.host_view, torch.device("cpu")
        return dataclasses.replace(
            entry, param=host(entry.param), view=None if entry.view is None else host(entry.view),
            index=None if entry.index is None else entry.index.to(cpu),
            parts=tuple((host(p), pos.to(cpu), local.to(cpu)) for p, pos, local in entry.parts))

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`."""
        return self._asleep

    def sleep(self, *, weights: bool = True) -> dict[str, float]:
        """Release device memory while another engine uses the device (colocated training).

        Frees every decode state (KV caches, captured CUDA graphs and their memory pool) and, with
        ``weights``, moves the weights to page-locked host memory (:class:`ferrule.offload.HostStash`;
        a served LoRA adapter's factors stay on the device). While asleep, :meth:`update_weights`,
        :meth:`update_lora_adapter` (of an adapter already served) and :meth:`get_hf_state_dict`
        work on the host copies; :meth:`generate` raises. Decode graphs are captured again on the
        first ``generate`` after :meth:`wake` (their buffers get new addresses).

        Returns:
            ``{"sleep_s": seconds, "sleep_bytes": weight bytes moved to the host}``.

        Raises:
            RuntimeError: already asleep, or shut down.
        """
        from ferrule.offload import HostStash, unique_storages

        if self._closed or self._asleep:
            raise RuntimeError(f"EmbeddedEngine.sleep(): the engine is {'shut down' if self._closed else 'asleep'}.")
        t0 = time.perf_counter()
        self._states.clear()
        self._merged_lora = None  # the fast path's merged adapter copy: rebuilt after wake
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        moved = 0
        if weights:
            adapter = unique_storages(self._lora.targets.values(), self.device) if self._lora is not None else {}
            tensors = [p.data for p in self.model.parameters()] + list(self.model.buffers())
            stash = HostStash(unique_storages(tensors, self.device, exclude=adapter), self.device, "rollout weights",
                              reuse=self._last_stash)
            stash.offload()
            self._stash, moved = stash, stash.nbytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True
        return {"sleep_s": time.perf_counter() - t0, "sleep_bytes": float(moved)}

    def wake(self) -> dict[str, float]:
        """Undo :meth:`sleep`: the weights (with every update made while asleep) back on the device.

        Returns:
            ``{"wake_s": seconds, "wake_bytes": weight bytes copied back}``.

        Raises:
            RuntimeError: not asleep.
        """
        if not self._asleep:
            raise RuntimeError("EmbeddedEngine.wake(): the engine is not asleep.")
        t0 = time.perf_counter()
        moved = 0
        if self._stash is not None:
            self._stash.onload()
            self._last_stash, self._stash, moved = self._stash, None, self._stash.nbytes
        self._weights_serial += 1
        self._asleep = False
        return {"wake_s": time.perf_counter() - t0, "wake_bytes": float(moved)}
