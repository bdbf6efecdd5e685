"""torchrun worker (2 gloo ranks) for plugins/inkling2/tests/test_inkling2.py: Inkling-2 and Inkling-2-Loop at EP=2.

``argv[1]``: a folder holding, per case, the HF checkpoint ``<case>/`` and ``<case>.ref.pt`` (HF logits and the
HF gradients in the released layout, made by the test in its own process). Per case: load the checkpoint at
EP=2 (megatron's alltoall dispatcher), export it back (exact?), logits vs HF, gradients of the summed token
log-likelihood exported through the mapping table (which gathers the experts over EP) vs HF. Rank 0 writes
``results.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

SEQ = 12


def main() -> None:
    warnings.filterwarnings("ignore")
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    from ferrule.converters import SafetensorsReader, export_mcore_to_hf, load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout, init_distributed
    from ferrule.plugins.inkling2 import inkling2_loop, inkling2_text

    results = {}
    for case in json.loads((work / "cases.json").read_text()):
        ref = torch.load(work / f"{case}.ref.pt")
        hf_config = json.loads((work / case / "config.json").read_text())
        variant = inkling2_loop if hf_config["model_type"] == "inkling2_loop_text" else inkling2_text
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        layout = ParallelLayout(ep=2)
        init_distributed(layout)
        chunks = variant.build_provider(hf_config, layout, parallel_output=False, moe_token_dispatcher_type="alltoall")
        load_hf_into_mcore(chunks, work / case, variant.MAPPING, hf_config=hf_config)
        expected = SafetensorsReader(work / case)
        got = dict(export_mcore_to_hf(chunks, variant.MAPPING, hf_config=hf_config))
        exact = sorted(got) == sorted(expected.keys()) and all(torch.equal(got[k], expected.get(k)) for k in got)
        model = chunks[0]
        model.train()
        # data parallel as in training: rank r takes sample r; dense gradients are summed over the DP group (what
        # finalize_model_grads does with calculate_per_token_loss), routed experts already saw both ranks' tokens
        rank = dist.get_rank()
        ids = ref["ids"][rank:rank + 1]
        width = ref["logits"].shape[-1]
        out = model(ids, torch.arange(SEQ).unsqueeze(0).expand_as(ids), attention_mask=None)[..., :width]
        logits_diff = torch.tensor((out.detach() - ref["logits"][rank:rank + 1]).abs().max().item())
        dist.all_reduce(logits_diff, op=dist.ReduceOp.MAX)
        logp = torch.log_softmax(out[:, :-1].float(), dim=-1)
        logp.gather(-1, ids[:, 1:, None]).sum().backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if "local_experts" not in n:
                    dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
                p.data.copy_(g)
        grads = dict(export_mcore_to_hf(chunks, variant.MAPPING, hf_config=hf_config))
        rel = {k: ((grads[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for k, g in ref["grads"].items()}
        results[case] = {"export_exact": exact, "logits_diff": logits_diff.item(),
                         "grad_rel_worst": max(rel.values()), "grad_keys_match": sorted(grads) == sorted(ref["grads"])}
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
