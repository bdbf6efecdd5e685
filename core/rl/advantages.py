"""Group-relative advantages (GRPO) and per-token loss weights.

**Advantages** (:func:`grpo_advantages`). Samples come in groups of responses to the same
prompt. For sample ``i`` of group ``g`` with reward ``r_i``::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)    if std_normalization   (GRPO)
    A_i =  r_i - mean_g(r)                         otherwise              (Dr. GRPO)

- GRPO: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, section 4.1.2 (outcome supervision:
  the normalized reward is every response token's advantage).
- ``std_g`` is the sample standard deviation (Bessel's correction, ``ddof=1``), as
  ``torch.Tensor.std`` computes it in TRL's, verl's and miles' GRPO implementations. A group whose
  rewards are all equal gets advantage 0 for every sample.
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
                    eps: float = 1e-6) -> np.ndarray:
    """Group-normalized advantages, one per sample.

    Args:
        rewards: ``[num_samples]`` scalar rewards.
        group_size: samples per prompt when groups are contiguous (``rollout.n_samples_per_prompt``).
        group_ids: ``[num_samples]`` group id of each sample (any hashable ints; groups may be
            interleaved and of different sizes). Give exactly one of ``group_size`` / ``group_ids``.
        std_normalization: divide by ``std_g + eps`` (GRPO) or not (Dr. GRPO).
        eps: added to the std (``algorithm.advantage_eps``).

    Returns:
        ``[num_samples]`` float64 advantages.

    Raises:
        ValueError: non-finite rewards, both/neither grouping argument, shape mismatch, or a
            group of size 1 with ``std_normalization`` (its std is undefined).
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
    adv = np.empty_like(r)
    for g in np.unique(ids):
        idx = np.flatnonzero(ids == g)
        centered = r[idx] - r[idx].mean()
        if std_normalization:
            if len(idx) < 2:
                raise ValueError(f"group {g} has 1 sample; std normalization needs >= 2 samples per group")
            centered = centered / (r[idx].std(ddof=1) + eps)
        adv[idx] = centered
    return adv


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
