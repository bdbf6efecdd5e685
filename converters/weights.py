"""Load HF weights into live (possibly TP/EP/PP-sharded) Megatron modules, and export them back.

Both directions go through a family's :class:`ferrule.mapping.MappingTable`:

- :func:`load_hf_into_mcore` reads HF tensors one at a time (from a directory through
  :class:`~ferrule.converters.safetensors_io.SafetensorsReader`, or from a dict), converts them to
  the full mcore tensor, slices this rank's TP shard and copies it into the live parameter.
  Everything (names in both directions, every shape) is validated *before* the first copy, on
  ``meta`` tensors, and errors are agreed across ranks so that no rank hangs in a collective.
- :func:`export_mcore_to_hf` yields ``(hf_name, full tensor)``: TP shards are all-gathered
  (expert-TP group for routed experts), routed experts collected over the EP group and, at
  PP > 1, each stage's tensors broadcast over the pipeline group. Every rank yields the same
  sequence. Weight sync reuses it.

Names: live parameters carry local indices; :func:`global_param_names` turns them into the
table's global names (``decoder.layers.{layer_number-1}``, ``local_experts.{global expert}``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping as _MappingABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.converters.safetensors_io import SafetensorsReader
from ferrule.mapping import Mapping, MappingContext, MappingError, MappingTable, StackExperts, TPSplit

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ParallelRanks", "global_param_names", "load_hf_into_mcore", "export_mcore_to_hf", "unwrap"]

_LAYER_RE = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*)\.experts\.local_experts\.(\d+)(\..*)$")


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


def _chunks(model_chunks: Any) -> list:
    if isinstance(model_chunks, (list, tuple)):
        return [unwrap(c) for c in model_chunks]
    return [unwrap(model_chunks)]


@dataclass
class _Item:
    global_name: str
    param: Any
    mapping: Mapping
    wildcards: tuple[str, ...]

    def split(self, ranks: ParallelRanks) -> tuple[int, int]:
        return (ranks.etp_rank, ranks.etp) if self.mapping.expert else (ranks.tp_rank, ranks.tp)


def _items(chunks: list, table: MappingTable) -> list[_Item]:
    items, names = [], []
    for chunk in chunks:
        gmap = global_param_names(chunk)
        for local, p in chunk.named_parameters():
            names.append(gmap[local])
            items.append((gmap[local], p))
    table.check_mcore_names(names)
    return [_Item(g, p, *table.resolve(g)) for g, p in items]


def _ctx_for(table_ctx: MappingContext | None, hf_config: _MappingABC | None, items: list[_Item],
             ranks: ParallelRanks) -> MappingContext:
    """The mapping context, with ``padded_vocab_size`` read off the live embedding/output layer."""
    import dataclasses

    if table_ctx is None:
        if hf_config is None:
            raise ValueError("pass hf_config= (the parsed config.json) or ctx= (a MappingContext).")
        table_ctx = MappingContext.from_hf_config(hf_config)
    for it in items:
        if it.mapping.tp is TPSplit.VOCAB:
            padded = it.param.shape[0] * ranks.tp
            return dataclasses.replace(table_ctx, padded_vocab_size=padded)
    return table_ctx


def _shape_suspect(it: _Item, full_shape: tuple, tp: int, family: str) -> str:
    """Which side a shape mismatch points at: the plugin's TP split, or the checkpoint/config."""
    p = it.param
    global_shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        global_shape[p.partition_dim] *= tp
    if tuple(global_shape) == tuple(full_shape):
        return (f"suspect the plugin: the HF tensors have the full shape {tuple(full_shape)} this parameter needs, but "
                f"MappingTable({family}) splits it over TP={tp} as TPSplit.{it.mapping.tp.name} while megatron "
                f"splits it on dim {getattr(p, 'partition_dim', None)}; fix the row's tp= in the mapping table.")
    return (f"suspect the checkpoint (or the family's config translation): the HF tensors assemble to "
            f"{tuple(full_shape)}, the model built from config.json needs {tuple(global_shape)} in full.")


def _all_gather_objects(obj: Any, group=None) -> list:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class _DictSource:
    def __init__(self, tensors: _MappingABC[str, "torch.Tensor"]):
        self.tensors = tensors

    def keys(self):
        return list(self.tensors.keys())

    def shape(self, k):
        return tuple(self.tensors[k].shape)

    def get(self, k):
        return self.tensors[k]


