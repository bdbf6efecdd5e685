"""``cross_entropy`` with rank-2 targets: ``target_tokens`` / ``weights`` of shape ``[N, K]``.

Tinker's ``Datum`` (``tinker-docs .../tinker/datum``) lets a loss input carry ``K`` values per
position; for ``cross_entropy`` (the cookbook's off-policy distillation with top-k teacher
targets) the loss is the sum over the ``K`` targets of every position::

    loss = -sum_{n, k} weights[n, k] * log p(target_tokens[n, k] | model_input[: n + 1])

and the outputs ``logprobs`` / ``elementwise_loss`` are ``[N, K]``. The service computes it by
expanding such a datum into ``K`` rank-1 data with the same ``model_input`` (column ``k`` of both
inputs), which the train engine handles as any batch: the sum is the same sum, so gradients are
exactly those of the rank-2 loss and, like the rank-1 case, invariant to how the SDK splits a
batch into requests. The price is ``K`` forward passes per datum (not one forward with ``K``
gathers): exact, not fast.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["expand", "regroup"]


def expand(data: Sequence[Any], loss_fn: str) -> tuple[list, list[tuple[int, int | None]]]:
    """``(rank-1 data, plan)``; ``plan[i] = (first expanded index, K or None)`` of datum ``i``.

    Raises:
        ValueError: a rank-2 ``target_tokens`` with another loss than ``cross_entropy``, or
            ``weights`` whose shape differs from ``target_tokens``' ``[N, K]``.
    """
    from ferrule.megatron.batching import Datum

    out: list = []
    plan: list[tuple[int, int | None]] = []
    for i, d in enumerate(data):
        tt = d.loss_fn_inputs.get("target_tokens")
        if tt is None or getattr(tt, "dim", lambda: 1)() != 2:
            plan.append((len(out), None))
            out.append(d)
            continue
        if loss_fn != "cross_entropy":
            raise ValueError(f"datum {i}: target_tokens of shape {tuple(tt.shape)} (rank 2) is defined for "
                             f"cross_entropy only, not {loss_fn!r}.")
        w = d.loss_fn_inputs.get("weights")
        if w is None or tuple(w.shape) != tuple(tt.shape):
            raise ValueError(f"datum {i}: rank-2 target_tokens {tuple(tt.shape)} need weights of the same shape, got "
                             f"{None if w is None else tuple(w.shape)}.")
        extra = sorted(set(d.loss_fn_inputs) - {"target_tokens", "weights"})
        if extra:
            raise ValueError(f"datum {i}: cross_entropy takes target_tokens and weights only, not {extra}.")
        k = int(tt.shape[1])
        plan.append((len(out), k))
        for j in range(k):
            out.append(Datum(d.model_input, {"target_tokens": tt[:, j].contiguous(), "weights": w[:, j].contiguous()},
                             getattr(d, "media", None)))
    return out, plan


def regroup(outputs: Sequence[dict], plan: Sequence[tuple[int, int | None]]) -> list[dict]:
    """Per original datum: its outputs, ``[N, K]`` (column ``k`` from expanded datum ``k``) for a
    rank-2 one, as they were for the others."""
    import torch

    out = []
    for start, k in plan:
        if k is None:
            out.append(outputs[start])
            continue
        group = outputs[start:start + k]
        out.append({name: torch.stack([torch.as_tensor(g[name]) for g in group], dim=1) for name in group[0]})
    return out
