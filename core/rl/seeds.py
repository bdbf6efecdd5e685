"""Per-step sampling seeds of the RL loop (rollout, eval, rollout shards): a pure function of the
run's seed and the step, so a resumed run draws the same samples."""

from __future__ import annotations

import hashlib

__all__ = ["rollout_seed"]


def rollout_seed(seed: int, step: int, salt: str = "rollout") -> int:
    """Sampling seed of ``step``: ``sha256("ferrule-{salt}:{seed}:{step}")`` (first 8 bytes, < 2**63)."""
    digest = hashlib.sha256(f"ferrule-{salt}:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**63)
