"""Rollout batch -> train-engine data for one GRPO step (pure data assembly, no engine calls).

Layout of one sample (Tinker alignment, :class:`ferrule.megatron.batching.Datum`): the
sequence ``tokens = prompt + response`` (``P + R`` ids, the response includes a matched stop
token) becomes ``model_input = tokens[:-1]`` and ``target_tokens = tokens[1:]`` (``N = P + R - 1``
positions). The last ``R`` positions predict the response; every per-token loss input is
``[N]`` float32 and is 0 on the ``P - 1`` prompt positions, where ``weights`` is 0 too, so the
prompt contributes neither loss nor metrics (``ferrule.losses`` counts tokens with weight != 0).

Per response token ``t`` of sample ``i`` (:func:`build_datums`):

- ``weights``: the per-token weight of :func:`ferrule.rl.advantages.token_weights` for the
  optimizer step's mini-batch (``token_mean``: ``1 / N_tokens`` of the mini-batch);
- ``advantages``: the sample's group-normalized advantage ``A_i`` (the same on every token);
- ``logprobs``: the behaviour ("old") logprob the PPO ratio divides by, see
  :func:`ferrule.rl.loop` (the trainer's own pre-update logprob when ``use_tis`` or several
  optimizer steps per rollout, else the rollout engine's logprob);
- ``rollout_logprobs`` (only with TIS): the rollout engine's logprob of the sampled token at
  temperature 1 (the untempered model distribution, ``GenerateResult.raw_logprobs``);
- ``ref_logprobs`` (only with a reference policy): the frozen reference model's logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferrule.megatron.batching import Datum
from ferrule.losses import LOSS_CONFIG_DEFAULTS


@dataclass(frozen=True)
class Sample:
    """One rollout sample.

    Attributes:
        group: index of its prompt in the step (GRPO group id; samples of a group are contiguous).
        prompt_ids: rendered prompt token ids ``[P]``.
        response_ids: generated ids ``[R]`` (R >= 1), a matched stop token included.
        rollout_logprobs: ``[R]`` logprobs of ``response_ids`` under the rollout engine's
            *untempered* model distribution (natural log).
        sampling_logprobs: ``[R]`` logprobs under the distribution the tokens were drawn from (the
            tempered one, ``GenerateResult.logprobs``) where it differs from ``rollout_logprobs``
            (``rollout.temperature`` != 1); None: the same. TIS divides by them with
            ``algorithm.tis_behaviour=sampled``.
        truncated: generation stopped at ``max_new_tokens`` (finish reason ``"length"``).
        media: the prompt's media (``{modality: [item, ...]}``, :mod:`ferrule.media`) or None.
        loss_mask: ``[R]`` 0/1 per response token, or None (all 1). A multi-turn episode
            (:mod:`ferrule.rl.envs.episodes`) puts its environment turns in ``response_ids`` with
            mask 0: they get weight 0 (no loss, no gradient) and are not counted by ``token_mean``.
        routed_experts: MoE routing replay (``algorithm.routing_replay``): the rollout's experts per
            datum position and MoE layer, ``[P + R - 1, num_moe_layers, top_k]`` int16
            (``GenerateResult.routed_experts``), handed to the train engine with every datum; else None.
    """

    group: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    truncated: bool
    media: Any = field(default=None, compare=False)
    loss_mask: tuple[int, ...] | None = None
    routed_experts: torch.Tensor | None = field(default=None, compare=False, repr=False)
    sampling_logprobs: tuple[float, ...] | None = None

    @property
    def mask(self) -> np.ndarray:
        """``[R]`` float64 loss mask (ones without ``loss_mask``)."""
        if self.loss_mask is None:
            return np.ones(len(self.response_ids))
        return np.asarray(self.loss_mask, dtype=np.float64)

    @property
    def num_tokens(self) -> int:
        """Positions of the training datum: ``P + R - 1``."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


def sequence_datum(sample: Sample) -> Datum:
    """A datum with only ``target_tokens`` (for ``forward_logprobs``)."""
    seq = list(sample.prompt_ids) + list(sample.response_ids)
    return Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:], dtype=torch.int64)}, sample.media,
                 sample.routed_experts)


def response_slice(per_position: torch.Tensor, sample: Sample) -> torch.Tensor:
    """The response part ``[R]`` of a ``[N]`` per-position tensor of ``sample``'s datum.

    Raises:
        ValueError: ``per_position`` has not ``N = P + R - 1`` entries.
    """
    if per_position.shape != (sample.num_tokens,):
        raise ValueError(f"expected [{sample.num_tokens}] per-position values, got {tuple(per_position.shape)}")
    return per_position[-len(sample.response_ids):]


def _pad_response(values: Sequence[float] | np.ndarray | torch.Tensor, sample: Sample) -> torch.Tensor:
    out = torch.zeros(sample.num_tokens, dtype=torch.float32)
    v = torch.as_tensor(np.asarray(values, dtype=np.float64) if not isinstance(values, torch.Tensor) else values,
                        dtype=torch.float32)
    if v.shape != (len(sample.response_ids),):
        raise ValueError(f"expected [{len(sample.response_ids)}] response values, got {tuple(v.shape)}")
    out[-len(sample.response_ids):] = v
    return out


