"""Optimizer, LR scheduler and the decoupled optimizer step of the train engine.

Wraps megatron-core's ``get_megatron_optimizer`` (Adam / AdamW; distributed optimizer on or off;
without TransformerEngine/Apex the inner optimizer is ``torch.optim.AdamW`` or ``Adam``) and
``OptimizerParamScheduler``. :func:`apply_step` mirrors ``ChainedOptimizer.step`` (prepare
grads, global grad norm, clip by the total norm, inner step) with two changes the engine needs:
a step whose gradient norm is not finite is *skipped* (nothing applied; megatron's FP32
optimizer has no such check), and per-call Adam hyper-parameters (Tinker's ``AdamParams``)
override the param groups for exactly one step.

torch's Adam keeps a per-parameter ``state["step"]`` tensor; megatron's sharded optimizer
checkpoint does not restore it on the torch-Adam path (megatron_cpu_lab.md row 5b), so
:func:`adam_step_count` / :func:`set_adam_step` read and write it explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["OptimizerSettings", "build_optimizer", "build_scheduler", "inner_optimizers", "apply_step",
           "adam_step_count", "set_adam_step", "init_adam_state", "ADAM_PARAM_KEYS"]

#: Tinker ``AdamParams`` keys accepted by :func:`apply_step` (``grad_clip_norm`` 0 = no clipping).
ADAM_PARAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer and LR-schedule settings (megatron ``OptimizerConfig`` / scheduler names).

    Attributes:
        lr: peak learning rate. min_lr: floor of the decay.
        lr_warmup_steps, lr_decay_steps (None = no decay horizon: constant after warmup),
        lr_decay_style: ``'constant'``, ``'linear'``, ``'cosine'``, ``'inverse-square-root'``.
        weight_decay: decoupled (AdamW) when ``decoupled_weight_decay`` else L2 (Adam).
        adam_beta1, adam_beta2, adam_eps: Adam coefficients.
        clip_grad: global L2 grad-norm clip; 0 disables clipping.
        use_distributed_optimizer: shard optimizer state over data-parallel ranks.
        grad_reduce_in_fp32: DDP grad buffers in fp32 for bf16 params.
    """

    lr: float = 1e-5
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = True
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True


