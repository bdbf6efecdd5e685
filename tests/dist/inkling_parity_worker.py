"""torchrun worker (2 gloo processes) for plugins/inkling/tests/test_inkling_parity.py: Inkling at TP=2 and EP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/inkling_parity_worker.py WORK_DIR

WORK_DIR holds tiny InklingForCausalLM dirs made by the test (one per name in
``tests/inkling_fixtures.CONFIGS``) and ``moe_2_shared_td``, a torch_dist checkpoint converted at
TP=1. Each case builds the Megatron model at a layout, loads it, compares full-vocab logits with
transformers (eager attention, fp32, computed here) and the exported HF tensors with the
safetensors files (bit-exact); for ``GRAD_TP2`` it also compares the TP=2 gradients of a summed
token log-likelihood with HF autograd (``grad_rel_diff``: max |diff| / max |HF grad| per tensor). Layouts the model cannot use must be refused with a ValueError.
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
GRAD_TP2 = ("dense_only", "moe_2_shared")  # MoE: tokens split over TP around the dispatcher


def _summed_logprob(logits, ids):
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).sum()


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
    ref, ref_grads = {}, {}
    for name in (*TP2, *REFUSED_AT_TP2):  # HF first (see qwen_parity_worker.py on import order)
        hf = InklingForCausalLM.from_pretrained(work / name, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            ref[name] = hf(input_ids=ids).logits
        if name in GRAD_TP2:
            hf.train()
            _summed_logprob(hf(input_ids=ids).logits, ids).backward()
            ref_grads[name] = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                               for n, p in hf.named_parameters()}
    results: dict[str, dict] = {}

    def grad_rel_diff(name, chunks, hf_config):
        """Max over HF parameters of max|grad_mcore - grad_hf| / max|grad_hf| (TP-gathered by the table)."""
        model = chunks[0]
        model.train()
        model.zero_grad()
        out = model(ids, torch.arange(SEQ).unsqueeze(0).expand_as(ids), attention_mask=None)[..., :96]
        _summed_logprob(out, ids).backward()
        # what megatron's finalize_model_grads (_allreduce_non_tensor_model_parallel_grads) does at optim_step
        # with config.qk_layernorm: sum the per-head q/k norm gradients over the TP group (each rank holds
        # the norm for its own heads only)
        for n, p in model.named_parameters():
            if "q_layernorm" in n or "k_layernorm" in n:
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
        with torch.no_grad():  # export the gradients through the mapping table (gathers the TP shards)
            for p in model.parameters():
                p.data.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        got = dict(export_mcore_to_hf(chunks, inkling_text.MAPPING, hf_config=hf_config))
        return max(((got[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                   for k, g in ref_grads[name].items())

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
        chunks = run(f"{name}_tp2", name, ParallelLayout(tp=2))
        if name in GRAD_TP2:
            hf_config = json.loads((work / name / "config.json").read_text())
            results[f"{name}_tp2"]["grad_rel_diff"] = grad_rel_diff(name, chunks, hf_config)
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
