"""torchrun worker (2 gloo processes) for plugins/inkling/tests/test_inkling_towers.py: Inkling with towers at TP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/inkling_towers_tp2_worker.py WORK_DIR

WORK_DIR holds ``mm`` (a tiny ``InklingForConditionalGeneration``, released layout) and
``media.pt`` (``ids``, ``pixel_values``, ``dmel``). The text model is split over TP=2, the towers
are replicated; full-vocab logits with the media scattered in are compared with transformers
(eager, fp32, computed here) and the exported HF tensors, towers included, with the checkpoint
(bit-exact). Rank 0 writes ``results.json`` ``{"logits_diff", "export_exact", "towers_identical_over_tp"}``.
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
    from transformers import InklingForConditionalGeneration

    from ferrule.contract import registry
    from ferrule.megatron.provider import provider_build
    from ferrule.converters import SafetensorsReader, export_mcore_to_hf, load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed
    from ferrule.megatron.towers import embed_with_media

    data = torch.load(work / "media.pt")
    ids, pixel_values, dmel = data["ids"], data["pixel_values"], data["dmel"]
    hf = InklingForConditionalGeneration.from_pretrained(work / "mm", dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixel_values, audio_input_ids=dmel[None]).logits
    hf_config = json.loads((work / "mm" / "config.json").read_text())
    layout = ParallelLayout(tp=2)
    init_distributed(layout)
    chunks = provider_build("inkling")(hf_config, layout, parallel_output=False)
    table = registry.get_converter("inkling").resolved_mapping()
    load_hf_into_mcore(chunks, work / "mm", table, hf_config=hf_config)
    expected = SafetensorsReader(work / "mm")
    got = dict(export_mcore_to_hf(chunks, table, hf_config=hf_config))
    exact = sorted(got) == sorted(expected.keys()) and all(torch.equal(got[k], expected.get(k)) for k in got)
    model = chunks[0].eval()
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        emb = embed_with_media(model, ids, pos, [{"vision": [pixel_values], "audio": [dmel]}])
        out = model(ids, pos, attention_mask=None, decoder_input=emb)[..., : ref.shape[-1]]
    flat = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if n.startswith("towers.")])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=parallel_state.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps({
            "logits_diff": (out - ref).abs().max().item(), "export_exact": exact,
            "towers_identical_over_tp": bool(torch.equal(gathered[0], gathered[1])),
            "tower_tensors_exported": sum(k.startswith(("model.visual.", "model.audio.")) for k in got)}))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
