"""Dynamic sampling stage (``algorithm.dynamic_sampling``): keep the groups that carry a gradient.

DAPO (Yu et al. 2025, arXiv 2503.14476, section 3.2, "dynamic sampling"): a group whose rewards
are all equal gets advantage 0 for every sample, so it adds no policy gradient and only dilutes
the token mean. Such groups are dropped and more prompts are generated until the step has
``train.prompts_per_step`` groups with a reward spread, at most
``algorithm.dynamic_sampling_max_rounds`` rollouts per step (DAPO's ``max_num_gen_batches``;
where DAPO stops with an error, a step still short here fills up with the earliest dropped groups,
advantage 0, counted as ``dynamic_sampling_filled_groups``, so every step trains on the same
number of groups and ``train.optim_steps_per_rollout`` still divides it).

Input: each round's scored :class:`~ferrule.rl.records.RolloutBatch` and which of its groups are
informative (:func:`informative_groups`). Output: the step's batch and its metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ferrule.rl.records import RolloutBatch, take_groups
from ferrule.rl.stages.advantages import build_samples, group_advantages

if TYPE_CHECKING:
    from ferrule.rl.config_schema import AlgorithmConfig

__all__ = ["informative_groups", "GroupSelector"]


def informative_groups(batch: RolloutBatch, algorithm: AlgorithmConfig, max_new_tokens: int) -> list[bool]:
    """Per prompt of ``batch`` (scored): whether its group gets a non-zero advantage somewhere, with
    the advantages the train step will compute (overlong penalty and mask included;
    :func:`ferrule.rl.stages.advantages.group_advantages`)."""
    samples = build_samples(batch.prompt_ids, batch.results, batch.media)
    adv = group_advantages(samples, batch.rewards, algorithm, batch.group_size, max_new_tokens)
    return [bool(np.any(adv.values[batch.group(g)] != 0)) for g in range(len(batch.prompts))]


class GroupSelector:
    """Collects the informative groups of successive rollout rounds of one step.

    Args:
        want: groups the step trains on (``train.prompts_per_step``).
    """

    def __init__(self, want: int) -> None:
        self.want = want
        self.kept: list[tuple[RolloutBatch, int]] = []
        self.dropped: list[tuple[RolloutBatch, int]] = []
        self.rounds = 0

    def add(self, batch: RolloutBatch, informative: Sequence[bool]) -> bool:
        """Take one round's groups; True once ``want`` informative groups are kept."""
        self.rounds += 1
        for g, ok in enumerate(informative):
            (self.kept if ok else self.dropped).append((batch, g))
        return len(self.kept) >= self.want

    def batch(self) -> RolloutBatch:
        """The step's batch: the first ``want`` kept groups in arrival order, filled up with the
        earliest dropped ones when short."""
        picks = self.kept[:self.want]
        return take_groups(picks + self.dropped[:self.want - len(picks)], self.rounds)

    def metrics(self) -> dict[str, int]:
        """``dynamic_sampling_rounds`` (rollouts this step), ``_kept_groups`` (informative groups
        trained), ``_dropped_groups`` (zero-variance groups seen), ``_filled_groups`` (dropped groups
        trained to fill a short step)."""
        kept = min(len(self.kept), self.want)
        return {"dynamic_sampling_rounds": self.rounds, "dynamic_sampling_kept_groups": kept,
                "dynamic_sampling_dropped_groups": len(self.dropped),
                "dynamic_sampling_filled_groups": self.want - kept}
