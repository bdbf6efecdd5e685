"""Per-token helpers of the losses (truncated IS weights, k3 KL, entropy) and the metric sums that
stay exact under any micro-batch / DP split. Part of :mod:`ferrule.losses` (re-exported there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .inputs import DERIVED_MEANS

# --------------------------------------------------------------------------- helpers


def truncated_is_weights(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, tis_cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token truncated importance weights ``c = min(exp(logprobs - rollout_logprobs), tis_cap)``
    and the boolean mask of truncated tokens (``exp(...) > tis_cap``); ``[T]`` each, no grad.

    ``logprobs``: the trainer's pre-update logprobs; ``rollout_logprobs``: the rollout engine's.
    Source: Yao et al. 2025 (truncated IS for rollout/train mismatch); Espeholt et al. 2018.
    """
    with torch.no_grad():
        ratio = torch.exp(logprobs - rollout_logprobs)
        return torch.clamp(ratio, max=tis_cap), ratio > tis_cap


def k3_kl(target_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): ``exp(d) - d - 1`` with
    ``d = ref_logprobs - target_logprobs`` (``[T]``, >= 0, differentiable in target_logprobs).
    Source: J. Schulman, "Approximating KL Divergence" (2020)."""
    d = ref_logprobs - target_logprobs
    return torch.exp(d) - d - 1.0


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the softmax over the last axis: ``[..., V] -> [...]`` float32, no grad.

    ``H = logsumexp(z) - sum(softmax(z) * z)``. Needs the full vocabulary on one device; with a
    tensor-parallel (vocab-sharded) output layer compute the two terms with all-reduces over the
    TP group instead.
    """
    with torch.no_grad():
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        return lse - (torch.softmax(z, dim=-1) * z).sum(-1)


def sum_metrics(metrics: Sequence[Mapping[str, torch.Tensor | float]]) -> dict[str, torch.Tensor]:
    """Key-wise sum of ``:sum`` metric dicts (per sample, micro-batch or rank) as float64 0-dim
    tensors. Raises ``ValueError`` when key sets differ or a key is not a ``:sum``."""
    if not metrics:
        return {}
    keys = set(metrics[0])
    out: dict[str, torch.Tensor] = {}
    for i, m in enumerate(metrics):
        if set(m) != keys:
            raise ValueError(f"metrics {i} has keys {sorted(m)}, expected {sorted(keys)}")
        for key, value in m.items():
            if not key.endswith(":sum"):
                raise ValueError(f"sum_metrics only adds ':sum' metrics, got {key!r}")
            v = torch.as_tensor(value, dtype=torch.float64)
            out[key] = out[key] + v.to(out[key].device) if key in out else v.clone()
    return out


def finalize_metrics(summed: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert summed metrics to floats and add each :data:`DERIVED_MEANS` entry whose numerator
    is present, as numerator / denominator (0.0 when the denominator is 0, i.e. no token carried
    weight). All keys have the form ``name:reduction`` required by the Tinker SDK."""
    out = {k: float(v) for k, v in summed.items()}
    for mean_key, (num, den) in DERIVED_MEANS.items():
        if num in out:
            out[mean_key] = out[num] / out[den] if out[den] != 0 else 0.0
    return out
