"""Bound parameters and their gathering: global names (PP / EP offsets), this rank's parallel
coordinates, object collectives, :class:`BoundParam` (a live shard bound to its mapping-table
entry) and the gather plan that yields full mcore tensors (:func:`plan_gather`, :func:`iter_full`).

Layers 1 and 2 of :mod:`ferrule.megatron.weights` (its docstring has the whole story; every
public name is re-exported there). Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.mapping import MappingContext, MappingError, MappingTable, ParamMapping, TPSplit

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["BoundParam", "GatherStep", "ParallelRanks", "agreed_errors", "all_gather_objects", "bind_params",
           "global_param_names", "iter_full", "mapping_context", "agree_padded_vocab", "model_chunks", "plan_gather",
           "gather_tp", "unwrap"]

_LAYER_RE = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*)\.experts\.local_experts\.(\d+)(\..*)$")


# ---------------------------------------------------------------------------------------
# Ranks, chunks and names
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelRanks:
    """This rank's coordinates, read from ``megatron.core.parallel_state`` (all 1/0 if uninitialized)."""

    tp: int = 1
    tp_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    pp: int = 1
    pp_rank: int = 0

    @classmethod
    def current(cls) -> "ParallelRanks":
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
            ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        )


def unwrap(module: Any) -> Any:
    """Strip DDP / Float16Module wrappers (``.module``) down to the GPTModel."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def model_chunks(chunks: Any) -> list:
    """This rank's unwrapped GPTModel chunks from one (possibly wrapped) model or a list of them."""
    if isinstance(chunks, (list, tuple)):
        return [unwrap(c) for c in chunks]
    return [unwrap(chunks)]


