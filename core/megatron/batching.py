"""Batch format and batch planning of the train engine: ``Datum``, DP assignment, micro-batches.

:class:`Datum` mirrors Tinker's ``Datum`` (``tinker.types.Datum``: ``model_input`` +
``loss_fn_inputs``) with the model input reduced to its token ids, so the service maps a
Tinker request 1:1 (``model_input.to_ints()`` -> ``Datum.model_input``; each ``TensorData`` ->
a torch tensor). Alignment (Tinker's): position ``i`` of ``model_input`` predicts
``loss_fn_inputs["target_tokens"][i]``; every per-token input has the same length ``N``.

Planning is pure Python on token counts (no torch, no collectives), so every rank computes the
same plan from the same batch:

- :func:`assign_dp_ranks` — online least-loaded assignment of each datum to a data-parallel
  rank by token count ("sequence-length balancing"). The loads carry over across the
  ``forward_backward`` calls of one accumulation window, so datum ``k`` of the window goes to
  the same rank, in the same order, however the window is split into calls. That is what makes
  the accumulated gradient bit-identical across splits (see :func:`pack_microbatches`).
- :func:`pack_microbatches` — a rank's data, longest first, greedily packed into
  micro-batches whose padded size ``count * max_len`` stays within a token budget (sorting by
  length keeps the padding of RL batches, whose lengths vary widely, to a few percent).
  With ``max_tokens=None`` every datum is its own micro-batch: gradients then accumulate datum
  by datum in window order, which is bit-identical for any split of the window into calls.
  With a budget, packed micro-batches are exact in real arithmetic but the floating-point
  summation order inside a GEMM depends on which data share a micro-batch, so results across
  *different* call splits agree to rounding (~1e-7 relative in fp32), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["Datum", "FBOutput", "assign_dp_ranks", "pack_microbatches"]


@dataclass
class Datum:
    """One training example (Tinker's ``Datum`` with token ids as model input).

    Attributes:
        model_input: token ids ``[N]`` (list of int or a 1-D integer tensor).
        loss_fn_inputs: Tinker names -> ``[N]`` tensors (or lists): ``target_tokens`` (int64),
            ``weights``, ``logprobs`` (the sampler's), ``advantages`` (float32), and the
            optional keys :data:`ferrule.losses.LOSS_INPUT_KEYS` lists per loss.
        media: for a family with towers (``register_towers``): ``{modality: [item, ...]}``, one
            tensor per media part in order of appearance, dim 0 = the placeholder tokens it fills
            in ``model_input`` (Inkling: vision ``pixel_values`` ``[n_patches, 2, P, P, 3]``
            float32, audio dMel ids ``[n_frames, 80]`` int). None or empty: text only.
        routed_experts: MoE routing replay (R3, :mod:`ferrule.megatron.routing_replay`): per
            ``model_input`` token and MoE layer the experts to route it to, ``[N, num_moe_layers,
            top_k]`` integer (the rollout's ``GenerateResult.routed_experts``); None: the routers pick.
            Within one call either every datum carries routes or none does.
    """

    model_input: Any
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)
    media: dict[str, Any] | None = None
    routed_experts: Any = None


@dataclass
class FBOutput:
    """Result of :meth:`TrainEngine.forward_backward` (Tinker's ``ForwardBackwardOutput``).

    Attributes:
        loss_fn_outputs: one dict per datum, in the caller's order: ``logprobs`` ``[N]`` float32
            (log-probability of ``target_tokens`` under the pre-step weights) and
            ``elementwise_loss`` ``[N]`` float32 (the per-token loss terms; their sum is the
            datum's loss), CPU tensors.
        metrics: ``"name:reduction"`` -> float, summed over the whole batch (all micro-batches
            and data-parallel ranks), plus derived ``:mean`` ratios
            (:func:`ferrule.losses.finalize_metrics`).
        loss_fn_output_type: ``"ArrayRecord"`` (Tinker's type tag).
    """

    loss_fn_outputs: list[dict[str, Any]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"


def assign_dp_ranks(lengths: Sequence[int], dp_size: int, loads: list[int] | None = None) -> list[int]:
    """Assign each datum to a data-parallel rank, least-loaded first (online, in order).

    Args:
        lengths: token count of each datum, in the caller's order.
        dp_size: number of data-parallel ranks.
        loads: tokens already assigned to each rank in this accumulation window; updated in
            place (pass the same list to every call of one window). None starts from zeros.

    Returns:
        ``rank[i]`` for each datum: the rank with the smallest load so far (ties -> the lowest
        rank index). Deterministic, so every rank computes the same assignment.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}; expected >= 1.")
    if loads is None:
        loads = [0] * dp_size
    if len(loads) != dp_size:
        raise ValueError(f"loads has {len(loads)} entries for dp_size={dp_size}.")
    out = []
    for n in lengths:
        r = min(range(dp_size), key=lambda i: (loads[i], i))
        loads[r] += int(n)
        out.append(r)
    return out


def pack_microbatches(indices: Sequence[int], lengths: Mapping[int, int] | Sequence[int],
                      max_tokens: int | None, *, packed: bool = False) -> list[list[int]]:
    """Group ``indices`` into micro-batches of at most ``max_tokens`` padded tokens.

    A micro-batch of ``b`` data padded to its longest (``s`` tokens) costs ``b * s`` tokens.
    With a budget the data are taken longest first (ties in arrival order) and packed greedily,
    so each micro-batch holds data of similar length and little padding. A datum longer than
    ``max_tokens`` gets a micro-batch of its own (never split: a datum's tokens attend to each
    other). ``max_tokens=None`` puts every datum in its own micro-batch, in arrival order (what
    the bit-identical split invariance rests on). ``packed=True`` (the engine concatenates a
    micro-batch's data into one row, megatron's ``thd`` format) counts real tokens: data are
    taken in arrival order while their summed length fits the budget.

    Returns:
        A list of micro-batches, each a list of datum indices.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; expected None or an integer >= 1.")
    if max_tokens is None:
        return [[i] for i in indices]
    if packed:
        groups: list[list[int]] = []
        used = 0
        for i in indices:
            n = int(lengths[i])
            if groups and used + n <= max_tokens:
                groups[-1].append(i)
                used += n
            else:
                groups.append([i])
                used = n
        return groups
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in sorted(indices, key=lambda i: -int(lengths[i])):
        n = int(lengths[i])
        if cur and (len(cur) + 1) * max(cur_max, n) > max_tokens:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    return out
