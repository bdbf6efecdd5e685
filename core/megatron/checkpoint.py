"""Atomic torch_dist save / load of the train engine's full training state.

Layout of a checkpoint directory (a superset of :mod:`ferrule.converters.checkpoint`'s, so
``torch_dist_to_hf`` and ``TrainEngine.from_torch_dist`` read it too)::

    DIR/
      metadata.json, .metadata, common.pt, __R_W.distcp   megatron dist_checkpointing (torch_dist)
      ferrule_checkpoint.json                              family, dtype, saved layout
      engine_state.json                                    step counters, Adam step, settings
      rng/rank_<R>.pt                                      each rank's RNG states
      lora/rank_<R>.pt                                     LoRA runs: each rank's adapter shards + optimizer
      lora/adapter_model.safetensors, adapter_config.json  LoRA runs: the full adapter in HF PEFT format
      hf/config.json                                       the HF config the model was built from
      hf/generation_config.json, hf/tokenizer*, ...        the source HF folder's side files (hf_side_files)
      checksums.json                                       size and XXH3-64 of every file above (ferrule.fs.integrity),
                                                           written last, verified before a load reads anything

The sharded state dict is ``{"model": GPTModel.sharded_state_dict(), "optimizer":
MegatronOptimizer.sharded_state_dict(...), "scheduler": OptimizerParamScheduler.state_dict()}``
(``model0``, ``model1``, ... per virtual pipeline stage). Model tensors are global with offsets
(load at any TP/PP/DP); the non-distributed optimizer's moments are keyed like the model
tensors; the distributed optimizer uses megatron's ``dp_reshardable`` format (loads at another
DP size, same TP/PP).

Adam step fix (megatron_cpu_lab.md row 5b): on the torch-Adam path megatron saves the shared
``step`` but a load template built from fresh state has none, so the loaded optimizer keeps a
wrong step and the bias correction drifts. The Adam step is stored in ``engine_state.json`` and
written back into every parameter's ``state["step"]`` after the load, which makes resume
bit-exact.

Writes go to a sibling temporary directory that rank 0 renames into place after every rank
finished (``os.replace``); an existing checkpoint is replaced only then, so a crash never
leaves a half-written checkpoint under the final name.

No ``if __name__ == "__main__":`` guard is needed in the caller (:func:`save_sharded`), and no
process outlives a killed save. megatron's torch_dist writer collects its per-rank write results
through a queue that it creates once per process with
``multiprocessing.get_context("spawn").Manager()``
(``dist_checkpointing/strategies/filesystem_async.py``, ``_get_write_results_queue``); starting
a spawn Manager re-imports the caller's ``__main__`` script, which fails in a plain script with
multiprocessing's "bootstrapping phase" ``RuntimeError``. It then writes each bucket of a rank's
tensors (``thread_count``, 2 by default) in a *forked* process
(``FileSystemWriterAsync.write_preloaded_data_multiproc``); when the trainer is killed during a
save, those children (each holding a copy of the parent's memory) wait forever on a queue whose
reader died, reparented to PID 1. Our saves are synchronous, so :func:`save_sharded` runs the
same per-bucket writer (``write_preloaded_data``, unchanged) in threads of this process and
collects the results in an in-process ``queue.Queue``: a killed process takes its writers with it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ferrule.fs.util import (DiskFullError, check_free_space, commit_dir, disk_full_message, is_disk_full,
                            temp_dir_name)
from ferrule.fs.integrity import record_checksums, verify_checksums

from .ckpt_writer import in_process_writer
from .optim import adam_step_count, init_adam_state, inner_optimizers, set_adam_step
from ferrule.formats.safetensors_io import CheckpointError
from ferrule.megatron.param_gather import unwrap

__all__ = ["ENGINE_STATE_FILE", "DISTOPT_SHARDING", "HF_WEIGHT_PATTERNS", "HF_SIDE_DIRS", "hf_side_files", "copy_hf_side_files", "save_training_state", "load_training_state", "frozen_fingerprint",
           "model_sharded_state_dict", "rng_state", "set_rng_state", "save_sharded", "load_sharded",
           "CheckpointMismatchError", "check_sharded_coverage"]

ENGINE_STATE_FILE = "engine_state.json"
#: megatron DistributedOptimizer checkpoint format (``fully_sharded_model_space``, megatron's
#: default, fails in 0.16.1 with ``ShardedTensor.flattened_range is not supported``).
DISTOPT_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
#: Name patterns (``fnmatch``) of an HF checkpoint folder's weight files: everything else at the
#: top of the folder is a side file (:func:`hf_side_files`).
HF_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                      "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite", "*.npz")
#: Sub-folders of an HF checkpoint that transformers reads (``additional_chat_templates/*.jinja``,
#: ``transformers.utils.hub``'s ``CHAT_TEMPLATE_DIR``); other sub-folders are not carried.
HF_SIDE_DIRS = ("additional_chat_templates",)


def hf_side_files(src: str | os.PathLike) -> list[str]:
    """Names (relative to ``src``, sorted) of an HF checkpoint folder's side files: every regular,
    non-hidden file at its top that no :data:`HF_WEIGHT_PATTERNS` pattern matches (``config.json``,
    ``generation_config.json``, tokenizer files, ``chat_template.jinja``, ``processor_config.json``,
    ``preprocessor_config.json`` (image processors and feature extractors), remote-code ``*.py``,
    README ...), plus the files of :data:`HF_SIDE_DIRS`. ``[]`` when ``src`` is not a folder."""
    import fnmatch

    src = Path(src)
    if not src.is_dir():
        return []
    out = [p.name for p in src.iterdir() if p.is_file() and not p.name.startswith(".")
           and not any(fnmatch.fnmatch(p.name, pat) for pat in HF_WEIGHT_PATTERNS)]
    for d in HF_SIDE_DIRS:
        if (src / d).is_dir():
            out += [f"{d}/{p.name}" for p in (src / d).iterdir() if p.is_file() and not p.name.startswith(".")]
    return sorted(out)


def copy_hf_side_files(src: str | os.PathLike, dst: str | os.PathLike, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy :func:`hf_side_files` of ``src`` (but ``skip``) into ``dst`` (created); return the names copied."""
    src, dst = Path(src), Path(dst)
    names = [n for n in hf_side_files(src) if n not in skip]
    for name in names:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, dst / name)
    return names


