"""NVFP4 checkpoints (the released Inkling-2-Mini expert layout) in conversion: read as transformers reads them.

Reference: transformers 5.24 itself. The tiny NVFP4 checkpoint is made here by hand from the format's
definition (E2M1 codes from their sign / exponent / mantissa bits, two per byte with the even element in the
low nibble; one float8_e4m3fn block scale per 16 values; a per-expert ``amax / outer_scale_denominator``)
under the names transformers' ``inkling2_loop_text`` conversion patterns read
(``mlp.experts.{w13,w2}_weight`` + ``_weight_scale``, ``_weight_amax``, ``_weight_outer_scale_denominator``),
with no ``quantization_config`` (transformers dequantizes these by name; its NVFP4 quantizer refuses
pre-quantized checkpoints). ``Inkling2LoopForCausalLM.from_pretrained`` of that folder (its
``Inkling2LoopDequantizeExperts``) is the referee for every weight, bit for bit, and for the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrule.conformance import numeric as cn
from ferrule.converters import CheckpointError, SafetensorsReader, hf_to_torch_dist, torch_dist_to_hf
from ferrule.formats.nvfp4 import dequantize_nvfp4, e2m1_values
from ferrule.formats.quantized_weights import open_hf_weights

#: tiny loop model; 2 KV heads everywhere so that TP=2 splits it
OVERRIDES = {"num_key_value_heads": 2}
#: E2M1 magnitudes of codes 0..7 (OCP MX v1.0 FP4), written out independently of ferrule.formats.nvfp4
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: NVFP4's per-tensor scale convention: amax maps to the largest E2M1 (6) times the largest E4M3 (448)
DENOMINATOR = 6.0 * 448.0
#: layer whose w13 is stored MXFP8 instead (the original loop checkpoints mix both; transformers reads both)
MXFP8_LAYER = 4


def quantize_nvfp4_by_hand(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[E, rows, cols]`` -> the four NVFP4 tensors (codes, block scales, amax, denominator), from the definition."""
    w = w.float()
    e, rows, cols = w.shape
    amax = w.abs().amax(dim=(1, 2))
    factor = amax / DENOMINATOR
    blocks = w.reshape(e, rows, cols // 16, 16)
    scale = (blocks.abs().amax(-1) / (6.0 * factor[:, None, None])).to(torch.float8_e4m3fn)
    scale = torch.where(scale.float() == 0, torch.tensor(2.0 ** -9).to(torch.float8_e4m3fn), scale)
    x = blocks / (scale.float()[..., None] * factor[:, None, None, None])
    mags = torch.tensor(E2M1_MAGNITUDES)
    codes = (x.abs()[..., None] - mags).abs().argmin(-1) | ((x < 0) | ((x == 0) & x.signbit())).long() << 3
    codes = codes.reshape(e, rows, cols)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return {"": packed, "_scale": scale, "_amax": amax}


def quantize_mxfp8_by_hand(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[E, rows, cols]`` -> float8_e4m3fn values + uint8 E8M0 exponents per 32 values (OCP MX v1.0)."""
    w = w.float()
    e, rows, cols = w.shape
    blocks = w.reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0 ** -100) / 448.0))
    values = (blocks / torch.exp2(exp)[..., None]).to(torch.float8_e4m3fn).reshape(e, rows, cols)
    return {"": values, "_scale": (exp + 127).to(torch.uint8)}


def make_nvfp4_dir(src: Path, out: Path) -> Path:
    """Quantize every routed-expert weight of ``src`` (released layout): NVFP4, except ``MXFP8_LAYER``'s w13."""
    tensors = {}
    for k, v in load_file(src / "model.safetensors").items():
        if not k.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")):
            tensors[k] = v
            continue
        if f".layers.{MXFP8_LAYER}." in k and k.endswith("w13_weight"):
            tensors.update({k + s: t for s, t in quantize_mxfp8_by_hand(v).items()})
            continue
        parts = quantize_nvfp4_by_hand(v)
        tensors.update({k + s: t for s, t in parts.items()})
        # w13: one denominator per expert; w2: one for the tensor (both forms broadcast in transformers)
        shape = (v.shape[0],) if k.endswith("w13_weight") else ()
        tensors[k + "_outer_scale_denominator"] = torch.full(shape, DENOMINATOR)
    shutil.copytree(src, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert not json.loads((out / "config.json").read_text()).get("quantization_config")
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so that -0.0 and 0.0 differ)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_tensors(a, b, upcast: bool = False) -> None:
    """Same keys, dtypes, shapes and bits; ``upcast``: ``b``'s tensors widened to ``a``'s dtype first (exact)."""
    assert sorted(a.keys()) == sorted(b.keys()), sorted(set(a.keys()) ^ set(b.keys()))
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        y = y.to(x.dtype) if upcast else y
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)), k


