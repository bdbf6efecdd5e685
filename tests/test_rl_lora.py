"""``ferrule train`` with a ``lora:`` section: config validation, and (with ferrule.lora) a LoRA GRPO run.

The run uses test_rl_e2e's tiny random Qwen3 with a character tokenizer; every sync is verified
(``check_weight_update_equal=True`` -> :func:`ferrule.sync.check_lora_adapter_equal`), the
rollout engine's base weights must stay bit-identical to the checkpoint (adapter-only sync, no
merge), and a resumed run must equal an uninterrupted one metric by metric.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ferrule.lora import MAX_LORA_RANK
from ferrule.rl.checkpoints import config_differences
from ferrule.rl.config import ConfigError, config_from_dict, load_config
from ferrule.rl.run_checks import lora_settings
from ferrule.serve.limits import ServeLimits

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"model": {"hf_dir": "some/hf"}, "data": {"task": "basic_arithmetic"}}
HAVE_LORA = importlib.util.find_spec("ferrule.lora") is not None


def _problems(raw) -> str:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    return "\n".join(exc.value.problems)


def test_lora_example_config_loads():
    cfg = load_config(REPO / "examples" / "configs" / "smollm2_arithmetic_lora.yaml")
    full = load_config(REPO / "examples" / "configs" / "smollm2_arithmetic.yaml")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (16, 32.0, "all")
    assert 1e-4 <= cfg.optimizer.lr <= 2e-4
    # side by side with the full-parameter run: only lora, the learning rate and the run folder differ
    diffs = {d.split(":")[0] for d in config_differences(full.to_dict(), cfg.to_dict())}
    assert diffs == {"lora.rank", "optimizer.lr"}
    assert full.lora.rank == 0


def test_lora_config_errors_name_the_key():
    assert "lora.rank: must be >= 0" in _problems({**MINIMAL, "lora": {"rank": -1}})
    text = _problems({**MINIMAL, "lora": {"alpha": 8, "use_rslora": True}})
    assert "lora.alpha, lora.use_rslora: set but lora.rank=0 (LoRA off)" in text
    text = _problems({**MINIMAL, "lora": {"rank": 8, "alpha": 0, "dropout": 1.0, "target_modules": "q_proj"}})
    assert "lora.alpha: must be > 0, got 0.0" in text
    assert "lora.dropout: must be in [0, 1), got 1.0" in text
    assert "lora.target_modules: 'q_proj' is neither 'all' nor a list; write a list of module names, e.g. [q_proj]" \
        in text
    assert "names a module twice" in _problems({**MINIMAL, "lora": {"rank": 8, "target_modules": ["q_proj", "q_proj"]}})
    assert "empty only with lora.target_parameters" in _problems({**MINIMAL, "lora": {"rank": 8, "target_modules": []}})
    assert "lora.target_parameters: set with lora.target_modules 'all'" in _problems(
        {**MINIMAL, "lora": {"rank": 8, "target_parameters": ["mlp.experts.down_proj"]}})
    assert "names a parameter twice" in _problems(
        {**MINIMAL, "lora": {"rank": 8, "target_modules": [], "target_parameters": ["a.b", "a.b"]}})
    assert "lora.rank: expected int" in _problems({**MINIMAL, "lora": {"rank": 1.5}})
    # up front, before any adapter is allocated: the limit ferrule serve's --max-lora-rank defaults to
    assert ServeLimits().max_lora_rank == MAX_LORA_RANK == 128
    assert ("lora.rank: 100000 is above the limit 128 (ferrule.lora.MAX_LORA_RANK, also the default of `ferrule serve "
            "--max-lora-rank`); set lora.rank <= 128") in _problems({**MINIMAL, "lora": {"rank": 100000}})
    assert config_from_dict({**MINIMAL, "lora": {"rank": MAX_LORA_RANK}}).lora.rank == MAX_LORA_RANK
    ok = config_from_dict({**MINIMAL, "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
                          ["lora.dropout=0.05"])
    assert ok.lora.target_modules == ["q_proj", "v_proj"] and ok.lora.dropout == 0.05


def test_lora_settings_from_the_config():
    assert lora_settings(config_from_dict(MINIMAL)) is None
    cfg = config_from_dict({**MINIMAL, "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                                "use_rslora": True}, "train": {"seed": 7}})
    if not HAVE_LORA:
        with pytest.raises(ConfigError, match="no ferrule.lora"):
            lora_settings(cfg)
        return
    from ferrule.lora import LoraSettings

    assert lora_settings(cfg) == LoraSettings(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"),
                                              use_rslora=True, init_seed=7)
    cfg = config_from_dict({**MINIMAL, "lora": {"rank": 8, "target_modules": ["o_proj"],
                                                "target_parameters": ["mlp.experts.down_proj"]}})
    assert lora_settings(cfg).target_parameters == ("mlp.experts.down_proj",)


def test_resume_refuses_a_changed_lora_section():
    a = config_from_dict({**MINIMAL, "lora": {"rank": 8}}).to_dict()
    b = config_from_dict({**MINIMAL, "lora": {"rank": 16}}).to_dict()
    assert config_differences(a, b) == ["lora.rank: checkpointed run has 8, this config has 16"]
    old = {k: v for k, v in config_from_dict(MINIMAL).to_dict().items() if k != "lora"}  # written before lora existed
    assert config_differences(old, config_from_dict(MINIMAL).to_dict()) == []


# ------------------------------------------------------------------ a LoRA run (needs ferrule.lora)
@pytest.mark.gpu  # also on CPU; on a CUDA machine it trains and syncs on the GPU
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_LORA, reason="ferrule.lora (the LoRA train side, branch issue13a) is not in this tree")
def test_lora_grpo_run_syncs_only_the_adapter_and_resumes_exactly(tmp_path):
    import torch
    from safetensors.torch import load_file
    from test_rl_e2e import CONFIG, _build_model, _comparable

    from ferrule.rl.loop import GRPOTrainer, train
    from ferrule.rl.metrics import read_metrics

    root = tmp_path / "assets"
    _build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(32):
            f.write(f'{{"prompt": "say {i}", "answer": "7"}}\n')
    (root / "tiny.yaml").write_text(CONFIG + "lora: {rank: 4, alpha: 8, target_modules: all}\n")
    base = load_file(str(root / "model" / "model.safetensors"))

    def overrides(run_dir, steps):
        return [f"model.hf_dir={root / 'model'}", f"data.jsonl_path={root / 'task.jsonl'}",
                f"logging.run_dir={run_dir}", f"train.steps={steps}", "optimizer.lr=5e-2"]

    full, split = tmp_path / "full", tmp_path / "split"
    trainer = GRPOTrainer(load_config(root / "tiny.yaml", overrides(full, 4)), check_weight_update_equal=True)
    trainer.run()
    assert trainer.engine.lora is not None and trainer.last_sync.checked
    adapter = trainer.rollout.get_lora_state_dict()
    assert adapter and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # the adapter trained
    for name, t in trainer.rollout.get_hf_state_dict().items():  # the base never moved
        if name in base:
            assert torch.equal(t.cpu(), base[name]), name
    metrics = read_metrics(full / "metrics.jsonl")
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    assert [m["sync_bytes"] for m in metrics] == [adapter_bytes] * 4

    # `ferrule export` of a LoRA run is the merged policy: the HF model it writes (PEFT's
    # merge_and_unload) gives the train engine's LoRA logprobs, not the base's
    import torch
    from transformers import AutoModelForCausalLM

    from ferrule.converters.export import export_run
    from ferrule.megatron.batching import Datum
    from ferrule.megatron.parallel import destroy_distributed

    g = torch.Generator().manual_seed(0)
    n_vocab = AutoModelForCausalLM.from_pretrained(root / "model").config.vocab_size
    data = [Datum(t[:-1].tolist(), {"target_tokens": t[1:].clone()})
            for t in (torch.randint(0, n_vocab, (n,), generator=g) for n in (7, 12, 5))]
    ours = trainer.engine.forward_logprobs(data)
    # the export runs as `ferrule export` does, in a process without a process group: with the trainer's still up,
    # the 1-rank export spawned an interpreter of its own
    del trainer
    destroy_distributed()
    step, merged_dir, _ = export_run(full, tmp_path / "merged")
    assert step == 4

    def hf_lp(model):
        with torch.no_grad():
            return [torch.log_softmax(model(torch.tensor([d.model_input])).logits[0].double(), -1)
                    .gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0] for d in data]

    merged = hf_lp(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32))
    base_lp = hf_lp(AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32))
    assert max(float((a.double() - b).abs().max()) for a, b in zip(ours, merged)) <= 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(merged, base_lp)) > 1e-4  # the adapter is in it
    assert (merged_dir / "tokenizer_config.json").is_file() and not list(tmp_path.glob(".merged.merge-*"))
    # `ferrule lora export` takes the run folder, a step folder or the engine folder alike
    from safetensors.torch import load_file as load_st

    from ferrule.cli.lora import export_adapter

    step_dir = full / "checkpoints" / "step_000004"
    outs = [export_adapter(src, tmp_path / f"adapter{i}") for i, src in enumerate((full, step_dir, step_dir / "engine"))]
    first_tensors = load_st(str(outs[0] / "adapter_model.safetensors"))
    assert all(lora_key in first_tensors for lora_key in (f"base_model.model.{k.removeprefix('base_model.model.')}"
                                                          for k in adapter))
    for o in outs[1:]:
        other = load_st(str(o / "adapter_model.safetensors"))
        assert other.keys() == first_tensors.keys() and all(torch.equal(other[k], first_tensors[k]) for k in other)
    with pytest.raises(FileNotFoundError, match="not a LoRA checkpoint"):
        export_adapter(tmp_path, tmp_path / "x")

    first = train(load_config(root / "tiny.yaml", overrides(split, 4)), stop_after=2)
    assert first.interrupted and first.last_step == 2
    train(load_config(root / "tiny.yaml", overrides(split, 4) + ["checkpoint.resume=true"]))
    assert _comparable(read_metrics(full / "metrics.jsonl")) == _comparable(read_metrics(split / "metrics.jsonl"))
