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
  plus ferrule extensions ``tis_cap`` and ``kl_coef``. Unknown keys are errors.
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
  to get ``entropy:sum``; it never enters the loss.

Validation: :func:`validate_loss_inputs` checks a sample (or a whole batch) on any device
before compute; the loss functions themselves only check shapes (no host sync).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch

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

Metrics = dict[str, torch.Tensor]


class LossFn(Protocol):
    """``(target_logprobs [T], loss_fn_inputs, loss_fn_config=None, *, entropy=None)
    -> (per_token_loss [T], metrics)``; see the module docstring."""

    def __call__(
        self,
        target_logprobs: torch.Tensor,
        loss_fn_inputs: Mapping[str, torch.Tensor],
        loss_fn_config: Mapping[str, float | str] | None = None,
        *,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]: ...


# Config keys and defaults. Tinker keys: ppo defaults 0.8 / 1.2 (docs/losses.mdx); the Tinker
# tutorial 202 states cispo shares them ("default clip thresholds (0.8 and 1.2)"); dro's beta
# has no published server default, 0.05 is the docs' example value.
_EXT_CONFIG = {"tis_cap": 2.0, "kl_coef": 0.0}
LOSS_CONFIG_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "cross_entropy": MappingProxyType({}),
        "importance_sampling": MappingProxyType(dict(_EXT_CONFIG)),
        "ppo": MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **_EXT_CONFIG}),
        "cispo": MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **_EXT_CONFIG}),
        "dro": MappingProxyType({"beta": 0.05, **_EXT_CONFIG}),
        # GSPO paper (arXiv:2507.18071) §5.1 clipping range 3e-4 / 4e-4, as absolute bounds
        "gspo": MappingProxyType({"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4}),
    }
)

_RL_REQUIRED = ("target_tokens", "logprobs", "advantages")
_RL_OPTIONAL = ("weights", "rollout_logprobs", "ref_logprobs")
# (required, optional) loss_fn_inputs keys per loss. Per-datum clip thresholds are listed by the
# Tinker SDK's dtype table; their server semantics are undocumented, ferrule reads them as
# per-token ([T]) or per-datum ([] / [1]) overrides of the config thresholds.
LOSS_INPUT_KEYS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = MappingProxyType(
    {
        "cross_entropy": (("target_tokens", "weights"), ()),
        "importance_sampling": (_RL_REQUIRED, _RL_OPTIONAL),
        "ppo": (_RL_REQUIRED, _RL_OPTIONAL + ("clip_low_threshold", "clip_high_threshold")),
        "cispo": (_RL_REQUIRED, _RL_OPTIONAL + ("clip_low_threshold", "clip_high_threshold")),
        "dro": (_RL_REQUIRED, _RL_OPTIONAL),
        "gspo": (_RL_REQUIRED, ("weights", "sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold")),
    }
)
_SCALAR_OK = ("clip_low_threshold", "clip_high_threshold")
# Names in Tinker's LossFnType literal (tinker 0.38) that ferrule does not implement.
_TINKER_ONLY = ("stable_reinforce", "custom")

# Global means reconstructed from summed metrics: mean key -> (numerator, denominator).
DERIVED_MEANS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "ratio:mean": ("ratio:sum", "tokens:sum"),
        "clip_fraction:mean": ("clipped_tokens:sum", "tokens:sum"),
        "tis_weight:mean": ("tis_weight:sum", "tokens:sum"),
        "tis_truncated_fraction:mean": ("tis_truncated_tokens:sum", "tokens:sum"),
        "ref_kl:mean": ("ref_kl:sum", "tokens:sum"),
        "entropy:mean": ("entropy:sum", "tokens:sum"),
    }
)


# --------------------------------------------------------------------------- validation


def _names() -> str:
    return ", ".join(sorted(LOSS_INPUT_KEYS))


def _check_name(name: str) -> None:
    if name in LOSS_INPUT_KEYS:
        return
    if name in _TINKER_ONLY:
        raise ValueError(
            f"loss_fn {name!r} exists in the Tinker API but is not implemented by ferrule; "
            f"use one of: {_names()}"
        )
    raise ValueError(f"unknown loss_fn {name!r}; known losses: {_names()}")


