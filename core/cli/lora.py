"""``ferrule lora export CKPT OUT`` / ``ferrule lora import ADAPTER BASE OUT``: HF PEFT in and out.

- export: a LoRA train checkpoint (``TrainEngine.save`` with ``lora=``; its ``lora/`` holds the
  full adapter in PEFT format, written at save time at any layout) -> a PEFT folder
  (``adapter_model.safetensors`` + ``adapter_config.json``) that
  ``peft.PeftModel.from_pretrained(hf_model, OUT)`` loads.
- import: a PEFT adapter folder + its base (an HF folder or a torch_dist checkpoint) -> a LoRA
  train checkpoint at world size 1 (step 0, fresh optimizer) that ``TrainEngine.from_torch_dist(
  OUT, lora=...)`` resumes, with ``LoraSettings`` read from ``adapter_config.json``.

Both write ``OUT`` atomically; user errors print one line and exit with code 2.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Annotated

import typer

from ferrule.fs.run_layout import find_run_checkpoint, is_run_folder

__all__ = ["app", "export_adapter", "import_adapter", "resolve_lora_checkpoint", "settings_from_peft_config"]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Export a LoRA checkpoint's adapter as HF PEFT, or import a PEFT adapter for training.")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite or choose another path.")


def resolve_lora_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """The ``TrainEngine.save`` folder of a LoRA checkpoint given as that folder, a ``ferrule train``
    checkpoint ``step_NNNNNN/`` (its ``engine/``) or a run folder (its latest complete checkpoint,
    or ``step``'s).

    Raises:
        FileNotFoundError: none of these, or not a LoRA checkpoint (the message says what exists).
        ferrule.fs.run_layout.RunCheckpointError: a run folder without (that) checkpoint.
    """
    from ferrule.lora.checkpoint import PEFT_CONFIG, PEFT_WEIGHTS

    path = Path(path)
    if step is None:
        for cand in (path, path / "engine"):
            if (cand / "lora" / PEFT_WEIGHTS).is_file() and (cand / "lora" / PEFT_CONFIG).is_file():
                return cand
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "engine").is_dir() or (path / "ferrule_checkpoint.json").is_file():
        if step is not None:
            raise FileNotFoundError(f"--step is for a run folder; {path} is one checkpoint")
        raise FileNotFoundError(f"{path} holds no LoRA adapter (lora/{PEFT_WEIGHTS}): it is a checkpoint of a "
                                "full-parameter run; `ferrule export RUN_DIR OUT` exports its weights")
    if is_run_folder(path):

        _, ckpt = find_run_checkpoint(path, step)
        return resolve_lora_checkpoint(ckpt)
    raise FileNotFoundError(f"{path} is not a LoRA checkpoint: give a run folder (logging.run_dir), one of its "
                            f"checkpoints/step_NNNNNN folders, or a TrainEngine.save folder with lora/{PEFT_WEIGHTS}")


def export_adapter(ckpt: str | Path, out: str | Path, *, base_model: str | None = None,
                   overwrite: bool = False, step: int | None = None, notice=None) -> Path:
    """Copy the PEFT adapter of LoRA checkpoint ``ckpt`` to ``out`` (atomic); returns ``out``.

    ``out`` is written as the converters write theirs (:func:`ferrule.fs.output_dir.prepare_out`):
    under the kernel lock ``.OUT.lock`` through the temporary sibling ``.OUT.tmp-PID``; leftovers of
    killed writers of ``out`` are removed first and ``notice(message)`` says how much that freed.

    ``ckpt``: a run folder (latest checkpoint, or ``step``'s), a ``step_NNNNNN/`` checkpoint or a
    ``TrainEngine.save`` folder (:func:`resolve_lora_checkpoint`).

    Raises:
        FileNotFoundError: ``ckpt`` is not a LoRA train checkpoint (the message says what is missing).
        FileExistsError: ``out`` exists and not ``overwrite``.
        ferrule.fs.locks.LockedError: another export or conversion is writing ``out`` (names its pid).
        ferrule.fs.util.DiskFullError: the adapter does not fit on ``out``'s filesystem.
    """
    from safetensors import safe_open

    from ferrule.fs.output_dir import prepare_out, unlock_output
    from ferrule.fs.util import commit_dir

    from ferrule.lora.checkpoint import PEFT_CONFIG, PEFT_WEIGHTS

    ckpt, out = resolve_lora_checkpoint(ckpt, step), Path(out)
    src = ckpt / "lora"
    _check_out(out, overwrite)
    with safe_open(str(src / PEFT_WEIGHTS), framework="pt") as f:  # readable and PEFT-named
        bad = [k for k in f.keys() if not k.startswith("base_model.model.") or ".lora_" not in k]
    if bad:
        raise FileNotFoundError(f"{src / PEFT_WEIGHTS} holds non-PEFT keys {bad[:4]}; the checkpoint is damaged.")
    config = json.loads((src / PEFT_CONFIG).read_text())
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    # one writer of OUT (a second export or conversion into it is refused naming this one); the temporary
    # sibling .OUT.tmp-PID is removed by the next writer of OUT if this process is killed
    tmp = prepare_out(out, overwrite, (src / PEFT_WEIGHTS).stat().st_size, notice)
    try:
        shutil.copy2(src / PEFT_WEIGHTS, tmp / PEFT_WEIGHTS)
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        unlock_output(out)


def _peft_module_of(key: str) -> str:
    """HF module path of a PEFT tensor key (``base_model.model.M[.base_layer...].lora_A.weight`` -> ``M``)."""
    from ferrule.lora.peft_base import PEFT_PREFIX

    path = key.removeprefix(PEFT_PREFIX).split(".lora_", 1)[0]
    while path.endswith(".base_layer"):
        path = path.removesuffix(".base_layer")
    return path


def _resolve_regex_targets(regex: str, adapted: set[str] | None, params: list[str]) -> tuple[list[str], str]:
    """A regular-expression ``target_modules`` as the list of full HF module paths it selected in PEFT.

    ``adapted``: the module paths that carry saved ``lora_`` factors (None: no tensors were given).
    Every adapted module must be explained, by the expression (``re.fullmatch``, as PEFT matches) or by
    a ``target_parameters`` entry (PEFT's ``ParamWrapper`` modules). Returns ``(paths, problem)``:
    ``problem`` is "" or the reason the expression cannot be resolved.
    """
    from ferrule.lora.appliers import peft_name_matches

    where = f"target_modules={regex!r} is a regular expression (PEFT's re.fullmatch form)"
    if adapted is None:
        return [], (f"{where} and no adapter tensors were given to resolve it: pass the adapter's tensors "
                    f"(ferrule lora import does), or re-save it with target_modules as a list of module names")
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        return [], f"{where} that Python's re module cannot compile ({exc}): fix the adapter_config.json"
    paths = sorted(m for m in adapted if pattern.fullmatch(m))
    unexplained = sorted(m for m in adapted if m not in paths
                         and not any(peft_name_matches(m, p.rpartition(".")[0] or p) for p in params))
    if unexplained:
        return [], (f"{where} but the adapter holds factors of modules it does not match ({unexplained[:4]}"
                    + (" ..." if len(unexplained) > 4 else "") + "): the adapter and its config disagree")
    return paths, ""


def settings_from_peft_config(config: dict, tensors: dict | None = None):
    """:class:`~ferrule.lora.LoraSettings` of an ``adapter_config.json`` dict: ``r``, ``lora_alpha``,
    ``lora_dropout``, ``use_rslora``, ``target_modules`` (HF module names) and ``target_parameters``
    (HF parameter paths), which keep PEFT's meaning in ferrule (docs/lora.md "Target names").

    With the adapter's ``tensors``, entries that matched nothing in PEFT (no saved factor under a
    module they name: PEFT adapts what matches and keeps the list as given, e.g. ``gate_proj`` on a
    model whose MLPs are all experts) are dropped, since they adapt nothing there either.

    A regular-expression ``target_modules`` (a string: PEFT selects module ``name`` when
    ``re.fullmatch(target_modules, name)``, ``peft.tuners.tuners_utils.check_target_module_exists``)
    is resolved with the adapter's ``tensors``: it becomes the sorted list of the full HF module paths
    that carry saved factors and that the expression matches, which PEFT's list rule selects exactly
    (so an expression that picks some layers only keeps that subset).

    Raises:
        AdapterFormatError: not a LoRA adapter; a regular-expression ``target_modules`` without
            ``tensors`` to resolve it, one that is not a valid expression, or one that leaves saved
            factors unexplained; a ``target_parameters`` string (PEFT takes a list there); or an
            option ferrule does not train (each named with its value: ``lora_bias``,
            ``exclude_modules``, ``use_dora``, ``rank_pattern``, ``modules_to_save``, ``bias``, ...).
    """
    from ferrule.lora.appliers import peft_name_matches
    from ferrule.lora.peft_base import AdapterFormatError
    from ferrule.lora.peft_format import unsupported_peft_options
    from ferrule.lora.settings import LoraSettings

    bad = unsupported_peft_options(config)
    modules, params = config.get("target_modules"), config.get("target_parameters")
    if isinstance(params, str):
        bad.append(f"target_parameters={params!r} is a string; PEFT takes a list of parameter names there: re-save "
                   f"the adapter with target_parameters as a list")
    adapted = None if tensors is None else {_peft_module_of(k) for k in tensors if ".lora_" in k}
    if isinstance(modules, str):
        modules, problem = _resolve_regex_targets(modules, adapted, list(params or []) if not isinstance(params, str)
                                                  else [])
        bad += [problem] if problem else []
    modules = list(modules or [])
    params = [] if isinstance(params, str) else list(params or [])
    if adapted is not None:
        modules = [t for t in modules if any(peft_name_matches(m, t) for m in adapted)]
        params = [t for t in params if "." not in t or any(peft_name_matches(m, t.rpartition(".")[0]) for m in adapted)]
    if not modules and not params and not bad:
        bad.append(f"target_modules={config.get('target_modules')!r}, target_parameters="
                   f"{config.get('target_parameters')!r} (nothing to adapt)")
    if bad:
        raise AdapterFormatError("this PEFT adapter uses options ferrule's LoRA does not train: " + "; ".join(bad))
    return LoraSettings(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                        dropout=float(config.get("lora_dropout") or 0.0), target_modules=tuple(sorted(modules)),
                        target_parameters=tuple(params), use_rslora=bool(config.get("use_rslora", False)))


def import_adapter(adapter: str | Path, base: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Build a LoRA engine on ``base`` (HF folder or torch_dist checkpoint), load the PEFT
    ``adapter`` into it and save it as a train checkpoint at ``out``; returns ``out``.

    Raises:
        FileNotFoundError: a missing folder / file; FileExistsError: ``out`` exists.
        AdapterFormatError: the adapter does not fit the base model (every offender listed).
    """
    from ferrule.megatron.engine import TrainEngine

    from ferrule.lora.peft_format import load_hf_adapter, read_peft_dir

    adapter, base, out = Path(adapter), Path(base), Path(out)
    _check_out(out, overwrite)
    tensors, config = read_peft_dir(adapter)
    settings = settings_from_peft_config(config, tensors)
    if (base / "hf" / "config.json").is_file():
        engine = TrainEngine.from_torch_dist(base, load_optimizer=False, lora=settings)
    elif (base / "config.json").is_file():
        engine = TrainEngine.from_hf(base, lora=settings)
    else:
        raise FileNotFoundError(f"{base} is neither an HF folder (config.json) nor a ferrule torch_dist checkpoint "
                                f"(hf/config.json).")
    load_hf_adapter(engine, tensors, config)
    return engine.save(out, overwrite=overwrite)


@app.command("export")
def export_command(
    ckpt: Annotated[Path, typer.Argument(help="A LoRA run folder (its latest checkpoint), one of its "
                                              "checkpoints/step_NNNNNN folders, or a TrainEngine.save folder.",
                                         show_default=False)],
    out: Annotated[Path, typer.Argument(help="Output PEFT folder.", show_default=False)],
    base_model: Annotated[str | None, typer.Option("--base-model", help="base_model_name_or_path to record; default: "
                                                   "the folder the engine was built from.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    step: Annotated[int | None, typer.Option("--step", help="With a run folder: this step's checkpoint "
                                                            "(default: the latest).")] = None,
) -> None:
    """Write a LoRA checkpoint's adapter as HF PEFT (adapter_model.safetensors + adapter_config.json)."""
    from ferrule.user_errors import exit_on_user_errors

    from ferrule.fs.util import sigterm_as_exit

    with exit_on_user_errors(), sigterm_as_exit():  # SIGTERM: the temporary folder and the lock are removed
        path = export_adapter(ckpt, out, base_model=base_model, overwrite=overwrite, step=step,
                              notice=lambda m: typer.echo(m, err=True))
    typer.echo(f"exported the adapter of {ckpt} to {path}")


@app.command("import")
def import_command(
    adapter: Annotated[Path, typer.Argument(help="PEFT adapter folder.", show_default=False)],
    base: Annotated[Path, typer.Argument(help="Base model: HF folder or ferrule torch_dist checkpoint.",
                                         show_default=False)],
    out: Annotated[Path, typer.Argument(help="Output LoRA train checkpoint.", show_default=False)],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Load a PEFT adapter onto its base model and save a LoRA train checkpoint (resumable with lora=)."""
    from ferrule.user_errors import exit_on_user_errors

    with exit_on_user_errors():
        path = import_adapter(adapter, base, out, overwrite=overwrite)
    typer.echo(f"imported {adapter} onto {base}: {path}")
