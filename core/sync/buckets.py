"""Update units -> full mcore tensors (TP gathered, EP collected) -> HF-named, byte-bounded buckets.

This module plans and packs; moving the tensors is :mod:`ferrule.megatron.weights`'s (bind,
TP/EP/PP gather), and so is the HF assembly (:class:`ferrule.mapping.HFAssembler`). Three
stages, each usable on its own:

1. :func:`plan_sync` (no data moved except small metadata objects): this rank's parameters get
   global names (:func:`ferrule.megatron.param_gather.bind_params`), a mapping-table entry
   each and an update unit each (:func:`ferrule.sync.groups.build_update_units`); errors are
   agreed across all ranks before any tensor collective, so a bad table raises everywhere and
   nothing is sent.
2. :func:`iter_full_units` (collective): yields :class:`FullUnit`\\ s of full mcore tensors in one
   global order. Who takes part in which collective:

   - dense units: the ranks of data-parallel replica 0 (``get_data_parallel_rank() == 0``):
     TP shards are all-gathered over the TP group and re-assembled by the mapping's
     :meth:`~ferrule.mapping.ParamMapping.gather` (stride-aware for SwiGLU ``linear_fc1``);
   - routed-expert units (:func:`~ferrule.sync.groups.is_routed_expert_param`): the ranks of
     expert-data-parallel replica 0: shards all-gathered over the expert-TP group, then every
     EP rank's experts collected over the EP group (a local routed unit becomes ``ep`` units,
     one per global expert, named by the owning rank);
   - at PP > 1 every stage's units are broadcast over the pipeline group from that stage, so
     that stage 0 holds the whole model.

   Other data-parallel replicas skip the step (no redundant communication). The ranks that
   take part all receive every full unit; only the *sender* (global rank 0, which lies in
   both replica 0s and in pipeline stage 0) goes on to convert and send.
3. :func:`iter_hf_buckets` (local): converts each full unit to HF names/layouts through the
   family's :class:`~ferrule.mapping.MappingTable` (:class:`~ferrule.mapping.HFAssembler`) and packs whole units greedily, in order,
   into buckets of at most ``bucket_bytes`` (bytes of the HF tensors, ``numel *
   element_size``). A unit larger than the budget travels alone in its own bucket; a unit is
   never split.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.mapping import HFAssembler, MappingContext, MappingError, MappingTable
from ferrule.megatron.param_gather import (BoundParam, GatherStep, ParallelRanks, agreed_errors, bind_params, iter_full,
                                           mapping_context, plan_gather)
from ferrule.contract.specs import UpdateGroup, UpdateGroupTable
from ferrule.sync.groups import UpdateGroupError, UpdateUnit, build_update_units, is_routed_expert_param

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FullUnit",
    "SyncPlan",
    "WeightSyncError",
    "hf_unit_tensors",
    "iter_full_units",
    "iter_hf_buckets",
    "pack_buckets",
    "plan_sync",
    "tensor_bytes",
]

#: Default bucket budget in bytes (512 MiB, the size miles uses for ``--update-weight-buffer-size``).
DEFAULT_BUCKET_BYTES = 512 * 2**20


class WeightSyncError(RuntimeError):
    """Weight sync or its verification failed (the message names the tensors / ranks involved)."""


def tensor_bytes(t: "torch.Tensor") -> int:
    """Bytes of a tensor's elements: ``numel * element_size``."""
    return t.numel() * t.element_size()