def build_datums(samples: Sequence[Sample], *, weights: Sequence[np.ndarray], advantages: Sequence[float],
                 behaviour_logprobs: Sequence[torch.Tensor], use_tis: bool,
                 ref_logprobs: Sequence[torch.Tensor] | None = None, sequence_ratio: bool = False,
                 tis_behaviour: str = "sampled") -> list[Datum]:
    """Engine data for one optimizer step (see the module docstring for each input).

    Args:
        samples: the mini-batch's samples.
        weights: per sample ``[R]`` float64 token weights (:func:`~ferrule.rl.advantages.token_weights`).
        advantages: per sample scalar advantage.
        behaviour_logprobs: per sample ``[R]`` logprobs the PPO ratio divides by.
        use_tis: add ``rollout_logprobs`` (truncated importance sampling in ``ferrule.losses``).
        tis_behaviour: ``algorithm.tis_behaviour``: ``"sampled"`` (default) gives TIS the samples'
            ``sampling_logprobs`` where they have them, else ``rollout_logprobs``; ``"untempered"``
            always their ``rollout_logprobs``.
        ref_logprobs: per sample ``[R]`` reference-policy logprobs, or None.
        sequence_ratio: a sequence-level loss (``ferrule.losses.SEQUENCE_LEVEL``, ``gspo``): add
            ``sequence_ratio_mask`` (1 on the response tokens, which form the ratio) and leave out
            ``rollout_logprobs`` / ``ref_logprobs``, which it does not take.

    Raises:
        ValueError: length mismatches (naming the sample index).
    """
    n = len(samples)
    for name, seq in (("weights", weights), ("advantages", advantages), ("behaviour_logprobs", behaviour_logprobs)):
        if len(seq) != n:
            raise ValueError(f"{len(seq)} {name} for {n} samples")
    if ref_logprobs is not None and len(ref_logprobs) != n:
        raise ValueError(f"{len(ref_logprobs)} ref_logprobs for {n} samples")
    out = []
    for i, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.response_ids)
        r = len(s.response_ids)
        try:
            w = np.asarray(weights[i], dtype=np.float64)
            inputs = {
                "target_tokens": torch.tensor(seq[1:], dtype=torch.int64),
                "weights": _pad_response(w * s.mask if s.loss_mask is not None else w, s),
                "advantages": _pad_response(np.full(r, float(advantages[i])), s),
                "logprobs": _pad_response(behaviour_logprobs[i], s),
            }
            if sequence_ratio:
                inputs["sequence_ratio_mask"] = _pad_response(s.mask, s)
            if use_tis and not sequence_ratio:
                sampled = tis_behaviour == "sampled" and s.sampling_logprobs is not None
                inputs["rollout_logprobs"] = _pad_response(s.sampling_logprobs if sampled else s.rollout_logprobs, s)
            if ref_logprobs is not None and not sequence_ratio:
                inputs["ref_logprobs"] = _pad_response(ref_logprobs[i], s)
        except ValueError as exc:
            raise ValueError(f"sample {i}: {exc}") from None
        out.append(Datum(seq[:-1], inputs, s.media, s.routed_experts))
    return out


def loss_fn_config(algorithm: object) -> tuple[str, dict[str, float]]:
    """``(loss name, loss_fn_config)`` for ``ferrule.losses`` from an ``AlgorithmConfig``.

    ``ppo`` / ``cispo`` / ``gspo`` clip the ratio to ``[1 - eps_clip, 1 + eps_clip_high]`` (absolute
    bounds, the losses' convention; for ``gspo`` the GSPO paper's band is ``eps_clip=3e-4``,
    ``eps_clip_high=4e-4``); ``tis_cap`` is passed with ``use_tis``; ``kl_coef`` always; ``entropy_coef``
    when > 0 (the train engine computes the policy entropy only then).
    """
    name = algorithm.loss  # type: ignore[attr-defined]
    accepted = LOSS_CONFIG_DEFAULTS[name]
    cfg: dict[str, float] = {}
    if "clip_low_threshold" in accepted:
        cfg["clip_low_threshold"] = 1.0 - algorithm.eps_clip  # type: ignore[attr-defined]
        cfg["clip_high_threshold"] = 1.0 + algorithm.eps_clip_high  # type: ignore[attr-defined]
    if algorithm.use_tis and "tis_cap" in accepted:  # type: ignore[attr-defined]
        cfg["tis_cap"] = float(algorithm.tis_cap)  # type: ignore[attr-defined]
    if "kl_coef" in accepted:  # gspo takes neither extension (config checks refuse use_tis / kl_coef with it)
        cfg["kl_coef"] = float(algorithm.kl_coef)  # type: ignore[attr-defined]
    if algorithm.entropy_coef > 0:  # type: ignore[attr-defined]  (the engine then computes the entropy)
        cfg["entropy_coef"] = float(algorithm.entropy_coef)  # type: ignore[attr-defined]
    return name, cfg


def split_groups(num_groups: int, parts: int) -> list[range]:
    """Contiguous group ranges of the ``parts`` mini-batches of one rollout (whole groups each).

    Raises:
        ValueError: ``parts`` does not divide ``num_groups``.
    """
    if parts < 1 or num_groups % parts:
        raise ValueError(f"{num_groups} groups do not split into {parts} equal mini-batches")
    size = num_groups // parts
    return [range(k * size, (k + 1) * size) for k in range(parts)]
