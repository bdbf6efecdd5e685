"""Advantages stage: rollout results + rewards -> training samples and group-normalized advantages.

Input: the prompts' token ids and media, the rollout results, their rewards, ``cfg.algorithm``.
Output: :class:`~ferrule.rl.batch.Sample` list (one per result, in result order) and
:class:`Advantages` (one value per sample, :func:`ferrule.rl.advantages.grpo_advantages` over
contiguous groups of ``n`` samples; an empty response is masked out of its group, and so is a
truncated one under ``algorithm.overlong=mask``; ``overlong=penalty`` adds :func:`overlong_penalty`
to the reward first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
from ferrule.rl.advantages import grpo_advantages

if TYPE_CHECKING:
    from ferrule.rl.batch import Sample
    from ferrule.rl.config_schema import AlgorithmConfig
    from ferrule.rl.rewards import RewardResult
    from ferrule.rollout import GenerateResult

__all__ = ["Advantages", "build_samples", "group_advantages", "overlong_penalty"]


def build_samples(prompt_ids: Sequence[tuple[int, ...]], results: Sequence[GenerateResult],
                  media: Sequence[dict | None]) -> list[Sample]:
    """One :class:`~ferrule.rl.batch.Sample` per rollout result. Its ``rollout_logprobs`` are the engine's
    raw (temperature-1) logprobs when it returned them (temperature != 1), and then its
    ``sampling_logprobs`` are the tempered ones the tokens were drawn from; otherwise the engine's
    logprobs are both (``sampling_logprobs`` None). The routed experts travel along (routing replay)."""
    from ferrule.rl.batch import Sample

    return [Sample(group=r.prompt_index, prompt_ids=prompt_ids[r.prompt_index], response_ids=r.token_ids,
                   rollout_logprobs=r.raw_logprobs if r.raw_logprobs is not None else r.logprobs,
                   truncated=r.finish_reason == "length", media=media[r.prompt_index],
                   routed_experts=r.routed_experts,
                   sampling_logprobs=tuple(r.logprobs) if r.raw_logprobs is not None else None)
            for r in results]


@dataclass(frozen=True)
class Advantages:
    """Attributes:
        rewards: the samples' rewards ``[S]`` as the advantages saw them (the task reward plus the
        overlong penalty); trainable: ``[S]`` (False: empty response, or truncated under
        ``algorithm.overlong=mask``: no loss, outside its group's statistics); values: the
        advantages ``[S]`` (float64 numpy); penalties: the overlong penalty of each sample ``[S]``
        (<= 0; empty unless ``algorithm.overlong=penalty``)."""

    rewards: list[float]
    trainable: list[bool]
    values: np.ndarray
    penalties: list[float] = field(default_factory=list)


def overlong_penalty(length: int, truncated: bool, *, max_new_tokens: int, buffer_tokens: int,
                     penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to the reward.

    With ``L_max = max_new_tokens``, ``L_cache = buffer_tokens`` and ``|y| = length`` (tokens):
    0 while ``|y| <= L_max - L_cache``, then ``-penalty * (|y| - (L_max - L_cache)) / L_cache``,
    and ``-penalty`` for a truncated response (DAPO's ``|y| > L_max``: generation was cut there).
    ``buffer_tokens = 0``: only truncated responses are penalised.
    """
    if truncated:
        return -penalty
    over = length - (max_new_tokens - buffer_tokens)
    if buffer_tokens <= 0 or over <= 0:
        return 0.0
    return -penalty * min(1.0, over / buffer_tokens)


def group_advantages(samples: Sequence[Sample], rewards: Sequence[RewardResult], algorithm: AlgorithmConfig,
                     group_size: int, max_new_tokens: int | None = None,
                     exclude: Sequence[bool] | None = None) -> Advantages:
    """Group-normalized advantages of ``samples`` (``algorithm.grpo_std_normalization``,
    ``algorithm.advantage_eps``), groups of ``group_size`` contiguous samples; ``algorithm.overlong``
    masks (``mask``) or penalises (``penalty``, :func:`overlong_penalty`; needs ``max_new_tokens``)
    truncated samples; ``exclude[i]`` True leaves sample ``i`` out like a masked one (a sample older
    than ``train.max_staleness``)."""
    mode = getattr(algorithm, "overlong", "keep")
    reward_values = [r.reward for r in rewards]
    trainable = [len(s.response_ids) > 0 and not (mode == "mask" and s.truncated) for s in samples]
    if exclude is not None:
        trainable = [t and not x for t, x in zip(trainable, exclude)]
    penalties: list[float] = []
    if mode == "penalty":
        penalties = [overlong_penalty(len(s.response_ids), s.truncated, max_new_tokens=max_new_tokens,
                                      buffer_tokens=algorithm.overlong_buffer_tokens,
                                      penalty=algorithm.overlong_penalty) for s in samples]
        reward_values = [r + p for r, p in zip(reward_values, penalties)]
    values = grpo_advantages(reward_values, group_size=group_size, std_normalization=algorithm.grpo_std_normalization,
                             eps=algorithm.advantage_eps, sample_mask=trainable)
    return Advantages(reward_values, trainable, values, penalties)
