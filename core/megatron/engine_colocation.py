"""Colocation of the train engine (docs/train.md): :meth:`~EngineColocation.offload` its device
memory for another engine on the same device and :meth:`~EngineColocation.onload` it back, bit
for bit (:mod:`ferrule.megatron.offload` does the copies). A mixin of
:class:`ferrule.megatron.engine.TrainEngine`; it reads the engine's ``_offload`` and ``_window_loads``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["EngineColocation"]


class EngineColocation:
    """``offload`` / ``onload`` / ``offloaded`` of :class:`~ferrule.megatron.engine.TrainEngine`."""

    _offload = None  # ferrule.megatron.offload.TrainOffload once offload() was called

    @property
    def offloaded(self) -> bool:
        """True between :meth:`offload` and :meth:`onload`."""
        return self._offload is not None and self._offload.offloaded

    def offload(self, *, weights: bool = False) -> dict[str, float]:
        """Release this engine's device memory for another engine on the same device (colocation).

        Optimizer state (Adam moments, fp32 master weights) goes to page-locked host memory, the
        gradient buffers are freed (their bytes travel only inside an open accumulation window),
        and with ``weights`` the model weights go too (:mod:`ferrule.megatron.offload`). Until
        :meth:`onload`, training calls raise; :meth:`save` still works (it onloads around the save).

        Returns:
            ``{"offload_s": seconds, "offload_bytes": bytes copied}``.

        Raises:
            RuntimeError: already offloaded.
        """
        from .offload import TrainOffload

        if self._offload is None:
            self._offload = TrainOffload(self)
        return self._offload.offload(weights=weights, window_open=any(self._window_loads))

    def onload(self) -> dict[str, float]:
        """Bring back everything :meth:`offload` released, bit for bit.

        Returns:
            ``{"onload_s": seconds, "onload_bytes": bytes copied}``.

        Raises:
            RuntimeError: the engine is not offloaded.
        """
        if self._offload is None:
            raise RuntimeError("TrainEngine.onload(): the engine is not offloaded.")
        return self._offload.onload()

    @contextlib.contextmanager
    def _temporarily_onloaded(self) -> Iterator[None]:
        """Onload for the duration of a ``with`` block (a save or load while offloaded), then offload again."""
        if not self.offloaded:
            yield
            return
        weights = self._offload.weights
        self.onload()
        try:
            yield
        finally:
            self.offload(weights=weights)

    def _check_onloaded(self, what: str) -> None:
        if self._offload is not None:
            self._offload.check_onloaded(what)
