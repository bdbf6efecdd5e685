"""Group-relative advantages (GRPO) and per-token loss weights.

**Advantages** (:func:`grpo_advantages`). Samples come in groups of responses to the same
prompt. For sample ``i`` of group ``g`` with reward ``r_i``::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)    if std_normalization   (GRPO)
    A_i =  r_i - mean_g(r)                         otherwise              (Dr. GRPO)

- GRPO: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, section 4.1.2 (outcome supervision:
  the normalized reward is every response token's advantage).
- ``std_g`` is the sample standard deviation (Bessel's correction, ``ddof=1``), as
  ``torch.Tensor.std`` computes it in TRL's, verl's and miles' GRPO implementations. A group whose
  rewards are all equal gets advantage exactly 0. "Equal" has a tolerance
  (:func:`is_zero_std`): summing equal float64 values is not exact (``[0.1] * 3`` has std
  ``1.7e-17``), so ``std == 0`` would call such a group informative and divide its round-off by
  ``eps``.
- ``sample_mask`` leaves samples out of the group statistics: a sample with no trainable token
  (an empty response, or one whose loss mask is all zero) gets advantage 0 and does not move
  its group's baseline ``mean_g`` or ``std_g``; the group is what remains.
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783) drops the
  std division (question-level difficulty bias) and the per-response length normalization; use
  ``std_normalization=False`` and ``token_weights(..., mode="constant")``.

**Per-token weights** (:func:`token_weights`). ``ferrule.losses`` sums ``weight_t * loss_t``
over tokens; all normalization lives in the weights. The default ``"token_mean"`` gives every
response token of the *global* batch (all prompts x samples of one optimizer step, across all
micro-batches and DP ranks) the weight ``1 / N_tokens``, so the update is the mean over all
response tokens (DAPO's token-level loss, arXiv 2503.14476, section 3.3): long responses are
not down-weighted per token, and since the denominator is fixed before the batch is split, any
micro-batch / DP split gives the same gradient. Alternatives: ``"sample_mean"`` (mean over
samples of each sample's token mean; the original GRPO objective) and ``"constant"``
(``1 / (num_samples * max_new_tokens)``, Dr. GRPO). Compute the weights once per optimizer
step on the whole (mini-)batch, then slice them with the samples.

Arrays are float64 numpy (CPU, torch-free); convert with ``torch.from_numpy`` at the call site.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WEIGHT_MODES = ("token_mean", "sample_mean", "constant")
#: A group counts as all-equal when its reward std is at most ``ZERO_STD_RTOL * max(1, max|r|)``.
#: float64 round-off of equal values is ~1e-16 relative; real reward differences are far larger.
ZERO_STD_RTOL = 1e-8


def is_zero_std(values: np.ndarray) -> bool:
    """True when ``values`` (one group's float64 rewards, >= 2 of them) are equal up to round-off:
    ``std(ddof=1) <= ZERO_STD_RTOL * max(1, max|values|)``."""
    return float(values.std(ddof=1)) <= ZERO_STD_RTOL * max(1.0, float(np.abs(values).max()))


def group_ids_contiguous(num_samples: int, group_size: int) -> np.ndarray:
    """Group id of each sample when groups are contiguous: ``[0]*g + [1]*g + ...``.

    Raises:
        ValueError: ``num_samples`` is not a multiple of ``group_size``.
    """
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
    return np.repeat(np.arange(num_samples // group_size), group_size)


def grpo_advantages(rewards: Sequence[float] | np.ndarray, *, group_size: int | None = None,
                    group_ids: Sequence[int] | np.ndarray | None = None, std_normalization: bool = True,
                    eps: float = 1e-6, sample_mask: Sequence[bool] | np.ndarray | None = None) -> np.ndarray:
    """Group-normalized advantages, one per sample.

    Args:
        rewards: ``[num_samples]`` scalar rewards.
        group_size: samples per prompt when groups are contiguous (``rollout.n_samples_per_prompt``).
        group_ids: ``[num_samples]`` group id of each sample (any hashable ints; groups may be
            interleaved and of different sizes). Give exactly one of ``group_size`` / ``group_ids``.
        std_normalization: divide by ``std_g + eps`` (GRPO) or not (Dr. GRPO).
        eps: added to the std (``algorithm.advantage_eps``).
        sample_mask: ``[num_samples]`` bool (or 0/1); False marks a sample with no trainable
            token. Such a sample gets advantage 0 and is left out of its group's mean and std.
            A group left with fewer than 2 samples under ``std_normalization`` (or none at all)
            has no baseline to compare against: its samples get 0. Default: every sample counts.

    Returns:
        ``[num_samples]`` float64 advantages; exactly 0 for masked samples and for groups whose
        (unmasked) rewards are all equal (:func:`is_zero_std`).

    Raises:
        ValueError: non-finite rewards, both/neither grouping argument, shape mismatch, a mask
            that is not 0/1, or a group of size 1 with ``std_normalization`` (its std is undefined).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_samples], got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards contain non-finite values at {np.flatnonzero(~np.isfinite(r)).tolist()}")
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size or group_ids")
    ids = group_ids_contiguous(len(r), group_size) if group_size is not None else np.asarray(group_ids)
    if ids.shape != r.shape:
        raise ValueError(f"group_ids shape {ids.shape} != rewards shape {r.shape}")
    live = _sample_mask(sample_mask, r.shape)
    adv = np.zeros_like(r)
    for g in np.unique(ids):
        idx = np.flatnonzero(ids == g)
        if std_normalization and len(idx) < 2:
            raise ValueError(f"group {g} has 1 sample; std normalization needs >= 2 samples per group")
        idx = idx[live[idx]]
        if len(idx) == 0 or (std_normalization and len(idx) < 2):
            continue
        vals = r[idx]
        if len(idx) > 1 and is_zero_std(vals):
            continue  # all equal: no preference inside the group
        centered = vals - vals.mean()
        if std_normalization:
            centered = centered / (vals.std(ddof=1) + eps)
        adv[idx] = centered
    return adv


