"""LoRA adapter checkpoints inside a :meth:`TrainEngine.save` directory (``lora/``).

``lora/rank_<R>.pt`` (one per global rank): ``{"format", "rank", "world_size", "layout",
"settings", "adapter": {global factor name: local shard (CPU)}, "optimizer": plain optimizer
state_dict}``; the optimizer holds adapter parameters only, so the plain (non-sharded) state is
small and restores Adam's moments and step exactly. ``lora/adapter_model.safetensors`` +
``lora/adapter_config.json``: the full adapter in HF PEFT format (what ``ferrule lora export``
copies, and what a load at another layout reads, weights only). ``lora/ranks.json``: every saved
rank's megatron coordinates ``{rank: {"tp", "pp", "dp", "ep"}}``, so a resume at another
data-parallel size (same TP/PP, EP=1, where every DP replica holds the same adapter shards and
Adam state) reads the file of the saved DP-rank-0 replica at its own TP/PP position.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any
from .model import adapter_params
from .peft_format import hf_adapter_state_dict, load_hf_adapter, peft_config, read_peft_dir
from ferrule.megatron.param_gather import all_gather_objects

__all__ = ["lora_save_payload", "lora_load_payload", "LoraLayoutError", "LORA_FORMAT", "PEFT_WEIGHTS", "PEFT_CONFIG",
           "RANKS_FILE"]

LORA_FORMAT = "ferrule-lora-v1"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
RANKS_FILE = "ranks.json"


class LoraLayoutError(ValueError):
    """The adapter's per-rank optimizer state cannot be loaded at this layout / world size."""


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _coords() -> dict[str, int]:
    """This rank's megatron coordinates (TP, PP, DP, EP rank)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank()}


def lora_save_payload(engine: Any) -> tuple[dict, dict[str, bytes]]:
    """``(this rank's lora/rank_<R>.pt payload, {file: bytes} for rank 0)``. Collective (PEFT gather)."""
    from safetensors.torch import save as st_save

    rank, world = _rank_world()
    coords = all_gather_objects(_coords())
    peft = {k: v.detach().cpu().contiguous() for k, v in hf_adapter_state_dict(engine).items()}
    config = peft_config(engine)
    state = {"format": LORA_FORMAT, "rank": rank, "world_size": world, "layout": asdict(engine.layout),
             "settings": asdict(engine.lora),
             "adapter": {k: p.detach().cpu().clone() for k, p in adapter_params(engine.model).items()},
             "optimizer": engine.optimizer.state_dict()}
    files = {PEFT_WEIGHTS: st_save(peft, metadata={"format": "pt"}),
             PEFT_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
             RANKS_FILE: (json.dumps({str(r): c for r, c in enumerate(coords)}) + "\n").encode()} if rank == 0 else {}
    return state, files


def _check_settings(engine: Any, saved: dict, where: Path) -> None:
    """rank / alpha / rsLoRA must match (the adapted modules are compared by the shard keys)."""
    mine = asdict(engine.lora)
    diff = {k: [saved[k], mine[k]] for k in ("rank", "alpha", "use_rslora") if k in saved and saved[k] != mine[k]}
    if diff:
        raise ValueError(f"{where} was saved with other LoRA settings ({{name: [saved, engine]}}: {diff}); build the "
                         f"engine with the saved LoraSettings to load it.")


def _dp_replica_rank(ckpt: Path, saved_state: dict, engine: Any) -> int | None:
    """The saved rank whose file this rank can resume from at another DP size, or None.

    Only the data-parallel size may differ: same TP/PP/EP/CP layout with ``ep == 1`` (then every
    DP replica holds the same adapter shards and Adam state: gradients are all-reduced before
    the step), and ``lora/ranks.json`` present. Returns the saved rank at this rank's TP and PP
    position in DP replica 0.
    """
    layout = asdict(engine.layout)
    index = Path(ckpt) / "lora" / RANKS_FILE
    if saved_state.get("layout") != layout or layout.get("ep", 1) != 1 or not index.is_file():
        return None
    me = _coords()
    found = [int(r) for r, c in json.loads(index.read_text()).items()
             if c["tp"] == me["tp"] and c["pp"] == me["pp"] and c["dp"] == 0]
    return found[0] if len(found) == 1 else None


def lora_load_payload(engine: Any, ckpt: Path, with_optimizer: bool) -> dict | None:
    """Load the adapter of checkpoint ``ckpt`` into ``engine``; return this rank's saved optimizer
    state (``with_optimizer``) or None.

    At the saved layout and world size every rank reads its own shard; at another DP size
    (same TP/PP, EP=1) the shard of DP replica 0 at its TP/PP position (module docstring).
    Elsewhere only the weights can be loaded (from the full PEFT adapter through
    :func:`~ferrule.lora.load_hf_adapter`).

    Raises:
        ValueError: other LoRA settings. LoraLayoutError (a ValueError): optimizer state requested
            at a layout it does not reshard to.
        FileNotFoundError: a rank file is missing.
    """
    import torch

    rank, world = _rank_world()
    f = Path(ckpt) / "lora" / f"rank_{rank}.pt"
    meta_file = Path(ckpt) / "engine_state.json"
    saved_state = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    _check_settings(engine, saved_state.get("lora") or {}, Path(ckpt))
    same_layout = saved_state.get("world_size") == world and saved_state.get("layout") == asdict(engine.layout)
    if not same_layout:
        src = _dp_replica_rank(Path(ckpt), saved_state, engine) if with_optimizer else None
        if src is None:
            if with_optimizer:
                raise LoraLayoutError(f"{ckpt} holds LoRA optimizer state per rank for layout {saved_state.get('layout')} at "
                                 f"world size {saved_state.get('world_size')}; this engine runs {asdict(engine.layout)} "
                                 f"at world size {world}. Only the data-parallel size may change (same tp/pp, ep=1, "
                                 f"a checkpoint with lora/{RANKS_FILE}); resume at the saved layout, or load the adapter "
                                 f"weights only (load_optimizer=False).")
            tensors, config = read_peft_dir(Path(ckpt) / "lora")
            load_hf_adapter(engine, tensors, config)
            return None
        f = Path(ckpt) / "lora" / f"rank_{src}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing; the LoRA checkpoint {ckpt} is incomplete.")
    payload = torch.load(f, weights_only=False, map_location="cpu")
    params = adapter_params(engine.model)
    saved = payload["adapter"]
    problems = sorted(set(params) ^ set(saved))
    problems += [f"{k}: saved {tuple(saved[k].shape)}, engine {tuple(p.shape)}" for k, p in params.items()
                 if k in saved and tuple(saved[k].shape) != tuple(p.shape)]
    if problems:
        raise ValueError(f"{f} does not fit this engine's adapters (other target_modules?): {problems[:8]}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(saved[k])
    return payload["optimizer"] if with_optimizer else None
