"""HF -> torch_dist -> HF conversion of tiny random Qwen models, and bad-input handling.

Reference: the safetensors files transformers' ``save_pretrained`` wrote (round trip must be
bit-exact, dtype included) and transformers' own loader (a sharded output must load and give the
same logits as the source model).
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
from ferrule.mapping import MappingError

CASES = {
    # family, overrides
    "qwen2_gqa_bias": ("qwen2", {}),
    "qwen3_tied_mqa_headdim16": ("qwen3", {}),  # 1 KV head, head_dim 16 != 32/4, tied
    "qwen3_untied": ("qwen3", {"tie_word_embeddings": False, "num_key_value_heads": 2}),
    "qwen3_moe": ("qwen3_moe", {}),
}


def _assert_same_files(a_dir: Path, b_dir: Path) -> None:
    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    assert a.keys() == b.keys(), sorted(set(a.keys()) ^ set(b.keys()))
    for k in a.keys():
        ta, tb = a.get(k), b.get(k)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), k


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"temporary output left behind: {leftovers}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_bit_exact(case, tmp_path):
    family, overrides = CASES[case]
    src = cn.tiny_hf_dir(family, tmp_path / "hf", overrides=overrides)
    ckpt = hf_to_torch_dist(src, tmp_path / "td")
    meta = json.loads((ckpt / "ferrule_checkpoint.json").read_text())
    assert meta["family"] == family and meta["dtype"] == "float32"
    assert (ckpt / "metadata.json").is_file() and (ckpt / "hf" / "config.json").is_file()
    back = torch_dist_to_hf(ckpt, tmp_path / "back")
    _assert_same_files(src, back)
    assert json.loads((src / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    assert (back / "generation_config.json").is_file()
    if overrides.get("tie_word_embeddings", cn.tiny_hf_config(family)["tie_word_embeddings"]):
        assert "lm_head.weight" not in SafetensorsReader(back)


def test_bf16_sharded_input_and_output_load_in_transformers(tmp_path):
    """bf16 stays bf16; sharded input (index json) is read; sharded output loads in transformers."""
    from transformers import AutoModelForCausalLM

    src = cn.tiny_hf_dir("qwen3", tmp_path / "hf1", dtype="bfloat16", overrides={"num_key_value_heads": 2})
    # re-save as several shards with transformers itself
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ckpt = hf_to_torch_dist(tmp_path / "hf", tmp_path / "td")
    assert json.loads((ckpt / "ferrule_checkpoint.json").read_text())["dtype"] == "bfloat16"
    back = torch_dist_to_hf(ckpt, tmp_path / "back", max_shard_bytes=16 * 1024)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_same_files(tmp_path / "hf", back)
    ids = torch.arange(12).view(2, 6)
    reloaded = AutoModelForCausalLM.from_pretrained(back, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return cn.tiny_hf_dir("qwen2", tmp_path_factory.mktemp("src") / "hf")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(hf_dir: Path, edit) -> None:
    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def test_truncated_shard(qwen2_dir, tmp_path):
    bad = _copy(qwen2_dir, tmp_path / "hf")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        hf_to_torch_dist(bad, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_missing_shard(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    bad = tmp_path / "hf"
    AutoModelForCausalLM.from_pretrained(qwen2_dir).save_pretrained(bad, max_shard_size="20KB")
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing"):
        hf_to_torch_dist(bad, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_a_shard_tensor_the_index_omits_is_refused_naming_it(qwen2_dir, tmp_path):
    """Issue 45.7: a 1-d tensor in a shard that model.safetensors.index.json omits was dropped silently (as
    transformers, which loads by the index, drops it)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ferrule.formats.safetensors_io import SafetensorsReader

    bad = tmp_path / "hf"
    AutoModelForCausalLM.from_pretrained(qwen2_dir).save_pretrained(bad, max_shard_size="20KB")
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    save_file({**tensors, "model.extra_bias": torch.ones(8)}, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shard.name} holds 1 tensor\(s\) that .*index.json does not map to "
                                              r"it, e.g. \['model.extra_bias'\]; transformers loads by the index"):
        SafetensorsReader(bad)
    with pytest.raises(CheckpointError, match="model.extra_bias"):
        hf_to_torch_dist(bad, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_unsupported_model_type(qwen2_dir, tmp_path):
    from ferrule.contract.registry import UnknownModelError

    bad = _copy(qwen2_dir, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt_bigcode_unknown"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownModelError, match="gpt_bigcode_unknown"):
        hf_to_torch_dist(bad, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_shape_mismatch(qwen2_dir, tmp_path):
    bad = _copy(qwen2_dir, tmp_path / "hf")
    _edit_tensors(bad, lambda t: t.update({"model.layers.1.mlp.down_proj.weight": torch.zeros(32, 40)}))
    with pytest.raises(MappingError, match=r"shape mismatch \(1\)") as exc:
        hf_to_torch_dist(bad, tmp_path / "out")
    assert "decoder.layers.1.mlp.linear_fc2.weight" in str(exc.value)
    _assert_nothing_written(tmp_path / "out")


def test_extra_and_missing_keys_all_listed(qwen2_dir, tmp_path):
    bad = _copy(qwen2_dir, tmp_path / "hf")

    def edit(t):
        del t["model.layers.0.self_attn.k_proj.bias"]
        del t["model.norm.weight"]
        t["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
        t["visual.patch_embed.weight"] = torch.zeros(2)
    _edit_tensors(bad, edit)
    with pytest.raises(MappingError) as exc:
        hf_to_torch_dist(bad, tmp_path / "out")
    msg = str(exc.value)
    assert "missing from the checkpoint (2)" in msg and "neither mapped nor ignored (2)" in msg
    for key in ("model.layers.0.self_attn.k_proj.bias", "model.norm.weight", "model.layers.0.mlp.bogus.weight",
                "visual.patch_embed.weight"):
        assert key in msg
    _assert_nothing_written(tmp_path / "out")


def test_existing_output_refused_unless_overwrite(qwen2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--overwrite"):
        hf_to_torch_dist(qwen2_dir, out)
    assert (out / "keep.txt").read_text() == "user data"
    hf_to_torch_dist(qwen2_dir, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "metadata.json").is_file()
    back = tmp_path / "back"
    back.mkdir()
    with pytest.raises(FileExistsError):
        torch_dist_to_hf(out, back)


def test_not_a_checkpoint_and_bad_layout(qwen2_dir, tmp_path):
    from ferrule.megatron.parallel import ParallelLayoutError

    with pytest.raises(CheckpointError, match="not a ferrule torch_dist checkpoint"):
        torch_dist_to_hf(qwen2_dir, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
    with pytest.raises(ParallelLayoutError):
        hf_to_torch_dist(qwen2_dir, tmp_path / "out2", tp=0)
    _assert_nothing_written(tmp_path / "out2")


@pytest.mark.slow
def test_tp2_conversion_spawns_two_processes(qwen2_dir, tmp_path, capfd):
    """tp=2 runs two gloo workers; the result round-trips exactly; an impossible TP fails cleanly.
    megatron's save finds an empty folder (the ranks' rendezvous folder is beside it): it printed
    "Overwriting old incomplete / corrupted checkpoint..." for every multi-process conversion."""
    ckpt = hf_to_torch_dist(qwen2_dir, tmp_path / "td_tp2", tp=2)
    assert "Overwriting" not in capfd.readouterr().err
    assert json.loads((ckpt / "ferrule_checkpoint.json").read_text())["saved_layout"] == {"tp": 2, "pp": 1, "ep": 1}
    assert (ckpt / "__1_0.distcp").is_file()  # rank 1 wrote its shard
    _assert_same_files(qwen2_dir, torch_dist_to_hf(ckpt, tmp_path / "back_tp2"))  # loaded at TP=1
    # (EP=2 save / TP=2 load of MoE is covered by plugins/qwen/tests/test_qwen_parity.py's torchrun launch)
    src = cn.tiny_hf_dir("qwen3", tmp_path / "hf")  # 1 KV head: TP=2 impossible
    with pytest.raises(ValueError, match="tp=2 must divide"):
        hf_to_torch_dist(src, tmp_path / "out", tp=2)
    _assert_nothing_written(tmp_path / "out")


def test_ignored_source_tensors_are_reported_on_export(qwen2_dir, tmp_path, monkeypatch):
    """A source tensor the table Ignores is named on export, and is an error unless HF drops it too."""
    import dataclasses

    from ferrule.converters import checkpoint as ck
    from ferrule.mapping import Ignore

    src = tmp_path / "hf"
    shutil.copytree(qwen2_dir, src)
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.self_attn.rotary_emb.inv_freq"
    tensors[key] = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    ckpt = hf_to_torch_dist(src, tmp_path / "td")
    meta = ck.read_checkpoint_metadata(ckpt)
    assert meta["hf_ignored"] == [key]
    back = torch_dist_to_hf(ckpt, tmp_path / "back")  # qwen2 marks inv_freq unused_by_hf: allowed
    assert key not in SafetensorsReader(back)
    table = ck._family_parts(json.loads((src / "config.json").read_text()))[2]
    dropped = ck.dropped_hf_tensors(meta, table)
    assert [(k, row.unused_by_hf) for k, row in dropped] == [(key, True)]
    # the same tensor ignored by a row that does not say HF drops it too: an error naming it
    strict = dataclasses.replace(table, ignores=(Ignore("model.layers.*.self_attn.rotary_emb.inv_freq",
                                                        reason="test: HF loads this"),))
    real = ck._family_parts
    monkeypatch.setattr(ck, "_family_parts", lambda cfg, family=None: (*real(cfg, family)[:2], strict))
    with pytest.raises(CheckpointError, match=r"lack them.*model\.layers\.1\.self_attn\.rotary_emb\.inv_freq"):
        torch_dist_to_hf(ckpt, tmp_path / "back2")
    _assert_nothing_written(tmp_path / "back2")


def test_single_process_conversion_takes_no_tcp_port(qwen2_dir, tmp_path, monkeypatch):
    """Issue 30.3: a one-rank conversion (and so ``ferrule export``) used a "free" TCP port for its
    process group, and lost the race for it on a busy machine (``DistNetworkError ... EADDRINUSE``).
    Here every port ferrule might pick is one that is already taken: the conversion must not care."""
    import socket

    import ferrule.converters.checkpoint as conv
    import ferrule.megatron.parallel as parallel

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for module in (conv, parallel):
            monkeypatch.setattr(module, "_free_port", lambda: port, raising=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        ckpt = hf_to_torch_dist(qwen2_dir, tmp_path / "td")
        _assert_same_files(qwen2_dir, torch_dist_to_hf(ckpt, tmp_path / "back"))


def test_a_parameter_the_sharded_state_dict_leaves_out_is_refused_at_convert(qwen2_dir, tmp_path, monkeypatch):
    """A provider module whose ``sharded_state_dict()`` omits a parameter (gpt-oss's attention sinks in a plugin
    author's custom attention): the conversion wrote a checkpoint without it and exited 0; now it names the
    parameter and the fix, and writes nothing."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    full = TransformerLayer.sharded_state_dict

    def without_input_norm(self, *args, **kwargs):
        return {k: v for k, v in full(self, *args, **kwargs).items() if "input_layernorm" not in k}

    monkeypatch.setattr(TransformerLayer, "sharded_state_dict", without_input_norm)
    with pytest.raises(CheckpointError, match=r"sharded_state_dict\(\) does not return.*"
                                              r"decoder\.layers\.0\.input_layernorm\.weight, "
                                              r"decoder\.layers\.1\.input_layernorm\.weight\..*must return it"):
        hf_to_torch_dist(qwen2_dir, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