def _sample_mask(sample_mask: Sequence[bool] | np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if sample_mask is None:
        return np.ones(shape, dtype=bool)
    m = np.asarray(sample_mask)
    if m.shape != shape:
        raise ValueError(f"sample_mask shape {m.shape} != rewards shape {shape}")
    if m.dtype != bool:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"sample_mask must be bool or 0/1, got values {sorted(set(m.tolist()))}")
        m = m.astype(bool)
    return m


def zero_std_group_fraction(rewards: Sequence[float] | np.ndarray, group_size: int, *,
                            sample_mask: Sequence[bool] | np.ndarray | None = None) -> float:
    """Fraction of contiguous groups whose (unmasked) rewards are all equal, i.e. groups that get
    advantage 0 from :func:`grpo_advantages` (:func:`is_zero_std`; a group with fewer than 2
    unmasked samples counts too).

    Raises:
        ValueError: ``len(rewards)`` is not a multiple of ``group_size``, or a bad mask.
    """
    r = np.asarray(rewards, dtype=np.float64)
    ids = group_ids_contiguous(len(r), group_size)
    live = _sample_mask(sample_mask, r.shape)
    n_groups = len(r) // group_size
    if n_groups == 0:
        return 0.0
    flat = 0
    for g in range(n_groups):
        vals = r[(ids == g) & live]
        flat += len(vals) < 2 or is_zero_std(vals)
    return flat / n_groups


def token_weights(response_lengths: Sequence[int], *, mode: str = "token_mean",
                  max_new_tokens: int | None = None,
                  loss_masks: Sequence[Sequence[float] | np.ndarray] | None = None) -> list[np.ndarray]:
    """Per-response-token loss weights for one optimizer step's batch.

    Args:
        response_lengths: ``[num_samples]`` response lengths in tokens (>= 0).
        mode: ``"token_mean"`` (``1/N`` on every unmasked token, ``N`` = unmasked response tokens
            of the whole batch), ``"sample_mean"`` (``1/(S * n_i)``, ``S`` samples, ``n_i``
            unmasked tokens of sample i; empty samples are skipped and not counted in ``S``),
            or ``"constant"`` (``1/(S * max_new_tokens)``).
        max_new_tokens: required for ``"constant"``.
        loss_masks: optional per-sample ``[n_i]`` 0/1 masks (0 excludes a token, e.g. a
            truncated tail); default all ones.

    Returns:
        One float64 array ``[n_i]`` per sample. For ``token_mean`` and ``sample_mean`` the
        weights of the whole batch sum to 1 (0 if there are no unmasked tokens); for
        ``constant`` they sum to ``N / (S * max_new_tokens)`` <= 1.

    Raises:
        ValueError: unknown mode, negative lengths, mask length mismatch, missing
            ``max_new_tokens`` for ``constant``.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown token weight mode {mode!r}; use one of {list(WEIGHT_MODES)}")
    lengths = [int(n) for n in response_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"response lengths must be >= 0, got {lengths}")
    if loss_masks is None:
        masks = [np.ones(n) for n in lengths]
    else:
        if len(loss_masks) != len(lengths):
            raise ValueError(f"{len(loss_masks)} loss masks for {len(lengths)} samples")
        masks = [np.asarray(m, dtype=np.float64) for m in loss_masks]
        for i, (m, n) in enumerate(zip(masks, lengths)):
            if m.shape != (n,):
                raise ValueError(f"sample {i}: loss mask shape {m.shape} != response length ({n},)")
    if mode == "token_mean":
        total = sum(float(m.sum()) for m in masks)
        return [m / total if total > 0 else m * 0.0 for m in masks]
    if mode == "sample_mean":
        counts = [float(m.sum()) for m in masks]
        live = sum(1 for c in counts if c > 0)
        return [m / (c * live) if c > 0 else m * 0.0 for m, c in zip(masks, counts)]
    if not max_new_tokens or max_new_tokens < 1:
        raise ValueError("mode='constant' needs max_new_tokens >= 1")
    return [m / (len(masks) * max_new_tokens) for m in masks]


def per_token_advantages(advantages: Sequence[float] | np.ndarray, response_lengths: Sequence[int]
                         ) -> list[np.ndarray]:
    """Broadcast each sample's advantage over its response tokens: ``[n_i]`` float64 per sample."""
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.shape != (len(response_lengths),):
        raise ValueError(f"{adv.shape[0] if adv.ndim else 0} advantages for {len(response_lengths)} samples")
    return [np.full(int(n), a) for a, n in zip(adv, response_lengths)]
