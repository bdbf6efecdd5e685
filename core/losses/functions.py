"""The loss functions and :func:`get_loss`. Part of :mod:`ferrule.losses` (re-exported there; the
formulas are in its docstring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from .inputs import LOSS_INPUT_KEYS, LossFn, Metrics, _SCALAR_OK, _check_name, resolve_loss_config
from .metrics import k3_kl, truncated_is_weights

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


def _entropy_bonus(term: torch.Tensor, entropy: torch.Tensor | None, cfg: Mapping[str, float],
                   name: str) -> torch.Tensor:
    """``term - entropy_coef * H`` (the entropy bonus; ``H`` keeps its autograd history), or ``term``
    when ``entropy_coef`` is 0. Raises ``ValueError`` when ``entropy_coef > 0`` comes without ``entropy``."""
    coef = cfg.get("entropy_coef", 0.0)
    if coef <= 0:
        return term
    if entropy is None:
        raise ValueError(f"loss {name!r}: loss_fn_config['entropy_coef'] = {coef} > 0 needs the policy's "
                         "per-token entropy (entropy=, [T] with autograd history; the train engine computes "
                         "it from the logits); pass it or set entropy_coef to 0")
    if tuple(entropy.shape) != tuple(term.shape):
        raise ValueError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(term.shape)}")
    return term - coef * entropy.to(term.dtype)


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
    term = _entropy_bonus(term, entropy, cfg, name)
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
    term = _entropy_bonus(-torch.where(clipped, clipped_obj, unclipped_obj), entropy, cfg, "gspo")
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
