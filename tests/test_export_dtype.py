"""Issue 30 (1, 2): a trained policy leaves at the precision it was trained in.

The source checkpoint is test_rl_e2e's tiny random Qwen3 saved in **bfloat16** (as SmolLM2's
asset is) and trained in float32 (``model.dtype: float32``). The exported folder is loaded with a
plain ``AutoModelForCausalLM.from_pretrained(OUT)`` (no dtype argument: transformers takes the
dtype that ``config.json`` states) and its logprobs are compared with the train engine's on the
same random token sequences: within 1e-5 for a full-parameter run and for a LoRA run (merged).
The merge itself is checked against ``W + (alpha / r) * B @ A`` computed here in float64.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from transformers import AutoConfig, GenerationMixin, Qwen3ForCausalLM  # noqa: F401  (before megatron's patches)

TOL = 1e-5
LENGTHS = (7, 12, 5)


def _bf16_assets(root: Path) -> Path:
    import torch
    from test_rl_e2e import _build_model

    _build_model(root / "fp32")
    model = Qwen3ForCausalLM.from_pretrained(root / "fp32", dtype=torch.float32).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    for f in (root / "fp32").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (root / "model" / f.name).write_bytes(f.read_bytes())
    assert json.loads((root / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    with open(root / "task.jsonl", "w") as f:
        for i in range(32):
            f.write(f'{{"prompt": "say {i}", "answer": "7"}}\n')
    return root


def _data(vocab: int):
    import torch

    from ferrule.megatron.batching import Datum

    g = torch.Generator().manual_seed(0)
    return [Datum(t[:-1].tolist(), {"target_tokens": t[1:].clone()})
            for t in (torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS)]


def _hf_logprobs(model, data):
    import torch

    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([d.model_input])).logits[0].double(), -1)
                .gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0] for d in data]


def _run(root: Path, run_dir: Path, extra: str = "") -> object:
    from test_rl_e2e import CONFIG

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer

    (root / "tiny.yaml").write_text(CONFIG + extra)
    cfg = load_config(root / "tiny.yaml", [f"model.hf_dir={root / 'model'}", f"data.jsonl_path={root / 'task.jsonl'}",
                                           f"logging.run_dir={run_dir}", "train.steps=2", "model.dtype=float32",
                                           "optimizer.lr=5e-2", "logging.plot_at_end=false"])
    trainer = GRPOTrainer(cfg)
    trainer.run()
    return trainer


def _export_cli(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    from inproc import run_ferrule

    return run_ferrule(["export", run_dir, out, *args], env=dict(os.environ, FERRULE_PLUGINS="qwen,inkling"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_of_fp32_training_from_a_bf16_source_loads_in_fp32(tmp_path, lora):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root = _bf16_assets(tmp_path / "assets")
    trainer = _run(root, tmp_path / "run", "lora: {rank: 4, alpha: 8, target_modules: all}\n" if lora else "")
    data = _data(AutoConfig.from_pretrained(root / "model").vocab_size)
    ours = trainer.engine.forward_logprobs(data)
    # the exports run as `ferrule export` does, in a process without a process group: with the trainer's still up,
    # each 1-rank export spawned an interpreter of its own (~10-20 s each on this machine)
    from ferrule.megatron.parallel import destroy_distributed

    del trainer
    destroy_distributed()

    out = tmp_path / "out"
    res = _export_cli(tmp_path / "run", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(float32)" in res.stderr and "Traceback" not in res.stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    model = AutoModelForCausalLM.from_pretrained(out)  # plain: the dtype config.json states
    assert model.dtype == torch.float32
    theirs = _hf_logprobs(model, data)
    assert max(float((a.double() - b).abs().max()) for a, b in zip(ours, theirs)) <= TOL
    base = _hf_logprobs(AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32), data)
    assert max(float((a - b).abs().max()) for a, b in zip(theirs, base)) > 1e-4  # the training is in it

    # the dtype asked for: bf16 weights, and config.json says bf16
    res = _export_cli(tmp_path / "run", tmp_path / "bf16", "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    bad = _export_cli(tmp_path / "run", tmp_path / "x", "--dtype", "float8")
    assert bad.returncode == 2 and "float8" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(120)
def test_merge_is_float32_and_warns_when_the_update_underflows(tmp_path):
    """merge_peft_adapter on a bf16 base: float32 output equals W + (alpha/r) B A in float64 within
    fp32 rounding; a bf16 output of a tiny update reports it lost (update_error near 1)."""
    import peft
    import torch
    from safetensors.torch import load_file

    from ferrule.converters.export import UNDERFLOW_WARN, merge_peft_adapter

    root = _bf16_assets(tmp_path / "assets")
    base = Qwen3ForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    rank, alpha = 4, 8
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(base, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 1e-4)  # far below bf16's resolution of weights ~0.02
    pm.save_pretrained(tmp_path / "adapter")
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    w0 = load_file(root / "model" / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    a = adapter[f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight"].double()
    b = adapter[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"].double()
    expected = w0[key].double() + (alpha / rank) * b @ a

    for dtype, lost in (("float32", False), ("bfloat16", True)):
        hf = tmp_path / dtype
        hf.mkdir()
        for f in (root / "model").iterdir():
            (hf / f.name).write_bytes(f.read_bytes())
        info = merge_peft_adapter(hf, tmp_path / "adapter", dtype=dtype)
        assert info["dtype"] == dtype and json.loads((hf / "config.json").read_text())["dtype"] == dtype
        merged = load_file(hf / "model.safetensors")[key]
        assert merged.dtype == getattr(torch, dtype)
        if lost:
            assert info["update_error"] > UNDERFLOW_WARN
        else:
            assert info["update_error"] < 1e-3
            torch.testing.assert_close(merged.double(), expected, rtol=0, atol=1e-7)
