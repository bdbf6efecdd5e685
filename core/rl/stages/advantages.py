"""Advantages stage: rollout results + rewards -> training samples and group-normalized advantages.

Input: the prompts' token ids and media, the rollout results, their rewards, ``cfg.algorithm``.
Output: :class:`~ferrule.rl.batch.Sample` list (one per result, in result order) and
:class:`Advantages` (one value per sample, :func:`ferrule.rl.advantages.grpo_advantages` over
contiguous groups of ``n`` samples; an empty response is masked out of its group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Advantages", "build_samples", "group_advantages"]


def build_samples(prompt_ids: Sequence[tuple[int, ...]], results: Sequence[Any],
                  media: Sequence[dict | None]) -> list[Any]:
    """One :class:`~ferrule.rl.batch.Sample` per rollout result; its behaviour logprobs are the
    engine's raw (temperature-1) logprobs when it returned them, else its sampling logprobs."""
    from ferrule.rl.batch import Sample

    return [Sample(group=r.prompt_index, prompt_ids=prompt_ids[r.prompt_index], response_ids=r.token_ids,
                   rollout_logprobs=r.raw_logprobs if r.raw_logprobs is not None else r.logprobs,
                   truncated=r.finish_reason == "length", media=media[r.prompt_index])
            for r in results]


@dataclass(frozen=True)
class Advantages:
    """Attributes:
        rewards: the samples' rewards ``[S]``; trainable: ``[S]`` (False: empty response, no token to
        train); values: the advantages ``[S]`` (float64 numpy)."""

    rewards: list[float]
    trainable: list[bool]
    values: np.ndarray


def group_advantages(samples: Sequence[Any], rewards: Sequence[Any], algorithm: Any, group_size: int) -> Advantages:
    """Group-normalized advantages of ``samples`` (``algorithm.grpo_std_normalization``,
    ``algorithm.advantage_eps``), groups of ``group_size`` contiguous samples."""
    from ferrule.rl.advantages import grpo_advantages

    reward_values = [r.reward for r in rewards]
    trainable = [len(s.response_ids) > 0 for s in samples]
    values = grpo_advantages(reward_values, group_size=group_size, std_normalization=algorithm.grpo_std_normalization,
                             eps=algorithm.advantage_eps, sample_mask=trainable)
    return Advantages(reward_values, trainable, values)
