"""torchrun worker (2 gloo processes) for tests/test_rl_distributed.py.

Usage: torchrun --nproc-per-node 2 tests/dist/rl_worker.py WORK_DIR

WORK_DIR holds ``tiny.yaml`` and ``overrides.json`` (the tiny GRPO example of
tests/test_rl_e2e.py: its model, task and config). For each layout (``dp2``: DP=2, ``tp2``:
TP=2, ``pp2``: PP=2 with tied embeddings) the worker runs, in this one launch:

- ``full``: ``STEPS`` steps uninterrupted, a checkpoint every ``CKPT_EVERY`` steps (all kept);
- ``resumed``: a copy of that run folder without its last checkpoint, resumed to ``STEPS``.

Rank 0 writes ``WORK_DIR/results.json``: per layout and run the metrics entries, the sampled
responses and a sha256 of the final weights (HF export, exact bytes). The process group stays
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
LAYOUTS = {"dp2": {}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}}
#: comma-separated subset of LAYOUTS to run (default all); the 2-GPU test runs dp2 only
LAYOUTS_ENV = "FERRULE_RL_WORKER_LAYOUTS"


def weights_digest(engine) -> str:
    """sha256 over the HF export (names, dtypes, shapes, bytes); collective."""
    h = hashlib.sha256()
    for name, t in engine.export_hf_state():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def run(config: Path, overrides: list[str], **kwargs):
    """One GRPO run; returns (metrics entries, responses, weights digest)."""
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rl.metrics import read_metrics

    cfg = load_config(config, overrides)
    trainer = GRPOTrainer(cfg)
    trainer.run(**kwargs)
    digest = weights_digest(trainer.engine)
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

    chosen = os.environ.get(LAYOUTS_ENV, ",".join(LAYOUTS)).split(",")
    for name, extra in ((n, LAYOUTS[n]) for n in chosen):
        common = base + [f"{k}={v}" for k, v in extra.items()] + [
            f"train.steps={STEPS}", f"checkpoint.interval={CKPT_EVERY}", "checkpoint.keep=0"]
        full_dir, resumed_dir = work / name / "full", work / name / "resumed"
        full = run(config, common + [f"logging.run_dir={full_dir}"])
        if dist.get_rank() == 0:  # the resumed run starts from the full run's step-CKPT_EVERY checkpoint
            shutil.copytree(full_dir, resumed_dir)
            shutil.rmtree(resumed_dir / "checkpoints" / f"step_{STEPS:06d}")
        dist.barrier()
        resumed = run(config, common + [f"logging.run_dir={resumed_dir}", "checkpoint.resume=true"])
        results[name] = {"full": full, "resumed": resumed}
        destroy_distributed(keep_process_group=True)
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
