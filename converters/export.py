"""``ferrule export RUN_DIR [--step N] OUT``: a trained policy leaves a run as an HF folder.

A ``ferrule train`` checkpoint ``CKPT_DIR/step_NNNNNN/engine`` is a torch_dist training
checkpoint (model, optimizer, scheduler, RNG; :mod:`ferrule.megatron.checkpoint`) whose ``hf/``
carries the source checkpoint's ``config.json``, ``generation_config.json`` and tokenizer files.
The export reads the model weights only (:func:`ferrule.converters.checkpoint.torch_dist_to_hf`)
and writes safetensors + those files into ``OUT``, so ``OUT`` loads with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and generates with the
source's generation config (EOS ids included). ``OUT`` is written atomically.

``CKPT_DIR`` is ``checkpoint.dir`` from ``RUN_DIR/config.yaml`` when set, else ``RUN_DIR/checkpoints``;
the latest complete checkpoint (one with ``loop_state.json``) is taken unless ``--step`` names one.

A LoRA run (``lora.rank > 0``) keeps its base frozen and its trained adapter in ``engine/lora/``
(HF PEFT format, :mod:`ferrule.lora.checkpoint`). Its export is the **merged** policy: the base
is converted as above, then ``peft.PeftModel.from_pretrained(base, engine/lora)`` merges the adapter
with PEFT's ``merge_and_unload`` (``W + scaling * B @ A``; routed / shared expert adapters through
``target_parameters`` alike) in float32, and the merged model is saved in the training dtype (or
``--dtype``), with a warning when that dtype cannot hold the update. ``ferrule lora export``
writes the adapter alone.

The weights are written in the training dtype (``model.dtype``) unless ``--dtype`` names another,
and ``OUT/config.json`` states the dtype written, so a plain ``from_pretrained(OUT)`` loads the
trained tensors as they are (the source checkpoint's ``dtype`` would load float32 training in bf16).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Annotated

import typer

from ferrule.fs.run_layout import RunCheckpointError, find_run_checkpoint
from ferrule.contract import registry
from ferrule.fs.util import DiskFullError, check_free_space, commit_dir, sigterm_as_exit

__all__ = ["EXPORT_DTYPES", "ExportError", "find_run_checkpoint", "export_run", "export_command", "merge_peft_adapter"]


#: raised by :func:`find_run_checkpoint` (kept under this name for callers of the export)
ExportError = RunCheckpointError


#: the dtypes an export can be written in
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
#: a merged export warns when the kept part of the LoRA update ``cast(W + dW) - cast(W)`` is off the
#: float32 update ``dW`` by more than this fraction of its norm (the update is below the dtype's
#: resolution of the base weights; measured on SmolLM2 after 5 steps in bf16: 0.94)
UNDERFLOW_WARN = 0.1


def merge_peft_adapter(hf_dir: str | os.PathLike, adapter_dir: str | os.PathLike, *, dtype: str | None = None,
                       max_shard_bytes: int = 5 * 1024**3) -> dict:
    """Merge the HF PEFT adapter in ``adapter_dir`` into the HF checkpoint ``hf_dir``, in place.

    Loads ``hf_dir`` with the family's transformers class **in float32** (whatever its saved
    dtype), applies the adapter with ``peft.PeftModel.from_pretrained``, merges it with
    ``merge_and_unload`` (PEFT's ``W + scaling * B @ A``, ``scaling = lora_alpha / r`` or
    ``/ sqrt(r)`` with rsLoRA) in float32, casts to ``dtype`` (default: the dtype ``hf_dir`` was
    saved in) and saves the merged weights back (``save_pretrained``: safetensors, shards of
    ``max_shard_bytes``, ``config.json`` stating ``dtype``); generation config and tokenizer files stay.

    Returns:
        ``{"adapter_config": adapter_config.json dict, "dtype": the written dtype,
        "update_error": max over the merged weights of ||cast(W + dW) - cast(W) - dW|| / ||dW||
        (0 in float32; near 1 when the update is below the dtype's resolution), "weight":
        the name of that weight}``.

    Raises:
        FileNotFoundError: ``adapter_dir`` lacks ``adapter_model.safetensors`` / ``adapter_config.json``.
        ImportError: peft is not installed (``pip install 'ferrule[rl]'``).
        ValueError: ``dtype`` is not one of :data:`EXPORT_DTYPES`.
    """
    import torch
    from transformers import AutoConfig

    hf_dir, adapter_dir = Path(hf_dir), Path(adapter_dir)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        if not (adapter_dir / name).is_file():
            raise FileNotFoundError(f"{adapter_dir / name} is missing; {adapter_dir} is not a PEFT adapter folder")
    try:
        import peft
    except ImportError as exc:
        raise ImportError("merging a LoRA adapter needs peft (pip install 'ferrule[rl]')") from exc
    config = AutoConfig.from_pretrained(hf_dir)
    saved = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    out_dtype = getattr(torch, dtype or saved)
    model = registry.hf_model_class(config).from_pretrained(hf_dir, use_kernels=False, dtype=torch.float32)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    worst, worst_name = 0.0, ""
    for name, w in merged.state_dict().items():
        b = base.get(name)
        if b is None or not w.is_floating_point() or torch.equal(w, b):
            continue
        delta = (w - b).double()
        kept = w.to(out_dtype).double() - b.to(out_dtype).double()
        err = float((kept - delta).norm() / delta.norm())
        if err > worst:
            worst, worst_name = err, name
    merged = merged.to(out_dtype)
    merged.save_pretrained(hf_dir, safe_serialization=True, max_shard_size=max_shard_bytes)
    from ferrule.converters.dtypes import write_config_dtype

    write_config_dtype(hf_dir / "config.json", str(out_dtype).removeprefix("torch."))
    return {"adapter_config": json.loads((adapter_dir / "adapter_config.json").read_text()),
            "dtype": str(out_dtype).removeprefix("torch."), "update_error": worst, "weight": worst_name}


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
               overwrite: bool = False, dtype: str | None = None,
               max_shard_bytes: int = 5 * 1024**3, notice=None) -> tuple[int, Path, dict | None]:
    """Export a run's checkpoint (latest, or ``step``) as an HF folder; return ``(step, out_dir, merge)``.

    The weights are written in ``dtype`` (default: the training dtype, ``model.dtype``), and
    ``config.json`` says so. A LoRA run's checkpoint (``engine/lora/adapter_model.safetensors``)
    is exported with its adapter merged in float32 (:func:`merge_peft_adapter`, whose dict is
    ``merge``; None for a full-parameter run); ``out_dir`` appears only when complete. ``notice``
    is :func:`ferrule.converters.checkpoint.hf_to_torch_dist`'s (leftovers of killed exports removed).

    Raises:
        ferrule.fs.util.DiskFullError: the export does not fit (checked before writing: the model in
            the written dtype, a LoRA merge's float32 staging copy too) or a write failed with ``ENOSPC``.
        ExportError: see :func:`find_run_checkpoint`.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ValueError: ``dtype`` is not one of :data:`EXPORT_DTYPES`.
        ferrule.formats.safetensors_io.CheckpointError: the checkpoint does not match its
            stored config (:func:`ferrule.converters.checkpoint.load_torch_dist_into_mcore`).
    """
    from ferrule.converters.checkpoint import TRAINING_STATE_PREFIXES, read_checkpoint_metadata, torch_dist_to_hf
    from ferrule.fs.output_dir import disk_full_from, lock_output, torch_dist_model_bytes, unlock_output

    out_dir = Path(out_dir)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if out_dir.exists() and not overwrite:  # before any model is built
        raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it, or "
                              "choose another path")
    found_step, path = find_run_checkpoint(run_dir, step)
    adapter_dir = path / "engine" / "lora"
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        out = torch_dist_to_hf(path / "engine", out_dir, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                               dtype=dtype, notice=notice)
        return found_step, out, None
    train_dtype = read_checkpoint_metadata(path / "engine")["dtype"]
    staging = out_dir.absolute().parent / f".{out_dir.name}.merge-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lock_output(out_dir, overwrite, notice)  # one writer of OUT (a second export or conversion is refused)
    needed = None
    try:  # the base in float32, merged in float32, then cast once
        needed = torch_dist_model_bytes(path / "engine", "float32", TRAINING_STATE_PREFIXES)
        check_free_space(out_dir.absolute().parent, needed, name=out_dir)
        torch_dist_to_hf(path / "engine", staging, max_shard_bytes=max_shard_bytes, dtype="float32")
        merge = merge_peft_adapter(staging, adapter_dir, dtype=dtype or train_dtype, max_shard_bytes=max_shard_bytes)
        out = commit_dir(staging, out_dir)
    except BaseException as exc:
        full = disk_full_from(exc, out_dir, needed)
        if full is not None:
            raise full from exc
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        unlock_output(out_dir)
    return found_step, out, merge


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="Run folder of `ferrule train` (logging.run_dir).",
                                            show_default=False)],
    out_dir: Annotated[Path, typer.Argument(help="Output HF folder (must not exist).", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", help="Export this step's checkpoint; default: the "
                                                            "latest complete one.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT_DIR if it exists.")] = False,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32, bfloat16 or float16; default: the "
                                                              "training dtype (model.dtype).")] = None,
) -> None:
    """Export a trained policy from a run's checkpoint as an HF folder (safetensors, config,
    generation config, tokenizer): loads with transformers' from_pretrained. A LoRA run's adapter
    is merged into the base (`ferrule lora export` writes the adapter alone)."""
    from rich.console import Console

    from ferrule.fs.locks import LockedError
    from ferrule.formats.safetensors_io import CheckpointError

    console = Console(stderr=True, soft_wrap=True)
    try:
        with sigterm_as_exit():  # SIGTERM: the staging folders and the lock are removed
            found_step, out, merge = export_run(run_dir, out_dir, step=step, overwrite=overwrite, dtype=dtype,
                                                notice=lambda m: console.print(m, markup=False, highlight=False))
    except (ExportError, FileExistsError, CheckpointError, ValueError, LockedError, DiskFullError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    written = json.loads((out / "config.json").read_text()).get("dtype")
    merged = ""
    if merge is not None:
        merged = " with its LoRA adapter merged into the base (the adapter alone: ferrule lora export)"
        if merge["update_error"] > UNDERFLOW_WARN:
            console.print(f"warning: in {merge['dtype']} the merged LoRA update is {merge['update_error']:.0%} off "
                          f"its float32 value ({merge['weight']}): it is below {merge['dtype']}'s resolution of the "
                          "base weights; export with --dtype float32 to keep it", markup=False, highlight=False)
    console.print(f"exported step {found_step} of {run_dir} to {out} ({written}){merged}", markup=False,
                  highlight=False)
