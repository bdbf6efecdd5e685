"""``get_rollout_engine(kind, ...)``: build the embedded or the SGLang rollout engine by name.

Kept apart from :mod:`ferrule.rollout.base` (the protocol, which both engines import) so that
the protocol never imports an engine.
"""

from __future__ import annotations

from typing import Any

from ferrule.rollout.base import ENGINE_KINDS, RolloutEngine

__all__ = ["get_rollout_engine"]


def get_rollout_engine(kind: str = "embedded", **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine.

    Args:
        kind: ``"embedded"`` (default; :class:`ferrule.rollout.embedded.EmbeddedEngine`) or
            ``"sglang"`` (:class:`ferrule.rollout.sglang.SGLangEngine`).
        **kwargs: passed to the engine's constructor.

    Raises:
        ValueError: unknown kind (lists the known kinds).
    """
    if kind == "embedded":
        from ferrule.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(**kwargs)
    if kind == "sglang":
        from ferrule.rollout.sglang import SGLangEngine

        return SGLangEngine(**kwargs)
    raise ValueError(f"Unknown rollout engine kind {kind!r}; known kinds: {', '.join(ENGINE_KINDS)}.")