def _unwrap(module: Any) -> Any:
    return unwrap(module)


def model_sharded_state_dict(model_chunks: list) -> dict:
    """``{"model": ...}`` (or ``model0``, ``model1``, ... with virtual pipeline stages)."""
    if len(model_chunks) == 1:
        return {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def check_sharded_coverage(model_chunks: list, sharded_state_dict: dict) -> None:
    """Raise unless every parameter of ``model_chunks`` is carried by ``sharded_state_dict`` (what a torch_dist
    save writes): a parameter that no ``ShardedTensor`` / ``ShardedTensorFactory`` holds (compared by storage, so
    views and factories count) would be dropped from the checkpoint silently, and only a later load would fail,
    naming the tensor but not the cause.

    Raises:
        ferrule.formats.safetensors_io.CheckpointError: the parameters missing (named, with the fix: the module that owns
            them must return them from its ``sharded_state_dict()``).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    held = set()
    for value in nested_values(sharded_state_dict):
        data = getattr(value, "data", None) if isinstance(value, (ShardedTensor, ShardedTensorFactory)) else None
        if data is not None and hasattr(data, "untyped_storage"):
            held.add(data.untyped_storage().data_ptr())
    missing = []
    for i, chunk in enumerate(model_chunks):
        prefix = f"model{i}." if len(model_chunks) > 1 else ""
        for name, param in _unwrap(chunk).named_parameters():
            if param.numel() and param.untyped_storage().data_ptr() not in held:
                missing.append(prefix + name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise CheckpointError(
            f"the provider's model has parameter(s) that its sharded_state_dict() does not return, so a torch_dist "
            f"checkpoint would not carry them: {shown}. The module that owns each one must return it from "
            f"sharded_state_dict(): inherit megatron's MegatronModule default (which shards every parameter of "
            f"state_dict()), or, in an override, add it with make_sharded_tensors_for_checkpoint / a ShardedTensor "
            f"(docs/plugins.md, 'sharded_state_dict').")


def rng_state() -> dict:
    """This rank's RNG states (python, numpy, torch CPU generator, megatron's RNG tracker)."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    # The default CUDA generator is not saved (only device.py may call torch.cuda.*); megatron's
    # tracker holds the model-parallel CUDA RNG states, and ferrule's families train with dropout 0.
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s output."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if state.get("tracker"):
        try:
            tracker.set_states(state["tracker"])
        except Exception:  # the CPU inference tracker keeps no states
            pass