def build_optimizer(model_chunks: list, settings: OptimizerSettings, params_dtype: torch.dtype):
    """``get_megatron_optimizer`` for DDP-wrapped ``model_chunks`` (needs megatron parallel state)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        decoupled_weight_decay=settings.decoupled_weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(optimizer, settings: OptimizerSettings):
    """megatron's ``OptimizerParamScheduler`` (sets each group's lr / weight decay at step 0)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = settings.lr_decay_steps if settings.lr_decay_steps is not None else max(1, settings.lr_warmup_steps + 1)
    if settings.lr_decay_steps is None and settings.lr_decay_style != "constant":
        raise ValueError(f"lr_decay_style={settings.lr_decay_style!r} needs lr_decay_steps.")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.lr_warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=max(decay, settings.lr_warmup_steps + 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers under a ``ChainedOptimizer`` (or ``[optimizer]``)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _torch_optimizers(optimizer) -> list:
    return [o.optimizer for o in inner_optimizers(optimizer) if getattr(o, "optimizer", None) is not None]


def init_adam_state(optimizer) -> None:
    """Create torch-Adam state (``step`` 0, zero moments) for every parameter that has none,
    exactly as ``torch.optim.Adam._init_group`` would on the first step. Needed before a
    checkpoint load builds its template (``DistributedOptimizer.state_dict`` asserts one step)."""
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if len(state) == 0:  # fused Adam keeps its step on the parameter's device
                    state["step"] = torch.tensor(0.0, dtype=torch.float32,
                                                 device=p.device if group.get("fused") else None)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_step_count(optimizer) -> int:
    """torch Adam's ``state["step"]`` shared by all parameters (0 before the first step).

    Raises:
        RuntimeError: parameters disagree (megatron supports one common step only).
    """
    steps = {float(s["step"]) for opt in _torch_optimizers(optimizer) for s in opt.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"Adam step differs between parameters: {sorted(steps)}")
    return int(steps.pop()) if steps else 0


def set_adam_step(optimizer, step: int) -> None:
    """Set torch Adam's per-parameter ``state["step"]`` to ``step`` (float32 CPU scalar, torch's layout)."""
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                s = opt.state.get(p)
                if not s or not ("step" in s or "exp_avg" in s):
                    continue
                old = s.get("step")
                device = old.device if isinstance(old, torch.Tensor) else torch.device("cpu")
                if group.get("fused"):  # fused Adam keeps its step on the parameter's device
                    device = p.device
                s["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)


def _check_adam_params(adam_params: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (adam_params or {}).items():
        if key not in ADAM_PARAM_KEYS:
            raise ValueError(f"adam_params key {key!r} is unknown; accepted keys: {', '.join(ADAM_PARAM_KEYS)}.")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"adam_params[{key!r}] = {value!r}; expected a finite number >= 0.")
        out[key] = float(value)
    for key in ("beta1", "beta2"):
        if key in out and not out[key] < 1:
            raise ValueError(f"adam_params[{key!r}] = {out[key]}; expected 0 <= {key} < 1.")
    return out


@torch.no_grad()
def apply_step(optimizer, *, clip_grad: float, learning_rate: float | None = None,
               adam_params: Mapping[str, Any] | None = None) -> tuple[bool, float, float | None]:
    """One optimizer step on the finalized (DP-reduced) gradients; the caller zeroes grads.

    Args:
        optimizer: a megatron optimizer (chained or not).
        clip_grad: default global-norm clip (0 = none); ``adam_params["grad_clip_norm"]``
            overrides it for this step.
        learning_rate: this step's lr (times each group's ``lr_mult``); None keeps the
            scheduler's. ``adam_params["learning_rate"]`` is used when this is None.
        adam_params: Tinker ``AdamParams`` (``beta1``, ``beta2``, ``eps``, ``weight_decay``,
            ...) applied to every param group for this step only (weight decay times the
            group's ``wd_mult``, so norms/biases stay undecayed).

    Returns:
        ``(success, grad_norm, lr_used)``: success is False, and nothing is applied, when the
        global gradient norm (or the mixed-precision inf check) is not finite.

    Raises:
        ValueError: an unknown or out-of-range ``adam_params`` entry (checked before anything).
    """
    params = _check_adam_params(adam_params)
    if learning_rate is not None:
        params["learning_rate"] = _check_adam_params({"learning_rate": learning_rate})["learning_rate"]
    clip = params.get("grad_clip_norm", clip_grad)
    groups = [g for opt in _torch_optimizers(optimizer) for g in opt.param_groups]
    saved = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g} for g in groups]
    try:
        for g in groups:
            if "learning_rate" in params:
                g["lr"] = params["learning_rate"] * g.get("lr_mult", 1.0)
            if "beta1" in params or "beta2" in params:
                b1, b2 = g["betas"]
                g["betas"] = (params.get("beta1", b1), params.get("beta2", b2))
            if "eps" in params:
                g["eps"] = params["eps"]
            if "weight_decay" in params:
                g["weight_decay"] = params["weight_decay"] * g.get("wd_mult", 1.0)
        lr_used = groups[0]["lr"] if groups else None
        found_inf = bool(optimizer.prepare_grads())
        grad_norm = optimizer.get_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        if found_inf or not math.isfinite(grad_norm):
            return False, grad_norm, lr_used
        if clip > 0:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            for sub in inner_optimizers(optimizer):
                if getattr(sub, "is_stub_optimizer", False):
                    continue
                sub_params = sub.get_parameters()
                if sub_params:
                    clip_grad_by_total_norm_fp32(
                        sub_params, max_norm=clip, total_norm=grad_norm,
                        use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        success = bool(optimizer.step_with_ready_grads())
        return success, grad_norm, lr_used
    finally:
        for g, s in zip(groups, saved):
            g.update(s)
