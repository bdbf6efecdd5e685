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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["ExportError", "find_run_checkpoint", "export_run", "export_command"]


class ExportError(ValueError):
    """The run folder has no (matching) complete checkpoint; the message says what exists."""


def _checkpoint_dir(run_dir: Path) -> Path:
    import yaml

    from ferrule.rl.config import CONFIG_FILE_NAME

    cfg_file = run_dir / CONFIG_FILE_NAME
    if cfg_file.is_file():
        configured = ((yaml.safe_load(cfg_file.read_text()) or {}).get("checkpoint") or {}).get("dir") or ""
        if configured:
            return Path(configured)
    return run_dir / "checkpoints"


def find_run_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """``(step, CKPT_DIR/step_NNNNNN)`` of a run: the latest complete checkpoint, or ``step``'s.

    Raises:
        ExportError: ``run_dir`` does not exist, has no complete checkpoint, or none at ``step``
            (the message lists the steps that exist).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"run folder {str(run_dir)!r} does not exist")
    from ferrule.rl.checkpoints import list_checkpoints

    ckpt_dir = _checkpoint_dir(run_dir)
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise ExportError(f"{ckpt_dir} holds no complete checkpoint (step_NNNNNN/ with loop_state.json); "
                          "train with checkpoint.enabled=true, or wait for the first checkpoint.interval")
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    raise ExportError(f"no checkpoint of step {step} in {ckpt_dir}; complete checkpoints: steps "
                      f"{[s for s, _ in found]} (checkpoint.keep prunes older ones)")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
               overwrite: bool = False, max_shard_bytes: int = 5 * 1024**3) -> tuple[int, Path]:
    """Export a run's checkpoint (latest, or ``step``) as an HF folder; return ``(step, out_dir)``.

    Raises:
        ExportError: see :func:`find_run_checkpoint`.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ferrule.safetensors_io.CheckpointError: the checkpoint does not match its
            stored config (:func:`ferrule.converters.checkpoint.load_torch_dist_into_mcore`).
    """
    from ferrule.converters.checkpoint import torch_dist_to_hf

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:  # before any model is built
        raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it, or "
                              "choose another path")
    found_step, path = find_run_checkpoint(run_dir, step)
    out = torch_dist_to_hf(path / "engine", out_dir, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
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
    generation config, tokenizer): loads with transformers' from_pretrained."""
    from rich.console import Console

    from ferrule.safetensors_io import CheckpointError

    console = Console(stderr=True, soft_wrap=True)
    try:
        found_step, out = export_run(run_dir, out_dir, step=step, overwrite=overwrite)
    except (ExportError, FileExistsError, CheckpointError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"exported step {found_step} of {run_dir} to {out}", markup=False, highlight=False)