def save_sharded(sharded_state_dict: dict, directory: str | os.PathLike, **kwargs: Any) -> None:
    """``megatron.core.dist_checkpointing.save`` (synchronous torch_dist) that works from a plain
    script without an ``if __name__ == "__main__":`` guard and from a notebook cell, and writes in
    threads of this process (no forked writer outlives a killed save; module docstring).

    ``kwargs`` go to ``dist_checkpointing.save`` unchanged (e.g. ``validate_access_integrity``).
    Collective: every rank calls it.
    """
    from megatron.core import dist_checkpointing

    with in_process_writer():
        dist_checkpointing.save(sharded_state_dict, str(directory), **kwargs)


class CheckpointMismatchError(ValueError):
    """A torch_dist checkpoint's tensors do not fit the model they are loaded into (shape, key)."""


def _first_failure(exc: BaseException) -> BaseException:
    """The per-rank cause inside torch's ``CheckpointException`` (``failures: {rank: (exc, tb)}``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def load_sharded(sharded_state_dict: dict, directory: str | os.PathLike, *, verify: bool = True,
                 **kwargs: Any) -> dict:
    """``megatron.core.dist_checkpointing.load`` with checkpoint-content errors as one ``Exception``.

    torch's ``CheckpointException`` (raised for a shape mismatch or a missing key, wrapping
    megatron's ``CheckpointingException`` per rank) derives from ``BaseException``, so
    ``except Exception`` handlers miss it and its text is a traceback per rank. With ``verify``
    the files are first checked against the folder's ``checksums.json`` (:func:`verify_checkpoint_files`).

    Raises:
        ferrule.fs.integrity.CheckpointIntegrityError: a file is missing, truncated or damaged (named).
        CheckpointMismatchError: the checkpoint does not fit the template; the message names
            ``directory`` and the first rank's cause, e.g. ``Global shape mismatch for loaded
            (torch.Size([2, 96, 32])) and expected ((2, 128, 32)) tensor for key
            decoder.layers.mlp.linear_fc1.weight``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    if verify:
        verify_checkpoint_files(directory)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(directory), **kwargs)
    except (CheckpointException, CheckpointingException) as exc:
        cause = _first_failure(exc)
        detail = " ".join(str(cause).split())
        raise CheckpointMismatchError(
            f"checkpoint {directory} cannot be loaded into this model: {detail} (a checkpoint loads only into "
            "the model config it was written for)") from exc


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _all_gather(obj: Any) -> list:
    import torch.distributed as dist

    out: list = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def verify_checkpoint_files(directory: str | os.PathLike) -> bool:
    """:func:`ferrule.fs.integrity.verify_checksums` of a torch_dist folder, shared by this job's ranks
    (collective when ``torch.distributed`` is initialized). Returns False for a folder without checksums.

    Raises:
        ferrule.fs.integrity.CheckpointIntegrityError: names the first missing or damaged file.
    """
    return verify_checksums(directory, rank=_rank(), world=_world(), gather=_all_gather)


