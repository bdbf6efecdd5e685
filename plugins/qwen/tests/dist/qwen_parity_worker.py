"""torchrun worker (2 gloo processes) for plugins/qwen/tests/test_qwen_parity.py.

Usage: torchrun --nproc-per-node 2 plugins/qwen/tests/dist/qwen_parity_worker.py WORK_DIR

WORK_DIR holds HF dirs prepared by the test (``qwen2``, ``qwen3_untied``, ``qwen3_tied``,
``qwen3_moe``) and ``qwen3_untied_td`` (a torch_dist checkpoint converted at TP=1). For each
case the worker builds the Megatron model at a layout, loads it, compares logits against HF
transformers (computed here, fp32) and the exported HF tensors against the safetensors files
(bit-exact). Rank 0 writes ``results.json``: ``{case: {"logits_diff": float, "export_exact": bool}}``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

SEQ = 10


def _hf_logits(hf_dir: Path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _mcore_logits(model, ids, vocab):
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        out = model(ids, pos, attention_mask=None)
    return out[..., :vocab] if out is not None else None


def _export_exact(chunks, table, hf_config, hf_dir: Path) -> bool:
    import torch

    from ferrule.converters import SafetensorsReader, export_mcore_to_hf

    ref = SafetensorsReader(hf_dir)
    got = dict(export_mcore_to_hf(chunks, table, hf_config=hf_config))
    return sorted(got) == ref.keys() and all(torch.equal(got[k], ref.get(k)) for k in ref.keys())


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from ferrule.contract import registry
    from ferrule.converters import load_hf_into_mcore
    from ferrule.converters.checkpoint import _sharded_state_dict, load_torch_dist_into_mcore
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed

    results: dict[str, dict] = {}
    # HF references first: transformers' lazily imported generation modules evaluate
    # `torch.cuda.Stream | None` at import time, which breaks once the CPU-compat patches replace
    # torch.cuda.Stream (reported to the runtime owner).
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(7))
    hf_ref = {name: _hf_logits(work / name, ids) for name in ("qwen2", "qwen3_tied", "qwen3_untied", "qwen3_moe")}

    def build(name, layout, **opts):
        hf_dir = work / name
        hf_config = json.loads((hf_dir / "config.json").read_text())
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_distributed(layout)
        family = registry.family_for_hf_config(hf_config).name
        chunks = registry.provider_build(family)(hf_config, layout, parallel_output=False, **opts)
        return hf_dir, hf_config, chunks, registry.get_converter(family).resolved_mapping()

    def run(case, name, layout, *, load=None, **opts):
        hf_dir, hf_config, chunks, table = build(name, layout, **opts)
        vocab = hf_config["vocab_size"]
        if load is None:
            load_hf_into_mcore(chunks, hf_dir, table, hf_config=hf_config)
        else:
            load_torch_dist_into_mcore(chunks, load)
        entry = {"export_exact": _export_exact(chunks, table, hf_config, hf_dir)}
        if layout.pp == 1:
            entry["logits_diff"] = (_mcore_logits(chunks[0], ids, vocab) - hf_ref[name]).abs().max().item()
        results[case] = entry
        return chunks

    run("qwen2_tp2", "qwen2", ParallelLayout(tp=2))
    run("qwen3_tied_tp2", "qwen3_tied", ParallelLayout(tp=2))
    run("qwen3_moe_tp2", "qwen3_moe", ParallelLayout(tp=2))
    moe_ep2 = run("qwen3_moe_ep2", "qwen3_moe", ParallelLayout(ep=2), moe_token_dispatcher_type="alltoall")
    save_moe = work / "qwen3_moe_td_ep2"
    if dist.get_rank() == 0:
        save_moe.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(moe_ep2), str(save_moe))  # saved at EP=2, loaded at TP=2 below
    del moe_ep2
    run("qwen3_moe_ep2_allgather", "qwen3_moe", ParallelLayout(ep=2), moe_token_dispatcher_type="allgather")
    run("qwen3_untied_pp2_export", "qwen3_untied", ParallelLayout(pp=2))
    # resharding: saved at TP=1 (by the test, via hf_to_torch_dist) -> loaded at TP=2
    chunks = run("qwen3_untied_td_tp1_to_tp2", "qwen3_untied", ParallelLayout(tp=2), load=work / "qwen3_untied_td")
    # and the reverse: save at TP=2 here, load at TP=1 (dp=2)
    saved = work / "qwen3_untied_td_tp2"
    if dist.get_rank() == 0:
        saved.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks), str(saved))
    run("qwen3_untied_td_tp2_to_tp1", "qwen3_untied", ParallelLayout(tp=1), load=saved)
    run("qwen3_moe_td_ep2_to_tp2", "qwen3_moe", ParallelLayout(tp=2), load=save_moe)

    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