def global_param_names(chunk: Any) -> dict[str, str]:
    """``{local parameter name: global name}`` for one model chunk.

    Layer indices become ``TransformerLayer.layer_number - 1`` (global, PP/VPP offset
    included); routed-expert indices become ``MoELayer.local_expert_indices[j]`` (global, EP
    offset included).
    """
    chunk = unwrap(chunk)
    layer_map: dict[int, int] = {}
    decoder = getattr(chunk, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            layer_map[i] = int(layer.layer_number) - 1
    expert_map: dict[str, list[int]] = {}
    for mname, mod in chunk.named_modules():
        if hasattr(mod, "local_expert_indices") and hasattr(mod, "experts"):
            expert_map[mname] = [int(e) for e in mod.local_expert_indices]
    out = {}
    for name, _ in chunk.named_parameters():
        g = name
        m = _EXPERT_RE.match(name)
        if m and m.group(1) in expert_map:
            g = f"{m.group(1)}.experts.local_experts.{expert_map[m.group(1)][int(m.group(2))]}{m.group(3)}"
        m = _LAYER_RE.match(g)
        if m:
            g = f"{m.group(1)}{layer_map.get(int(m.group(2)), int(m.group(2)))}{m.group(3)}"
        out[name] = g
    return out


# ---------------------------------------------------------------------------------------
# Small collectives
# ---------------------------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def all_gather_objects(obj: Any, group: Any = None) -> list:
    """``[obj of every rank of group]`` (``[obj]`` without torch.distributed or on one rank)."""
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agreed_errors(errors: Sequence[str]) -> list[str]:
    """The union (in rank order, deduplicated) of every rank's ``errors`` (collective over the world).

    Callers raise when it is non-empty, so that every rank raises together and none is left
    waiting in a later collective.
    """
    return list(dict.fromkeys(e for errs in all_gather_objects(list(errors)) for e in errs))


# ---------------------------------------------------------------------------------------
# Bind
# ---------------------------------------------------------------------------------------


@dataclass
class BoundParam:
    """One live parameter bound to its mapping-table entry.

    Attributes:
        global_name: global mcore name (see :func:`global_param_names`).
        param: the live ``torch.nn.Parameter`` (this rank's TP shard).
        mapping: the table entry (:class:`~ferrule.mapping.ParamMapping`).
        wildcards: values of the entry's ``*`` (layer, global expert).
    """

    global_name: str
    param: Any
    mapping: ParamMapping
    wildcards: tuple[str, ...]

    def split(self, ranks: ParallelRanks) -> tuple[int, int]:
        """``(rank, size)`` of the TP group this parameter is split on (expert-TP for routed experts)."""
        return (ranks.etp_rank, ranks.etp) if self.mapping.expert else (ranks.tp_rank, ranks.tp)

    def full_shape(self, ranks: ParallelRanks) -> tuple[int, ...]:
        """Shape of the full mcore tensor (the split dimension times the TP size)."""
        shape = list(self.param.shape)
        _, size = self.split(ranks)
        if self.mapping.tp is not TPSplit.REPLICATED and size > 1:
            shape[self.mapping.tp.dim] *= size
        return tuple(shape)

    @property
    def dtype_name(self) -> str:
        return str(self.param.dtype).removeprefix("torch.")


def bind_params(chunks: Any, table: MappingTable) -> list[BoundParam]:
    """Bind every base parameter of this rank's model chunks (in ``named_parameters`` order) to ``table``
    (LoRA factors, marked ``is_lora_adapter``, are left out: :mod:`ferrule.lora` exports them).

    Args:
        chunks: a GPTModel (possibly DDP/Float16-wrapped) or a list of them (virtual stages).
        table: the family's mapping table.

    Raises:
        MappingError: listing every parameter without a mapping or matched by several entries.
    """
    named = []
    for chunk in model_chunks(chunks):
        gmap = global_param_names(chunk)
        # LoRA factors (ferrule.lora.layers) are not base weights: they have no mapping-table row
        named += [(gmap[local], p) for local, p in chunk.named_parameters() if not getattr(p, "is_lora_adapter", False)]
    table.check_mcore_names([n for n, _ in named])
    return [BoundParam(n, p, *table.resolve(n)) for n, p in named]


def mapping_context(params: Sequence[BoundParam], ranks: ParallelRanks, *,
                    hf_config: Mapping[str, Any] | None = None, ctx: MappingContext | None = None
                    ) -> MappingContext:
    """The mapping context, with ``padded_vocab_size`` read off this rank's live vocab-parallel layer.

    Not collective: a pipeline stage without embedding and output layer keeps
    ``padded_vocab_size`` None (see :func:`agree_padded_vocab`).

    Raises:
        ValueError: neither ``hf_config`` nor ``ctx`` given.
    """
    if ctx is None:
        if hf_config is None:
            raise ValueError("pass hf_config= (the parsed config.json) or ctx= (a MappingContext).")
        ctx = MappingContext.from_hf_config(hf_config)
    for bp in params:
        if bp.mapping.tp is TPSplit.VOCAB:
            return dataclasses.replace(ctx, padded_vocab_size=int(bp.param.shape[0]) * ranks.tp)
    return ctx


def agree_padded_vocab(ctx: MappingContext, ranks: ParallelRanks) -> MappingContext:
    """``ctx`` with the padded vocabulary of the stages that hold one (collective over the pipeline group)."""
    if ranks.pp == 1:
        return ctx
    pads = [p for p in all_gather_objects(ctx.padded_vocab_size, _ps().get_pipeline_model_parallel_group()) if p]
    return dataclasses.replace(ctx, padded_vocab_size=pads[0]) if pads else ctx


# ---------------------------------------------------------------------------------------
# Gather
# ---------------------------------------------------------------------------------------


@dataclass
class GatherStep:
    """One collective step of one pipeline stage: a group of dense parameters, or a group of
    routed-expert parameters collected over EP.

    Attributes:
        key: the caller's label for the group (an update-group key, or the name itself).
        routed: routed-expert parameters (expert-TP gather, EP collection).
        names: per produced group: global names (routed: one list per EP rank, rank order).
        shapes / dtypes: full shape and dtype name per parameter (same for every EP rank).
        local: this stage's global names of the group (None on other stages).
    """

    key: str
    routed: bool
    names: list[list[str]]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    local: tuple[str, ...] | None = None


def plan_gather(params: Mapping[str, BoundParam], groups: Sequence[tuple[str, Sequence[str]]],
                ranks: ParallelRanks, *, with_experts: bool = True) -> list[list[GatherStep]]:
    """Lay out the collective steps that :func:`iter_full` runs, for every pipeline stage.

    Collective: call on every rank of the job; exchanges names over the EP group (when
    ``with_experts`` and EP > 1), agrees errors over the world and exchanges the steps over
    the pipeline group (PP > 1).

    Args:
        params: this rank's bound parameters by global name.
        groups: ``(key, global names)`` of the groups to gather, in order; a group is routed
            when its first parameter's mapping is a routed-expert mapping (callers keep routed
            and dense parameters apart).
        with_experts: False on ranks that skip the routed steps (they exchange no EP names).

    Returns:
        ``steps[stage]``: the ordered steps of every pipeline stage (this stage's carry
        ``local``).

    Raises:
        MappingError: (on every rank) EP ranks hold different numbers of routed groups.
    """
    routed = [(key, list(names)) for key, names in groups if params[names[0]].mapping.expert]
    ep_names = [[names for _, names in routed]]
    if with_experts and ranks.ep > 1:
        ep_names = all_gather_objects(ep_names[0], _ps().get_expert_model_parallel_group())
    problems = agreed_errors([f"EP ranks hold different numbers of routed-expert groups: {[len(x) for x in ep_names]}"]
                             if len({len(x) for x in ep_names}) > 1 else [])
    if problems:  # raised on every rank together, before the pipeline exchange
        raise MappingError("\n".join(problems))
    steps: list[GatherStep] = []
    r = 0
    for key, names in groups:
        bps = [params[n] for n in names]
        shapes = [bp.full_shape(ranks) for bp in bps]
        dtypes = [bp.dtype_name for bp in bps]
        if bps[0].mapping.expert:
            steps.append(GatherStep(key, True, [x[r] for x in ep_names], shapes, dtypes, tuple(names)))
            r += 1
        else:
            steps.append(GatherStep(key, False, [list(names)], shapes, dtypes, tuple(names)))
    if ranks.pp == 1:
        return [steps]
    shared = [dataclasses.replace(s, local=None) for s in steps]
    per_stage = all_gather_objects(shared, _ps().get_pipeline_model_parallel_group())
    per_stage[ranks.pp_rank] = steps
    return per_stage


def gather_tp(bp: BoundParam, ranks: ParallelRanks) -> "torch.Tensor":
    """The full mcore tensor of one parameter: TP shards all-gathered (collective on its TP group).

    Returned detached; it may alias the live parameter when nothing is split.
    """
    import torch

    t = bp.param.detach()
    _, size = bp.split(ranks)
    if size == 1 or bp.mapping.tp is TPSplit.REPLICATED:
        return t
    ps = _ps()
    group = ps.get_expert_tensor_parallel_group() if bp.mapping.expert else ps.get_tensor_model_parallel_group()
    t = t.contiguous()
    shards = [torch.empty_like(t) for _ in range(size)]
    _dist().all_gather(shards, t, group=group)
    return bp.mapping.gather(shards)


def _produce(step: GatherStep, params: Mapping[str, BoundParam], ranks: ParallelRanks) -> list[list["torch.Tensor"]]:
    """Full tensors of a step owned by this stage: ``[EP rank][param]`` (one row when dense)."""
    import torch

    fulls = [gather_tp(params[n], ranks) for n in step.local]
    if not step.routed or ranks.ep == 1:
        return [fulls]
    rows: list[list[torch.Tensor]] = [[] for _ in range(ranks.ep)]
    group = _ps().get_expert_model_parallel_group()
    for t in fulls:
        t = t.contiguous()
        recv = [torch.empty_like(t) for _ in range(ranks.ep)]
        _dist().all_gather(recv, t, group=group)
        for e in range(ranks.ep):
            rows[e].append(recv[e])
    return rows


def iter_full(steps: Sequence[Sequence[GatherStep]], params: Mapping[str, BoundParam], ranks: ParallelRanks, *,
              dense: bool = True, routed: bool = True
              ) -> Iterator[tuple[str, tuple[str, ...], tuple["torch.Tensor", ...]]]:
    """Yield ``(key, global names, full tensors)`` for every step of :func:`plan_gather`, stage by stage.

    Collective: iterate to the end on every rank that takes part. ``dense=False`` /
    ``routed=False`` skip those steps on this rank (the caller guarantees that whole TP, EP
    and pipeline groups skip together). Tensors are on the parameters' device, in the
    parameter dtype, detached (they may alias live parameters: copy before modifying).
    """
    import torch

    pp_group = _ps().get_pipeline_model_parallel_group() if ranks.pp > 1 else None
    pp_ranks = _dist().get_process_group_ranks(pp_group) if pp_group is not None else None
    device = next(iter(params.values())).param.device if params else torch.device("cpu")
    for stage, stage_steps in enumerate(steps):
        for step in stage_steps:
            if not (routed if step.routed else dense):
                continue
            if stage == ranks.pp_rank:
                rows = _produce(step, params, ranks)
            else:
                rows = [[torch.empty(s, dtype=getattr(torch, d), device=device)
                         for s, d in zip(step.shapes, step.dtypes)] for _ in step.names]
            if pp_group is not None:
                for row in rows:
                    for i, t in enumerate(row):
                        t = t.contiguous()
                        _dist().broadcast(t, src=pp_ranks[stage], group=pp_group)
                        row[i] = t
            for names, row in zip(step.names, rows):
                yield step.key, tuple(names), tuple(row)