def _broadcast_str(value: str | None) -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        return value  # type: ignore[return-value]
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def save_training_state(path: str | os.PathLike, *, model_chunks: list, optimizer, scheduler,
                        engine_state: dict, checkpoint_meta: dict, hf_config: dict,
                        overwrite: bool = True, hf_files_dir: str | os.PathLike | None = None,
                        lora_state: dict | None = None, lora_files: dict[str, Any] | None = None,
                        omit_frozen: bool = False) -> Path:
    """Write model + optimizer + scheduler + RNG + counters to ``path`` atomically (all ranks call).

    ``omit_frozen`` (LoRA only): the frozen base's tensors are not written; ``engine_state``
    records ``frozen_base = {"omitted": True, "fingerprint": ..., "tensors": N}``
    (:func:`frozen_fingerprint` of them), and :func:`load_training_state` loads such a checkpoint
    only into an engine whose frozen tensors have that fingerprint (the same base). The checkpoint
    is then the adapter, its optimizer state, the scheduler and RNG: what changed.

    LoRA (``lora_state`` given): the torch_dist part holds the frozen base model and the
    scheduler only; every global rank writes its ``lora_state`` (adapter shards and the
    optimizer's plain ``state_dict``, which holds adapter parameters only) to
    ``lora/rank_<R>.pt``, one shard per global rank (ranks of one TP/PP position hold different
    experts under EP), and rank 0 writes ``lora_files`` (``{file name: bytes}``) under ``lora/``.

    ``hf/config.json`` is ``hf_config``; every other side file of ``hf_files_dir``
    (:func:`hf_side_files`: generation config, tokenizer, chat template, processor and
    preprocessor configs, ...; not its weights) is copied next to it.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False (raised on every rank).
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {path} exists; pass overwrite=True or choose another path.")
    tmp = Path(_broadcast_str(str(path.parent / temp_dir_name(path.name)) if _rank() == 0 else None))
    needed = None
    try:
        if _rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # left empty: megatron warns "overwriting corrupted checkpoint" on a non-empty dir
        _barrier()
        init_adam_state(optimizer)  # before the first step: give the template a (zero) step
        state = model_sharded_state_dict(model_chunks)
        if omit_frozen:
            if lora_state is None:
                raise ValueError("omit_frozen: only a LoRA engine's frozen base can be left out of its checkpoint.")
            engine_state = dict(engine_state, frozen_base={"omitted": True, **frozen_fingerprint(model_chunks)})
            state = _without_frozen(state, model_chunks)
        model_sd = state["model"] if len(model_chunks) == 1 else {}
        for i in range(len(model_chunks) if len(model_chunks) > 1 else 0):
            model_sd.update(state[f"model{i}"])
        if lora_state is None:
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=DISTOPT_SHARDING)
        state["scheduler"] = scheduler.state_dict()
        engine_state = dict(engine_state, adam_step=adam_step_count(optimizer))
        needed = _check_space(tmp, state, lora_state, path)  # before writing: refuse a save that cannot fit
        save_sharded(state, tmp, validate_access_integrity=True)
        if _rank() == 0:
            (tmp / "rng").mkdir(exist_ok=True)
            if lora_state is not None:
                (tmp / "lora").mkdir(exist_ok=True)
                for name, data in (lora_files or {}).items():
                    (tmp / "lora" / name).write_bytes(data)
        _barrier()
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
        if lora_state is not None:
            torch.save(lora_state, tmp / "lora" / f"rank_{_rank()}.pt")
        if _rank() == 0:
            (tmp / "hf").mkdir(exist_ok=True)
            if hf_files_dir is not None:
                copy_hf_side_files(hf_files_dir, tmp / "hf", skip=("config.json",))
            (tmp / "hf" / "config.json").write_text(json.dumps(hf_config, indent=2, default=str) + "\n")
            (tmp / "ferrule_checkpoint.json").write_text(json.dumps(checkpoint_meta, indent=2) + "\n")
            (tmp / ENGINE_STATE_FILE).write_text(json.dumps(engine_state, indent=2) + "\n")
        _barrier()
        record_checksums(tmp, rank=_rank(), world=_world(), gather=_all_gather)  # verified on load
        _barrier()
        if _rank() == 0:
            commit_dir(tmp, path)
        _barrier()
    except BaseException as exc:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, DiskFullError) and is_disk_full(exc):  # ENOSPC inside megatron / torch.save
            raise DiskFullError(disk_full_message(path, needed, write_failed=True) + " (a write of the save failed: "
                                "No space left "
                                "on device)") from exc
        raise
    return path


def _frozen_names(chunk: Any) -> set[str]:
    return {n for n, p in _unwrap(chunk).named_parameters() if not p.requires_grad}


def _without_frozen(state: dict, model_chunks: list) -> dict:
    """``state`` (:func:`model_sharded_state_dict` keys) without the frozen parameters' entries."""
    out = dict(state)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        frozen = _frozen_names(chunk)
        out[key] = {k: v for k, v in state[key].items() if k not in frozen}
    return out


