"""torchrun worker (2 gloo processes) for plugins/inkling2/tests/test_inkling2_mm.py: family ``inkling2`` with images at TP=2 and EP=2.

Usage: torchrun --nproc-per-node 2 tests/dist/inkling2_mm_worker.py WORK_DIR

WORK_DIR/mm holds a tiny ``Inkling2ForConditionalGeneration`` made by the test. Each layout builds the
Megatron model with its vision tower (replicated over TP and EP), loads it, runs an image prompt
(``embed_with_media``) and compares full-vocab logits with transformers (fp32, computed here), and the
exported HF tensors (tower included) with the safetensors file (bit-exact). Rank 0 writes
``results.json``: ``{layout: {"logits_diff", "export_exact", "tower_replicated"}}``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared fixtures


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import Inkling2ForConditionalGeneration

    from inkling2_vision_fixtures import IMAGE_TOKEN, images
    from ferrule.contract import registry
    from ferrule.converters import SafetensorsReader, export_mcore_to_hf, load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed
    from ferrule.megatron.provider import provider_build
    from ferrule.megatron.towers import embed_with_media
    from ferrule.plugins.inkling2.towers import hf_vision_inputs

    path = work / "mm"
    items = images(6, ((2, 3), (1, 2)))
    ids = torch.tensor([[3, 4] + [IMAGE_TOKEN] * 6 + [5, 6] + [IMAGE_TOKEN] * 2 + [7, 8, 9]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    hf = Inkling2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, **hf_vision_inputs(items, {})).logits
    hf_config = json.loads((path / "config.json").read_text())
    mapping = registry.get_converter("inkling2").resolved_mapping()
    expected = SafetensorsReader(path)
    results = {}
    for case, layout, opts in (("tp2", ParallelLayout(tp=2), {}),
                               ("ep2", ParallelLayout(ep=2), {"moe_token_dispatcher_type": "alltoall"})):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_distributed(layout)
        chunks = provider_build("inkling2")(hf_config, layout, parallel_output=False, **opts)
        load_hf_into_mcore(chunks, path, mapping, hf_config=hf_config)
        got = dict(export_mcore_to_hf(chunks, mapping, hf_config=hf_config))
        exact = sorted(got) == sorted(expected.keys()) and all(torch.equal(got[k], expected.get(k)) for k in got)
        model = chunks[0].eval()
        with torch.no_grad():
            out = model(ids, pos, attention_mask=None, decoder_input=embed_with_media(model, ids, pos,
                                                                                      [{"vision": items}]))
        tower = [p.detach().flatten() for _, p in sorted(model.towers.vision.named_parameters())]
        gathered = [None, None]
        dist.all_gather_object(gathered, torch.cat(tower).tolist())
        results[case] = {"logits_diff": (out[..., : ref.shape[-1]] - ref).abs().max().item(), "export_exact": exact,
                         "tower_replicated": gathered[0] == gathered[1]}
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
