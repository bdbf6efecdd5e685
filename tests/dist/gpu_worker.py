"""torchrun worker for tests/test_gpu.py: split invariance on CUDA + NCCL with bf16 params.

Usage: torchrun --nproc-per-node N tests/dist/gpu_worker.py WORK_DIR

Runs the same split-invariance protocol as tests/dist/train_engine_worker.py (1 x fb(8),
2 x fb(4), fb(3)+fb(5), then one step), with ``params_dtype=bfloat16`` and fp32 gradient
buffers (``grad_reduce_in_fp32``), with and without the distributed optimizer, at DP=N
(and TP=2 when N == 2). Rank 0 writes WORK_DIR/gpu_results.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sys.path.insert(0, str(Path(__file__).parent))
    import train_engine_worker as w

    from ferrule.megatron.engine import OptimizerSettings
    from ferrule.megatron.parallel import ParallelLayout

    hf_dir = work / "qwen2"
    bf16 = dict(params_dtype=torch.bfloat16)
    res: dict = {}
    res["dp"] = w.split_invariance(hf_dir, ParallelLayout(), **bf16)
    res["dp_distopt"] = w.split_invariance(
        hf_dir, ParallelLayout(), optimizer=OptimizerSettings(lr=w.LR, use_distributed_optimizer=True), **bf16)
    if dist.get_world_size() == 2:
        ps.destroy_model_parallel()
        res["tp2"] = w.split_invariance(hf_dir, ParallelLayout(tp=2), **bf16)
    res["world_size"] = dist.get_world_size()
    res["backend"] = dist.get_backend()
    res["device"] = torch.cuda.get_device_name()
    if dist.get_rank() == 0:
        (work / "gpu_results.json").write_text(json.dumps(res, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
