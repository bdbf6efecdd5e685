"""torchrun worker (2 gloo processes) for tests/test_rl_sglang.py: ``rollout.engine: sglang`` at DP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/rl_sglang_worker.py WORK_DIR RUN_DIR

No SGLang here: :class:`EmbeddedBehindTheClientInterface` (the embedded engine behind
``SGLangEngine``'s constructor and methods) replaces the client class, so the run checks
ferrule's side of the path on two ranks: only the driver builds a rollout engine, every shard
runs there, the other rank only trains, the sync reaches the driver's engine and nothing is
fanned out. ``WORK_DIR`` holds ``tiny.yaml`` and ``overrides.json``; rank 0 writes
``WORK_DIR/sglang_results.json``: the run's metrics, responses and weights digest, and per rank
the engines built, the weight updates received and whether the engine was closed.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


class EmbeddedBehindTheClientInterface:
    """NOT SGLang: the embedded engine behind ``SGLangEngine``'s constructor and methods."""

    kind = "sglang"
    built: list = []

    def __init__(self, url=None, **kwargs):
        import torch

        from ferrule.rollout.embedded import EmbeddedEngine

        self.kwargs, self.process, self.closed, self.updates = dict(kwargs, url=url), None, False, 0
        self.inner = EmbeddedEngine(hf_dir=kwargs["model_path"], dtype=torch.float32, device=torch.device("cpu"))
        type(self).built.append(self)

    @property
    def weights_version(self):
        return self.inner.weights_version

    def generate(self, requests, params):
        assert not params.return_raw_logprobs, "SGLangEngine refuses return_raw_logprobs"
        return self.inner.generate(requests, params)

    def update_weights(self, named_tensors, version):
        self.updates += 1
        self.inner.update_weights(named_tensors, version)

    def shutdown(self):
        self.closed = True


def main() -> None:
    import torch.distributed as dist

    import ferrule.rollout.sglang as client
    from ferrule.rl import rollout_engine
    from ferrule.megatron.parallel import destroy_distributed

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import rl_worker

    work, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    client.SGLangEngine = EmbeddedBehindTheClientInterface
    rollout_engine._sglang_importable = lambda: True  # the stand-in plays the server: the launch check passes
    overrides = json.loads((work / "overrides.json").read_text()) + sys.argv[3:] + [
        f"logging.run_dir={run_dir}", "rollout.engine=sglang", "rollout.sglang_weight_transport=disk"]
    metrics, responses, digest = rl_worker.run(work / "tiny.yaml", overrides)
    mine = [(len(e.kwargs), e.updates, e.closed) for e in EmbeddedBehindTheClientInterface.built]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        (work / "sglang_results.json").write_text(json.dumps({"run": [metrics, responses, digest],
                                                              "engines": per_rank}))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
