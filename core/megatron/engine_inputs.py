"""Input checks of the train engine: a batch of :class:`~ferrule.megatron.batching.Datum` (or
``{"model_input", "loss_fn_inputs"}`` dicts, or ``tinker.Datum``) -> validated CPU tensors, before
any gradient is touched. Used by :meth:`ferrule.megatron.engine.TrainEngine.forward_backward` and
friends (``engine._prepare``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..losses import validate_loss_inputs
from .batching import Datum
from .towers import check_media

__all__ = ["prepare_batch"]


def _as_tensor(value: Any, dtype: torch.dtype, where: str) -> torch.Tensor:
    if hasattr(value, "to_torch"):          # tinker.TensorData
        value = value.to_torch()
    elif hasattr(value, "to_ints"):         # tinker.ModelInput
        value = value.to_ints()
    if isinstance(value, torch.Tensor):
        if dtype == torch.int64 and (value.dtype.is_floating_point or value.dtype == torch.bool):
            raise ValueError(f"{where} must hold integer token ids, got dtype {value.dtype}.")
        return value.detach().to("cpu", dtype if dtype == torch.int64 else value.dtype
                                 if value.dtype.is_floating_point else dtype)
    try:
        return torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{where} cannot be converted to a {dtype} tensor: {exc}") from exc


class _Prepared:
    """A validated datum: CPU tensors ``tokens`` [N] int64, ``inputs`` (name -> [N]) and ``media``
    (modality -> list of tensors, checked against the placeholders; empty for text)."""

    __slots__ = ("tokens", "inputs", "media", "routes")

    def __init__(engine, tokens: torch.Tensor, inputs: dict[str, torch.Tensor],
                 media: dict[str, list[torch.Tensor]] | None = None, routes: torch.Tensor | None = None):
        engine.tokens, engine.inputs, engine.media, engine.routes = tokens, inputs, media or {}, routes


def _routes(engine: Any, d: Any, n: int, i: int) -> torch.Tensor | None:
    """A datum's ``routed_experts`` checked: ``[n, num_moe_layers, top_k]`` ids in ``[0, num_experts)``."""
    value = getattr(d, "routed_experts", None)
    if value is None:
        return None
    routes = torch.as_tensor(value)
    routers = engine.moe_routers
    if not routers:
        raise ValueError(f"datum {i}: routed_experts given, but the model has no MoE router; drop them.")
    want = (n, len(routers), routers[0].topk)
    if routes.dtype.is_floating_point or routes.dtype == torch.bool or tuple(routes.shape) != want:
        raise ValueError(f"datum {i}: routed_experts must be integer ids of shape {want} (tokens, MoE layers, "
                         f"top_k), got {routes.dtype} {tuple(routes.shape)}.")
    experts = routers[0].config.num_moe_experts
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= experts):
        raise ValueError(f"datum {i}: routed_experts holds ids outside [0, {experts}); they come from another model.")
    return routes.to("cpu", torch.int16)


def prepare_batch(engine: Any, batch: Sequence[Any], loss_fn: str | None,
                  loss_fn_config: Mapping[str, Any] | None) -> tuple[list[_Prepared], dict]:
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence) or len(batch) == 0:
        raise ValueError("empty batch: forward_backward / forward_logprobs need a non-empty list of Datum.")
    out: list[_Prepared] = []
    for i, d in enumerate(batch):
        if isinstance(d, Mapping):
            d = Datum(d.get("model_input"), dict(d.get("loss_fn_inputs") or {}), d.get("media"), d.get("routed_experts"))
        tokens = _as_tensor(d.model_input, torch.int64, f"datum {i}: model_input")
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"datum {i}: model_input must be a non-empty 1-D list of token ids, "
                             f"got shape {tuple(tokens.shape)}.")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= engine.vocab_size:
            raise ValueError(f"datum {i}: model_input holds token id {lo if lo < 0 else hi} outside "
                             f"[0, {engine.vocab_size}); the tokens do not belong to this model's tokenizer.")
        if engine.max_positions and tokens.numel() > engine.max_positions:
            raise ValueError(f"datum {i}: {tokens.numel()} tokens exceed max_position_embeddings "
                             f"{engine.max_positions}; truncate the datum.")
        inputs = {}
        for key, value in (d.loss_fn_inputs or {}).items():
            dtype = torch.int64 if key == "target_tokens" else torch.float32
            inputs[key] = _as_tensor(value, dtype, f"datum {i}: loss_fn_inputs[{key!r}]")
        if "target_tokens" not in inputs:
            raise ValueError(f"datum {i}: loss_fn_inputs['target_tokens'] is missing (position i of "
                             f"model_input predicts target_tokens[i]).")
        if inputs["target_tokens"].shape != tokens.shape:
            raise ValueError(f"datum {i}: target_tokens has length {inputs['target_tokens'].numel()} but "
                             f"model_input has {tokens.numel()}; they must be token-aligned (same length).")
        media = check_media(tokens, getattr(d, "media", None), engine.towers, f"datum {i}", engine.family)
        out.append(_Prepared(tokens, inputs, media, _routes(engine, d, tokens.numel(), i)))
    with_routes = [p.routes is not None for p in out]
    if any(with_routes) and not all(with_routes):
        raise ValueError(f"data {[i for i, w in enumerate(with_routes) if not w][:5]} carry no routed_experts while "
                         "others do; routing replay needs routes for every datum of a call, or for none.")
    if loss_fn is None:  # forward_logprobs: only target_tokens matter
        for i, p in enumerate(out):
            validate_loss_inputs("cross_entropy", {"target_tokens": p.inputs["target_tokens"],
                                                   "weights": torch.zeros(p.tokens.numel())},
                                 vocab_size=engine.vocab_size)
            p.inputs = {"target_tokens": p.inputs["target_tokens"]}
        return out, {}
    validate_loss_inputs(loss_fn, [p.inputs for p in out], loss_fn_config, vocab_size=engine.vocab_size)
    return out, dict(loss_fn_config or {})
