"""Update units -> full mcore tensors (TP gathered, EP collected) -> HF-named, byte-bounded buckets.

Three stages, each usable on its own:

1. :func:`plan_sync` (no data moved except small metadata objects): this rank's parameters get
   global names (:func:`ferrule.converters.weights.global_param_names`), a mapping-table entry
   each and an update unit each (:func:`ferrule.sync.groups.build_update_units`); errors are
   agreed across all ranks before any tensor collective, so a bad table raises everywhere and
   nothing is sent.
2. :func:`iter_full_units` (collective): yields :class:`FullUnit`\\ s of full mcore tensors in one
   global order. Who takes part in which collective:

   - dense units: the ranks of data-parallel replica 0 (``get_data_parallel_rank() == 0``):
     TP shards are all-gathered over the TP group and re-assembled by the mapping's
     :meth:`~ferrule.mapping.Mapping.gather` (stride-aware for SwiGLU ``linear_fc1``);
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
   family's :class:`~ferrule.mapping.MappingTable` and packs whole units greedily, in order,
   into buckets of at most ``bucket_bytes`` (bytes of the HF tensors, ``numel *
   element_size``). A unit larger than the budget travels alone in its own bucket; a unit is
   never split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping as _MappingABC, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.mapping import Mapping, MappingContext, MappingError, MappingTable, StackExperts, TPSplit
from ferrule.specs import UpdateGroup, UpdateGroupTable
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
class _Param:
    global_name: str
    param: Any
    mapping: Mapping
    wildcards: tuple[str, ...]


@dataclass
class _Step:
    """One collective step of one pipeline stage: a dense unit, or a routed unit collected over EP."""

    routed: bool
    group: str
    names: list[list[str]]  # per produced FullUnit: global names (EP: one list per EP rank)
    shapes: list[tuple[int, ...]]  # full shape per parameter of the unit (same for every EP rank)
    dtypes: list[str]
    local: UpdateUnit | None = None  # only on the ranks of the owning stage


@dataclass
class SyncPlan:
    """What :func:`iter_full_units` will do on this rank (built by :func:`plan_sync`).

    Attributes:
        steps: per pipeline stage, the ordered collective steps (same on every rank of a
            pipeline group).
        stage: this rank's pipeline stage.
        dense_on / expert_on: whether this rank takes part in dense / routed-expert steps.
        ctx: the mapping context (``padded_vocab_size`` read off the live embedding).
        table: the family's mapping table.
    """

    steps: list[list[_Step]]
    stage: int
    dense_on: bool
    expert_on: bool
    ctx: MappingContext
    table: MappingTable
    params: dict[str, _Param]


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


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _all_gather_objects(obj: Any, group=None) -> list:
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _agree_errors(errors: list[str]) -> None:
    """Raise the union of every rank's errors on every rank (no rank is left in a collective)."""
    everyone = [e for errs in _all_gather_objects(errors) for e in errs]
    if everyone:
        raise WeightSyncError("\n".join(dict.fromkeys(everyone)))


def _chunks(model_chunks: Any) -> list:
    from ferrule.converters.weights import unwrap

    if isinstance(model_chunks, (list, tuple)):
        return [unwrap(c) for c in model_chunks]
    return [unwrap(model_chunks)]


