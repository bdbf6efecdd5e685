"""MXFP8 checkpoints in conversion: read dequantized as transformers reads them, written back bf16 or MXFP8.

Reference: transformers 5.24 itself. The tiny MXFP8 checkpoints are made with its quantizer op
(``integrations.finegrained_fp8.Fp8Quantize`` with ``FineGrainedFP8Config(quant_method="mxfp8",
weight_block_size=(1, 32), scale_fmt="ue8m0")``: ``from_pretrained`` refuses to quantize without a GPU,
the op itself is plain torch), with the E8M0 scales stored as ``uint8`` bytes as Inkling-2-Small-MXFP8
ships them; ``AutoModelForCausalLM.from_pretrained`` of that folder on CPU dequantizes it
(``Fp8Dequantize``) and is the reference every weight and logit is compared against, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from unittest import mock
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrule.conformance import numeric as cn
from ferrule.converters import CheckpointError, SafetensorsReader, hf_to_torch_dist, torch_dist_to_hf
from ferrule.converters.checkpoint import hf_to_torch_dist_bytes, read_checkpoint_metadata, torch_dist_to_hf_bytes
from ferrule.formats.quantized_weights import dequantize_block_fp8, open_hf_weights, quantize_mxfp8, requantize_exactly

#: every Linear of the decoder has both dims a multiple of the 32-wide MXFP8 block
CASES = {
    "qwen3": ("qwen3", {"intermediate_size": 64, "tie_word_embeddings": False, "num_key_value_heads": 2}),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 32, "intermediate_size": 64}),
}


def _hf_quantizer():
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class _Quantizer:  # the one attribute Fp8Quantize / Fp8Dequantize read
        quantization_config = FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=(1, 32), scale_fmt="ue8m0")

    return _Quantizer()


def make_mxfp8_dir(src: Path, out: Path) -> Path:
    """Quantize every decoder-layer Linear weight of ``src`` with transformers' ``Fp8Quantize`` (MXFP8)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = _hf_quantizer()
    op = Fp8Quantize(quantizer)
    tensors = {}
    for k, v in load_file(src / "model.safetensors").items():
        if ".layers." in k and k.endswith("proj.weight") and v.dim() == 2:
            for name, t in op.convert({k: v}).items():
                tensors[name] = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t
        else:
            tensors[k] = v
    shutil.copytree(src, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantizer.quantization_config.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    return out


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (path, info)
    return model.eval()


def test_block_arithmetic_is_transformers():
    """dequantize_block_fp8 / quantize_mxfp8 give exactly transformers' Fp8Dequantize / Fp8Quantize outputs."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(3, 8, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # stacked experts
    ref = Fp8Dequantize(_hf_quantizer())._dequantize_one
    byte_scales = torch.randint(100, 140, (3, 8, 2), dtype=torch.uint8, generator=g)
    for scales in (byte_scales, byte_scales.view(torch.float8_e8m0fnu),          # MXFP8 [1, 32]
                   torch.rand(3, 2, 4, generator=g) + 0.01):                     # fine-grained FP8 [4, 16], fp32
        for dtype in (torch.bfloat16, torch.float32):
            ours = dequantize_block_fp8(q, scales, dtype)
            assert ours.dtype == dtype and torch.equal(ours, ref(q, scales, output_dtype=dtype)), scales.dtype
    w = torch.randn(64, 96, generator=g) * 0.05
    w[:1, :32] = 0  # an all-zero block
    expected = Fp8Quantize(_hf_quantizer())._quantize_one("x.weight", w)
    values, scales = quantize_mxfp8(w, (1, 32), "F8_E8M0")
    assert torch.equal(values.view(torch.uint8), expected["x.weight"].view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), expected["x.weight_scale_inv"].view(torch.uint8))
    # the export's exact path: the same bytes back from the dequantized values and their own scales
    exact = dequantize_block_fp8(values, scales, torch.bfloat16)
    assert torch.equal(requantize_exactly(exact, scales).view(torch.uint8), values.view(torch.uint8))
    assert requantize_exactly(exact + 1e-3, scales) is None  # changed weights: no exact MXFP8 form


@pytest.mark.parametrize("case", sorted(CASES))
def test_mxfp8_source_converts_like_transformers_loads_it(case, tmp_path):
    family, overrides = CASES[case]
    src = make_mxfp8_dir(cn.tiny_hf_dir(family, tmp_path / "bf16", dtype="bfloat16", overrides=overrides),
                         tmp_path / "mxfp8")
    reference = _hf_model(src)  # transformers dequantizes on CPU
    ckpt = hf_to_torch_dist(src, tmp_path / "td")
    meta = json.loads((ckpt / "ferrule_checkpoint.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["hf_quantization"]["config"]["quant_method"] == "mxfp8"
    assert "quantization_config" not in json.loads((ckpt / "hf" / "config.json").read_text())

    back = torch_dist_to_hf(ckpt, tmp_path / "bf16_back")  # default: dequantized, in bf16
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    assert {SafetensorsReader(back).dtype_name(k) for k in SafetensorsReader(back).keys()} == {"BF16"}
    exported = _hf_model(back)
    ref_sd, out_sd = reference.state_dict(), exported.state_dict()
    assert ref_sd.keys() == out_sd.keys()
    for k in ref_sd:
        assert ref_sd[k].dtype == out_sd[k].dtype and torch.equal(ref_sd[k], out_sd[k]), k
    ids = cn.test_token_ids(reference.config.vocab_size, 8)
    with torch.no_grad():
        assert torch.equal(reference(input_ids=ids).logits, exported(input_ids=ids).logits)

    again = torch_dist_to_hf(ckpt, tmp_path / "mxfp8_back", mxfp8=True)
    a, b = SafetensorsReader(src), SafetensorsReader(again)
    assert a.keys() == b.keys(), sorted(set(a.keys()) ^ set(b.keys()))
    for k in a.keys():
        assert a.dtype_name(k) == b.dtype_name(k) and torch.equal(a.get(k).view(torch.uint8),
                                                                 b.get(k).view(torch.uint8)), k
    assert json.loads((again / "config.json").read_text())["quantization_config"] == \
        json.loads((src / "config.json").read_text())["quantization_config"]
    _hf_model(again)
    # the free-space check sizes an --mxfp8 export as MXFP8 (within 10% of the bytes written; the check adds a 5% margin),
    # not as the bf16 export, which would refuse a disk the MXFP8 folder fits on
    from ferrule.fs.output_dir import torch_dist_model_bytes
    from ferrule.converters.quantized import mxfp8_bytes_saved
    from ferrule.converters.checkpoint import TRAINING_STATE_PREFIXES

    written = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in (back, again)}
    bf16_estimate = torch_dist_model_bytes(ckpt, "bfloat16", TRAINING_STATE_PREFIXES)
    mx_estimate = bf16_estimate - mxfp8_bytes_saved(meta, ckpt, "bfloat16")
    assert 0.9 * written[again] <= mx_estimate <= 1.1 * written[again] < written[back], (written, mx_estimate)
    real_usage = shutil.disk_usage
    # a disk with room for the MXFP8 folder (+20%) but not for the bf16 one: --mxfp8 is written
    with mock.patch("shutil.disk_usage", lambda p: real_usage(p)._replace(free=int(1.2 * written[again]))):
        torch_dist_to_hf(ckpt, tmp_path / "mxfp8_on_a_small_disk", mxfp8=True)


@pytest.fixture(scope="module")
def mxfp8_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mx")
    family, overrides = CASES["qwen3"]
    return make_mxfp8_dir(cn.tiny_hf_dir(family, root / "bf16", dtype="bfloat16", overrides=overrides), root / "q")


def _edit(src: Path, dst: Path, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_bad_quantized_checkpoints_are_refused(mxfp8_dir, tmp_path):
    gptq = _edit(mxfp8_dir, tmp_path / "gptq", config=lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(CheckpointError, match="quant_method 'gptq'.*reads only"):
        hf_to_torch_dist(gptq, tmp_path / "out1")
    orphan = _edit(mxfp8_dir, tmp_path / "orphan",
                   tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight_scale_inv is a scale without its weight"):
        open_hf_weights(orphan)
    unscaled = _edit(mxfp8_dir, tmp_path / "unscaled",
                     tensors=lambda t: t.pop("model.layers.1.self_attn.q_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.q_proj.weight is F8_E4M3 but has no scale"):
        open_hf_weights(unscaled)
    unconfigured = _edit(mxfp8_dir, tmp_path / "unconfigured", config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="FP8 weights carry block scales .* no quantization_config"):
        open_hf_weights(unconfigured)
    as_string = _edit(mxfp8_dir, tmp_path / "as_string", config=lambda c: c.update(quantization_config="mxfp8"))
    with pytest.raises(CheckpointError, match="quantization_config is a str"):
        open_hf_weights(as_string)
    ragged = _edit(mxfp8_dir, tmp_path / "ragged", tensors=lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight_scale_inv": torch.zeros(64, 3, dtype=torch.uint8)}))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv \(64, 3\) does not tile"):
        open_hf_weights(ragged)
    plain = cn.tiny_hf_dir("qwen3", tmp_path / "plain")
    ckpt = hf_to_torch_dist(plain, tmp_path / "td")
    with pytest.raises(CheckpointError, match="--keep-quantized: the source HF checkpoint .* was not quantized"):
        torch_dist_to_hf(ckpt, tmp_path / "back", mxfp8=True)
    assert not (tmp_path / "back").exists() and not (tmp_path / "out1").exists()


def test_inkling2_released_mxfp8_experts(tmp_path):
    """Inkling-2's released layout: MXFP8 routed experts ``mlp.experts.{w13,w2}_weight`` ``[E, rows, cols]`` with
    ``uint8`` E8M0 scales ``..._weight_scale`` ``[E, rows, cols / 32]``, the padded unembedding beside.

    transformers 5.24 cannot be the loader here: on CPU it dequantizes by the model's parameter names and reports
    the expert scales as unexpected keys, loading the raw FP8 values unscaled (its Inkling-2 expert path keeps them
    quantized, on GPU only). The reference is therefore its arithmetic applied by hand (``Fp8Dequantize._dequantize_one``
    on each expert tensor and its scale) written as a bf16 folder, which transformers then loads cleanly.
    """
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    src = cn.tiny_hf_dir("inkling2_text", tmp_path / "bf16", dtype="bfloat16", overrides={"moe_intermediate_size": 32})
    quantizer = _hf_quantizer()
    quantized, dequantized = {}, {}
    for k, v in load_file(src / "model.safetensors").items():
        quantized[k] = dequantized[k] = v
        if k.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")):
            out = Fp8Quantize(quantizer)._quantize_one(k, v)
            quantized[k], quantized[k + "_scale"] = out[k], out[k + "_scale_inv"].view(torch.uint8)
            dequantized[k] = Fp8Dequantize(quantizer)._dequantize_one(out[k], quantized[k + "_scale"], torch.bfloat16)
    assert sum(k.endswith("_weight_scale") for k in quantized) == 2 * 4  # 4 MoE layers
    mx = tmp_path / "mxfp8"
    shutil.copytree(src, mx)
    save_file(quantized, mx / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = quantizer.quantization_config.to_dict()
    (mx / "config.json").write_text(json.dumps(config, indent=2))
    ref_dir = tmp_path / "reference"
    shutil.copytree(src, ref_dir)
    save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})

    # the progress bars' units: each HF tensor once (a stacked-expert tensor is read once per expert), and
    # an export counts the bytes of the dequantized tensors with or without --mxfp8; they add up to the totals
    loaded, exported_bytes, requantized_bytes = [], [], []
    ckpt = hf_to_torch_dist(mx, tmp_path / "td", progress=loaded.append)
    back = torch_dist_to_hf(ckpt, tmp_path / "back", progress=exported_bytes.append)
    assert sum(loaded) == hf_to_torch_dist_bytes(mx) == SafetensorsReader(ref_dir).total_bytes()
    total = torch_dist_to_hf_bytes(read_checkpoint_metadata(ckpt))
    assert sum(exported_bytes) == total == SafetensorsReader(back).total_bytes()
    a, b = SafetensorsReader(ref_dir), SafetensorsReader(back)
    assert a.keys() == b.keys(), sorted(set(a.keys()) ^ set(b.keys()))
    for k in a.keys():
        assert a.dtype_name(k) == b.dtype_name(k) and torch.equal(a.get(k), b.get(k)), k
    reference, exported = _hf_model(ref_dir), _hf_model(back)
    ids = cn.test_token_ids(90, 8)
    with torch.no_grad():
        assert torch.equal(reference(input_ids=ids).logits, exported(input_ids=ids).logits)
    again = torch_dist_to_hf(ckpt, tmp_path / "mxfp8_back", keep_quantized=True, progress=requantized_bytes.append)
    assert sum(requantized_bytes) == total
    a, b = SafetensorsReader(mx), SafetensorsReader(again)
    assert a.keys() == b.keys()
    for k in a.keys():
        assert a.dtype_name(k) == b.dtype_name(k) and torch.equal(a.get(k).view(torch.uint8), b.get(k).view(torch.uint8)), k
    # ferrule check on the MXFP8 folder: transformers' CPU load of it keeps the experts' raw FP8 values (unexpected
    # scales), so the check's HF referee is the folder dequantized; it failed with logits off by 0.78 before
    from ferrule.converters.check import run_check

    report = run_check(mx, seq_len=12)
    rows = [(r.step, r.status) for r in report.rows]
    assert rows == [("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"),
                    ("logits (tp=1, fp32)", "ok")], [(r.step, r.status, r.detail) for r in report.rows]
    assert "dequantized" in report.rows[-1].detail


@pytest.mark.timeout(600)
def test_ferrule_check_passes_on_an_mxfp8_checkpoint(mxfp8_dir):
    """``ferrule check`` compares the round trip with the source as transformers reads it (dequantized)."""
    from ferrule.converters.check import run_check

    report = run_check(mxfp8_dir, seq_len=12)
    assert [(r.step, r.status) for r in report.rows] == [
        ("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"), ("logits (tp=1, fp32)", "ok")], \
        [(r.step, r.status, r.detail) for r in report.rows]


def test_export_of_a_checkpoint_whose_config_still_says_mxfp8_drops_it(mxfp8_dir, tmp_path):
    """A training checkpoint of a run started from an MXFP8 folder keeps that config (with quantization_config)
    in its hf/; its export holds dequantized weights, so the exported config.json must not claim MXFP8
    (transformers would expect weight_scale_inv tensors on GPU)."""
    from ferrule.fs.integrity import record_checksums

    ckpt = hf_to_torch_dist(mxfp8_dir, tmp_path / "td")
    config_path = ckpt / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = json.loads((mxfp8_dir / "config.json").read_text())["quantization_config"]
    config_path.write_text(json.dumps(config))
    (ckpt / "checksums.json").unlink()
    record_checksums(ckpt)
    back = torch_dist_to_hf(ckpt, tmp_path / "back")
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    _hf_model(back)
