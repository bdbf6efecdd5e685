"""Sync stage: the train engine's weights to every rollout engine.

Full-parameter training sends every update group (:func:`ferrule.sync.sync_weights`) to the
driver's engine, then the driver's tensors to the other replicas
(:func:`ferrule.rl.distributed.fan_out_rollout_weights`); with LoRA only the adapter travels
(:func:`ferrule.sync.sync_lora_adapter`, :func:`ferrule.rl.distributed.fan_out_lora_adapter`).
Output: the driver sync's :class:`~ferrule.sync.SyncStats` and the wall time in seconds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ferrule.rl import distributed as rl_dist
from ferrule import sync as fsync

if TYPE_CHECKING:
    from ferrule.engine_settings import WeightSyncSettings
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.engines import PolicyTrainer
    from ferrule.rollout import RolloutEngine
    from ferrule.sync import SyncStats

__all__ = ["sync_policy"]


def sync_policy(engine: PolicyTrainer, rollout: RolloutEngine | None, roles: RankRoles, *, check_equal: bool,
                settings: WeightSyncSettings | None = None) -> tuple[SyncStats, float]:
    """Send the policy at ``engine.step`` to the rollout engines; collective. ``check_equal``
    verifies every tensor after the sync; ``settings``: the run's
    :class:`~ferrule.engine_settings.WeightSyncSettings` (``weight_sync``). Returns ``(SyncStats, seconds)``."""
    t0 = time.perf_counter()
    if getattr(engine, "lora", None) is not None:  # LoRA: only the adapter travels; the base stays put
        direct = {} if settings is None or settings.direct else {"direct": False}  # weight_sync.direct
        stats = fsync.sync_lora_adapter(engine, rollout, version=engine.step, check_equal=check_equal, **direct)
        # the other replicas' rollout engines get the adapter the driver's engine now serves
        rl_dist.fan_out_lora_adapter(roles, rollout, engine.step, check_equal=check_equal)
    else:
        stats = fsync.sync_weights(engine, rollout, version=engine.step, check_equal=check_equal, settings=settings)
        # the other replicas' rollout engines get the driver engine's tensors (gathered once)
        rl_dist.fan_out_rollout_weights(roles, rollout, engine.step)
    return stats, time.perf_counter() - t0