def load_hf_into_mcore(model_chunks: Any, hf_dir_or_tensors: str | os.PathLike | _MappingABC[str, "torch.Tensor"],
                       table: MappingTable, *, hf_config: _MappingABC[str, Any] | None = None,
                       ctx: MappingContext | None = None, progress: Any = None) -> dict[str, int]:
    """Copy HF weights into live Megatron parameters through ``table``.

    Args:
        model_chunks: a GPTModel (possibly DDP/Float16-wrapped) or a list of them (one per
            virtual pipeline stage), built at any TP / EP / PP layout on this rank.
        hf_dir_or_tensors: an HF checkpoint directory (``model.safetensors[.index.json]``) or a
            ``{hf_key: full tensor}`` dict.
        table: the family's mapping table.
        hf_config: the parsed ``config.json`` (head counts, vocab size, tying); or ``ctx``.
        progress: optional callable ``progress(n_bytes)`` called after each parameter.

    Returns:
        ``{"params": n parameters loaded, "bytes": HF bytes read on this rank}``.

    Raises:
        MappingError: a live parameter without a mapping, HF keys missing or unknown
            (neither mapped nor ignored; checked across all ranks), or a shape that does not
            fit; every offender is listed, and nothing has been copied yet.
        CheckpointError: the directory is not a readable safetensors checkpoint.
    """
    import torch

    ranks = ParallelRanks.current()
    src = _DictSource(hf_dir_or_tensors) if isinstance(hf_dir_or_tensors, _MappingABC) \
        else SafetensorsReader(hf_dir_or_tensors)
    errors: list[str] = []
    try:
        items = _items(_chunks(model_chunks), table)
        ctx = _ctx_for(ctx, hf_config, items, ranks)
    except MappingError as exc:
        items, errors = [], [str(exc)]
    present = set(src.keys())
    needed: set[str] = set()
    missing: list[str] = []
    for it in items:
        keys = it.mapping.hf_keys(it.global_name, ctx)
        needed.update(keys)
        missing += [f"{k}  (needed by {it.global_name})" for k in keys if k not in present]
    if missing:
        errors.append(f"MappingTable({table.family}): HF keys missing from the checkpoint ({len(missing)}):\n"
                      + "\n".join(f"  - {m}" for m in sorted(missing)))
    # shapes, on meta tensors (no I/O)
    shape_errors = []
    if not missing:
        for it in items:
            keys = it.mapping.hf_keys(it.global_name, ctx)
            try:
                metas = [torch.empty(src.shape(k), device="meta") for k in keys]
                full = it.mapping.to_mcore(metas, ctx, it.wildcards)
                local = it.mapping.shard(full, *it.split(ranks))
                if tuple(local.shape) != tuple(it.param.shape):
                    raise MappingError(f"HF {list(keys)} {[tuple(m.shape) for m in metas]} give a shard of shape "
                                       f"{tuple(local.shape)}, the live parameter has {tuple(it.param.shape)}; "
                                       + _shape_suspect(it, tuple(full.shape), ranks.tp, table.family))
            except (MappingError, RuntimeError) as exc:
                shape_errors.append(f"{it.global_name}: {exc}")
    if shape_errors:
        errors.append(f"shape mismatch ({len(shape_errors)}):\n" + "\n".join(f"  - {e}" for e in shape_errors))
    # extra keys: union of needed keys over every rank
    all_needed = set().union(*_all_gather_objects(sorted(needed)))
    extra = sorted(k for k in present if k not in all_needed and not table.is_ignored(k))
    if extra and items:
        errors.append(f"MappingTable({table.family}): HF keys neither mapped nor ignored ({len(extra)}):\n"
                      + "\n".join(f"  - {k}" for k in extra)
                      + "\nMap them, or add an Ignore(hf=..., reason=...) entry if they carry no weights.")
    all_errors = [e for errs in _all_gather_objects(errors) for e in errs]
    if all_errors:
        raise MappingError("\n".join(dict.fromkeys(all_errors)))

    n_bytes = 0
    with torch.no_grad():
        for it in items:
            keys = it.mapping.hf_keys(it.global_name, ctx)
            hf = [src.get(k) for k in keys]
            full = it.mapping.to_mcore(hf, ctx, it.wildcards)
            local = it.mapping.shard(full, *it.split(ranks))
            it.param.data.copy_(local)
            b = sum(t.numel() * t.element_size() for t in hf)
            n_bytes += b
            del hf, full, local
            if progress is not None:
                progress(b)
    return {"params": len(items), "bytes": n_bytes}


def _gather_tp(item: _Item, ranks: ParallelRanks) -> "torch.Tensor":
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank, size = item.split(ranks)
    t = item.param.detach()
    if size == 1 or item.mapping.tp is TPSplit.REPLICATED:
        return t
    group = ps.get_expert_tensor_parallel_group() if item.mapping.expert else ps.get_tensor_model_parallel_group()
    t = t.contiguous()
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t, group=group)
    return item.mapping.gather(shards)


