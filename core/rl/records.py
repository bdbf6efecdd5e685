"""The typed records one GRPO step moves between its stages (:mod:`ferrule.rl.stages`).

A step's data is values, not loose lists: the rollout stage makes a :class:`RolloutBatch` (the
driver's prompts, the engine's samples with the weight version that made them, their rewards),
the advantages stage turns it into samples and :class:`~ferrule.rl.stages.advantages.Advantages`,
the train stage returns a :class:`~ferrule.rl.stages.train.TrainOutcome`, and the record stage
reads them all. A schedule (:mod:`ferrule.rl.loop`) only passes records from stage to stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ferrule.rl.config_schema import TrainConfig
    from ferrule.rl.envs.launcher import AgentStep
    import torch

    from ferrule.rl.batch import Sample
    from ferrule.rl.rewards import RewardResult
    from ferrule.rl.stages.advantages import Advantages
    from ferrule.rl.stages.train import TrainOutcome
    from ferrule.rl.tasks import Prompt
    from ferrule.rollout import GenerateResult

__all__ = ["RolloutBatch", "StepRecord", "take_groups", "staleness_of", "max_staleness"]


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollout as the driver holds it: ``P`` prompts with ``n`` samples each, prompt-major.

    Attributes:
        prompts: the sampler's prompts ``[P]``.
        prompt_ids: each prompt's rendered token ids ``[P]``.
        media: each prompt's preprocessed media, or None for text ``[P]``.
        results: the rollout engine's samples ``[P * n]``, prompt-major (``results[k].prompt_index
            == k // n``); each carries the ``weights_version`` of the engine that sampled it.
        texts: the decoded responses ``[P * n]``.
        rewards: their rewards ``[P * n]`` (None until the score stage ran).
        weight_version: the train engine's optimizer steps when the rollout was generated (the
            version the rollout engine held).
        rounds: rollouts the batch was drawn from (``algorithm.dynamic_sampling`` refills: > 1).
        seconds: generation wall time of all its rounds (s). selection: the dynamic-sampling
            metrics (empty without it). sampler_state: the prompt sampler's ``state_dict()`` right
            after this batch drew its prompts (what a checkpoint of its step records: an
            asynchronous schedule has drawn later prompts by then).
        agent: multi-turn episodes (``agent.environment``): the
            :class:`~ferrule.rl.envs.launcher.AgentStep` whose samples, rewards, metrics and logged
            entries the step trains on; ``results`` and ``texts`` are then empty.
    """

    prompts: list[Prompt]
    prompt_ids: list[tuple[int, ...]]
    media: list[dict | None]
    results: list[GenerateResult]
    texts: list[str]
    rewards: list[RewardResult] | None = None
    weight_version: int = 0
    rounds: int = 1
    seconds: float = 0.0
    selection: dict[str, int] = field(default_factory=dict)
    sampler_state: dict[str, Any] | None = None
    agent: AgentStep | None = None

    @property
    def group_size(self) -> int:
        """``n``: samples per prompt (0 for an empty batch)."""
        return len(self.results) // len(self.prompts) if self.prompts else 0

    def group(self, g: int) -> slice:
        """The samples of prompt ``g`` (a slice of ``results`` / ``texts`` / ``rewards``)."""
        n = self.group_size
        return slice(g * n, (g + 1) * n)


def take_groups(picks: Sequence[tuple[RolloutBatch, int]], rounds: int) -> RolloutBatch:
    """A batch of the picked groups ``(batch, prompt index)``, in the given order, renumbered
    (``prompt_index`` = position in the new batch). Every picked batch must have rewards and the
    same group size; ``weight_version`` is the oldest of the picked batches'.

    Raises:
        ValueError: no picks, or group sizes that differ.
    """
    if not picks:
        raise ValueError("take_groups needs at least one group")
    sizes = {b.group_size for b, _ in picks}
    if len(sizes) != 1:
        raise ValueError(f"take_groups: the batches have different group sizes {sorted(sizes)}")
    prompts, ids, media, results, texts, rewards = [], [], [], [], [], []
    for new, (b, g) in enumerate(picks):
        prompts.append(b.prompts[g])
        ids.append(b.prompt_ids[g])
        media.append(b.media[g])
        results += [dataclasses.replace(r, prompt_index=new) for r in b.results[b.group(g)]]
        texts += b.texts[b.group(g)]
        rewards += b.rewards[b.group(g)]
    return RolloutBatch(prompts, ids, media, results, texts, rewards,
                        weight_version=min(b.weight_version for b, _ in picks), rounds=rounds)


@dataclass(frozen=True)
class StepRecord:
    """One trained step: what the record stage turns into metrics and logged samples.

    Attributes:
        step: the step (1-based). batch: its rollout (:class:`RolloutBatch`).
        samples: the training samples ``[P * n]`` (:class:`~ferrule.rl.batch.Sample`).
        advantages: their advantages (:class:`~ferrule.rl.stages.advantages.Advantages`).
        rollout_logprobs: per sample the rollout engine's logprobs ``[R]`` float32.
        outcome: the update (:class:`~ferrule.rl.stages.train.TrainOutcome`).
        staleness: per sample, train steps between the weights that sampled it and the weights it
            trains (0 on policy).
        stale_dropped: samples left out for being older than ``train.max_staleness``.
    """

    step: int
    batch: RolloutBatch
    samples: list[Sample]
    advantages: Advantages
    rollout_logprobs: list[torch.Tensor]
    outcome: TrainOutcome
    staleness: list[int]
    stale_dropped: int = 0


def staleness_of(batch: RolloutBatch, train_version: int, steps_per_version: int, num_samples: int) -> list[int]:
    """Per sample of ``batch`` (``num_samples`` of them): ``(train_version - v) // steps_per_version``,
    ``v`` the ``weights_version`` its result carries (the batch's when the engine recorded none, or for
    agent episodes), i.e. the train steps of ``steps_per_version`` optimizer steps each since the
    weights that sampled it."""
    versions = ([r.weights_version if r.weights_version is not None else batch.weight_version for r in batch.results]
                if batch.agent is None else [batch.weight_version] * num_samples)
    return [max(0, train_version - v) // steps_per_version for v in versions]


def max_staleness(train: TrainConfig) -> int:
    """The staleness bound of ``train.schedule`` (a ``TrainConfig``): 0 for ``sync``, 1 for
    ``one_step_off``, ``train.max_staleness`` for ``async``."""
    return {"sync": 0, "one_step_off": 1}.get(train.schedule, train.max_staleness)
