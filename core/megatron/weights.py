"""Move live Megatron weights: bind parameters to the mapping table, gather them full, load HF into them.

The one module that touches live (possibly TP/EP/PP-sharded) parameters for load, export and
weight sync. Its layers, each usable on its own:

1. **bind** (:func:`bind_params`): every parameter of this rank's model chunks gets its
   *global* mcore name (:func:`global_param_names`: layer index ``layer_number - 1``, PP/VPP
   offset included; routed-expert index global, EP offset included), its mapping-table entry
   and the wildcard values (:class:`BoundParam`).
2. **gather** (:func:`plan_gather`, :func:`iter_full`): full (unsharded) mcore tensors of
   groups of parameters in one global order. TP shards are all-gathered over the TP group
   (expert-TP group for routed experts) and re-assembled by the mapping's
   :meth:`~ferrule.mapping.ParamMapping.gather` (stride-aware for SwiGLU ``linear_fc1``);
   routed experts are then collected over the EP group (one local group becomes ``ep``
   groups, named by the owning rank); at PP > 1 every stage's tensors are broadcast over the
   pipeline group from their stage, in stage order.
3. **assemble**: full mcore tensors -> HF tensors through the family's table
   (:class:`~ferrule.mapping.HFAssembler`).

On top of them: :func:`load_hf_into_mcore` (HF checkpoint -> live shards) and
:func:`export_mcore_to_hf` (live shards -> full HF tensors). Weight sync
(:mod:`ferrule.sync.buckets`) plans its update units with :func:`plan_gather` and packs what
:func:`iter_full` yields; the converters (:mod:`ferrule.converters`) wrap load/export with
checkpoint I/O.

Layers 1 and 2 live in :mod:`ferrule.megatron.param_gather`. Importing this
module imports no torch (functions import it when called).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ferrule.compat import renamed_name
from ferrule.mapping import HFAssembler, MappingContext, MappingError, MappingTable

if TYPE_CHECKING:  # pragma: no cover
    import torch

from .param_gather import (BoundParam, ParallelRanks, agree_padded_vocab, agreed_errors, all_gather_objects, bind_params,
                           iter_full, mapping_context, plan_gather, unwrap)
from ferrule.formats.quantized_weights import open_hf_weights

__all__ = ["export_mcore_to_hf", "load_hf_into_mcore"]


def __getattr__(name: str):
    # layers 1 and 2 (bind, gather) and HFAssembler were re-exported here; ferrule.compat lists the old names
    return renamed_name(__name__, name)


# ---------------------------------------------------------------------------------------
# Load and export
# ---------------------------------------------------------------------------------------


class _DictSource:
    def __init__(self, tensors: Mapping[str, "torch.Tensor"]):
        self.tensors = tensors

    def keys(self):
        return list(self.tensors.keys())

    def shape(self, k):
        return tuple(self.tensors[k].shape)

    def get(self, k):
        return self.tensors[k]


def _shape_suspect(bp: BoundParam, full_shape: tuple, tp: int, family: str) -> str:
    """Which side a shape mismatch points at: the plugin's TP split, or the checkpoint/config. ``tp`` is the size
    of the group that splits this parameter: the expert-TP size for a routed expert's weight
    (``BoundParam.split``), the TP size otherwise (the TP size for an expert row quoted a wrong full shape and
    blamed the checkpoint at TP=2, etp=1)."""
    p = bp.param
    axis = "expert TP" if getattr(bp.mapping, "expert", False) else "TP"
    global_shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        global_shape[p.partition_dim] *= tp
    if tuple(global_shape) == tuple(full_shape):
        return (f"suspect the plugin: the HF tensors have the full shape {tuple(full_shape)} this parameter needs, but "
                f"MappingTable({family}) splits it over {axis}={tp} as TPSplit.{bp.mapping.tp.name} while megatron "
                f"splits it on dim {getattr(p, 'partition_dim', None)}; fix the row's tp= in the mapping table.")
    if sorted(full_shape) == sorted(global_shape):
        return (f"suspect the plugin: the HF tensors assemble to {tuple(full_shape)}, the same sizes as the "
                f"{tuple(global_shape)} this parameter needs in another order, so the row of MappingTable({family}) "
                f"names the wrong HF tensor (swapped rows) or its layout is transposed; fix the row in the mapping "
                f"table.")
    return (f"suspect the checkpoint (or the family's config translation): the HF tensors assemble to "
            f"{tuple(full_shape)}, the model built from config.json needs {tuple(global_shape)} in full.")


def _check_load(params: list[BoundParam], src: Any, table: MappingTable, ctx: MappingContext,
                ranks: ParallelRanks) -> tuple[list[str], set[str]]:
    """Problems of loading ``src`` into ``params`` (names, then shapes on meta tensors), and the HF keys read."""
    import torch

    present = set(src.keys())
    needed: set[str] = set()
    missing: list[str] = []
    for bp in params:
        keys = bp.mapping.hf_keys(bp.global_name, ctx)
        needed.update(keys)
        missing += [f"{k}  (needed by {bp.global_name})" for k in keys if k not in present]
    if missing:
        return [f"MappingTable({table.family}): HF keys missing from the checkpoint ({len(missing)}):\n"
                + "\n".join(f"  - {m}" for m in sorted(missing))], needed
    bad = []
    for bp in params:
        keys = bp.mapping.hf_keys(bp.global_name, ctx)
        try:
            metas = [torch.empty(src.shape(k), device="meta") for k in keys]
            local = bp.mapping.shard(bp.mapping.to_mcore(metas, ctx, bp.wildcards), *bp.split(ranks))
            if tuple(local.shape) != tuple(bp.param.shape):
                full = bp.mapping.to_mcore(metas, ctx, bp.wildcards)
                raise MappingError(f"HF {list(keys)} {[tuple(m.shape) for m in metas]} give a shard of shape "
                                   f"{tuple(local.shape)}, the live parameter has {tuple(bp.param.shape)}; "
                                   + _shape_suspect(bp, tuple(full.shape), bp.split(ranks)[1], table.family))
        except (MappingError, RuntimeError) as exc:
            bad.append(f"{bp.global_name}: {exc}")
    if bad:
        return [f"shape mismatch ({len(bad)}):\n" + "\n".join(f"  - {e}" for e in bad)], needed
    return [], needed


def _params_dtype_name(chunks: Any) -> str | None:
    """``"bfloat16"`` etc.: the megatron config's ``params_dtype`` of the first chunk (None if it has none)."""
    first = chunks[0] if isinstance(chunks, (list, tuple)) and chunks else chunks
    dtype = getattr(getattr(unwrap(first), "config", None), "params_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    return name if name in ("float32", "bfloat16", "float16") else None


def load_hf_into_mcore(chunks: Any, hf_dir_or_tensors: str | os.PathLike | Mapping[str, "torch.Tensor"],
                       table: MappingTable, *, hf_config: Mapping[str, Any] | None = None,
                       ctx: MappingContext | None = None, progress: Any = None) -> dict[str, int]:
    """Copy HF weights into live Megatron parameters through ``table``.

    Each HF tensor is read once (memory-mapped from safetensors), converted to the full mcore
    tensor (:meth:`~ferrule.mapping.ParamMapping.to_mcore`), sliced to this rank's TP shard
    (:meth:`~ferrule.mapping.ParamMapping.shard`) and copied into the live parameter.
    Everything (names in both directions, every shape) is validated *before* the first copy,
    on ``meta`` tensors, and errors are agreed across ranks so that no rank hangs.

    Args:
        chunks: a GPTModel (possibly DDP/Float16-wrapped) or a list of them (one per virtual
            pipeline stage), built at any TP / EP / PP layout on this rank.
        hf_dir_or_tensors: an HF checkpoint directory (``model.safetensors[.index.json]``) or a
            ``{hf_key: full tensor}`` dict.
        table: the family's mapping table.
        hf_config: the parsed ``config.json`` (head counts, vocab size, tying); or ``ctx``.
        progress: optional callable ``progress(n_bytes)`` called after each parameter with the bytes
            of the HF tensors read for it that no earlier parameter read (an HF tensor counts once), so
            on one rank the calls add up to the bytes of every HF tensor the table does not ignore.

    Returns:
        ``{"params": n parameters loaded, "bytes": HF bytes read on this rank (each tensor once)}``.

    Raises:
        MappingError: a live parameter without a mapping, HF keys missing or unknown
            (neither mapped nor ignored; checked across all ranks), or a shape that does not
            fit; every offender is listed, and nothing has been copied yet.
        ferrule.formats.safetensors_io.CheckpointError: the directory is not a readable safetensors checkpoint.
    """
    import torch

    ranks = ParallelRanks.current()
    # MXFP8 / FP8 / NVFP4 weights are read dequantized, straight into the model's dtype (NVFP4 values depend on it)
    src = _DictSource(hf_dir_or_tensors) if isinstance(hf_dir_or_tensors, Mapping) \
        else open_hf_weights(hf_dir_or_tensors, dtype=_params_dtype_name(chunks))
    errors: list[str] = []
    needed: set[str] = set()
    params: list[BoundParam] = []
    try:
        params = bind_params(chunks, table)
        ctx = mapping_context(params, ranks, hf_config=hf_config, ctx=ctx)
        errors, needed = _check_load(params, src, table, ctx, ranks)
    except MappingError as exc:
        params, errors = [], [str(exc)]
    # extra keys: the union of needed keys over every rank
    all_needed = set().union(*all_gather_objects(sorted(needed)))
    extra = sorted(k for k in src.keys() if k not in all_needed and not table.is_ignored(k))
    if extra and params:
        errors.append(f"MappingTable({table.family}): HF keys neither mapped nor ignored ({len(extra)}):\n"
                      + "\n".join(f"  - {k}" for k in extra)
                      + "\nMap them, or add an Ignore(hf=..., reason=...) entry if they carry no weights.")
    everyone = agreed_errors(errors)
    if everyone:
        raise MappingError("\n".join(everyone))

    n_bytes = 0
    counted: set[str] = set()  # an HF tensor read for several parameters (StackExperts: one per expert) counts once
    with torch.no_grad():
        for bp in params:
            keys = bp.mapping.hf_keys(bp.global_name, ctx)
            hf = [src.get(k) for k in keys]
            bp.param.data.copy_(bp.mapping.shard(bp.mapping.to_mcore(hf, ctx, bp.wildcards), *bp.split(ranks)))
            b = sum(t.numel() * t.element_size() for k, t in zip(keys, hf) if k not in counted)
            counted.update(keys)
            n_bytes += b
            del hf
            if progress is not None:
                progress(b)
    return {"params": len(params), "bytes": n_bytes}


def export_mcore_to_hf(chunks: Any, table: MappingTable, *, hf_config: Mapping[str, Any] | None = None,
                       ctx: MappingContext | None = None, dtype: "torch.dtype | None" = None
                       ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, on every rank, in the same order.

    Must be iterated to the end on every rank of the job (it runs collectives: see
    :func:`iter_full`). Tensors are full (TP shards gathered, vocabulary padding removed), on
    the parameters' device, in the parameter dtype unless ``dtype`` is given (floating tensors
    are cast). Stacked-expert HF tensors (:class:`~ferrule.mapping.StackExperts`) are yielded
    once all their experts arrived. Tied output layers are not yielded (the embedding carries them).

    Raises:
        MappingError: a live parameter has no mapping (every offender listed); a stacked-expert
            tensor is incomplete at the end.
    """
    ranks = ParallelRanks.current()
    params = bind_params(chunks, table)
    ctx = agree_padded_vocab(mapping_context(params, ranks, hf_config=hf_config, ctx=ctx), ranks)
    by_name = {bp.global_name: bp for bp in params}
    steps = plan_gather(by_name, [(bp.global_name, [bp.global_name]) for bp in params], ranks)
    assembler = HFAssembler(table, ctx, dtype)
    for _, names, tensors in iter_full(steps, by_name, ranks):
        for name, full in zip(names, tensors):
            yield from assembler.add(name, full)
    assembler.finish()