def resolve_loss_config(name: str, loss_fn_config: Mapping[str, float | str] | None) -> dict[str, float]:
    """Return ``loss_fn_config`` merged over :data:`LOSS_CONFIG_DEFAULTS[name]` as floats.

    Raises ``ValueError`` for an unknown loss name, an unknown key (listing the accepted keys),
    a non-numeric or non-finite value, ``clip_low_threshold > clip_high_threshold``, a negative
    threshold, ``beta < 0``, ``kl_coef < 0`` or ``tis_cap <= 0``.
    """
    _check_name(name)
    defaults = LOSS_CONFIG_DEFAULTS[name]
    out = dict(defaults)
    for key, value in (loss_fn_config or {}).items():
        if key not in defaults:
            accepted = ", ".join(defaults) or "none (cross_entropy takes no config)"
            raise ValueError(
                f"loss_fn_config key {key!r} is not accepted by loss {name!r}; accepted keys: "
                f"{accepted}. Remove it or fix its spelling."
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        out[key] = float(value)
    lo, hi = out.get("clip_low_threshold", 0.0), out.get("clip_high_threshold", math.inf)
    if lo < 0 or lo > hi:
        raise ValueError(
            f"loss {name!r}: need 0 <= clip_low_threshold <= clip_high_threshold (absolute ratio "
            f"bounds, e.g. 0.8 and 1.2), got {lo} and {hi}"
        )
    for key, ok in (("beta", lambda v: v >= 0), ("kl_coef", lambda v: v >= 0), ("tis_cap", lambda v: v > 0)):
        if key in out and not ok(out[key]):
            raise ValueError(f"loss {name!r}: loss_fn_config[{key!r}] = {out[key]} is out of range")
    return out


def _validate_one(
    name: str, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], where: str, vocab_size: int | None
) -> None:
    required, optional = LOSS_INPUT_KEYS[name]
    for key in required:
        if key not in inputs:
            raise ValueError(f"{where}loss {name!r} needs loss_fn_inputs[{key!r}], which is missing")
    for key in inputs:
        if key not in required and key not in optional:
            hint = ""
            if key == "mask":
                hint = " (the Tinker cookbook strips its 'mask' before sending; express masks as weights)"
            raise ValueError(
                f"{where}loss_fn_inputs key {key!r} is not accepted by loss {name!r}{hint}; "
                f"accepted keys: {', '.join(required + optional)}"
            )
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}loss_fn_inputs[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    tokens = inputs["target_tokens"]
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(
            f"{where}loss_fn_inputs['target_tokens'] must be a 1-D integer tensor [T], "
            f"got dtype {tokens.dtype} shape {tuple(tokens.shape)}"
        )
    n = tokens.shape[0]
    if n and int(tokens.min()) < 0:
        raise ValueError(f"{where}target_tokens contains a negative id {int(tokens.min())}")
    if n and vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"{where}target_tokens contains id {int(tokens.max())} >= vocab_size {vocab_size}; "
            "the tokens do not belong to this model's tokenizer"
        )
    for key, value in inputs.items():
        if key == "target_tokens":
            continue
        scalar_ok = key in _SCALAR_OK and value.numel() == 1 and value.dim() <= 1
        if not value.dtype.is_floating_point:
            raise ValueError(f"{where}loss_fn_inputs[{key!r}] must be floating point, got {value.dtype}")
        if not scalar_ok and tuple(value.shape) != (n,):
            raise ValueError(
                f"{where}loss_fn_inputs[{key!r}] has shape {tuple(value.shape)} but target_tokens has "
                f"length {n}; every per-token input must have shape [{n}]"
            )
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            idx = int(bad.reshape(-1).nonzero()[0])
            raise ValueError(
                f"{where}loss_fn_inputs[{key!r}][{idx}] = {float(value.reshape(-1)[idx])} is not finite; "
                "pad masked positions with 0 (and weight 0) instead of nan/inf"
            )
    if "clip_low_threshold" in inputs or "clip_high_threshold" in inputs:
        lo = inputs.get("clip_low_threshold", torch.tensor(config["clip_low_threshold"]))
        hi = inputs.get("clip_high_threshold", torch.tensor(config["clip_high_threshold"]))
        if bool((lo < 0).any()) or bool((lo.double().cpu() > hi.double().cpu()).any()):
            raise ValueError(f"{where}per-datum clip thresholds need 0 <= clip_low_threshold <= clip_high_threshold")
    mask = inputs.get("sequence_ratio_mask")
    if mask is not None and n and not bool((mask != 0).any()):
        raise ValueError(f"{where}loss_fn_inputs['sequence_ratio_mask'] marks no token, so the datum's sequence ratio "
                         "is undefined; mark its sampled tokens with 1.0")
    if config.get("kl_coef", 0.0) > 0 and "ref_logprobs" not in inputs:
        raise ValueError(
            f"{where}loss_fn_config['kl_coef'] = {config['kl_coef']} > 0 needs loss_fn_inputs['ref_logprobs'] "
            "(the reference policy's logprobs of target_tokens); supply it or set kl_coef to 0"
        )


