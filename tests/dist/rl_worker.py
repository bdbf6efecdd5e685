"""torchrun worker (2 gloo processes) for tests/test_rl_distributed.py.

Usage: torchrun --nproc-per-node 2 tests/dist/rl_worker.py WORK_DIR

WORK_DIR holds ``tiny.yaml`` and ``overrides.json`` (the tiny GRPO example of
tests/test_rl_e2e.py: its model, task and config) and ``model_moe`` (the same task on a tiny
Qwen3-MoE). For each layout (``dp2``: DP=2, ``tp2``: TP=2, ``pp2``: PP=2 with tied embeddings,
``lora_dp2`` / ``lora_tp2``: a LoRA adapter on the frozen base at DP=2 / TP=2, ``ep2``: the
Qwen3-MoE at EP=2, ``lora_ep2``: LoRA on it at EP=2, routed experts included) the worker runs,
in this one launch:

- ``full``: ``STEPS`` steps uninterrupted, a checkpoint every ``CKPT_EVERY`` steps (all kept);
- ``resumed``: a copy of that run folder without its last checkpoint, resumed to ``STEPS``.

Rank 0 writes ``WORK_DIR/results.json``: per layout and run the metrics entries, the sampled
responses and a sha256 of the final weights (HF export, plus the PEFT adapter with LoRA; exact
bytes); for LoRA layouts also ``served``: a sha256 of the adapter each rollout rank's engine
serves after the full run (``[rank, digest]`` pairs; the fan-out must make them equal). The process group stays
up between layouts (:func:`ferrule.megatron.parallel.destroy_distributed` with
``keep_process_group=True``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

STEPS = 3
CKPT_EVERY = 2
#: LoRA settings of the lora_* layouts (and of their one-process referee in the test)
LORA = {"lora.rank": 4, "lora.alpha": 8}
#: the EP layout's model (``{work}``: WORK_DIR); the test builds it
MOE_MODEL = {"model.hf_dir": "{work}/model_moe"}
LAYOUTS = {"dp2": {}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2},
           "lora_dp2": LORA, "lora_tp2": {**LORA, "parallel.tp": 2},
           "ep2": {**MOE_MODEL, "parallel.ep": 2}, "lora_ep2": {**MOE_MODEL, **LORA, "parallel.ep": 2}}
#: comma-separated subset of LAYOUTS to run (default all); the 2-GPU test runs dp2 only
LAYOUTS_ENV = "FERRULE_RL_WORKER_LAYOUTS"


def tensors_digest(items) -> str:
    """sha256 over ``(name, tensor)`` pairs (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for name, t in items:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def weights_digest(engine) -> str:
    """sha256 over the HF export, and the PEFT adapter of a LoRA engine; collective."""
    digest = tensors_digest(engine.export_hf_state())
    if getattr(engine, "lora", None) is not None:
        from ferrule.lora import hf_adapter_state_dict

        digest += ":" + tensors_digest(sorted(hf_adapter_state_dict(engine).items()))
    return digest


def served_adapter_digests(trainer) -> list | None:
    """``[rank, sha256 of the served adapter]`` of every rank with a rollout engine (rank 0), else None."""
    from ferrule.rl.distributed import gather_objects

    rollout = trainer.rollout
    mine = None if rollout is None else (trainer.roles.rank, tensors_digest(sorted(rollout.get_lora_state_dict().items())))
    got = gather_objects(mine) if trainer.roles.distributed else [mine]
    return None if got is None else [x for x in got if x is not None]


def run(config: Path, overrides: list[str], served: list | None = None, **kwargs):
    """One GRPO run (every sync verified with LoRA); returns (metrics entries, responses, weights
    digest); with ``served`` (a list) the served-adapter digests are appended to it."""
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rl.metrics import read_metrics

    cfg = load_config(config, overrides)
    trainer = GRPOTrainer(cfg, check_weight_update_equal=cfg.lora.rank > 0)
    trainer.run(**kwargs)
    digest = weights_digest(trainer.engine)
    if served is not None:
        served.extend(served_adapter_digests(trainer) or [])
    run_dir = Path(cfg.logging.run_dir)
    samples = run_dir / "samples.jsonl"
    responses = [json.loads(ln)["response"] for ln in samples.read_text().splitlines()] if samples.exists() else []
    return read_metrics(run_dir / "metrics.jsonl"), responses, digest


def main() -> None:
    import torch.distributed as dist

    from ferrule.megatron.parallel import destroy_distributed

    work = Path(sys.argv[1])
    config = work / "tiny.yaml"
    base = json.loads((work / "overrides.json").read_text())
    results: dict = {}
    import os
    import time

    chosen = os.environ.get(LAYOUTS_ENV, ",".join(LAYOUTS)).split(",")
    for name, extra in ((n, LAYOUTS[n]) for n in chosen):
        t0 = time.perf_counter()
        common = base + [f"{k}={str(v).format(work=work)}" for k, v in extra.items()] + [
            f"train.steps={STEPS}", f"checkpoint.interval={CKPT_EVERY}", "checkpoint.keep=0"]
        full_dir, resumed_dir = work / name / "full", work / name / "resumed"
        served: list = []
        full = run(config, common + [f"logging.run_dir={full_dir}"], served=served if "lora.rank" in extra else None)
        if dist.get_rank() == 0:  # the resumed run starts from the full run's step-CKPT_EVERY checkpoint
            shutil.copytree(full_dir, resumed_dir)
            shutil.rmtree(resumed_dir / "checkpoints" / f"step_{STEPS:06d}")
        dist.barrier()
        resumed = run(config, common + [f"logging.run_dir={resumed_dir}", "checkpoint.resume=true"])
        results[name] = {"full": full, "resumed": resumed, "seconds": time.perf_counter() - t0}
        if served:
            results[name]["served"] = served
        destroy_distributed(keep_process_group=True)
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
