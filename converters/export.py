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
``target_parameters`` alike) and the merged model is saved in the base's dtype. ``ferrule lora
export`` writes the adapter alone.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Annotated

import typer

from ferrule.run_layout import RunCheckpointError, find_run_checkpoint

__all__ = ["ExportError", "find_run_checkpoint", "export_run", "export_command", "merge_peft_adapter"]


#: raised by :func:`find_run_checkpoint` (kept under this name for callers of the export)
ExportError = RunCheckpointError


def merge_peft_adapter(hf_dir: str | os.PathLike, adapter_dir: str | os.PathLike, *,
                       max_shard_bytes: int = 5 * 1024**3) -> dict:
    """Merge the HF PEFT adapter in ``adapter_dir`` into the HF checkpoint ``hf_dir``, in place.

    Loads ``hf_dir`` with the family's transformers class in its saved dtype, applies the adapter
    with ``peft.PeftModel.from_pretrained``, merges it with ``merge_and_unload`` (PEFT's
    ``W + scaling * B @ A``, ``scaling = lora_alpha / r`` or ``/ sqrt(r)`` with rsLoRA) and saves
    the merged weights back (``save_pretrained``: safetensors, shards of ``max_shard_bytes``);
    config, generation config and tokenizer files stay.

    Returns:
        The adapter's ``adapter_config.json`` dict.

    Raises:
        FileNotFoundError: ``adapter_dir`` lacks ``adapter_model.safetensors`` / ``adapter_config.json``.
        ImportError: peft is not installed (``pip install 'ferrule[rl]'``).
    """
    import json

    from transformers import AutoConfig

    from ferrule import registry

    hf_dir, adapter_dir = Path(hf_dir), Path(adapter_dir)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        if not (adapter_dir / name).is_file():
            raise FileNotFoundError(f"{adapter_dir / name} is missing; {adapter_dir} is not a PEFT adapter folder")
    try:
        import peft
    except ImportError as exc:
        raise ImportError("merging a LoRA adapter needs peft (pip install 'ferrule[rl]')") from exc
    config = AutoConfig.from_pretrained(hf_dir)
    cls = registry.hf_model_class(config)
    model = cls.from_pretrained(hf_dir, dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(hf_dir, safe_serialization=True, max_shard_size=max_shard_bytes)
    return json.loads((adapter_dir / "adapter_config.json").read_text())


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
               overwrite: bool = False, max_shard_bytes: int = 5 * 1024**3) -> tuple[int, Path]:
    """Export a run's checkpoint (latest, or ``step``) as an HF folder; return ``(step, out_dir)``.

    A LoRA run's checkpoint (``engine/lora/adapter_model.safetensors``) is exported with its
    adapter merged (:func:`merge_peft_adapter`); ``out_dir`` appears only when complete.

    Raises:
        ExportError: see :func:`find_run_checkpoint`.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ferrule.safetensors_io.CheckpointError: the checkpoint does not match its
            stored config (:func:`ferrule.converters.checkpoint.load_torch_dist_into_mcore`).
    """
    from ferrule.converters.checkpoint import torch_dist_to_hf
    from ferrule.fsutil import commit_dir

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:  # before any model is built
        raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it, or "
                              "choose another path")
    found_step, path = find_run_checkpoint(run_dir, step)
    adapter_dir = path / "engine" / "lora"
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        out = torch_dist_to_hf(path / "engine", out_dir, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
        return found_step, out
    staging = out_dir.absolute().parent / f".{out_dir.name}.merge-{uuid.uuid4().hex[:8]}"
    try:
        torch_dist_to_hf(path / "engine", staging, max_shard_bytes=max_shard_bytes)
        merge_peft_adapter(staging, adapter_dir, max_shard_bytes=max_shard_bytes)
        out = commit_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return found_step, out


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="Run folder of `ferrule train` (logging.run_dir).",
                                            show_default=False)],
    out_dir: Annotated[Path, typer.Argument(help="Output HF folder (must not exist).", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", help="Export this step's checkpoint; default: the "
                                                            "latest complete one.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT_DIR if it exists.")] = False,
) -> None:
    """Export a trained policy from a run's checkpoint as an HF folder (safetensors, config,
    generation config, tokenizer): loads with transformers' from_pretrained. A LoRA run's adapter
    is merged into the base (`ferrule lora export` writes the adapter alone)."""
    from rich.console import Console

    from ferrule.safetensors_io import CheckpointError

    console = Console(stderr=True, soft_wrap=True)
    try:
        found_step, out = export_run(run_dir, out_dir, step=step, overwrite=overwrite)
    except (ExportError, FileExistsError, CheckpointError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    merged = (" with its LoRA adapter merged into the base (the adapter alone: ferrule lora export)"
              if (find_run_checkpoint(run_dir, found_step)[1] / "engine" / "lora" / "adapter_model.safetensors").is_file()
              else "")
    console.print(f"exported step {found_step} of {run_dir} to {out}{merged}", markup=False, highlight=False)
