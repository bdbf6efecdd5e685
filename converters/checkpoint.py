"""HF checkpoint <-> Megatron ``dist_checkpointing`` torch_dist checkpoint.

Output layout of :func:`hf_to_torch_dist` (one directory)::

    OUT_DIR/
      metadata.json, .metadata, common.pt, __R_W.distcp   megatron torch_dist files
      ferrule_checkpoint.json                              family, layout it was saved from, dtype
      hf/config.json, hf/generation_config.json, hf/tokenizer*, ...  every side file of the HF directory
                                                           (all but weights: hf_side_files)
      hf/passthrough.safetensors                           HF tensors the mapping table passes through
                                                           (MappingTable.passthrough; only if any)
      hf/mxfp8_scales.safetensors                          an MXFP8 source's scales (ferrule.converters.quantized)
      checksums.json                                       size and XXH3-64 of every file (ferrule.fs.integrity)

The sharded state dict is ``{"model": GPTModel.sharded_state_dict()}`` (``"model0"``,
``"model1"``, ... per virtual pipeline stage, as Megatron-LM does); it stores global tensors
with offsets, so it loads under any TP / EP / PP layout.

Both directions write into a temporary sibling directory (``.OUT_DIR.tmp-<pid>``) that is
renamed to ``OUT_DIR`` only once complete; on any error it is deleted, so nothing that looks
like a checkpoint is left behind. An existing ``OUT_DIR`` is refused unless ``overwrite``.
The free space is checked before anything is written, and the leftovers of killed conversions
into ``OUT_DIR`` are removed first (:mod:`ferrule.fs.output_dir`).
Layouts with more than one rank run that many gloo (CPU) or NCCL (GPU) processes via
``torch.multiprocessing`` spawn; the requested layout is never changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrule.fs.util import commit_dir
from ferrule.fs.integrity import record_checksums, verify_checksums
from ferrule.formats.quantized_weights import open_hf_weights
from ferrule.formats.safetensors_io import CheckpointError, SafetensorsReader, ShardedSafetensorsWriter
from ferrule import __version__
from ferrule.compat import renamed_name
from ferrule.contract import registry
from ferrule.fs.output_dir import _ITEMSIZE
from ferrule.megatron.checkpoint import check_sharded_coverage, copy_hf_side_files, load_sharded, save_sharded
from ferrule.megatron.gpt_config import check_family_layout
from ferrule.megatron.parallel import ParallelLayout, init_distributed
from ferrule.megatron.provider import provider_build
from ferrule.megatron.weights import export_mcore_to_hf, load_hf_into_mcore
from ferrule.megatron.param_gather import unwrap

from .dtypes import _FLOAT_NAMES, _dtype_name, _other_float_dtypes, write_config_dtype
from ferrule.fs.output_dir import (Notice, disk_full_from, hf_write_bytes, prepare_out, torch_dist_model_bytes,
                                   unlock_output)
from .quantized import drop_quantization_config, mxfp8_bytes_saved, requantizer, restore_quantization_config, source_quantization
from .workers import ConversionError, _run

__all__ = ["hf_to_torch_dist", "torch_dist_to_hf", "load_torch_dist_into_mcore", "ConversionError", "HF_SUBDIR", "METADATA_FILE",
           "read_checkpoint_metadata", "dropped_hf_tensors", "TRAINING_STATE_PREFIXES",
           "hf_to_torch_dist_bytes", "torch_dist_to_hf_bytes"]


def __getattr__(name: str):
    # the names this module re-exported from the modules they were split into (ferrule.compat lists them)
    return renamed_name(__name__, name)


HF_SUBDIR = "hf"
#: File in ``OUT_DIR/hf`` holding the tensors a family's mapping table passes through unchanged.
PASSTHROUGH_FILE = "passthrough.safetensors"
METADATA_FILE = "ferrule_checkpoint.json"
FORMAT = "ferrule-torch_dist-v1"


def _save_passthrough(reader: SafetensorsReader, table: Any, hf_out: Path) -> int:
    """Copy the checkpoint's :class:`~ferrule.mapping.Passthrough` tensors to ``hf_out/passthrough.safetensors``.

    Returns the number of tensors kept (0 writes no file).
    """
    keys = sorted(k for k in reader.keys() if table.is_passthrough(k))
    if keys:
        from safetensors.torch import save_file

        save_file({k: reader.get(k).contiguous() for k in keys}, str(hf_out / PASSTHROUGH_FILE))
    return len(keys)


def _check_layout_before_spawn(family: str, hf_config: dict, layout) -> None:
    """Fail fast (before any worker process starts) when the layout cannot split this model or the family
    does not support it (:func:`ferrule.megatron.gpt_config.check_family_layout`)."""
    translation = registry.get_converter(family).resolved_config_translation()
    tc_kwargs, _ = translation.to_mcore(hf_config)
    check_family_layout(family, tc_kwargs, layout)


def layout_kwargs(tp: int = 1, ep: int = 1, pp: int = 1, etp: int | None = None) -> dict:
    """The ``ParallelLayout`` keywords of a conversion (``etp`` only when set: megatron's default is ``tp``)."""
    return {"tp": tp, "pp": pp, "ep": ep, **({"etp": etp} if etp is not None else {})}


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Every side file of ``src`` (:func:`ferrule.megatron.checkpoint.hf_side_files`: all but weights) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    return copy_hf_side_files(src, dst)


def _read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.exists():
        raise CheckpointError(f"HF checkpoint directory {hf_dir} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; an HF checkpoint directory needs its config.json.")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """The ``ferrule_checkpoint.json`` of a converted checkpoint.

    Raises:
        CheckpointError: the directory is not a complete ferrule torch_dist checkpoint.
    """
    ckpt_dir = Path(ckpt_dir)
    meta = ckpt_dir / METADATA_FILE
    if not (ckpt_dir / "metadata.json").is_file() or not meta.is_file() \
            or not (ckpt_dir / HF_SUBDIR / "config.json").is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a ferrule torch_dist checkpoint (needs metadata.json, {METADATA_FILE} and "
            f"{HF_SUBDIR}/config.json); create one with `ferrule convert hf-to-torch-dist`."
        )
    return json.loads(meta.read_text())


def _family_parts(hf_config: dict, family_name: str | None = None) -> tuple[Any, Any, Any]:
    """(family spec, provider build callable with towers, mapping table) from the registry: the family
    ``family_name`` when given, else the one ``hf_config`` resolves to."""
    family = registry.get_family(family_name) if family_name else registry.family_for_hf_config(hf_config)
    converter = registry.get_converter(family.name)
    return family, provider_build(family.name), converter.resolved_mapping()


def _build(build: Callable, hf_config: dict, layout: Any, dtype: str) -> list:
    import torch

    # every parameter is overwritten from the checkpoint: skip megatron's random init
    chunks = build(hf_config, layout, params_dtype=getattr(torch, dtype),
                   config_overrides={"perform_initialization": False})
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def _sharded_state_dict(chunks: list) -> dict:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


#: Prefix of the sharded keys a training checkpoint (``TrainEngine.save``) holds besides the model:
#: the optimizer's moments and step. Model-weight loads skip them.
TRAINING_STATE_PREFIXES = ("optimizer.",)


def load_torch_dist_into_mcore(model_chunks: Any, ckpt_dir: str | os.PathLike) -> None:
    """Load a torch_dist checkpoint's model weights into live Megatron chunks (any layout).

    Uses ``{"model": sharded_state_dict}`` (``model0``, ... for virtual stages) and reads only
    those tensors, so both a converter checkpoint (weights only) and a training checkpoint
    (``TrainEngine.save``: weights + optimizer + scheduler) work. Every model tensor must be in
    the checkpoint; a checkpoint tensor that is neither a model tensor nor training state
    (:data:`TRAINING_STATE_PREFIXES`) is an error too (it would mean another model).
    Every rank of the job must call it.

    Raises:
        CheckpointError: model tensors missing from the checkpoint, or unknown checkpoint
            tensors (the first few of each are named).
        ferrule.megatron.checkpoint.CheckpointMismatchError: a tensor's shape differs.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    # megatron: "missing" = in the checkpoint, not requested; "unexpected" = requested, not in the checkpoint
    loaded, in_ckpt_only, in_model_only = load_sharded(_sharded_state_dict(chunks), ckpt_dir, strict="return_all")
    foreign = sorted(str(k) for k in in_ckpt_only if not str(k).startswith(TRAINING_STATE_PREFIXES))
    if in_model_only or foreign:
        parts = []
        if in_model_only:
            parts.append(f"{len(in_model_only)} model tensor(s) are not in the checkpoint, e.g. "
                         f"{sorted(map(str, in_model_only))[:5]}")
        if foreign:
            parts.append(f"{len(foreign)} checkpoint tensor(s) belong to no model parameter, e.g. {foreign[:5]}")
        raise CheckpointError(f"{ckpt_dir} does not match the model built from its hf/config.json: "
                              + "; ".join(parts) + ".")
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        unwrap(chunk).load_state_dict(loaded[key], strict=True)


# ---------------------------------------------------------------------------------------
# HF -> torch_dist
# ---------------------------------------------------------------------------------------


def _loaded_bytes(reader: Any, table: Any) -> int:
    """Bytes of the HF tensors a conversion loads into Megatron (each once; not the ignored or passed-through
    ones), as ``reader`` reads them: what :func:`hf_to_torch_dist`'s ``progress`` calls add up to."""
    return sum(reader.nbytes(k) for k in reader.keys() if not table.is_ignored(k))


def _exported_bytes(reader: Any, table: Any, dtype: str, other_dtypes: dict[str, str]) -> int:
    """Bytes of the HF tensors an export of this conversion writes before any requantization: every tensor but
    the ignored ones, in ``dtype`` or its own (``other_dtypes``); the passed-through ones as stored. What
    :func:`torch_dist_to_hf`'s ``progress`` calls add up to (recorded as ``export_bytes`` in the metadata)."""
    import math

    total = 0
    for k in reader.keys():
        if table.is_passthrough(k):
            total += reader.nbytes(k)
        elif not table.is_ignored(k):
            total += math.prod(reader.shape(k)) * _ITEMSIZE[other_dtypes.get(k, dtype)]
    return total


def hf_to_torch_dist_bytes(hf_dir: str | os.PathLike, *, dtype: str | None = None, family: str | None = None) -> int:
    """The bytes :func:`hf_to_torch_dist` (same arguments) reports through ``progress`` in all: those of the
    HF tensors it loads (each once, quantized ones dequantized in the conversion dtype), for a progress bar's total.

    Raises: what :func:`hf_to_torch_dist` raises for a missing config, an unsupported model_type or unreadable shards.
    """
    hf_dir = Path(hf_dir)
    hf_config = _read_config(hf_dir)
    _, _, table = _family_parts(hf_config, family)
    reader = open_hf_weights(hf_dir, hf_config, dtype=dtype)
    # the worker reads at the model's dtype (load_hf_into_mcore): the sizes of dequantized tensors depend on it
    return _loaded_bytes(open_hf_weights(hf_dir, hf_config, dtype=dtype or _dtype_name(reader)), table)


def _hf_to_torch_dist_worker(rank: int, hf_dir: str, tmp: str, hf_config: dict, layout_kw: dict, dtype: str,
                             progress: Callable[[int], None] | None, family: str | None = None) -> None:
    layout = ParallelLayout(**layout_kw)
    init_distributed(layout)
    _, build, table = _family_parts(hf_config, family)
    chunks = _build(build, hf_config, layout, dtype)
    load_hf_into_mcore(chunks, hf_dir, table, hf_config=hf_config, progress=progress if rank == 0 else None)
    sharded = _sharded_state_dict(chunks)
    check_sharded_coverage(chunks, sharded)  # a parameter the save would drop: an error now, not at the load
    save_sharded(sharded, tmp)  # no __main__ guard needed in the caller


def hf_to_torch_dist(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, ep: int = 1, pp: int = 1,
                     etp: int | None = None, overwrite: bool = False, dtype: str | None = None,
                     progress: Callable[[int], None] | None = None, notice: Notice | None = None,
                     family: str | None = None) -> Path:
    """Convert an HF safetensors checkpoint into a megatron torch_dist checkpoint.

    The family is ``family`` (a registered family name) or comes from ``config.json`` through the
    registry (recorded in ``ferrule_checkpoint.json`` either way); the model is built by the
    family's provider at the requested layout (``tp * ep * pp`` ranks; expert TP = ``etp``, default ``tp``),
    HF tensors are streamed one at a time through the family's mapping table into the live
    parameters, and ``megatron.core.dist_checkpointing.save`` writes the result.

    Args:
        hf_dir: HF checkpoint directory (``config.json`` + ``model.safetensors[.index.json]``).
        out_dir: output directory (must not exist unless ``overwrite``).
        tp, ep, pp, etp: parallel layout used for the conversion processes (the checkpoint itself
            loads under any layout); ``etp`` None is megatron's default (``tp``). A layout the model cannot
            split or the family does not support (``ModelFamilySpec.layouts``) is refused before any process starts.
        dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); default: the
            checkpoint's main floating dtype (most bytes). Tensors stored in another floating dtype
            are recorded (``hf_dtypes`` in ``ferrule_checkpoint.json``) and exported in their own
            dtype again, so the conversion is bit-exact.
        progress: ``progress(n_bytes)`` after each parameter (single-process runs only); the calls add up to
            :func:`hf_to_torch_dist_bytes` (each HF tensor loaded counts once).
        notice: ``notice(message)`` for what was done besides the conversion (the removal of a
            killed conversion's temporary folder); default: a warning on the ``ferrule.converters`` logger.

    Returns:
        ``out_dir`` as an absolute path.

    Raises:
        ferrule.fs.util.DiskFullError: ``out_dir``'s filesystem has less free space than the
            conversion writes (checked first), or a write failed with ``ENOSPC``: "no space left on
            OUT_DIR (needed ~N MB, free M MB)"; nothing is left behind.
        CheckpointError: missing ``config.json``, missing/truncated shard; a provider parameter its model's
            ``sharded_state_dict()`` does not return (named: the checkpoint would lack it).
        ferrule.contract.registry.UnknownModelError: no plugin supports the ``model_type``.
        ferrule.megatron.parallel.ParallelLayoutError: an invalid layout.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ferrule.mapping.MappingError: missing / extra HF keys or shape mismatches (all listed).
        ConversionError: a worker failed otherwise.
    """
    hf_dir = Path(hf_dir).absolute()
    out_dir = Path(out_dir).absolute()
    hf_config = _read_config(hf_dir)
    spec, _, table = _family_parts(hf_config, family)  # unsupported model_type fails here, before any output
    # missing / truncated shards fail here; MXFP8 / NVFP4 is read dequantized (into ``dtype`` when given)
    reader = open_hf_weights(hf_dir, hf_config, dtype=dtype)
    dtype = dtype or _dtype_name(reader)
    other_dtypes = _other_float_dtypes(reader, dtype)
    layout_kw = layout_kwargs(tp, ep, pp, etp)
    world = tp * pp * ep
    ParallelLayout(**layout_kw).validate(world)
    _check_layout_before_spawn(spec.name, hf_config, ParallelLayout(**layout_kw))
    needed = hf_write_bytes(reader, dtype, hf_dir)
    tmp = prepare_out(out_dir, overwrite, needed, notice)
    try:
        _run(world, _hf_to_torch_dist_worker, (str(hf_dir), str(tmp), hf_config, layout_kw, dtype,
                                               progress if world == 1 else None, spec.name), tmp)
        if not (tmp / "metadata.json").is_file():
            raise ConversionError(f"megatron dist_checkpointing.save wrote no metadata.json into {tmp}.")
        copied = _copy_side_files(hf_dir, tmp / HF_SUBDIR)
        quantization = source_quantization(reader, tmp / HF_SUBDIR)  # hf/config.json describes the stored weights
        kept = _save_passthrough(reader, table, tmp / HF_SUBDIR)
        import megatron.core

        meta = {"format": FORMAT, "family": spec.name, "model_type": hf_config.get("model_type"),
                "dtype": dtype, "saved_layout": layout_kw, "source": str(hf_dir), "hf_files": copied,
                "hf_bytes": reader.total_bytes(), "export_bytes": _exported_bytes(reader, table, dtype, other_dtypes),
                "passthrough_tensors": kept,
                "hf_dtypes": other_dtypes, "ferrule_version": __version__, "hf_quantization": quantization,
                "hf_ignored": sorted(k for k in reader.keys() if table.is_ignored(k) and not table.is_passthrough(k)),
                "megatron_core_version": getattr(megatron.core, "__version__", "unknown")}
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        record_checksums(tmp)  # ferrule.fs.integrity: every file's size and hash, verified when it is read
        commit_dir(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full_from(exc, out_dir, needed)
        if full is not None:
            raise full from exc
        raise
    finally:
        unlock_output(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------
# torch_dist -> HF
# ---------------------------------------------------------------------------------------


def dropped_hf_tensors(meta: dict, table: Any) -> list[tuple[str, Any]]:
    """``(hf_key, Ignore row)`` for each source tensor the export will not contain.

    ``meta`` is :func:`read_checkpoint_metadata`'s dict (``hf_ignored`` lists the source keys the
    table ignored at import; checkpoints written before ferrule recorded it give ``[]``).
    """
    out = []
    for key in meta.get("hf_ignored", []):
        row = next((i for i in table.ignores if i.match(key)), None)
        out.append((key, row))
    return out


def _check_dropped(dropped: list[tuple[str, Any]], table: Any) -> None:
    bad = [key for key, row in dropped if row is None or not row.unused_by_hf]
    if bad:
        shown = ", ".join(bad[:20]) + (f" ... ({len(bad)} in all)" if len(bad) > 20 else "")
        raise CheckpointError(
            f"the source HF checkpoint had tensors that MappingTable({table.family}) Ignores, so this export would "
            f"lack them although transformers loads them: {shown}. Map them in the family's mapping table, or, if "
            f"HF does not load them either, mark the Ignore row unused_by_hf=True."
        )


def _torch_dist_to_hf_worker(rank: int, ckpt_dir: str, tmp: str, hf_config: dict, layout_kw: dict, dtype: str,
                             max_shard_bytes: int, progress: Callable[[int], None] | None,
                             hf_dtypes: dict | None = None, out_dtype: str | None = None,
                             requantize: Callable | None = None, family: str | None = None) -> None:
    layout = ParallelLayout(**layout_kw)
    init_distributed(layout)
    _, build, table = _family_parts(hf_config, family)
    chunks = _build(build, hf_config, layout, dtype)
    load_torch_dist_into_mcore(chunks, ckpt_dir)
    writer = ShardedSafetensorsWriter(tmp, max_shard_bytes) if rank == 0 else None
    import torch

    # megatron may keep some parameters (e.g. torch norms) in fp32 under bf16 params_dtype; each HF
    # tensor gets back the dtype it had in the source checkpoint (exact for bf16 -> fp32 -> bf16), which
    # is the main dtype except for the tensors listed in hf_dtypes
    hf_dtypes = hf_dtypes or {}
    for name, tensor in export_mcore_to_hf(chunks, table, hf_config=hf_config):
        if writer is None:
            continue
        out = tensor.to(getattr(torch, hf_dtypes.get(name, out_dtype or dtype)))
        # --keep-quantized: the source's quantized tensors are quantized again from the stored (exact) values
        for n, t in (requantize(name, tensor.cpu(), out) if requantize is not None else [(name, out)]):
            writer.add(n, t.cpu())
        if progress is not None:  # the tensor's bytes before any requantization: the unit of ``export_bytes``
            progress(out.numel() * out.element_size())
    if writer is not None:
        passthrough = Path(ckpt_dir) / HF_SUBDIR / PASSTHROUGH_FILE
        if passthrough.is_file():  # tensors Megatron does not hold (MappingTable.passthrough), written back verbatim
            from safetensors.torch import load_file

            for name, tensor in load_file(str(passthrough)).items():
                writer.add(name, tensor)
                if progress is not None:
                    progress(tensor.numel() * tensor.element_size())
        writer.close()


def torch_dist_to_hf_bytes(meta: dict) -> int | None:
    """What :func:`torch_dist_to_hf`'s ``progress`` calls add up to (at the checkpoint's own dtype), from its
    :func:`read_checkpoint_metadata` dict: ``export_bytes``, recorded by :func:`hf_to_torch_dist`. None when it
    is not recorded (checkpoints of ``TrainEngine.save`` and of ferrule before 2026-12-02): a bar without a total."""
    value = meta.get("export_bytes")
    return value if isinstance(value, int) and value > 0 else None


def _recorded_family(meta: dict) -> str | None:
    """The family ``ferrule_checkpoint.json`` names, when it is registered (else None: the config decides)."""
    name = meta.get("family")
    return name if isinstance(name, str) and name in registry.get_registry().families else None


def torch_dist_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, ep: int = 1,
                     etp: int | None = None, overwrite: bool = False, max_shard_bytes: int = 5 * 1024**3,
                     progress: Callable[[int], None] | None = None, dtype: str | None = None,
                     keep_quantized: bool = False, notice: Notice | None = None, family: str | None = None,
                     mxfp8: bool = False) -> Path:
    """Convert a checkpoint written by :func:`hf_to_torch_dist` or ``TrainEngine.save`` (e.g. the
    ``engine/`` folder of a ``ferrule train`` checkpoint) back to HF safetensors.

    Reads the family, dtype and HF config from ``CKPT_DIR/ferrule_checkpoint.json`` and
    ``CKPT_DIR/hf/`` (the family: ``family`` when given, else the one the metadata records when it
    is registered, else the one the config resolves to); builds the model at ``tp`` x ``ep`` (any layout; 1 is enough), loads the
    model weights only (:func:`load_torch_dist_into_mcore`: optimizer state is skipped, a
    missing or foreign tensor is an error),
    exports through the mapping table and writes ``model-0000i-of-0000n.safetensors`` shards
    (``max_shard_bytes`` each, bytes) + ``model.safetensors.index.json`` (or one
    ``model.safetensors``), plus the config / generation config / tokenizer files.

    Returns:
        ``out_dir`` as an absolute path.

    A source checkpoint in MXFP8 (read dequantized, :mod:`ferrule.formats.quantized_weights`) exports
    dequantized in ``dtype`` with no ``quantization_config``; ``keep_quantized=True`` writes the tensors it
    stored quantized in its format again (MXFP8: same names, blocks and scale dtype; NVFP4: the source's bytes,
    for unchanged tensors; :mod:`ferrule.converters.quantized`) and restores its ``quantization_config``.
    ``mxfp8=True`` is the older name of ``keep_quantized=True`` (the CLI's ``--mxfp8``), kept as an alias.

    Tensors of the source HF checkpoint that the mapping table ignores (``Ignore`` rows) are not in the
    export; :func:`dropped_hf_tensors` names them (``ferrule convert`` prints them).

    ``notice`` is :func:`hf_to_torch_dist`'s. ``progress(n_bytes)`` is called after each HF tensor written
    (single-process runs only) with its bytes before any requantization (``keep_quantized``); the calls add up to
    :func:`torch_dist_to_hf_bytes`.

    Raises:
        ferrule.fs.util.DiskFullError: ``out_dir``'s filesystem has less free space than the export
            writes (the model tensors in the output dtype, from the torch_dist metadata; checked
            first), or a write failed with ``ENOSPC``; nothing is left behind.
        ferrule.fs.integrity.CheckpointIntegrityError: a file of ``ckpt_dir`` is missing, truncated or
            damaged (checked against its ``checksums.json`` first; named).
        CheckpointError: ``ckpt_dir`` is not a ferrule torch_dist checkpoint; or the source had
            tensors the table ignores (``Ignore`` rows) without ``unused_by_hf=True`` (the export would lack
            tensors transformers loads; all are named, nothing is written).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ferrule.contract.registry.UnknownModelError: the stored config's model_type is unsupported.
        CheckpointError: model tensors missing from the torch_dist files, or tensors there that
            belong to no model parameter (all counted, the first few named).
        ferrule.megatron.checkpoint.CheckpointMismatchError: a tensor's shape does not match the
            model built from the stored config (ConversionError when a worker of a multi-process
            conversion reports it).
    """
    ckpt_dir = Path(ckpt_dir).absolute()
    out_dir = Path(out_dir).absolute()
    if (ckpt_dir / "metadata.json").is_file():
        verify_checksums(ckpt_dir)  # a damaged file is named here, not converted into a wrong model
    meta = read_checkpoint_metadata(ckpt_dir)
    hf_config = _read_config(ckpt_dir / HF_SUBDIR)
    spec, _, table = _family_parts(hf_config, family or _recorded_family(meta))
    _check_dropped(dropped_hf_tensors(meta, table), table)
    layout_kw = layout_kwargs(tp, ep, 1, etp)
    world = tp * ep
    ParallelLayout(**layout_kw).validate(world)
    _check_layout_before_spawn(spec.name, hf_config, ParallelLayout(**layout_kw))
    if dtype is not None and dtype not in _FLOAT_NAMES.values():
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_FLOAT_NAMES.values())}")
    out_dtype = dtype or meta["dtype"]
    requantize = requantizer(meta, keep_quantized or mxfp8, ckpt_dir)  # refused before anything is written
    needed = torch_dist_model_bytes(ckpt_dir, out_dtype, TRAINING_STATE_PREFIXES)
    if requantize is not None:
        needed -= mxfp8_bytes_saved(meta, ckpt_dir, out_dtype)
    tmp = prepare_out(out_dir, overwrite, needed, notice)
    try:
        _run(world, _torch_dist_to_hf_worker, (str(ckpt_dir), str(tmp), hf_config, layout_kw, meta["dtype"],
                                               max_shard_bytes, progress if world == 1 else None,
                                               meta.get("hf_dtypes", {}), out_dtype, requantize, spec.name), tmp)
        _copy_side_files(ckpt_dir / HF_SUBDIR, tmp)
        write_config_dtype(tmp / "config.json", out_dtype)
        if requantize is not None:
            restore_quantization_config(tmp / "config.json", meta)
        else:  # the weights written are dequantized (a training checkpoint's hf/config.json may still say MXFP8)
            drop_quantization_config(tmp / "config.json")
        commit_dir(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full_from(exc, out_dir, needed)
        if full is not None:
            raise full from exc
        raise
    finally:
        unlock_output(out_dir)
    return out_dir
