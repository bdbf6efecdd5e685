"""Checkpoint part of the record stage: ``CKPT_DIR/step_NNNNNN/`` = ``engine/``
(:meth:`~ferrule.megatron.engine.TrainEngine.save`) + ``loop_state.json`` (written last and
atomically; :mod:`ferrule.fs.run_layout`), pruning to ``checkpoint.keep``; and the resume point.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ferrule.fs.integrity import CheckpointIntegrityError, text_digest
from ferrule.fs.run_layout import LOOP_STATE_FILE, RunCheckpointError, list_checkpoints
from ferrule.rl.checkpoints import atomic_write, config_differences
from ferrule.rl.config_types import ConfigError
from ferrule.rl.model_identity import MODEL_FILES_KEY, model_changes
from ferrule.lora.checkpoint import LoraLayoutError


if TYPE_CHECKING:
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rl.config_schema import RLConfig
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.tasks import PromptSampler

__all__ = ["save_checkpoint", "resume_point", "check_model_identity", "read_loop_state", "CHECKSUM_KEY"]

#: Key of ``loop_state.json`` holding the XXH3-64 of the rest (sorted-key JSON; ferrule.fs.integrity).
CHECKSUM_KEY = "checksum"


def save_checkpoint(engine: TrainEngine, roles: RankRoles, ckpt_dir: Path, step: int, *, sampler: PromptSampler,
                    cfg: RLConfig,
                    model_files: dict | None = None) -> Path:
    """Write ``ckpt_dir/step_NNNNNN`` (engine + loop state) and prune to ``cfg.checkpoint.keep``.

    Collective: every rank writes its engine shards; the driver alone writes the loop state
    (``{"step", "sampler", "engine_step", "config", "world_size", "model_files"}``; ``model_files``:
    :func:`ferrule.rl.model_identity.model_files` of ``model.hf_dir`` at the run's start) and prunes.
    Returns the folder.
    """
    path = Path(ckpt_dir) / f"step_{step:06d}"
    if roles.is_driver:
        path.mkdir(parents=True, exist_ok=True)
        (path / LOOP_STATE_FILE).unlink(missing_ok=True)  # incomplete until rewritten below
    if roles.distributed:
        import torch.distributed as dist

        dist.barrier()
    engine.save(path / "engine")  # collective: every rank writes its shards
    if not roles.is_driver:
        return path
    state = {"step": step, "sampler": sampler.state_dict(), "engine_step": engine.step,
             "config": cfg.to_dict(), "world_size": roles.world_size}
    if model_files is not None:
        state[MODEL_FILES_KEY] = model_files
    state[CHECKSUM_KEY] = text_digest(_canonical(state))  # read_loop_state verifies it
    atomic_write(path / LOOP_STATE_FILE, json.dumps(state, indent=2) + "\n")
    keep = cfg.checkpoint.keep
    if keep:
        for _, old in list_checkpoints(ckpt_dir)[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def resume_point(engine: TrainEngine, sampler: PromptSampler, cfg: RLConfig, ckpt_dir: Path, log: Callable[[str], None],
                 model_files: dict | None = None) -> int:
    """Load the latest complete checkpoint of ``ckpt_dir`` into ``engine`` and ``sampler``; return
    its step (0 when there is none: a run that died before its first checkpoint restarts, and the
    log says so).

    ``model_files``: :func:`ferrule.rl.model_identity.model_files` of ``model.hf_dir`` now, compared with
    the checkpoint's record (:func:`check_model_identity`); None skips the comparison.

    Raises:
        RunCheckpointError: a file of the latest checkpoint is missing, truncated or damaged
            (:mod:`ferrule.fs.integrity`): the message names it and the previous complete checkpoint.
        ConfigError: the checkpoint's config differs in a key that must not change
            (:data:`~ferrule.rl.checkpoints.RESUME_MUTABLE`), the data changed, the model folder's
            weights or tokenizer changed (:func:`check_model_identity`), a LoRA run resumes
            at another layout, or the engine state does not fit (e.g. MoE Adam state across ep).
    """
    found = list_checkpoints(ckpt_dir)
    if not found:  # it died before its first checkpoint: the same run again from the start
        from ferrule.rl.metrics import METRICS_FILE, read_metrics

        logged = read_metrics(Path(cfg.logging.run_dir) / METRICS_FILE)
        log(f"checkpoint.resume: no complete checkpoint in {ckpt_dir} yet; restarting the run at step 0"
            + (f" (its {len(logged)} logged steps are replaced)" if logged else ""))
        return 0
    step, path = found[-1]
    try:
        state = read_loop_state(path)
    except CheckpointIntegrityError as exc:
        raise _offer_previous(exc, path, found) from None
    diffs = config_differences(state.get("config", {}), cfg.to_dict())
    diffs = check_model_identity(state, cfg, model_files, diffs, path, log)
    if diffs:
        raise ConfigError(diffs + ["resume must keep the data, model, rollout and algorithm settings of the "
                                   "checkpointed run (only train.steps, train.colocate, checkpoint.*, eval.*, "
                                   "logging.* and parallel.* may change); or start a new logging.run_dir"],
                          origin=str(path))
    try:  # before the engine loads: a data set that changed size or order cannot resume
        sampler.load_state_dict(state["sampler"])
    except ValueError as exc:
        raise ConfigError([f"{exc} (the training data changed since the checkpoint: restore it, or start a "
                           "new logging.run_dir)"], origin=str(path)) from None
    engine_state = _load_engine(engine, path, state)
    log(f"resumed from {path} (step {step}, optimizer step {engine.step})")
    changed = engine_state.get("settings_changed") or {}
    if changed:  # e.g. train.steps grew: the decay horizon is re-planned, never silently kept
        log("optimizer settings differ from the checkpoint; this config's are used from step "
            f"{engine.step} on: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    return int(step)


def check_model_identity(state: dict, cfg: RLConfig, model_files: dict | None, diffs: list[str], path: Path,
                         log: Callable[[str], None]) -> list[str]:
    """Compare the checkpoint's record of the model folder (:data:`MODEL_FILES_KEY`) with ``model_files``
    (the folder now); returns ``diffs`` (the config differences), less a ``model.hf_dir`` that only moved.

    A folder given at another path (``model.hf_dir=NEW``) whose files are the recorded ones is the same
    model: the difference is dropped and the log says so. With ``checkpoint.allow_model_change`` a
    changed folder is used as it is (logged, each file named). A checkpoint without the record (written
    before it existed) is not compared.

    Raises:
        ConfigError: a file changed, is missing or is new: one line naming each and the two ways on.
    """
    recorded = state.get(MODEL_FILES_KEY)
    if recorded is None or model_files is None:
        return diffs
    changes = model_changes(recorded, model_files)
    old_dir = state.get("config", {}).get("model", {}).get("hf_dir")
    moved = [d for d in diffs if d.startswith("model.hf_dir:")]
    if changes and cfg.checkpoint.allow_model_change:
        log(f"checkpoint.allow_model_change: resuming on a changed model folder {cfg.model.hf_dir}: "
            + "; ".join(changes))
        return [d for d in diffs if d not in moved]
    if changes:
        where = cfg.model.hf_dir + (f" (the run started from {old_dir})" if moved else "")
        raise ConfigError([f"model.hf_dir: the model folder {where} is not the one the checkpoint was trained from: "
                           + "; ".join(changes) + ". Restore the original files (or give the folder they moved to: "
                           "model.hf_dir=PATH), or resume on the changed model on purpose with --allow-model-change "
                           "(checkpoint.allow_model_change=true)"], origin=str(path))
    if moved:
        log(f"model.hf_dir: the model folder moved from {old_dir} to {cfg.model.hf_dir} (same files); resuming")
    return [d for d in diffs if d not in moved]


def _load_engine(engine: TrainEngine, path: Path, state: dict) -> dict:
    from ferrule.megatron.checkpoint import CheckpointMismatchError

    try:
        return engine.load(path / "engine")
    except LoraLayoutError as exc:  # the adapter's Adam state is per rank: only the DP size may change
        raise ConfigError([f"parallel: {exc} For ferrule train: resume this LoRA run with the checkpoint's "
                           f"parallel.* and {state.get('world_size')} ranks, or start a new run"],
                          origin=str(path)) from None
    except CheckpointMismatchError as exc:  # e.g. MoE Adam state across ep=1 / ep>1
        raise ConfigError([f"checkpoint.resume: {exc}"], origin=str(path)) from None
    except CheckpointIntegrityError as exc:  # a damaged file (ferrule.fs.integrity): name it, offer the one before
        raise _offer_previous(exc, path, list_checkpoints(path.parent)) from None


def _canonical(state: dict) -> str:
    return json.dumps({k: v for k, v in state.items() if k != CHECKSUM_KEY}, sort_keys=True)


def read_loop_state(path: Path) -> dict:
    """``STEP_DIR/loop_state.json``, checked against the checksum the save wrote into it.

    Raises:
        CheckpointIntegrityError: the file is not JSON, not an object, or its checksum differs
            (one line naming the file). A file without a checksum (older runs) is read as is.
    """
    file = Path(path) / LOOP_STATE_FILE
    try:
        state = json.loads(file.read_text())
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointIntegrityError(f"checkpoint file {file} is damaged ({type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())[:100]})", file) from None
    if CHECKSUM_KEY in state and state[CHECKSUM_KEY] != text_digest(_canonical(state)):
        raise CheckpointIntegrityError(f"checkpoint file {file} is damaged: its content differs from what the "
                                       f"save wrote (its {CHECKSUM_KEY} does not match)", file)
    return state


def _offer_previous(exc: Exception, path: Path, found: list[tuple[int, Path]]) -> RunCheckpointError:
    """The resume error for a damaged checkpoint: the damaged file, then the previous complete checkpoint."""
    earlier = [(s, p) for s, p in found if p != path]
    if earlier:
        step, prev = earlier[-1]
        hint = (f"the previous complete checkpoint is step {step} ({prev}): move the damaged one aside "
                f"(mv {path} {path.parent / ('.damaged-' + path.name)}) and run --resume again to continue from it")
    else:
        hint = "there is no earlier complete checkpoint: start again without --resume in a new logging.run_dir"
    return RunCheckpointError(f"checkpoint.resume: {exc}; {hint}")
