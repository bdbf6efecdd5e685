"""Token-level training losses shared by the RL launcher and the Tinker-compatible service.

Every loss is a **sum over tokens** of per-token terms; normalisation (1/num_tokens,
1/num_samples, ...) lives in the per-token ``weights`` or ``advantages`` the caller supplies.
Because no term depends on other tokens, the gradient is the same however a batch is split
across ``forward_backward`` calls, micro-batches or data-parallel ranks, and several samples may
be packed (concatenated along the token axis) into one call.

Calling convention (one sample, or several packed along the token axis)::

    per_token_loss, metrics = get_loss(name)(target_logprobs, loss_fn_inputs, loss_fn_config)
    per_token_loss.sum().backward()

* ``target_logprobs``: ``[T]`` floating tensor, the current model's log-probability of
  ``target_tokens[i]`` at position ``i`` (Tinker alignment: position i of ``model_input``
  predicts ``target_tokens[i]``), with autograd history. bf16/fp16 inputs are computed in
  float32, float64 stays float64.
* ``loss_fn_inputs``: Tinker names, every tensor ``[T]`` on the same device:
  ``target_tokens`` (int), ``weights``, ``logprobs`` (the sampler's, q), ``advantages`` (A);
  ferrule extensions ``rollout_logprobs``, ``ref_logprobs`` (see below).
* ``loss_fn_config``: Tinker keys (``clip_low_threshold``, ``clip_high_threshold``, ``beta``)
  plus ferrule extensions ``tis_cap``, ``kl_coef`` and ``entropy_coef``. Unknown keys are errors.
* returns ``per_token_loss`` ``[T]`` (its sum is the loss to backprop) and ``metrics``: a dict of
  0-dim detached float64 tensors whose keys all end in ``:sum``. Sums are exact to add across
  samples, micro-batches and ranks (:func:`sum_metrics`, or an all-reduce of the stacked
  values); :func:`finalize_metrics` then derives the global ``:mean`` metrics as ratios of
  sums, so a mean over the global batch is reconstructed exactly rather than averaged.

Formulas (per token; t = target_logprobs, q = ``logprobs``, A = ``advantages``,
r = exp(t - q), w = ``weights``, c = truncated-IS weight, sg = stop-gradient), all from the
Tinker loss documentation (tinker-cookbook ``docs/losses.mdx``):

==================== ===========================================================
cross_entropy        l = -w * t
importance_sampling  l = w * (-c * r * A + kl)
ppo                  l = w * (-c * min(r*A, clip(r, lo, hi)*A) + kl)
cispo                l = w * (-c * sg(clip(r, lo, hi)) * A * t + kl)
dro                  l = w * (-c * (t*A - beta/2 * (t - q)^2) + kl)
gspo                 l = w * -min(s*A, clip(s, lo, hi)*A), s = sg(exp(mean_M(t - q))) * exp(t - sg(t))
==================== ===========================================================

``gspo``'s ratio is one value per datum (its masked mean log-ratio), so its terms depend on the
datum's other tokens: packed calls pass ``segment_ids`` (:data:`SEQUENCE_LEVEL`, :func:`gspo`).
The TIS / KL extensions below do not apply to it.

Tinker's RL losses have no ``weights`` input; here it is optional with default 1 and multiplies
the whole per-token term, so requests from the Tinker SDK (no weights, no extensions) compute
exactly Tinker's loss. ``kl = kl_coef * k3`` is 0 unless ``kl_coef > 0`` (extension, below).

RL-launcher extensions (absent keys mean "off"; Tinker requests never carry them):

* **Truncated importance sampling (TIS)** for the train/rollout mismatch: when
  ``loss_fn_inputs["rollout_logprobs"]`` (the rollout engine's logprobs, mu) is present,
  ``logprobs`` holds the trainer's own pre-update ("old") logprobs and the policy term is
  multiplied by ``c = min(exp(logprobs - rollout_logprobs), tis_cap)`` (an input-only constant,
  ``tis_cap`` default 2.0). Source: F. Yao et al., "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training" (2025 blog, C = 2); truncation as in IMPALA's V-trace (Espeholt
  et al. 2018). The KL term is not multiplied by c.
* **KL penalty to a reference policy**: with ``ref_logprobs`` present and ``kl_coef > 0``, adds
  ``kl_coef * k3`` with ``k3 = exp(ref - t) - (ref - t) - 1`` (>= 0), the "k3" estimator of
  KL(pi_theta || pi_ref) from J. Schulman, "Approximating KL Divergence" (2020 blog,
  http://joschu.net/blog/kl-approx.html), used as a loss term by GRPO (Shao et al. 2024).
  Tinker's docs advise putting KL in the reward instead; the penalty is off by default.
  With ``ref_logprobs`` present the KL is reported (``ref_kl:sum``) even when ``kl_coef == 0``.
* **Entropy reporting**: pass ``entropy=`` (``[T]``, e.g. :func:`token_entropy` of the logits)
  to get ``entropy:sum``; with ``entropy_coef == 0`` (the default) it never enters the loss.
* **Entropy bonus**: with ``loss_fn_config["entropy_coef"] = c > 0`` (every RL loss, ``gspo``
  included) the per-token term becomes ``l - w * c * H`` with ``H`` the policy's entropy
  (nats) at that position, passed as ``entropy=`` *with* its autograd history (the train engine
  computes it from the full, vocab-parallel logits). Not multiplied by the TIS weight. Source:
  the entropy regularizer of A3C (Mnih et al. 2016) and PPO (Schulman et al. 2017, eq. 9), as
  verl's ``entropy_coeff``. ``entropy_coef > 0`` without ``entropy=`` is a ``ValueError``.

Validation: :func:`validate_loss_inputs` checks a sample (or a whole batch) on any device
before compute; the loss functions themselves only check shapes (no host sync).
"""

from __future__ import annotations

# the public names (and the tables), importable from here as before the split
from .functions import (  # noqa: F401
    LOSSES, SEQUENCE_LEVEL, cispo, cross_entropy, dro, get_loss, gspo, importance_sampling, ppo)
from .inputs import (  # noqa: F401
    DERIVED_MEANS, LOSS_CONFIG_DEFAULTS, LOSS_INPUT_KEYS, LossFn, Metrics, resolve_loss_config, validate_loss_inputs)
from .metrics import (  # noqa: F401
    finalize_metrics, k3_kl, sum_metrics, token_entropy, truncated_is_weights)

__all__ = [
    "LOSSES",
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_INPUT_KEYS",
    "DERIVED_MEANS",
    "LossFn",
    "get_loss",
    "validate_loss_inputs",
    "resolve_loss_config",
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "SEQUENCE_LEVEL",
    "truncated_is_weights",
    "k3_kl",
    "token_entropy",
    "sum_metrics",
    "finalize_metrics",
]