def plan_sync(model_chunks: Any, table: MappingTable, groups: UpdateGroupTable | Sequence[UpdateGroup],
              hf_config: _MappingABC[str, Any] | None = None, *, ctx: MappingContext | None = None) -> SyncPlan:
    """Validate names, mapping and update groups on every rank and lay out the collective steps.

    Must be called on every rank of the job (it exchanges small objects over the world, the
    pipeline and the EP groups).

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
    from ferrule.converters.weights import ParallelRanks, global_param_names

    ranks = ParallelRanks.current()
    errors: list[str] = []
    params: dict[str, _Param] = {}
    units: list[UpdateUnit] = []
    try:
        named = []
        for chunk in _chunks(model_chunks):
            gmap = global_param_names(chunk)
            named += [(gmap[local], p) for local, p in chunk.named_parameters()]
        names = [n for n, _ in named]
        table.check_mcore_names(names)
        for n, p in named:
            params[n] = _Param(n, p, *table.resolve(n))
        units = build_update_units(names, groups)
        wrong = [f"{n}: is_routed_expert_param={is_routed_expert_param(n)}, mapping "
                 f"{type(it.mapping).__name__}({it.mapping.mcore}).expert={it.mapping.expert}"
                 for n, it in params.items() if is_routed_expert_param(n) != bool(it.mapping.expert)]
        if wrong:
            errors.append("routed-expert classification disagrees with the mapping table (the gather group "
                          "would be wrong):\n" + "\n".join(f"  - {w}" for w in wrong)
                          + "\nUse ExpertRename/ExpertFuseGateUp/StackExperts exactly for routed experts.")
    except (MappingError, UpdateGroupError) as exc:
        errors.append(f"rank {_rank()}: {exc}")
    if ctx is None:
        if hf_config is None:
            errors.append("plan_sync needs hf_config= (the parsed config.json) or ctx= (a MappingContext).")
        else:
            ctx = MappingContext.from_hf_config(hf_config)
    _agree_errors(errors)
    for it in params.values():
        if it.mapping.tp is TPSplit.VOCAB:
            ctx = dataclasses.replace(ctx, padded_vocab_size=int(it.param.shape[0]) * ranks.tp)
            break

    dense_on, expert_on = _replica_flags()
    ep_group = _ps().get_expert_model_parallel_group() if ranks.ep > 1 else None
    routed_units = [u for u in units if u.routed]
    ep_names = _all_gather_objects([list(u.names) for u in routed_units], ep_group) if expert_on else [
        [list(u.names) for u in routed_units]]
    if len({len(x) for x in ep_names}) > 1:
        _agree_errors([f"EP ranks hold different numbers of routed-expert units: {[len(x) for x in ep_names]}"])
    else:
        _agree_errors([])
    steps: list[_Step] = []
    r = 0
    for u in units:
        its = [params[n] for n in u.names]
        shapes = [_full_shape(it, ranks) for it in its]
        dtypes = [str(it.param.dtype).removeprefix("torch.") for it in its]
        if u.routed:
            steps.append(_Step(True, u.group, [x[r] for x in ep_names], shapes, dtypes, u))
            r += 1
        else:
            steps.append(_Step(False, u.group, [list(u.names)], shapes, dtypes, u))
    stage = ranks.pp_rank
    if ranks.pp > 1:
        pp_group = _ps().get_pipeline_model_parallel_group()
        shared = [[dataclasses.replace(s, local=None) for s in steps]]
        all_steps = _all_gather_objects(shared[0], pp_group)
        all_steps[stage] = steps
    else:
        all_steps = [steps]
    return SyncPlan(all_steps, stage, dense_on, expert_on, ctx, table, params)


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def _replica_flags() -> tuple[bool, bool]:
    ps = _ps()
    if not ps.model_parallel_is_initialized():
        return True, True
    return ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0


def _split(it: _Param, ranks) -> tuple[int, int]:
    return (ranks.etp_rank, ranks.etp) if it.mapping.expert else (ranks.tp_rank, ranks.tp)


def _full_shape(it: _Param, ranks) -> tuple[int, ...]:
    shape = list(it.param.shape)
    _, size = _split(it, ranks)
    if it.mapping.tp is not TPSplit.REPLICATED and size > 1:
        shape[it.mapping.tp.dim] *= size
    return tuple(shape)


# ---------------------------------------------------------------------------------------
# Gathering
# ---------------------------------------------------------------------------------------


def _gather_tp(it: _Param, ranks) -> "torch.Tensor":
    import torch

    t = it.param.detach()
    rank, size = _split(it, ranks)
    if size == 1 or it.mapping.tp is TPSplit.REPLICATED:
        return t
    ps = _ps()
    group = ps.get_expert_tensor_parallel_group() if it.mapping.expert else ps.get_tensor_model_parallel_group()
    t = t.contiguous()
    shards = [torch.empty_like(t) for _ in range(size)]
    _dist().all_gather(shards, t, group=group)
    return it.mapping.gather(shards)


def _produce(step: _Step, plan: SyncPlan, ranks) -> list[list["torch.Tensor"]]:
    """Full tensors of a step owned by this stage: ``[EP rank][param]`` (one row when dense)."""
    import torch

    fulls = [_gather_tp(plan.params[n], ranks) for n in step.local.names]
    if not step.routed or ranks.ep == 1:
        return [fulls]
    out: list[list[torch.Tensor]] = [[] for _ in range(ranks.ep)]
    group = _ps().get_expert_model_parallel_group()
    for t in fulls:
        t = t.contiguous()
        recv = [torch.empty_like(t) for _ in range(ranks.ep)]
        _dist().all_gather(recv, t, group=group)
        for e in range(ranks.ep):
            out[e].append(recv[e])
    return out


def iter_full_units(plan: SyncPlan) -> Iterator[FullUnit]:
    """Yield every full unit of the model in the plan's global order (collective).

    Must be iterated to the end on every rank of the job. Ranks outside data-parallel replica
    0 (dense units) or expert-data-parallel replica 0 (routed units) skip those steps and do
    not yield them; global rank 0 yields every unit of the model. Tensors are on the
    parameters' device, in the parameter dtype, detached (they may alias live parameters:
    copy before modifying).
    """
    import torch

    from ferrule.converters.weights import ParallelRanks

    ranks = ParallelRanks.current()
    pp_group = _ps().get_pipeline_model_parallel_group() if ranks.pp > 1 else None
    pp_ranks = _dist().get_process_group_ranks(pp_group) if pp_group is not None else None
    device = next(iter(plan.params.values())).param.device if plan.params else torch.device("cpu")
    for stage, steps in enumerate(plan.steps):
        for step in steps:
            if not (plan.expert_on if step.routed else plan.dense_on):
                continue
            if stage == plan.stage:
                rows = _produce(step, plan, ranks)
            else:
                rows = [[torch.empty(s, dtype=getattr(torch, d), device=device) for s, d in
                         zip(step.shapes, step.dtypes)] for _ in step.names]
            if pp_group is not None:
                for row in rows:
                    for i, t in enumerate(row):
                        t = t.contiguous()
                        _dist().broadcast(t, src=pp_ranks[stage], group=pp_group)
                        row[i] = t
            for names, row in zip(step.names, rows):
                yield FullUnit(step.group, tuple(names), tuple(row))


# ---------------------------------------------------------------------------------------
# Conversion and packing
# ---------------------------------------------------------------------------------------


class _Converter:
    """Full mcore unit -> HF-named tensors; stacked-expert pieces are held until complete."""

    def __init__(self, table: MappingTable, ctx: MappingContext, dtype=None):
        self.table, self.ctx, self.dtype = table, ctx, dtype
        self.stacks: dict[str, tuple[StackExperts, dict[int, Any]]] = {}

    def __call__(self, unit: FullUnit) -> list[tuple[str, "torch.Tensor"]]:
        out = []
        for name, full in zip(unit.names, unit.tensors):
            m, wild = self.table.resolve(name)
            if not m.exports(self.ctx):
                continue
            keys = m.hf_keys(name, self.ctx)
            tensors = m.to_hf(full, self.ctx, wild)
            if isinstance(m, StackExperts):
                pieces = self.stacks.setdefault(keys[0], (m, {}))[1]
                pieces[m.expert_index(wild)] = tensors[0]
                if len(pieces) == self.ctx.num_experts:
                    out.append((keys[0], m.assemble(self.stacks.pop(keys[0])[1], self.ctx)))
                continue
            out += list(zip(keys, tensors))
        if self.dtype is not None:
            out = [(k, t.to(self.dtype) if t.is_floating_point() else t) for k, t in out]
        return out

    def finish(self) -> None:
        if self.stacks:
            raise WeightSyncError(f"incomplete stacked-expert tensors at the end of sync: {sorted(self.stacks)}; "
                                  "every expert of a layer must be exported.")


def hf_unit_tensors(units: Iterable[FullUnit], table: MappingTable, ctx: MappingContext,
                    dtype: "torch.dtype | None" = None) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Per full unit, its HF-named tensors (names/layouts via ``table``; padding removed).

    A unit whose parameters export nothing (a tied output layer) yields an empty list.
    Stacked-expert HF tensors (:class:`~ferrule.mapping.StackExperts`) appear with the unit
    that completes them. ``dtype`` casts floating tensors.

    Raises:
        WeightSyncError: stacked-expert tensors still incomplete at the end.
    """
    conv = _Converter(table, ctx, dtype)
    for unit in units:
        yield conv(unit)
    conv.finish()


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
