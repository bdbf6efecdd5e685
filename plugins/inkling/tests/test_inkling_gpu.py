"""Inkling checks that need a CUDA device (run on the lent H200; skipped where CUDA is absent).

bf16 parity: the Megatron Inkling (ferrule TrainEngine, bf16 params; ShortConv weights and the
router kept in fp32 as transformers keeps them) vs ``InklingForCausalLM`` on the same fp32
checkpoint. Tolerance, justified as in tests/test_gpu.py: bf16 keeps 8 significant bits (relative
rounding 2**-8 = 3.9e-3), so two correct bf16 implementations that accumulate in a different
order disagree by about that much per op; both are measured against the fp32 HF reference, and
Megatron's bf16 error must be at most 2x HF's own bf16 error (+ 1e-3 slack), with the mean
absolute logprob error below 0.02 nats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

#: A mid-size Inkling (~25 M parameters): local + global layers, dense + MoE with 2 shared experts.
CONFIG = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=64,
              sliding_window_size=64, rel_extent=256, d_rel=16,
              layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid_sliding", "hybrid"],
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=1408,
              moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
              max_position_embeddings=512, logits_mup_width_multiplier=4.0)


def _hf_dir(root: Path) -> Path:
    from transformers import InklingForCausalLM, InklingTextConfig

    torch.manual_seed(0)
    InklingForCausalLM(InklingTextConfig(**CONFIG)).float().save_pretrained(root / "inkling")
    return root / "inkling"


def test_inkling_bf16_parity_vs_hf(tmp_path):
    from transformers import InklingForCausalLM

    from ferrule.megatron.batching import Datum
    from ferrule.megatron.engine import TrainEngine

    hf_dir = _hf_dir(tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, CONFIG["vocab_size"], (n + 1,), generator=g) for n in (64, 200, 128, 31)]
    batch = [Datum(model_input=s[:-1].tolist(), loss_fn_inputs={"target_tokens": s[1:],
                                                                "weights": torch.ones(len(s) - 1)}) for s in seqs]
    engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16)
    mcore = [lp.double().cpu() for lp in engine.forward_logprobs(batch)]

    def hf_logprobs(dtype):
        model = InklingForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager").cuda().eval()
        out = []
        with torch.no_grad():
            for s in seqs:
                logits = model(s[None, :-1].cuda()).logits[0].double()
                out.append(torch.log_softmax(logits, -1).gather(-1, s[1:, None].cuda())[:, 0].cpu())
        return out

    ref32, ref16 = hf_logprobs(torch.float32), hf_logprobs(torch.bfloat16)
    err_m = max(float((a - r).abs().max()) for a, r in zip(mcore, ref32))
    err_h = max(float((a - r).abs().max()) for a, r in zip(ref16, ref32))
    mean_m = float(torch.cat([(a - r).abs() for a, r in zip(mcore, ref32)]).mean())
    print(f"\ninkling: max|mcore_bf16 - hf_fp32| = {err_m:.4g}, max|hf_bf16 - hf_fp32| = {err_h:.4g}, "
          f"mean|mcore_bf16 - hf_fp32| = {mean_m:.4g}")
    assert err_m <= 2 * err_h + 1e-3, (err_m, err_h)
    assert mean_m < 0.02


def test_inkling_trains_on_cuda_without_transformer_engine(tmp_path):
    """bf16 fb + step of the MoE Inkling on the GPU (no TransformerEngine): finite positive grad
    norm, and the loss on the batch goes down."""
    from ferrule.megatron.batching import Datum
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    hf_dir = _hf_dir(tmp_path)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, CONFIG["vocab_size"], (n + 1,), generator=g) for n in (64, 128, 31)]
    total = sum(len(s) - 1 for s in seqs)
    batch = [Datum(model_input=s[:-1].tolist(), loss_fn_inputs={"target_tokens": s[1:],
                                                                "weights": torch.full((len(s) - 1,), 1 / total)})
             for s in seqs]
    engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16, optimizer=OptimizerSettings(lr=1e-3))

    def nll() -> float:
        return -float(torch.cat([lp.double().cpu() for lp in engine.forward_logprobs(batch)]).mean())

    before = nll()
    engine.forward_backward(batch, "cross_entropy")
    step = engine.optim_step()
    after = nll()
    print(f"\ninkling bf16: grad_norm {step['grad_norm']:.4g}, nll {before:.4f} -> {after:.4f}")
    assert step["success"] and 0 < step["grad_norm"] < float("inf")
    assert after < before
