"""Inkling checkpoint conversion: HF <-> torch_dist, bit-exact, for both HF layouts.

- ``inkling_text`` (what ``InklingForCausalLM.save_pretrained`` writes), through the
  ``ferrule convert`` CLI; the exported directory loads in ``InklingForCausalLM.from_pretrained``
  with no missing or unexpected keys.
- ``inkling_mm_model`` in the released layout (``model.llm.*``, interleaved ``w13`` tensors,
  ``model.visual.*`` / ``model.audio.*`` towers), from ``InklingForConditionalGeneration``: the
  text model converts, the tower tensors are kept verbatim (never dropped), the export loads in
  ``InklingForConditionalGeneration.from_pretrained`` cleanly, and Megatron logits loaded from the
  released layout match the HF multimodal model on text input (fp32, <= 1e-5).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from inkling_fixtures import PERTURB, tiny_inkling_dir
from inproc import run_ferrule

ATOL = 1e-5


def _same_tensors(a_dir, b_dir):
    from ferrule.converters import SafetensorsReader

    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    assert a.keys() == b.keys(), sorted(set(a.keys()) ^ set(b.keys()))
    bad = [k for k in a.keys() if a.get(k).dtype != b.get(k).dtype or not torch.equal(a.get(k), b.get(k))]
    assert not bad, f"round trip changed {bad}"
    return a


@pytest.mark.timeout(300)
def test_inkling_text_cli_round_trip_loads_in_transformers(tmp_path):
    from transformers import InklingForCausalLM

    src = tiny_inkling_dir(tmp_path / "hf")
    env = dict(os.environ, FERRULE_PLUGINS="qwen,inkling")
    for cmd in (["hf-to-torch-dist", str(src), str(tmp_path / "td")],
                ["torch-dist-to-hf", str(tmp_path / "td"), str(tmp_path / "back")]):
        proc = run_ferrule(["convert", *cmd], env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _same_tensors(src, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    _, info = InklingForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def _tiny_mm(out):
    from transformers import InklingConfig, InklingForConditionalGeneration

    from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG

    text = {k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"}
    cfg = InklingConfig(text_config=text, vision_config={"hidden_size": 16, "num_hidden_layers": 2, "patch_size": 8})
    torch.manual_seed(3)
    model = InklingForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


@pytest.mark.timeout(300)
def test_released_multimodal_layout_round_trip_keeps_towers(tmp_path):
    """The towers are Megatron-side parameters (``towers.vision.*`` / ``towers.audio.*``), converted both ways."""
    from transformers import InklingForConditionalGeneration

    from ferrule.converters import hf_to_torch_dist, torch_dist_to_hf
    from ferrule.converters.checkpoint import PASSTHROUGH_FILE, read_checkpoint_metadata

    src = _tiny_mm(tmp_path / "mm")
    hf_to_torch_dist(src, tmp_path / "td")
    towers = [k for k in _same_tensors(src, src).keys() if k.startswith(("model.visual.", "model.audio."))]
    assert len(towers) == 6 and read_checkpoint_metadata(tmp_path / "td").get("passthrough_tensors", 0) == 0
    assert not (tmp_path / "td" / "hf" / PASSTHROUGH_FILE).exists()
    torch_dist_to_hf(tmp_path / "td", tmp_path / "back")
    reader = _same_tensors(src, tmp_path / "back")
    assert any(k == "model.llm.layers.1.mlp.experts.w13_weight" for k in reader.keys())
    _, info = InklingForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_released_layout_logits_match_multimodal_model_on_text(tmp_path):
    from transformers import InklingForConditionalGeneration

    from ferrule.conformance.numeric import single_rank
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.contract import registry
    from ferrule.megatron.provider import provider_build
    from ferrule.plugins.inkling import inkling

    src = _tiny_mm(tmp_path / "mm")
    hf = InklingForConditionalGeneration.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    hf_config = json.loads((src / "config.json").read_text())
    with single_rank():
        (model,) = provider_build("inkling")(hf_config, ParallelLayout())  # text model + towers
        load_hf_into_mcore([model], src, inkling.MAPPING, hf_config=hf_config)
        model.eval()
        with torch.no_grad():
            out = model(ids, torch.arange(12).unsqueeze(0).expand_as(ids), attention_mask=None)[..., :96]
    assert ref.abs().max() > 0.5
    assert (out - ref).abs().max().item() <= ATOL


def test_interleave_layout_matches_transformers_conversion():
    """Our de-interleave equals transformers' own ``Interleave`` op (the referee for the w13 layout)."""
    from transformers.core_model_loading import Interleave

    from ferrule.mapping.experts import deinterleave, interleave

    w13 = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    theirs = Interleave(dim=1).convert({"w": w13}, ["w"], ["out"])["out"]
    assert torch.equal(deinterleave(w13, 1), theirs)
    assert torch.equal(interleave(theirs, 1), w13)
    assert torch.equal(deinterleave(w13[0], 0), theirs[0])


@pytest.mark.timeout(300)
def test_bf16_checkpoint_with_fp32_kept_tensors_round_trips_exactly(tmp_path):
    """transformers keeps Inkling's ShortConvs and router bias / global scale in fp32 inside a bf16
    checkpoint (``_keep_in_fp32_modules_strict``); conversion keeps every tensor's own dtype."""
    from transformers import AutoModelForCausalLM, InklingTextConfig

    from ferrule.converters import SafetensorsReader, hf_to_torch_dist, torch_dist_to_hf
    from ferrule.converters.checkpoint import read_checkpoint_metadata
    from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG

    torch.manual_seed(0)
    cfg = InklingTextConfig(**{k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"})
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    reader = SafetensorsReader(tmp_path / "bf16")
    fp32 = {k for k in reader.keys() if reader.dtype_name(k) == "F32"}
    assert any("sconv" in k for k in fp32) and any("global_scale" in k for k in fp32)
    hf_to_torch_dist(tmp_path / "bf16", tmp_path / "td")
    meta = read_checkpoint_metadata(tmp_path / "td")
    assert meta["dtype"] == "bfloat16" and set(meta["hf_dtypes"]) == fp32
    torch_dist_to_hf(tmp_path / "td", tmp_path / "back")
    _same_tensors(tmp_path / "bf16", tmp_path / "back")