def pack_buckets(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy in-order packing of unit sizes (bytes) into buckets of at most ``budget`` bytes.

    Units keep their order; a bucket is closed when the next unit would overflow it. A unit
    larger than ``budget`` is placed alone in its own bucket (never split). Returns the unit
    indices of each bucket.

    Raises:
        ValueError: ``budget < 1`` or a negative size.
    """
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"bucket budget must be a positive number of bytes, got {budget!r}.")
    buckets: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"unit {i} has a negative size {size}.")
        if cur and used + size > budget:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size
        if used > budget:  # an oversized unit alone
            buckets.append(cur)
            cur, used = [], 0
    if cur:
        buckets.append(cur)
    return buckets


# ---------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------


@dataclass
class SyncPlan:
    """What :func:`iter_full_units` will do on this rank (built by :func:`plan_sync`).

    Attributes:
        steps: per pipeline stage, the ordered gather steps, one per update unit
            (:class:`ferrule.megatron.param_gather.GatherStep`, same on every rank of a pipeline group).
        dense_on / expert_on: whether this rank takes part in dense / routed-expert steps.
        ctx: the mapping context (``padded_vocab_size`` read off the live embedding).
        table: the family's mapping table.
        params: this rank's bound parameters by global name.
        ranks: this rank's parallel coordinates.
    """

    steps: list[list[GatherStep]]
    dense_on: bool
    expert_on: bool
    ctx: MappingContext
    table: MappingTable
    params: dict[str, BoundParam]
    ranks: ParallelRanks


@dataclass(frozen=True)
class FullUnit:
    """One update unit as full (unsharded) mcore tensors.

    Attributes:
        group: the update group key.
        names: global mcore names.
        tensors: full tensors in ``names`` order (TP shards gathered, vocabulary still padded).
    """

    group: str
    names: tuple[str, ...]
    tensors: tuple["torch.Tensor", ...]


def _agree_errors(errors: list[str]) -> None:
    """Raise the union of every rank's errors on every rank (no rank is left in a collective)."""
    everyone = agreed_errors(errors)
    if everyone:
        raise WeightSyncError("\n".join(everyone))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _replica_flags() -> tuple[bool, bool]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True, True
    return ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0


def plan_sync(model_chunks: Any, table: MappingTable, groups: UpdateGroupTable | Sequence[UpdateGroup],
              hf_config: Mapping[str, Any] | None = None, *, ctx: MappingContext | None = None) -> SyncPlan:
    """Validate names, mapping and update groups on every rank and lay out the collective steps.

    Must be called on every rank of the job (it exchanges small objects over the world, the
    pipeline and the EP groups). Binding and gathering are :mod:`ferrule.megatron.weights`'s.

    Args:
        model_chunks: this rank's GPTModel chunks (possibly DDP/Float16-wrapped).
        table: the family's mapping table.
        groups: the family's update-group table.
        hf_config: parsed HF ``config.json`` (head counts, vocabulary, tying); or ``ctx``.

    Raises:
        WeightSyncError: on every rank, with every rank's problems: parameters without a
            mapping, update-group violations (:class:`~ferrule.sync.groups.UpdateGroupError`),
            a classifier disagreement (:func:`is_routed_expert_param` vs the mapping's
            ``expert`` flag), or EP ranks holding differently shaped expert units.
    """
    ranks = ParallelRanks.current()
    errors: list[str] = []
    params: dict[str, BoundParam] = {}
    units: list[UpdateUnit] = []
    try:
        params = {bp.global_name: bp for bp in bind_params(model_chunks, table)}
        units = build_update_units(list(params), groups)
        wrong = [f"{n}: is_routed_expert_param={is_routed_expert_param(n)}, mapping "
                 f"{type(bp.mapping).__name__}({bp.mapping.mcore}).expert={bp.mapping.expert}"
                 for n, bp in params.items() if is_routed_expert_param(n) != bool(bp.mapping.expert)]
        if wrong:
            errors.append("routed-expert classification disagrees with the mapping table (the gather group "
                          "would be wrong):\n" + "\n".join(f"  - {w}" for w in wrong)
                          + "\nUse ExpertRename/ExpertFuseGateUp/StackExperts exactly for routed experts.")
    except (MappingError, UpdateGroupError) as exc:
        errors.append(f"rank {_rank()}: {exc}")
    if ctx is None and hf_config is None:
        errors.append("plan_sync needs hf_config= (the parsed config.json) or ctx= (a MappingContext).")
    _agree_errors(errors)
    ctx = mapping_context(list(params.values()), ranks, hf_config=hf_config, ctx=ctx)
    dense_on, expert_on = _replica_flags()
    try:
        steps = plan_gather(params, [(u.group, u.names) for u in units], ranks, with_experts=expert_on)
    except MappingError as exc:  # raised on every rank together
        raise WeightSyncError(str(exc)) from exc
    return SyncPlan(steps, dense_on, expert_on, ctx, table, params, ranks)


def iter_full_units(plan: SyncPlan) -> Iterator[FullUnit]:
    """Yield every full unit of the model in the plan's global order (collective).

    Must be iterated to the end on every rank of the job. Ranks outside data-parallel replica
    0 (dense units) or expert-data-parallel replica 0 (routed units) skip those steps and do
    not yield them; global rank 0 yields every unit of the model. Tensors are on the
    parameters' device, in the parameter dtype, detached (they may alias live parameters:
    copy before modifying). The collectives are :func:`ferrule.megatron.param_gather.iter_full`'s.
    """
    for key, names, tensors in iter_full(plan.steps, plan.params, plan.ranks, dense=plan.dense_on,
                                         routed=plan.expert_on):
        yield FullUnit(key, names, tensors)


# ---------------------------------------------------------------------------------------
# Conversion and packing
# ---------------------------------------------------------------------------------------


def hf_unit_tensors(units: Iterable[FullUnit], table: MappingTable, ctx: MappingContext,
                    dtype: "torch.dtype | None" = None) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Per full unit, its HF-named tensors (names/layouts via ``table``; padding removed).

    A unit whose parameters export nothing (a tied output layer) yields an empty list.
    Stacked-expert HF tensors (:class:`~ferrule.mapping.StackExperts`) appear with the unit
    that completes them. ``dtype`` casts floating tensors. The conversion is
    :class:`ferrule.mapping.HFAssembler`'s (the same as export's).

    Raises:
        WeightSyncError: stacked-expert tensors still incomplete at the end.
    """
    assembler = HFAssembler(table, ctx, dtype)
    for unit in units:
        yield [pair for name, full in zip(unit.names, unit.tensors) for pair in assembler.add(name, full)]
    try:
        assembler.finish()
    except MappingError as exc:
        raise WeightSyncError(f"weight sync: {exc}") from exc


def iter_hf_buckets(units: Iterable[FullUnit], table: MappingTable, ctx: MappingContext, bucket_bytes: int,
                    dtype: "torch.dtype | None" = None) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Pack the HF tensors of ``units`` into buckets of at most ``bucket_bytes`` bytes.

    Same rule as :func:`pack_buckets` applied to each unit's HF bytes, streamed: at most one
    bucket plus one unit is held at a time. Empty units are dropped.

    Raises:
        ValueError: ``bucket_bytes < 1``.
        WeightSyncError: see :func:`hf_unit_tensors`.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}.")
    cur: list[tuple[str, Any]] = []
    used = 0
    for hf in hf_unit_tensors(units, table, ctx, dtype):
        if not hf:
            continue
        size = sum(tensor_bytes(t) for _, t in hf)
        if cur and used + size > bucket_bytes:
            yield cur
            cur, used = [], 0
        cur += hf
        used += size
        if used > bucket_bytes:
            yield cur
            cur, used = [], 0
    if cur:
        yield cur
