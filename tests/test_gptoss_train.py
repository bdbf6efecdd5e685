"""3 GRPO steps of the gpt-oss-shaped fixture family (tests/fixtures/ferrule-gptoss-fixture) on CPU.

Its own file: the in-process run leaves megatron's process groups initialised for the rest of its module, and
``ferrule check`` in tests/test_gptoss_family.py would then take the multi-process path (10x slower).
References: HF transformers' ``GptOssForCausalLM`` (the rollout engine's model), the trained weights (the rollout
engine's copy is checked equal after every sync).
"""

from __future__ import annotations

import json

import pytest

from fixture_plugins import plugin_env
from inproc import environment

pytestmark = pytest.mark.slow

GPTOSS = ("ferrule-gptoss-fixture",)


@pytest.mark.timeout(400)
def test_grpo_trains_three_steps_and_the_rollout_engine_gets_every_weight(tmp_path):
    """3 GRPO steps of a tiny gpt-oss on CPU: the backward pass through sinks, biased experts and the router runs
    (the first step crashed in megatron's in-place expert-bias add before), every step's loss and gradient norm are
    finite (positive gradient norm on a step whose rewards differ), and after every sync the rollout engine's weights equal the trained ones."""
    import math

    import test_rl_e2e as e2e
    from transformers import AutoConfig, GptOssForCausalLM
    import torch

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    env = plugin_env(tmp_path, GPTOSS)
    with environment(env):
        from ferrule_gptoss_fixture.gpt_oss import TINY_HF_CONFIG

        model = tmp_path / "model"
        e2e._build_model(model)  # the character tokenizer (and a Qwen3 we replace)
        vocab = json.loads((model / "config.json").read_text())
        (model / "model.safetensors").unlink()
        cfg = AutoConfig.for_model(**{**TINY_HF_CONFIG, "vocab_size": vocab["vocab_size"],
                                      "eos_token_id": vocab["eos_token_id"], "pad_token_id": vocab["pad_token_id"],
                                      "max_position_embeddings": 256})
        torch.manual_seed(0)
        GptOssForCausalLM(cfg).float().save_pretrained(model)
        data = tmp_path / "task.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n" for i in range(16)))
        config = tmp_path / "tiny.yaml"
        config.write_text(e2e.CONFIG)
        run_dir = tmp_path / "run"
        train(load_config(config, [f"model.hf_dir={model}", f"data.jsonl_path={data}", f"logging.run_dir={run_dir}",
                                   "train.steps=3", "rollout.n_samples_per_prompt=4", "train.prompts_per_step=2",
                                   "data.chat_template=qwen3"]),
              check_weight_update_equal=True)
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["grad_norm"]) for e in entries), entries
    learning = [e for e in entries if e["reward_std"] > 0]  # a step whose rewards all tie has no advantage
    assert learning and all(e["grad_norm"] > 0 for e in learning), entries
    assert entries[-1]["weights_version"] == 3
    assert max(e["train_rollout_logprob_abs_diff"] for e in entries) < 1e-4
