"""torchrun worker (2 gloo processes) for tests/test_inkling_parity.py: Inkling at TP=2 and EP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/inkling_parity_worker.py WORK_DIR

WORK_DIR holds tiny InklingForCausalLM dirs made by the test (one per name in
``tests/inkling_fixtures.CONFIGS``) and ``moe_2_shared_td``, a torch_dist checkpoint converted at
TP=1. Each case builds the Megatron model at a layout, loads it, compares full-vocab logits with
transformers (eager attention, fp32, computed here) and the exported HF tensors with the
safetensors files (bit-exact). Layouts the model cannot use must be refused with a ValueError.
Rank 0 writes ``results.json``: ``{case: {"logits_diff", "export_exact"} | {"refused": message}}``
plus ``shared_experts_replicated_over_ep``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

SEQ = 12
TP2 = ("moe_2_shared", "dense_only", "local_only", "global_only_log_scaling")
REFUSED_AT_TP2 = ("one_kv_head", "swa_head_shape")


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from transformers import InklingForCausalLM

    from ferrule.converters import SafetensorsReader, export_mcore_to_hf, load_hf_into_mcore
    from ferrule.converters.checkpoint import _sharded_state_dict, load_torch_dist_into_mcore
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed
    from ferrule.plugins.inkling import inkling_text

    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(7))
    ref = {}
    for name in (*TP2, *REFUSED_AT_TP2):  # HF first (see qwen_parity_worker.py on import order)
        hf = InklingForCausalLM.from_pretrained(work / name, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            ref[name] = hf(input_ids=ids).logits
    results: dict[str, dict] = {}

    def build(name, layout, **opts):
        hf_config = json.loads((work / name / "config.json").read_text())
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_distributed(layout)
        return hf_config, inkling_text.build_provider(hf_config, layout, parallel_output=False, **opts)

    def run(case, name, layout, *, load=None, **opts):
        hf_config, chunks = build(name, layout, **opts)
        if load is None:
            load_hf_into_mcore(chunks, work / name, inkling_text.MAPPING, hf_config=hf_config)
        else:
            load_torch_dist_into_mcore(chunks, load)
        expected = SafetensorsReader(work / name)
        got = dict(export_mcore_to_hf(chunks, inkling_text.MAPPING, hf_config=hf_config))
        exact = sorted(got) == sorted(expected.keys()) and all(torch.equal(got[k], expected.get(k)) for k in got)
        model = chunks[0]
        model.eval()
        with torch.no_grad():
            out = model(ids, torch.arange(SEQ).unsqueeze(0).expand_as(ids), attention_mask=None)[..., :96]
        results[case] = {"export_exact": exact, "logits_diff": (out - ref[name]).abs().max().item()}
        return chunks

    for name in TP2:
        run(f"{name}_tp2", name, ParallelLayout(tp=2))
    for name in REFUSED_AT_TP2:
        try:
            build(name, ParallelLayout(tp=2))
            results[f"{name}_tp2"] = {"refused": None}
        except ValueError as exc:
            results[f"{name}_tp2"] = {"refused": str(exc)}
    ep2 = run("moe_2_shared_ep2", "moe_2_shared", ParallelLayout(ep=2), moe_token_dispatcher_type="alltoall")
    # shared experts and the router are replicated over EP (never expert-parallel); routed experts are split
    shared = {n: p.detach().clone() for n, p in ep2[0].named_parameters() if "shared_experts" in n or "router" in n}
    gathered = [None, None]
    dist.all_gather_object(gathered, {n: t.tolist() for n, t in shared.items()})
    results["shared_experts_replicated_over_ep"] = bool(shared) and gathered[0] == gathered[1]
    saved = work / "moe_2_shared_td_ep2"
    if dist.get_rank() == 0:
        saved.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(ep2), str(saved))
    del ep2
    run("moe_2_shared_ep2_allgather", "moe_2_shared", ParallelLayout(ep=2), moe_token_dispatcher_type="allgather")
    # torch_dist resharding: saved at TP=1 by the test -> TP=2; saved at EP=2 above -> TP=2
    run("moe_2_shared_td_tp1_to_tp2", "moe_2_shared", ParallelLayout(tp=2), load=work / "moe_2_shared_td")
    run("moe_2_shared_td_ep2_to_tp2", "moe_2_shared", ParallelLayout(tp=2), load=saved)
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