def frozen_fingerprint(model_chunks: list) -> dict:
    """``{"fingerprint": XXH3-64 hex, "tensors": N}`` of this rank's frozen parameters (names,
    shapes, dtypes and bytes, in name order): the identity of the base a LoRA checkpoint that
    omits it refers to (:func:`save_training_state` ``omit_frozen``)."""
    import xxhash

    h = xxhash.xxh3_64()
    n = 0
    for i, chunk in enumerate(model_chunks):
        for name, p in sorted(_unwrap(chunk).named_parameters()):
            if p.requires_grad:
                continue
            t = p.detach().contiguous().cpu()
            h.update(f"{i}:{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            n += 1
    return {"fingerprint": h.hexdigest(), "tensors": n}


def _state_bytes(tree: Any) -> int:
    """Bytes of the tensors this rank writes for ``tree`` (nested dicts / lists of tensors and
    megatron ``ShardedTensor``s; a ShardedTensor that is not its main replica is written by another rank)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    if isinstance(tree, dict):
        return sum(_state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_state_bytes(v) for v in tree)
    if isinstance(tree, ShardedBase):  # ShardedTensor, ShardedTensorFactory, ShardedObject
        return _state_bytes(tree.data) if is_main_replica(tree.replica_id) else 0
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return 0


def _check_space(tmp: Path, state: dict, lora_state: dict | None, path: Path) -> int:
    """The save's size (all ranks' tensors; collective), refused with :class:`DiskFullError` (naming
    ``path``) on every rank when ``tmp``'s filesystem has less free space (:func:`ferrule.fs.util.check_free_space`)."""
    local = _state_bytes(state) + _state_bytes(lora_state or {})
    needed = sum(_all_gather(local)) if _world() > 1 else local
    problem = None
    if _rank() == 0:
        try:
            check_free_space(tmp, needed, name=path)
        except DiskFullError as exc:
            problem = str(exc)
    problem = _broadcast_str(problem) if _world() > 1 else problem
    if problem:
        raise DiskFullError(problem)
    return needed


def _param_groups(optimizer) -> list[dict]:
    return [g for o in inner_optimizers(optimizer) if getattr(o, "optimizer", None) is not None
            for g in o.optimizer.param_groups]


def _check_expert_optimizer_layout(model_chunks: list, engine_state: dict, path: Path) -> None:
    """Refuse optimizer state written on the other side of the ep=1 / ep>1 line (MoE models only).

    megatron-core's ``get_megatron_optimizer`` puts routed-expert parameters in a second optimizer
    (a ``ChainedOptimizer``, tensor keys prefixed ``chained_1.``) only when they are expert-parallel
    (``expert_model_parallel_size > 1``, ``allreduce=False`` on the expert weights); at ep=1 one
    optimizer holds every parameter under unprefixed keys. The two layouts' Adam state therefore
    has other keys and param groups and does not reshard between them (ep 2 <-> 4 keeps the form).
    """
    from megatron.core import parallel_state as ps

    if not getattr(_unwrap(model_chunks[0]).config, "num_moe_experts", None):
        return
    saved = (engine_state.get("layout") or {}).get("ep")
    now = ps.get_expert_model_parallel_world_size()
    if isinstance(saved, int) and (saved > 1) != (now > 1):
        raise CheckpointMismatchError(
            f"{path}: its optimizer state was written at expert-parallel size ep={saved}, this engine runs ep={now}; "
            "megatron-core keeps the Adam state of routed experts in a separate chained optimizer only when ep > 1, "
            "so that state does not reshard between ep=1 and ep>1. Resume with "
            f"{'ep > 1' if saved > 1 else 'ep=1'} (the weights load at any ep: load_optimizer=False).")