def validate_loss_inputs(
    name: str,
    loss_fn_inputs: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    vocab_size: int | None = None,
) -> dict[str, float]:
    """Check one sample's ``loss_fn_inputs`` (a mapping) or a batch (a sequence of mappings)
    against loss ``name`` before any compute; return the resolved config (see
    :func:`resolve_loss_config`).

    Raises ``ValueError`` (``TypeError`` for non-tensor values), naming the datum index, key
    and position, for: an unknown loss name (listing the known ones), an unknown config key or
    bad config value, a missing required input, an input key the loss does not accept,
    ``target_tokens`` that are not 1-D integers or lie outside ``[0, vocab_size)``, a per-token
    input whose length differs from ``target_tokens``, non-floating or non-finite (nan/inf)
    values in ``weights``/``logprobs``/``advantages``/..., ``kl_coef > 0`` without
    ``ref_logprobs``, an empty batch, and (for a batch) samples whose optional key sets differ,
    which would make the summed metrics inconsistent. Syncs with the device per check: run it on
    the CPU copies of the request.
    """
    config = resolve_loss_config(name, loss_fn_config)
    if isinstance(loss_fn_inputs, Mapping):
        _validate_one(name, loss_fn_inputs, config, "", vocab_size)
        return config
    if len(loss_fn_inputs) == 0:
        raise ValueError(f"empty batch for loss {name!r}: forward_backward needs at least one datum")
    first = set(loss_fn_inputs[0])
    for i, inputs in enumerate(loss_fn_inputs):
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"datum {i}: loss_fn_inputs must be a mapping of name -> tensor, got {type(inputs).__name__}"
            )
        _validate_one(name, inputs, config, f"datum {i}: ", vocab_size)
        if set(inputs) != first:
            raise ValueError(
                f"datum {i}: loss_fn_inputs keys {sorted(inputs)} differ from datum 0's {sorted(first)}; "
                "every datum of one request must carry the same optional keys"
            )
    return config


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


# --------------------------------------------------------------------------- losses


def _prepare(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], keys: Sequence[str]
) -> tuple[torch.dtype, dict[str, torch.Tensor]]:
    if target_logprobs.dim() != 1 or not target_logprobs.dtype.is_floating_point:
        raise ValueError(
            f"target_logprobs must be a 1-D floating tensor [T], got {target_logprobs.dtype} "
            f"shape {tuple(target_logprobs.shape)}"
        )
    n = target_logprobs.shape[0]
    dtype = torch.promote_types(target_logprobs.dtype, torch.float32)
    out = {}
    for key in keys:
        if key not in inputs:
            continue
        v = inputs[key]
        if tuple(v.shape) != (n,) and not (key in _SCALAR_OK and v.numel() == 1 and v.dim() <= 1):
            raise ValueError(
                f"loss_fn_inputs[{key!r}] has shape {tuple(v.shape)} but target_logprobs has [{n}]; "
                "the model's logprobs must be token-aligned with target_tokens"
            )
        out[key] = v.to(device=target_logprobs.device, dtype=dtype)
    return dtype, out


def _thresholds(x: Mapping[str, torch.Tensor], cfg: Mapping[str, float], t: torch.Tensor) -> tuple:
    """Clip bounds as floats, or as tensors broadcastable to [T] when a per-datum input is given."""
    if "clip_low_threshold" not in x and "clip_high_threshold" not in x:
        return cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    bounds = []
    for key in ("clip_low_threshold", "clip_high_threshold"):
        v = x[key] if key in x else torch.tensor(cfg[key], dtype=t.dtype, device=t.device)
        bounds.append(v.reshape(-1) if v.dim() == 1 else v)
    return bounds[0], bounds[1]


