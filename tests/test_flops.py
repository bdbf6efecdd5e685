"""Model FLOPs against torch's own FLOP counter on HF forwards (an independent count)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ferrule.megatron.flops import forward_flops, peak_flops, training_mfu

COMMON = dict(vocab_size=160, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=64, attn_implementation="eager")


def counted(model, seq_lens):
    total = 0
    for n in seq_lens:
        ids = torch.randint(0, model.config.vocab_size, (1, n))
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(ids)
        total += fc.get_total_flops()
    return total


@pytest.mark.parametrize("build", [
    lambda: Qwen2ForCausalLM(Qwen2Config(intermediate_size=80, tie_word_embeddings=True, **COMMON)),
    lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=80, head_dim=12, **COMMON)),
    lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=80, moe_intermediate_size=24, num_experts=4,
                                               num_experts_per_tok=2, head_dim=10,
                                               # per-expert matmuls, which the flop counter sees (the default
                                               # grouped kernel is not in its formula table)
                                               experts_implementation="eager", **COMMON)),
], ids=["qwen2-tied", "qwen3-head_dim", "qwen3-moe"])
def test_forward_flops_equal_torch_flop_counter(build):
    torch.manual_seed(0)
    model = build().eval()
    seq_lens = [7, 13, 1]
    assert forward_flops(model.config.to_dict(), seq_lens) == counted(model, seq_lens)


def test_unsupported_configs_and_peak(monkeypatch):
    assert forward_flops({"layer_types": ["hybrid"], "hidden_size": 8}, [3]) is None
    assert forward_flops({"hidden_size": 8}, [3]) is None
    monkeypatch.delenv("FERRULE_PEAK_TFLOPS", raising=False)
    assert peak_flops("cpu") is None and training_mfu(Qwen2Config(**COMMON).to_dict(), [4], 1.0, "cpu") is None
    monkeypatch.setenv("FERRULE_PEAK_TFLOPS", "100")
    cfg = Qwen2Config(intermediate_size=80, **COMMON).to_dict()
    mfu = training_mfu(cfg, [10, 20], 2.0, "cpu", forward_only_seq_lens=[10, 20])
    assert mfu == pytest.approx(4 * forward_flops(cfg, [10, 20]) / (2.0 * 100e12), rel=1e-12)