def load_training_state(path: str | os.PathLike, *, model_chunks: list, optimizer, scheduler,
                        load_optimizer: bool = True, lora_load: Any = None) -> dict:
    """Load a :func:`save_training_state` checkpoint (or a converter checkpoint, weights only).

    Model tensors load at any layout. With ``load_optimizer`` the optimizer state (Adam
    moments), the scheduler's step count, Adam's step and (when the world size matches) RNG
    states are restored too. Settings are not: the lr schedule (lr, min_lr, warmup, decay
    steps and style), weight decay, betas and eps stay those ``optimizer`` / ``scheduler`` were
    built with, applied at the restored step (a resume may re-plan the schedule, e.g. decay
    over more steps). Returns the saved ``engine_state`` (empty for a weights-only checkpoint).

    LoRA: ``lora_load(path, load_optimizer) -> optimizer state dict or None`` loads the adapter
    (after the base model) and returns this rank's saved plain optimizer state, which is then
    restored like the sharded one. Without ``lora_load`` a LoRA checkpoint loads weights only.

    Raises:
        FileNotFoundError: ``path`` is not a torch_dist checkpoint.
        ferrule.fs.integrity.CheckpointIntegrityError: a file is missing, truncated or damaged
            (checked against ``checksums.json`` before anything is read; the message names it).
        ValueError: ``load_optimizer`` on a checkpoint without optimizer state.
        CheckpointMismatchError: the checkpoint's tensors do not fit this model, or a MoE
            model's optimizer state crosses the ep=1 / ep>1 line (:func:`_check_expert_optimizer_layout`).
    """
    import torch.distributed as dist

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a torch_dist checkpoint (no metadata.json).")
    verify_checkpoint_files(path)  # before any file is read: a damaged one is named, not loaded
    engine_file = path / ENGINE_STATE_FILE
    engine_state = json.loads(engine_file.read_text()) if engine_file.is_file() else {}
    if load_optimizer and not engine_state:
        raise ValueError(f"{path} holds weights only (no {ENGINE_STATE_FILE}); load it with load_optimizer=False "
                         f"(TrainEngine.from_torch_dist does).")
    is_lora_ckpt = (path / "lora").is_dir()
    if load_optimizer and is_lora_ckpt and lora_load is None:
        raise ValueError(f"{path} is a LoRA checkpoint (its optimizer state covers adapters only): build the engine "
                         f"with lora=LoraSettings(...) to resume it, or load its base weights with load_optimizer=False.")
    if load_optimizer and lora_load is not None and not is_lora_ckpt:
        raise ValueError(f"{path} holds no LoRA adapter (lora/ is missing): load it with load_optimizer=False to "
                         f"start LoRA training from its weights.")
    template = model_sharded_state_dict(model_chunks)
    omitted = (engine_state.get("frozen_base") or {}).get("omitted", False)
    if omitted:   # the base is not in the checkpoint: it must be the one this engine holds
        saved = engine_state["frozen_base"]
        mine = frozen_fingerprint(model_chunks)
        if mine["fingerprint"] != saved.get("fingerprint") or mine["tensors"] != saved.get("tensors"):
            raise CheckpointMismatchError(
                f"{path} stores a LoRA adapter without its frozen base (base fingerprint {saved.get('fingerprint')}, "
                f"{saved.get('tensors')} tensors); this engine's frozen base is {mine['fingerprint']} "
                f"({mine['tensors']} tensors). Load it into an engine built from the base it was trained on.")
        template = _without_frozen(template, model_chunks)
    if load_optimizer and lora_load is None:
        _check_expert_optimizer_layout(model_chunks, engine_state, path)
        init_adam_state(optimizer)
        model_sd: dict = {}
        for key in template:
            model_sd.update(template[key])
        template["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=DISTOPT_SHARDING)
    loaded = load_sharded(template, path, verify=False)  # verified above
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        if omitted:   # the frozen tensors stay the engine's own (checked equal above)
            result = _unwrap(chunk).load_state_dict(loaded[key], strict=False)
            missing = set(result.missing_keys) - _frozen_names(chunk)
            if missing or result.unexpected_keys:
                raise CheckpointMismatchError(f"{path}: tensors that do not fit this model: missing "
                                              f"{sorted(missing)[:5]}, unexpected {list(result.unexpected_keys)[:5]}.")
        else:
            _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    opt_state = loaded.get("optimizer")
    if lora_load is not None and is_lora_ckpt:
        opt_state = lora_load(path, load_optimizer)
    if not load_optimizer:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            sub.reload_model_params()
        return engine_state
    # torch's Optimizer.load_state_dict replaces every param group's hyper-parameters (megatron's
    # max_lr / min_lr, betas, eps, weight_decay) with the saved ones: keep this engine's settings.
    configured = [{k: v for k, v in g.items() if k != "params"} for g in _param_groups(optimizer)]
    with torch.no_grad():
        optimizer.load_state_dict(opt_state)
    for group, hyper in zip(_param_groups(optimizer), configured, strict=True):
        group.update(hyper)
    set_adam_step(optimizer, int(engine_state.get("adam_step", 0)))
    # Only the step count comes from the checkpoint. OptimizerParamScheduler.load_state_dict would
    # also take the saved max_lr / min_lr / warmup / decay steps and style / weight decay over the
    # configured ones (use_checkpoint_opt_param_scheduler), e.g. keep a decay horizon of 4 steps
    # on a resume configured for 6, so it is not used.
    scheduler.num_steps = int(loaded["scheduler"]["num_steps"])
    scheduler.step(0)  # lr and weight decay of every group at the resumed step, configured schedule
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if engine_state.get("world_size") == world and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return engine_state
