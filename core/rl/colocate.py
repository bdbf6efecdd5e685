"""Colocated phases on one device (``train.colocate``): train and rollout take turns.

Each step of a colocated run is::

    wake rollout -> generate -> sleep rollout -> onload train -> fb/step -> sync -> offload train

(:meth:`~ferrule.rollout.embedded.EmbeddedEngine.sleep` frees the KV caches and CUDA-graph pools
and moves the rollout weights to page-locked host memory; the sync writes into those host
copies, and the next wake brings them back. :meth:`~ferrule.megatron.engine.TrainEngine.offload`
moves the optimizer state, fp32 master weights and weights to the host and frees the gradient
buffers.) Every transition is idempotent, so evaluation (which generates) or a checkpoint save
(which onloads around itself) fit in between.

:class:`PhaseMeter` records, for colocated and plain runs alike, the peak device memory of each
phase and (colocated) the seconds spent in sleep / wake / offload / onload: ``metrics.jsonl``
keys ``memory_{rollout,train,sync}_peak_bytes``, ``memory_offloaded_bytes`` (device memory held
while the rollout phase starts: what the rollout engine has to itself) and
``time_{wake,sleep,onload,offload}_s``. On CPU the memory keys are the process RSS at the end of
the phase (the peak RSS cannot be reset).
"""

from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rl.config_schema import RLConfig
    from ferrule.rollout import RolloutEngine
    from ferrule.rollout.embedded import EmbeddedEngine

__all__ = ["Colocation", "PhaseMeter", "resolve_colocate", "projected_bytes"]


def _backend():
    from ferrule.megatron.device import get_backend

    return get_backend()


class PhaseMeter:
    """Peak device memory per phase: :meth:`start` resets the peak, :meth:`stop` records it."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def start(self) -> None:
        _backend().reset_peak_memory()

    def stop(self, phase: str) -> None:
        stats = _backend().memory_stats()
        self.values[f"memory_{phase}_peak_bytes"] = stats.get("peak_allocated", stats.get("rss", 0))

    def record_now(self, key: str) -> None:
        stats = _backend().memory_stats()
        self.values[key] = stats.get("allocated", stats.get("rss", 0))

    def add_time(self, key: str, seconds: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out, self.values = self.values, {}
        return out


class Colocation:
    """Which engine holds the device; transitions are no-ops when already in the asked state.

    Args:
        engine: the :class:`~ferrule.megatron.engine.TrainEngine`.
        rollout: the :class:`~ferrule.rollout.embedded.EmbeddedEngine` on the same device.
        meter: where the seconds of each transition are added.
    """

    def __init__(self, engine: TrainEngine, rollout: EmbeddedEngine, meter: PhaseMeter):
        self.engine, self.rollout, self.meter = engine, rollout, meter

    def offload_train(self) -> None:
        """The train engine's optimizer state, gradients and weights off the device."""
        if not self.engine.offloaded:
            self.meter.add_time("time_offload_s", self.engine.offload(weights=True)["offload_s"])

    def rollout_phase(self) -> None:
        """Train offloaded, rollout awake (before generating: a step's rollout, an evaluation)."""
        self.offload_train()
        if self.rollout.asleep:
            self.meter.add_time("time_wake_s", self.rollout.wake()["wake_s"])

    def train_phase(self) -> None:
        """Rollout asleep (weights on the host), train onloaded."""
        if not self.rollout.asleep:
            self.meter.add_time("time_sleep_s", self.rollout.sleep(weights=True)["sleep_s"])
        if self.engine.offloaded:
            self.meter.add_time("time_onload_s", self.engine.onload()["onload_s"])


def projected_bytes(engine: TrainEngine, cfg: RLConfig) -> int:
    """Device bytes a plain (non-colocated) run needs at its peak, estimated after both engines
    are built: what is allocated now, plus Adam's two fp32 moments per trainable parameter
    (created at the first step), plus the rollout batch's KV cache
    (``2 * layers * kv_heads * head_dim * dtype bytes`` per token of
    ``train.prompts_per_step * rollout.n_samples_per_prompt`` rows of ``data.max_prompt_tokens +
    rollout.max_new_tokens``)."""
    import torch

    stats = _backend().memory_stats()
    trainable = sum(p.numel() for c in engine.model for p in c.parameters() if p.requires_grad)
    hf = engine.hf_config if "num_hidden_layers" in engine.hf_config else engine.hf_config.get("text_config", {})
    heads = int(hf.get("num_attention_heads", 1))
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or int(hf.get("hidden_size", 0)) // max(heads, 1))
    rows = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt
    tokens = rows * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    elt = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    kv_bytes = 2 * int(hf.get("num_hidden_layers", 0)) * kv * head_dim * elt * tokens
    return int(stats.get("allocated", 0)) + 8 * trainable + kv_bytes


def resolve_colocate(setting: bool | str, engine: TrainEngine, rollout: RolloutEngine, cfg: RLConfig, *,
                     distributed: bool) -> tuple[bool, str]:
    """``(on, why)`` for ``train.colocate`` (``true`` / ``false`` / ``"auto"``).

    ``auto``: on with CUDA when :func:`projected_bytes` exceeds 90 % of the device's memory (the
    model would not fit with both engines resident), off otherwise and always off on CPU.

    Raises:
        ValueError: ``true`` where colocation cannot run (no embedded rollout engine on the train
            engine's device, or several processes).
    """
    if setting is False:
        return False, "train.colocate: false"
    device = next(engine.model[0].parameters()).device
    usable = (rollout is not None and getattr(rollout, "kind", None) == "embedded"
              and getattr(rollout, "device", None) == device and not distributed)
    if setting is True:
        if not usable:
            raise ValueError("train.colocate: true needs the embedded rollout engine on the train engine's device in "
                             "one process (not rollout.engine: sglang, not torchrun); set train.colocate: false.")
        return True, "train.colocate: true"
    if device.type != "cuda" or not usable:
        return False, "train.colocate: auto -> off (" + ("CPU" if device.type != "cuda" else "rollout elsewhere") + ")"
    need = projected_bytes(engine, cfg)
    total = _backend().total_memory()
    on = need > 0.9 * total
    return on, (f"train.colocate: auto -> {'on' if on else 'off'} (projected {need / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB with both engines resident)")
