"""What each loss takes: its config keys and defaults, its ``loss_fn_inputs`` keys, the derived
means of the summed metrics, and the input checks (:func:`validate_loss_inputs`). Part of
:mod:`ferrule.losses` (re-exported there; the module docstring there is the reference).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch

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
_EXT_CONFIG = {"tis_cap": 2.0, "kl_coef": 0.0, "entropy_coef": 0.0}
LOSS_CONFIG_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "cross_entropy": MappingProxyType({}),
        "importance_sampling": MappingProxyType(dict(_EXT_CONFIG)),
        "ppo": MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **_EXT_CONFIG}),
        "cispo": MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **_EXT_CONFIG}),
        "dro": MappingProxyType({"beta": 0.05, **_EXT_CONFIG}),
        # GSPO paper (arXiv:2507.18071) §5.1 clipping range 3e-4 / 4e-4, as absolute bounds
        "gspo": MappingProxyType({"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4,
                                  "entropy_coef": 0.0}),
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
    threshold, ``beta < 0``, ``kl_coef < 0``, ``entropy_coef < 0`` or ``tis_cap <= 0``.
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
    for key, ok in (("beta", lambda v: v >= 0), ("kl_coef", lambda v: v >= 0), ("entropy_coef", lambda v: v >= 0),
                    ("tis_cap", lambda v: v > 0)):
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
            f"{where}target_tokens contains id {int(tokens.max())} >= the vocabulary size {vocab_size} (ids 0.."
            f"{vocab_size - 1}; the rows of a padded embedding past unpadded_vocab_size are no tokens); "
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