def _base_metrics(loss: torch.Tensor, w: torch.Tensor | None) -> tuple[Metrics, torch.Tensor]:
    """``loss:sum``, ``tokens:sum`` (weight != 0), ``weights:sum`` and the active-token mask."""
    n, device = loss.shape[0], loss.device
    active = (w != 0) if w is not None else torch.ones(n, dtype=torch.bool, device=device)
    if w is not None:
        w_sum = w.sum(dtype=torch.float64)
    else:
        w_sum = torch.tensor(float(n), dtype=torch.float64, device=device)
    metrics = {
        "loss:sum": loss.detach().sum(dtype=torch.float64),
        "tokens:sum": active.sum(dtype=torch.float64),
        "weights:sum": w_sum,
    }
    return metrics, active


def _masked_sum(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return torch.where(active, x.detach().to(torch.float64), 0.0).sum()


def _add_entropy(metrics: Metrics, entropy: torch.Tensor | None, active: torch.Tensor) -> None:
    if entropy is not None:
        if tuple(entropy.shape) != tuple(active.shape):
            raise ValueError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(active.shape)}")
        metrics["entropy:sum"] = _masked_sum(entropy, active)


def cross_entropy(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Weighted negative log-likelihood: ``l_i = -weights_i * t_i`` (Tinker ``cross_entropy``).

    Exactly linear in ``weights`` (arbitrary signed floats, never normalised or clamped): the
    Tinker SDK's ``forward_backward_custom`` sends ``weights = -dL/dlogprobs`` and relies on it.
    Inputs: ``target_tokens`` [T] int, ``weights`` [T] float. No config keys.
    Metrics: ``loss:sum``, ``weights:sum``, ``tokens:sum`` (count of weights != 0), and
    ``entropy:sum`` over those tokens when ``entropy`` is given.
    """
    resolve_loss_config("cross_entropy", loss_fn_config)
    _, x = _prepare(target_logprobs, loss_fn_inputs, ("weights",))
    w = x["weights"]
    loss = -w * target_logprobs
    metrics, active = _base_metrics(loss, w)
    _add_entropy(metrics, entropy, active)
    return loss, metrics


def _policy_loss(
    name: str,
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    cfg = resolve_loss_config(name, loss_fn_config)
    keys = ("logprobs", "advantages") + LOSS_INPUT_KEYS[name][1]
    dtype, x = _prepare(target_logprobs, loss_fn_inputs, keys)
    t = target_logprobs.to(dtype)
    q, adv, w = x["logprobs"], x["advantages"], x.get("weights")
    ratio = torch.exp(t - q)
    clipped = None
    if name == "importance_sampling":
        term = -ratio * adv
    elif name == "ppo":
        lo, hi = _thresholds(x, cfg, t)
        unclipped_obj = ratio * adv
        clipped_obj = torch.clamp(ratio, lo, hi) * adv
        # min(r*A, clip(r)*A); on a tie (inside the band or on its edge) the unclipped branch
        # carries the gradient, which equals torch.min's split of the tie.
        clipped = clipped_obj < unclipped_obj
        term = -torch.where(clipped, clipped_obj, unclipped_obj)
    elif name == "cispo":
        lo, hi = _thresholds(x, cfg, t)
        coef = torch.clamp(ratio.detach(), lo, hi)
        clipped = (ratio.detach() < lo) | (ratio.detach() > hi)
        term = -coef * adv * t
    else:  # dro
        term = -(t * adv - 0.5 * cfg["beta"] * (t - q) ** 2)
    extra: Metrics = {}
    active = (w != 0) if w is not None else torch.ones_like(t, dtype=torch.bool)
    if "rollout_logprobs" in x:
        c, truncated = truncated_is_weights(q, x["rollout_logprobs"], cfg["tis_cap"])
        term = c * term
        extra["tis_weight:sum"] = _masked_sum(c, active)
        extra["tis_truncated_tokens:sum"] = (truncated & active).sum(dtype=torch.float64)
    if "ref_logprobs" in x:
        kl = k3_kl(t, x["ref_logprobs"])
        extra["ref_kl:sum"] = _masked_sum(kl, active)
        if cfg["kl_coef"] > 0:
            term = term + cfg["kl_coef"] * kl
    loss = term if w is None else w * term
    metrics, _ = _base_metrics(loss, w)
    metrics["ratio:sum"] = _masked_sum(ratio, active)
    if clipped is not None:
        metrics["clipped_tokens:sum"] = (clipped & active).sum(dtype=torch.float64)
    metrics.update(extra)
    _add_entropy(metrics, entropy, active)
    return loss, metrics


def importance_sampling(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with an importance-sampling correction (Tinker ``importance_sampling``):
    ``l_i = w_i * (-c_i * exp(t_i - q_i) * A_i + kl_i)``; gradient ``-w c r A`` per token.

    Inputs: ``target_tokens``, ``logprobs`` (q), ``advantages`` (A), all [T]; optional
    ``weights``, ``rollout_logprobs``, ``ref_logprobs``. Config: ``tis_cap``, ``kl_coef``
    (ferrule extensions; Tinker defines none). Metrics (sums over tokens with weight != 0):
    ``loss:sum``, ``weights:sum``, ``tokens:sum``, ``ratio:sum``, plus ``tis_weight:sum`` and
    ``tis_truncated_tokens:sum`` with ``rollout_logprobs``, ``ref_kl:sum`` with
    ``ref_logprobs``, ``entropy:sum`` with ``entropy``. Source: Tinker docs/losses.mdx.
    """
    return _policy_loss("importance_sampling", target_logprobs, loss_fn_inputs, loss_fn_config, entropy)


def ppo(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate objective (Schulman et al. 2017, arXiv:1707.06347; Tinker ``ppo``):
    ``l_i = w_i * (-c_i * min(r_i A_i, clip(r_i, lo, hi) A_i) + kl_i)``, ``r = exp(t - q)``.

    ``lo``/``hi`` are absolute ratio bounds: config ``clip_low_threshold`` (default 0.8) and
    ``clip_high_threshold`` (default 1.2), overridable per datum by the same-named inputs
    ([T] or one value). A token is clipped when the clipped branch is strictly smaller (its
    gradient is then 0); on ties, the edge ``r == hi`` included, the gradient flows.
    Metrics: as :func:`importance_sampling` plus ``clipped_tokens:sum``.
    """
    return _policy_loss("ppo", target_logprobs, loss_fn_inputs, loss_fn_config, entropy)


def cispo(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped IS-weight policy optimisation (MiniMax-M1, Chen et al. 2025, arXiv:2506.13585;
    Tinker ``cispo``): ``l_i = w_i * (-c_i * sg(clip(r_i, lo, hi)) * A_i * t_i + kl_i)``.

    The clipped ratio is a constant weight, so every token keeps a gradient
    ``-w c clip(r) A``. Thresholds as in :func:`ppo` (defaults 0.8 / 1.2, Tinker tutorial 202;
    some reimplementations use 0.0 / 4.0: pass them explicitly if you rely on them).
    ``clipped_tokens:sum`` counts ``r < lo or r > hi``.
    """
    return _policy_loss("cispo", target_logprobs, loss_fn_inputs, loss_fn_config, entropy)


def dro(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Direct reward optimisation with a quadratic penalty (Richemond et al. 2024,
    arXiv:2405.19107; Kimi k1.5 2025; Tinker ``dro``):
    ``l_i = w_i * (-c_i * (t_i A_i - beta/2 * (t_i - q_i)^2) + kl_i)``.

    Config ``beta`` (default 0.05, the Tinker docs' example). The penalty also acts on tokens
    with A = 0: give prompt positions weight 0 (or matching ``logprobs``) to exclude them.
    """
    return _policy_loss("dro", target_logprobs, loss_fn_inputs, loss_fn_config, entropy)


#: losses whose per-token terms depend on their datum's other tokens: the engine passes ``segment_ids``
SEQUENCE_LEVEL = frozenset({"gspo"})


def gspo(
    target_logprobs: torch.Tensor,
    loss_fn_inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float | str] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Tinker ``gspo``): ``l_i = -w_i * min(s_i A_i, clip(s_i, lo, hi) A_i)``.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (its
    token-level variant, GSPO-token), as Tinker's loss page
    (``tinker-docs.thinkingmachines.ai/tinker/losses/gspo``) states it. With ``t`` the current
    logprobs, ``q`` = ``logprobs`` (the sampler's), ``A`` = ``advantages`` and ``M`` the tokens
    ``sequence_ratio_mask`` marks (non-zero) in one datum::

        s      = exp( mean_{i in M} (sg(t_i) - q_i) )            the sequence ratio (geometric mean)
        s_i    = sg(s) * exp(t_i - sg(t_i))                       value s, gradient s * grad t_i
        l_i    = -min(s_i * A_i, clip(s_i, lo, hi) * A_i)         summed over every token i

    so every token of a datum carries the same ratio value and is kept or clipped together, and
    per-token advantages still weight each token's own gradient. ``lo`` / ``hi`` are absolute ratio
    bounds (``clip_low_threshold`` / ``clip_high_threshold``, the keys of Tinker's ``ppo``); their
    defaults are the GSPO paper's clipping range (§5.1: left 3e-4, right 4e-4, i.e. 0.9997 and
    1.0004), since the sequence ratio of a mean log-ratio stays close to 1. Without
    ``sequence_ratio_mask`` every token is in ``M``. A ferrule ``weights`` input, if given,
    multiplies ``l_i`` (absent for Tinker requests).

    The ratio couples the tokens of one datum, so the loss needs to know where data start when
    several are packed along the token axis: the train engine passes ``segment_ids`` (``[T]``
    int, one id per datum, see :data:`SEQUENCE_LEVEL`); a call without it is one datum.

    Inputs ``[T]``: ``target_tokens``, ``logprobs``, ``advantages``; optional
    ``sequence_ratio_mask`` (float, non-zero = in the ratio), ``weights``, per-datum
    ``clip_low_threshold`` / ``clip_high_threshold``; ``segment_ids`` (int ``[T]``, from the
    engine). Metrics: ``loss:sum``, ``weights:sum``, ``tokens:sum``, ``ratio:sum`` (each token's
    ratio value ``s``), ``clipped_tokens:sum`` (tokens whose clipped branch is strictly smaller).

    Raises:
        ValueError: shapes that differ from ``target_logprobs``, or a datum whose
            ``sequence_ratio_mask`` marks no token (its ratio would be undefined).
    """
    cfg = resolve_loss_config("gspo", loss_fn_config)
    keys = ("logprobs", "advantages", "weights", "sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold")
    dtype, x = _prepare(target_logprobs, loss_fn_inputs, keys)
    t = target_logprobs.to(dtype)
    q, adv, w = x["logprobs"], x["advantages"], x.get("weights")
    n = t.shape[0]
    seg = loss_fn_inputs.get("segment_ids")
    seg = torch.zeros(n, dtype=torch.long, device=t.device) if seg is None else seg.to(t.device, torch.long)
    if tuple(seg.shape) != (n,):
        raise ValueError(f"segment_ids has shape {tuple(seg.shape)}, expected [{n}]")
    in_ratio = (x["sequence_ratio_mask"] != 0) if "sequence_ratio_mask" in x else torch.ones(n, dtype=torch.bool,
                                                                                               device=t.device)
    n_seg = int(seg.max()) + 1 if n else 0
    counts = torch.zeros(n_seg, dtype=dtype, device=t.device).index_add_(0, seg, in_ratio.to(dtype))
    if n_seg and bool((counts == 0).any()):
        raise ValueError("loss 'gspo': a datum's sequence_ratio_mask marks no token, so its sequence ratio is "
                         "undefined; mark the sampled tokens (1.0) or drop the datum")
    diff = torch.where(in_ratio, t.detach() - q, torch.zeros_like(q))
    log_s = torch.zeros(n_seg, dtype=dtype, device=t.device).index_add_(0, seg, diff) / counts.clamp(min=1)
    ratio = torch.exp(log_s[seg] + t - t.detach())
    lo, hi = _thresholds(x, cfg, t)
    unclipped_obj = ratio * adv
    clipped_obj = torch.clamp(ratio, lo, hi) * adv
    clipped = clipped_obj < unclipped_obj
    term = -torch.where(clipped, clipped_obj, unclipped_obj)
    loss = term if w is None else w * term
    metrics, active = _base_metrics(loss, w)
    metrics["ratio:sum"] = _masked_sum(ratio, active)
    metrics["clipped_tokens:sum"] = (clipped & active).sum(dtype=torch.float64)
    _add_entropy(metrics, entropy, active)
    return loss, metrics


LOSSES: Mapping[str, LossFn] = MappingProxyType(
    {
        "cross_entropy": cross_entropy,
        "importance_sampling": importance_sampling,
        "ppo": ppo,
        "cispo": cispo,
        "dro": dro,
        "gspo": gspo,
    }
)


def get_loss(name: str) -> LossFn:
    """Return the loss called ``name`` (Tinker's ``loss_fn`` string). Raises ``ValueError``
    listing the known names for an unknown one."""
    _check_name(name)
    return LOSSES[name]
