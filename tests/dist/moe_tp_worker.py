"""torchrun worker (2 gloo ranks) for tests/test_moe_tp.py: MoE families training at TP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/moe_tp_worker.py WORK_DIR  (or 4 ranks for cases with ``"ep": 2``:
TP=2 x EP=2, data parallel 2; each DP replica takes every other row of the batch)

``WORK_DIR/cases.json``: ``{case: {"hf_dir", "ref", "ep", "etp", "dispatcher", "config_overrides", "unsplit"}}``;
``ref`` is a ``torch.save``\\ d ``{"ids": [B, S] int64, "width": HF logits width, "grads": {HF key: fp32 tensor}}`` made by the test in
its own process (HF autograd, or TP=1 megatron for the aux-loss case); an optional ``"media"`` (a batch's media
items, ``[{"vision": [item, ...]}]``) is run through the model's towers (``embed_with_media``) into the prompt.
Per case both ranks build a
:class:`ferrule.megatron.engine.TrainEngine` at ``ParallelLayout(tp=2, ep=ep, etp=etp)`` from the HF folder, run
the summed token log-likelihood of the whole batch (replicated over TP, as in training) through the engine's
DDP-wrapped model, run megatron's ``finalize_model_grads`` (what ``TrainEngine.optim_step`` does: DP and
expert-DP all-reduce, TP sums of q/k norms) and export the main gradients through the mapping table (which
gathers TP / expert-TP shards). Rank 0 writes ``results.json``: per case ``grad_rel_worst`` (max over HF
tensors of max |diff| / max |ref|), ``grad_rel_experts`` (the same over routed-expert tensors), the worst
tensor's name, ``grad_keys_match`` and ``replicated_spread`` (max |grad rank 0 - grad rank 1| over the
parameters that are not TP-split: they must agree, since the export reads one rank).

``unsplit``: the case runs with :func:`ferrule.megatron.moe.token_split_group` patched to return None (the
dispatcher fed replicated tokens, i.e. the code before the token split without its refusal): the test checks
that the comparison then fails by the factor ``tp`` on the routed experts.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    import ferrule.megatron.moe as moe
    from ferrule.megatron.engine import TrainEngine
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed
    from ferrule.megatron.towers import embed_with_media
    from ferrule.megatron.weights import export_mcore_to_hf
    from ferrule.megatron.param_gather import unwrap

    results = {}
    split = moe.token_split_group
    for case, spec in json.loads((work / "cases.json").read_text()).items():
        ref = torch.load(spec["ref"])
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        moe.token_split_group = (lambda layer: None) if spec.get("unsplit") else split
        layout = ParallelLayout(tp=2, ep=spec.get("ep", 1), etp=spec.get("etp"))
        engine = TrainEngine.from_hf(spec["hf_dir"], layout, provider_options={
            "moe_token_dispatcher_type": spec["dispatcher"], "parallel_output": False, "config_overrides": spec.get("config_overrides") or {}})
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        ids = ref["ids"][dp_rank::dp]  # data parallel (world > 2): each replica takes its rows, DDP sums them
        ddp = engine.model[0]
        ddp.train()
        ddp.zero_grad_buffer()
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        media = {}
        if ref.get("media"):  # an image prompt: the towers' embeddings scattered into the prompt (replicated over TP)
            media["decoder_input"] = embed_with_media(unwrap(ddp), ids, pos, ref["media"])
        logits = ddp(ids, pos, attention_mask=None, **media)[..., : ref["width"]]  # HF's width: no padded columns
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp.gather(-1, ids[:, 1:, None]).sum().backward()
        finalize_model_grads(engine.model)
        model = unwrap(ddp)
        replicated = [p.main_grad.reshape(-1) for p in model.parameters()
                      if p.requires_grad and not getattr(p, "tensor_model_parallel", False)]
        flat = torch.cat(replicated)
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat, group=parallel_state.get_tensor_model_parallel_group())  # TP ranks 0 and 1
        with torch.no_grad():
            for p in model.parameters():
                p.data.copy_(p.main_grad if p.requires_grad else torch.zeros_like(p))
        got = dict(export_mcore_to_hf([model], engine.mapping_table, hf_config=engine.hf_config))
        rel = {k: ((got[k].float() - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
               for k, g in ref["grads"].items() if k in got}
        experts = {k: v for k, v in rel.items() if ".experts." in k and "shared" not in k}
        worst = max(rel, key=rel.get)
        results[case] = {"grad_rel_worst": rel[worst], "worst_tensor": worst, "n_tensors": len(rel),
                         "grad_rel_experts": max(experts.values()) if experts else None,
                         "grad_rel_non_experts": max((v for k, v in rel.items() if k not in experts), default=None),
                         "grad_keys_match": sorted(got) == sorted(ref["grads"]),
                         "replicated_spread": (both[0] - both[1]).abs().max().item()}
        del engine, ddp, model
    moe.token_split_group = split
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
