"""torchrun worker (2 gloo processes) for tests/test_weight_sync.py::test_sync_under_tp_ep_pp.

Usage: torchrun --nproc-per-node 2 tests/dist/weight_sync_worker.py WORK_DIR

WORK_DIR holds tiny HF checkpoints ``qwen3`` (2 KV heads, untied) and ``qwen3_moe`` written by
the test with transformers. For each layout (tp2 on qwen3, pp2 on qwen3, ep2 on qwen3_moe, where
dense data-parallel size 2 makes rank 1 skip the dense units) the checkpoint is loaded into the
sharded megatron model, ``sync_weights`` sends it to a recording sink on rank 0, and rank 0
records whether every received tensor equals the checkpoint tensor bit for bit (the
checkpoint is the independent reference). ``check_weight_update_equal`` is run against an
engine view of the checkpoint, clean and with one tensor corrupted; every rank records what it
raised. Each rank writes ``result_<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


class Recorder:
    def __init__(self):
        self.buckets = []

    def update_weights(self, named_tensors, version):
        self.buckets.append([(k, v.detach().clone()) for k, v in named_tensors])


class CheckpointView:
    def __init__(self, tensors):
        self.tensors = tensors

    def get_hf_state_dict(self):
        return self.tensors


def main(work: Path) -> None:
    from transformers import Qwen3ForCausalLM  # noqa: F401  (before ferrule's CPU patches)
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from ferrule.megatron.weights import load_hf_into_mcore
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed
    from ferrule.plugins.qwen import qwen3, qwen3_moe
    from ferrule.sync import WeightSyncError, check_weight_update_equal, sync_weights

    cases = {"tp2": (qwen3, ParallelLayout(tp=2)), "pp2": (qwen3, ParallelLayout(pp=2)),
             "ep2": (qwen3_moe, ParallelLayout(ep=2))}
    results = {}
    for name, (mod, layout) in cases.items():
        family = mod.MAPPING.family
        hf_dir = work / family
        cfg = json.loads((hf_dir / "config.json").read_text())
        ref = load_file(str(hf_dir / "model.safetensors"))
        init_distributed(layout)
        chunks = build_from_hf_config(cfg, layout, mod.CONFIG_TRANSLATION)
        load_hf_into_mcore(chunks, hf_dir, mod.MAPPING, hf_config=cfg)
        sink = Recorder()
        stats = sync_weights(chunks, sink if dist.get_rank() == 0 else None, 1, bucket_bytes=16 * 1024,
                             family=family, hf_config=cfg)
        got = {k: v for b in sink.buckets for k, v in b}
        res = {"sender": stats.sender, "buckets": stats.buckets, "tensors": stats.tensors}
        if dist.get_rank() == 0:
            res["same_keys"] = sorted(got) == sorted(ref)
            res["unequal"] = sorted(k for k in ref if k in got and not torch.equal(got[k], ref[k]))
            res["duplicates"] = stats.tensors - len(got)
        view = CheckpointView({k: v.clone() for k, v in ref.items()}) if dist.get_rank() == 0 else None
        res["clean_check"] = check_weight_update_equal(chunks, view, family=family, hf_config=cfg) is not None
        corrupt = "model.layers.1.mlp.experts.3.up_proj.weight" if family == "qwen3_moe" \
            else "model.layers.1.self_attn.q_proj.weight"
        if view is not None:
            view.tensors[corrupt].view(-1)[0] += 1.0
        try:
            check_weight_update_equal(chunks, view, family=family, hf_config=cfg)
            res["corrupt_error"] = None
        except WeightSyncError as exc:
            res["corrupt_error"] = str(exc)
        res["corrupt"] = corrupt
        results[name] = res
        destroy_distributed(keep_process_group=True)
    (work / f"result_{dist.get_rank()}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
