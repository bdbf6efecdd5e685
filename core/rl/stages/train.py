"""Train stage: the policy update of one rollout.

Input: the samples, their advantages, the train engine, the frozen reference (or None) and the
config. Output: :class:`TrainOutcome` (loss sums, grad norms, learning rates, skipped steps,
``ppo_kl``, the trainer's logprobs of the responses).

1. Old logprobs: with ``algorithm.use_tis`` or several optimizer steps per rollout the train
   engine's ``forward_logprobs`` gives the pre-update ("behaviour") logprobs the PPO ratio
   divides by; otherwise the rollout engine's play that role (one forward pass fewer).
2. Reference logprobs (``kl_coef > 0``): the reference policy on the driver, broadcast to all.
3. ``train.optim_steps_per_rollout`` mini-batches of whole groups, each one ``forward_backward``
   (per-token weights from ``algorithm.loss_aggregation``) and one ``optim_step``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

    from ferrule.rl.batch import Sample
    from ferrule.rl.config_schema import RLConfig
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.engines import PolicyTrainer, ReferenceScorer

__all__ = ["TrainOutcome", "behaviour_logprobs", "reference_logprobs", "train_policy"]


@dataclass
class TrainOutcome:
    """What one rollout's update did.

    Attributes:
        sums: per optimizer step, the ``":sum"`` loss metrics of its ``forward_backward``.
        grad_norms / learning_rates: per optimizer step. skipped: optimizer steps that were skipped.
        ppo_kl: mean over response tokens of ``exp(d) - 1 - d``, ``d = log(p_old / p_cur)``.
        trainer_logprobs: per sample, the train engine's response logprobs ``[R]`` (old logprobs
            when computed, else those of the first ``forward_backward``), None if never computed.
        need_old: whether old logprobs were computed (an extra forward pass). seconds: wall time.
    """

    sums: list[dict[str, float]]
    grad_norms: list[float]
    learning_rates: list[float]
    skipped: int
    ppo_kl: float
    trainer_logprobs: list[torch.Tensor | None]
    need_old: bool
    seconds: float


def behaviour_logprobs(engine: PolicyTrainer, samples: Sequence[Sample], rollout_lp: Sequence[torch.Tensor],
                       need_old: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``(behaviour logprobs, trainer logprobs)`` per sample: the train engine's old logprobs (both)
    when ``need_old``, else the rollout's and Nones."""
    from ferrule.rl.batch import response_slice, sequence_datum

    if not need_old:
        return list(rollout_lp), [None] * len(samples)
    old = engine.forward_logprobs([sequence_datum(s) for s in samples])
    behaviour = [response_slice(lp, s) for lp, s in zip(old, samples)]
    return behaviour, list(behaviour)


def reference_logprobs(reference: ReferenceScorer | None, samples: Sequence[Sample], micro_batch_tokens: int,
                       roles: RankRoles, kl_coef: float) -> list[torch.Tensor] | None:
    """The reference policy's response logprobs per sample (None without a reference); collective
    when distributed with ``kl_coef > 0`` (the reference lives on rank 0)."""
    from ferrule.rl import distributed as rl_dist
    from ferrule.rl.batch import response_slice

    ref = None
    if reference is not None:
        ref = [response_slice(lp, s) for lp, s in zip(
            reference.logprobs([s.prompt_ids + s.response_ids for s in samples], micro_batch_tokens), samples)]
    if roles.distributed and kl_coef > 0:
        ref = rl_dist.broadcast_object(ref)
    return ref


def train_policy(engine: PolicyTrainer, samples: Sequence[Sample], advantages: Sequence[float],
                 rollout_lp: Sequence[torch.Tensor], *, cfg: RLConfig, reference: ReferenceScorer | None,
                 roles: RankRoles, num_groups: int,
                 trainable: Sequence[bool] | None = None) -> TrainOutcome:
    """Old and reference logprobs, then one ``forward_backward`` + ``optim_step`` per mini-batch
    (module docstring). Collective: every rank calls it with the same samples. ``trainable[i]``
    False gives sample ``i`` loss weight 0 (``algorithm.overlong=mask``, a stale sample); it still
    runs through the forward pass, and is left out of the token count of ``token_mean`` /
    ``sample_mean``. A sample's ``loss_mask`` (multi-turn episodes) masks its tokens likewise."""
    import torch

    from ferrule.losses import SEQUENCE_LEVEL
    from ferrule.rl.advantages import token_weights
    from ferrule.rl.batch import build_datums, loss_fn_config, response_slice, split_groups

    a, t0 = cfg.algorithm, time.perf_counter()
    need_old = a.use_tis or cfg.train.optim_steps_per_rollout > 1
    behaviour, trainer_lp = behaviour_logprobs(engine, samples, rollout_lp, need_old)
    ref = reference_logprobs(reference, samples, cfg.train.micro_batch_tokens, roles, a.kl_coef)
    loss_name, loss_cfg = loss_fn_config(a)
    sums, grad_norms, lrs, skipped, ppo_kl_num, ppo_kl_den = [], [], [], 0, 0.0, 0
    for k, groups in enumerate(split_groups(num_groups, cfg.train.optim_steps_per_rollout)):
        idx = [i for i, s in enumerate(samples) if s.group in groups]
        # multi-turn episodes' loss masks (ferrule.rl.envs), times 0 for a sample left out
        masked = trainable is not None or any(samples[i].loss_mask is not None for i in idx)
        w = token_weights([len(samples[i].response_ids) for i in idx], mode=a.loss_aggregation,
                          max_new_tokens=cfg.rollout.max_new_tokens,
                          loss_masks=[samples[i].mask * float(trainable is None or trainable[i]) for i in idx]
                          if masked else None)
        datums = build_datums([samples[i] for i in idx], weights=w, advantages=[advantages[i] for i in idx],
                              behaviour_logprobs=[behaviour[i] for i in idx], use_tis=a.use_tis,
                              ref_logprobs=[ref[i] for i in idx] if ref is not None else None,
                              sequence_ratio=loss_name in SEQUENCE_LEVEL, tis_behaviour=a.tis_behaviour)
        out = engine.forward_backward(datums, loss_name, loss_cfg)
        sums.append({key: v for key, v in out.metrics.items() if key.endswith(":sum")})
        for j, i in enumerate(idx):
            cur = response_slice(out.loss_fn_outputs[j]["logprobs"], samples[i])
            if k == 0 and trainer_lp[i] is None:
                trainer_lp[i] = cur
            d = (behaviour[i] - cur).double()  # log(p_old / p_cur)
            if samples[i].loss_mask is not None:
                d = d[torch.as_tensor(samples[i].mask) > 0]
            ppo_kl_num += float((d.exp() - 1 - d).sum())
            ppo_kl_den += d.numel()
        res = engine.optim_step()
        grad_norms.append(res["grad_norm"])
        lrs.append(res["learning_rate"])
        skipped += not res["success"]
    return TrainOutcome(sums, grad_norms, lrs, skipped, ppo_kl_num / max(ppo_kl_den, 1), trainer_lp, need_old,
                        time.perf_counter() - t0)