def _hf(path: Path, dtype=None):
    from transformers import Inkling2LoopForCausalLM

    kw = {} if dtype is None else {"dtype": dtype}
    model, info = Inkling2LoopForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nvfp4")
    # saved again by transformers, so that its fp32-kept tensors (attention-residual queries, convolutions, router
    # bias) are stored in fp32 as a released checkpoint stores them
    _hf(cn.tiny_hf_dir("inkling2_loop", root / "tiny", dtype="bfloat16", overrides=OVERRIDES)).save_pretrained(
        root / "bf16")
    return make_nvfp4_dir(root / "bf16", root / "q")


def test_e2m1_table_and_dequantization_are_transformers():
    """Every byte value, both denominator forms, bf16 and fp32: == Inkling2LoopDequantizeExperts, bit for bit."""
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts

    assert e2m1_values().tolist() == list(Inkling2LoopDequantizeExperts.E2M1_VALUES)
    g = torch.Generator().manual_seed(0)
    experts, rows, cols = 10, 16, 64  # more experts than its chunk of 8
    packed = torch.arange(experts * rows * cols // 2).remainder(256).to(torch.uint8).reshape(experts, rows, cols // 2)
    scale = (torch.rand(experts, rows, cols // 16, generator=g) * 300).to(torch.float8_e4m3fn)
    amax = torch.rand(experts, generator=g) * 3
    op = Inkling2LoopDequantizeExperts()
    patterns = ["w", "w_scale", "w_amax", "w_den"]
    for denominator in (torch.tensor(DENOMINATOR), torch.rand(experts, generator=g) * 2000 + 1):
        for dtype in (torch.bfloat16, torch.float32):
            model = torch.nn.Module()
            model.p = torch.nn.Parameter(torch.empty(0, dtype=dtype))
            ref = op.convert({"w": packed, "w_scale": scale, "w_amax": amax, "w_den": denominator}, patterns, ["out"],
                             model=model, full_layer_name="p")["out"]
            ours = dequantize_nvfp4(packed, scale, amax, denominator, dtype)
            assert ours.dtype == ref.dtype == dtype and torch.equal(_bits(ours), _bits(ref))


def test_nvfp4_source_reads_converts_and_exports_as_transformers_loads_it(nvfp4_dir, tmp_path):
    raw = SafetensorsReader(nvfp4_dir)
    assert {raw.dtype_name(k) for k in raw.keys() if k.endswith("w2_weight")} == {"U8"}
    # the referee's weights, back in the released layout by transformers' own reverse conversion
    for dtype, name in ((None, "bfloat16"), (torch.float32, "float32")):
        _hf(nvfp4_dir, dtype).save_pretrained(tmp_path / f"ref_{name}")
        ours = open_hf_weights(nvfp4_dir) if dtype is None else open_hf_weights(nvfp4_dir, dtype=name)
        # fp32: transformers widens the bf16 tensors too (exact); the dequantized ones ferrule makes in fp32 itself
        assert ours.get("model.llm.layers.0.mlp.experts.w2_weight").dtype == getattr(torch, name)
        _assert_same_tensors(SafetensorsReader(tmp_path / f"ref_{name}"), ours, upcast=dtype is not None)
    bf16_ref = SafetensorsReader(tmp_path / "ref_bfloat16")
    w13 = "model.llm.layers.1.mlp.experts.w13_weight"
    assert bf16_ref.dtype_name(w13) == "BF16" and bf16_ref.get(w13).float().abs().max() > 0

    ckpt = hf_to_torch_dist(nvfp4_dir, tmp_path / "td")
    meta = json.loads((ckpt / "ferrule_checkpoint.json").read_text())
    fmt = {k: t.get("format", "block_fp8") for k, t in meta["hf_quantization"]["tensors"].items()}
    assert sorted(fmt.values()).count("nvfp4") == 2 * 5 - 1 and list(fmt.values()).count("block_fp8") == 1, fmt
    back = torch_dist_to_hf(ckpt, tmp_path / "back")  # dequantized, bf16
    _assert_same_tensors(bf16_ref, SafetensorsReader(back))
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    _hf(back)
    # --keep-quantized (the CLI; --mxfp8 is its older name, which NVFP4 outgrew): the tensors the source stored
    # quantized come back as it stored them, byte for byte
    from typer.testing import CliRunner

    from ferrule.cli import app

    for flag in ("--keep-quantized", "--mxfp8"):
        res = CliRunner().invoke(app, ["convert", "torch-dist-to-hf", str(ckpt), str(tmp_path / flag), flag])
        assert res.exit_code == 0, res.output
        _assert_same_tensors(raw, SafetensorsReader(tmp_path / flag))
    again = tmp_path / "--keep-quantized"
    assert "quantization_config" not in json.loads((again / "config.json").read_text())
    _assert_same_tensors(bf16_ref, open_hf_weights(again))
    _hf(again)


def test_nvfp4_exact_requantization():
    """requantize_nvfp4_exactly gives back the codes (-0.0 kept) of unchanged values and None for changed ones."""
    from ferrule.formats.nvfp4 import requantize_nvfp4_exactly

    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 8, 16), dtype=torch.uint8, generator=g)
    scale = (torch.rand(3, 8, 2, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
    amax, den = torch.rand(3, generator=g) + 0.1, torch.tensor(DENOMINATOR)
    for dtype in (torch.bfloat16, torch.float32):
        values = dequantize_nvfp4(packed, scale, amax, den, dtype)
        assert torch.equal(requantize_nvfp4_exactly(values, scale, amax, den), packed)
        changed = values.clone()
        changed[1, 2, 3] = changed[1, 2, 3] * 1.01 + 1e-3
        assert requantize_nvfp4_exactly(changed, scale, amax, den) is None


@pytest.mark.timeout(600)
def test_ferrule_check_on_an_nvfp4_checkpoint_matches_transformers_logits(nvfp4_dir):
    """``ferrule check``: converted at fp32, round trip bit-exact, megatron logits vs from_pretrained(fp32) <= 1e-5."""
    from ferrule.converters.check import run_check

    report = run_check(nvfp4_dir, seq_len=12, family="inkling2_loop")
    rows = [(r.step, r.status) for r in report.rows]
    assert rows == [("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"),
                    ("logits (tp=1, fp32)", "ok")], [(r.step, r.status, r.detail) for r in report.rows]


def _edit(src: Path, dst: Path, tensors) -> Path:
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    tensors(t)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


W = "model.llm.layers.2.mlp.experts.w2_weight"
BAD = {
    "no_scale": (lambda t: t.pop(W + "_scale"), rf"NVFP4 weight {W} lacks \['{W}_scale'\]"),
    "no_amax": (lambda t: t.pop(W + "_amax"), rf"NVFP4 weight {W} lacks \['{W}_amax'\]"),
    "no_factors": (lambda t: (t.pop(W + "_amax"), t.pop(W + "_outer_scale_denominator")),
                   rf"NVFP4 weight {W} lacks \['{W}_amax', '{W}_outer_scale_denominator'\]"),
    "no_weight": (lambda t: t.pop(W), rf"NVFP4 weight {W} lacks \['{W}'\]"),
    "odd_block": (lambda t: t.update({W + "_scale": torch.ones(4, 32, 2).to(torch.float8_e4m3fn)}),
                  rf"NVFP4 block scale {W}_scale \(4, 32, 2\) does not tile {W} \(4, 32, 8\)"),
    "scale_dtype": (lambda t: t.update({W + "_scale": t[W + "_scale"].float()}),
                    rf"NVFP4 block scale {W}_scale is F32, expected F8_E4M3"),
    "amax_shape": (lambda t: t.update({W + "_amax": torch.ones(3)}), rf"NVFP4 amax {W}_amax has shape \(3,\)"),
    "codes_dtype": (lambda t: t.update({W: t[W].to(torch.int16)}), rf"NVFP4 weight {W} is I16, expected U8"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_nvfp4_tensors_are_refused_in_one_line(nvfp4_dir, tmp_path, case):
    edit, message = BAD[case]
    bad = _edit(nvfp4_dir, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=message) as exc:
        hf_to_torch_dist(bad, tmp_path / "out")
    assert "\n" not in str(exc.value) and not (tmp_path / "out").exists()