def _stage_tensors(items: list[_Item], ranks: ParallelRanks) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Full mcore tensors of this PP stage, experts collected over EP (collectives inside)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep_names: list[list[str]] | None = None
    expert_pos = 0
    if ranks.ep > 1:
        ep_names = _all_gather_objects([it.global_name for it in items if it.mapping.expert],
                                       ps.get_expert_model_parallel_group())
    for it in items:
        full = _gather_tp(it, ranks)
        if it.mapping.expert and ep_names is not None:
            full = full.contiguous()
            outs = [torch.empty_like(full) for _ in range(ranks.ep)]
            dist.all_gather(outs, full, group=ps.get_expert_model_parallel_group())
            for r, t in enumerate(outs):
                yield ep_names[r][expert_pos], t
            expert_pos += 1
        else:
            yield it.global_name, full


def _stage_meta(items: list[_Item], ranks: ParallelRanks) -> list[tuple[str, tuple[int, ...], str]]:
    """``(global name, full shape, dtype)`` of what :func:`_stage_tensors` yields, without data."""
    from megatron.core import parallel_state as ps

    out = []
    ep_names = None
    if ranks.ep > 1:
        ep_names = _all_gather_objects([it.global_name for it in items if it.mapping.expert],
                                       ps.get_expert_model_parallel_group())
    pos = 0
    for it in items:
        shape = list(it.param.shape)
        _, size = it.split(ranks)
        if it.mapping.tp is not TPSplit.REPLICATED and size > 1:
            shape[it.mapping.tp.dim] *= size
        dtype = str(it.param.dtype).removeprefix("torch.")
        if it.mapping.expert and ep_names is not None:
            out += [(ep_names[r][pos], tuple(shape), dtype) for r in range(ranks.ep)]
            pos += 1
        else:
            out.append((it.global_name, tuple(shape), dtype))
    return out


def export_mcore_to_hf(model_chunks: Any, table: MappingTable, *, hf_config: _MappingABC[str, Any] | None = None,
                       ctx: MappingContext | None = None, dtype: "torch.dtype | None" = None
                       ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, on every rank, in the same order.

    Must be iterated to the end on every rank of the job (it runs collectives). Tensors are
    full (TP shards gathered, vocabulary padding removed), on CPU or the parameters' device,
    in the parameter dtype unless ``dtype`` is given. Stacked-expert HF tensors
    (:class:`~ferrule.mapping.StackExperts`) are yielded once all their experts arrived.
    Tied output layers are not yielded (the embedding carries them).

    Raises:
        MappingError: a live parameter has no mapping (every offender listed).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ranks = ParallelRanks.current()
    items = _items(_chunks(model_chunks), table)
    ctx = _ctx_for(ctx, hf_config, items, ranks)
    if ranks.pp > 1:
        # the padded vocab must be known on stages that hold neither embedding nor output layer
        pads = [p for p in _all_gather_objects(ctx.padded_vocab_size, ps.get_pipeline_model_parallel_group()) if p]
        if pads:
            import dataclasses
            ctx = dataclasses.replace(ctx, padded_vocab_size=pads[0])
    stacks: dict[str, tuple[StackExperts, dict[int, Any]]] = {}

    def convert(name: str, full: "torch.Tensor") -> Iterator[tuple[str, "torch.Tensor"]]:
        m, wild = table.resolve(name)
        if not m.exports(ctx):
            return
        keys = m.hf_keys(name, ctx)
        tensors = m.to_hf(full, ctx, wild)
        if isinstance(m, StackExperts):
            m_, pieces = stacks.setdefault(keys[0], (m, {}))
            pieces[m.expert_index(wild)] = tensors[0]
            if len(pieces) == ctx.num_experts:
                yield keys[0], _cast(m.assemble(stacks.pop(keys[0])[1], ctx), dtype)
            return
        for k, t in zip(keys, tensors):
            yield k, _cast(t, dtype)

    if ranks.pp == 1:
        for name, full in _stage_tensors(items, ranks):
            yield from convert(name, full)
    else:
        group = ps.get_pipeline_model_parallel_group()
        group_ranks = dist.get_process_group_ranks(group)
        metas = _all_gather_objects(_stage_meta(items, ranks), group)
        for stage, meta in enumerate(metas):
            mine = _stage_tensors(items, ranks) if stage == ranks.pp_rank else None
            for name, shape, dt in meta:
                if mine is not None:
                    got_name, full = next(mine)
                    assert got_name == name, (got_name, name)
                    full = full.contiguous()
                else:
                    full = torch.empty(shape, dtype=getattr(torch, dt), device=_device_of(items))
                dist.broadcast(full, src=group_ranks[stage], group=group)
                yield from convert(name, full)
    if stacks:
        raise MappingError(f"incomplete expert stacks at the end of export: {sorted(stacks)}")


def _device_of(items: list[_Item]):
    import torch

    return items[0].param.device if items else torch.device("cpu")


def _cast(t: "torch.Tensor", dtype) -> "torch.Tensor":
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
