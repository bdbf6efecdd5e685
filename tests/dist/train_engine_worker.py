"""torchrun worker (2 gloo processes) for tests/test_train_engine.py, plus shared helpers.

Usage: torchrun --nproc-per-node 2 tests/dist/train_engine_worker.py WORK_DIR

WORK_DIR holds ``qwen2`` (a tiny HF checkpoint the test wrote with :func:`make_hf_dir`). The
worker runs every 2-process check in one launch and rank 0 writes ``results.json``:

- ``dp2`` / ``dp2_distopt`` / ``tp2``: split invariance (1 x fb(8), 2 x fb(4), fb(3)+fb(5), then
  one step): the three grad norms and exported weights, compared bit for bit here;
  ``grad_norm`` is also returned so the test can compare it with world size 1 (DP sums, not
  averages).
- ``tp2_logprobs_vs_hf``: max |fb logprobs - HF transformers logprobs| at TP=2 (the padded
  vocabulary columns live on TP rank 1).
- ``tp2_fused_logprobs``: the same at TP=2 through the fused hidden-state logprob path
  (``TrainEngine.fused_logprobs``): logprobs vs HF, and the gradients vs the plain path's.
- ``dp2_resume``: DP=2 with the distributed optimizer, save after 2 steps, 2 more steps; a
  fresh engine loads and repeats them: identical losses, grad norms, weights, Adam step.
  The checkpoint stays in WORK_DIR/ckpt_dp2 for the test's cross-DP load, with the expected
  continuation in results.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

VOCAB = 96
NUM_DATA = 8
LR = 1e-3


def make_hf_dir(out_dir: Path, family: str = "qwen2", seed: int = 0) -> Path:
    """A tiny random HF checkpoint (fp32) written with transformers' own config/model classes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    model.float().save_pretrained(out_dir)
    return Path(out_dir)


def make_batch(seed: int = 1, lengths=(5, 9, 3, 12, 7, 4, 10, 6), loss: str = "cross_entropy"):
    """``NUM_DATA`` data of different lengths; weights normalised by the total token count."""
    import torch

    from ferrule.megatron.batching import Datum

    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    out = []
    for n in lengths:
        toks = torch.randint(0, VOCAB, (n + 1,), generator=g)
        inputs = {"target_tokens": toks[1:].clone()}
        if loss == "cross_entropy":
            inputs["weights"] = torch.full((n,), 1.0 / total)
        else:
            inputs["logprobs"] = -4.6 + 0.3 * torch.randn(n, generator=g)
            inputs["advantages"] = torch.randn(n, generator=g)
        out.append(Datum(toks[:-1].tolist(), inputs))
    return out


def weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.export_hf_state()}


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def split_run(hf_dir: Path, layout, splits, **kw):
    """Fresh engine; fb over ``splits`` of one batch; one step. Returns (grad_norm, weights, engine)."""
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    opt = kw.pop("optimizer", OptimizerSettings(lr=LR))
    engine = TrainEngine.from_hf(hf_dir, layout, optimizer=opt, **kw)
    batch = make_batch()
    start = 0
    for n in splits:
        engine.forward_backward(batch[start:start + n], "cross_entropy")
        start += n
    res = engine.optim_step()
    return res["grad_norm"], weights(engine), engine


def split_invariance(hf_dir: Path, layout, **kw) -> dict:
    runs = [split_run(hf_dir, layout, s, **kw) for s in ((8,), (4, 4), (3, 5))]
    norms = [r[0] for r in runs]
    return {"grad_norms": norms, "grad_norm": norms[0],
            "identical": len(set(norms)) == 1 and same(runs[0][1], runs[1][1]) and same(runs[0][1], runs[2][1])}


def train_steps(engine, n: int, seed0: int) -> list:
    out = []
    for i in range(n):
        fb = engine.forward_backward(make_batch(seed=seed0 + i), "cross_entropy")
        st = engine.optim_step()
        out.append([fb.metrics["loss:sum"], st["grad_norm"], engine.adam_step()])
    return out


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    # import HF modeling code before ferrule's CPU patches replace torch.cuda.Stream (transformers
    # evaluates `torch.cuda.Stream | None` annotations at import time)
    from transformers import Qwen2ForCausalLM
    from megatron.core import parallel_state as ps

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout

    hf_dir = work / "qwen2"
    results: dict = {}
    dp = ParallelLayout()
    results["dp2"] = split_invariance(hf_dir, dp)
    distopt = OptimizerSettings(lr=LR, use_distributed_optimizer=True, lr_decay_style="linear", lr_decay_steps=20)
    results["dp2_distopt"] = split_invariance(hf_dir, dp, optimizer=distopt)

    # exact resume at DP=2 with the distributed optimizer
    a = TrainEngine.from_hf(hf_dir, dp, optimizer=distopt)
    train_steps(a, 2, seed0=10)
    a.save(work / "ckpt_dp2")
    saved_weights = weights(a)
    cont_a = train_steps(a, 2, seed0=20)
    b = TrainEngine.from_hf(hf_dir, dp, optimizer=distopt)
    train_steps(b, 1, seed0=99)  # diverge first, so the load has to overwrite everything
    b.load(work / "ckpt_dp2")
    loaded_same = same(weights(b), saved_weights)
    cont_b = train_steps(b, 2, seed0=20)
    results["dp2_resume"] = {"loaded_weights_identical": loaded_same, "continuation_identical": cont_a == cont_b,
                             "weights_identical": same(weights(a), weights(b)), "continuation": cont_a,
                             "step": b.step, "adam_step": b.adam_step()}
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in saved_weights.items()}, str(work / "ckpt_dp2_weights.safetensors"))

    # TP = 2 (destroy the DP layout's megatron groups; the process group stays)
    ps.destroy_model_parallel()
    tp = ParallelLayout(tp=2)
    results["tp2"] = split_invariance(hf_dir, tp)
    engine = TrainEngine.from_hf(hf_dir, tp)
    batch = make_batch()
    out = engine.forward_backward(batch, "cross_entropy")
    lps = engine.forward_logprobs(batch)
    hf = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    diff, fb_vs_fwd = 0.0, True
    with torch.no_grad():
        for d, o, lp in zip(batch, out.loss_fn_outputs, lps):
            ref = torch.log_softmax(hf(torch.tensor([d.model_input])).logits[0].double(), -1)
            ref = ref.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0]
            diff = max(diff, float((ref - o["logprobs"].double()).abs().max()))
            fb_vs_fwd &= bool(torch.equal(o["logprobs"], lp))
    results["tp2_logprobs_vs_hf"] = {"max_abs_diff": diff, "fb_equals_forward": fb_vs_fwd}

    # the fused (hidden-state) logprob path at TP=2: vocab-parallel reductions and the hidden
    # gradient's all-reduce, against HF and against the plain path's gradients
    plain = {n: p.main_grad.detach().clone() for n, p in engine.model[0].module.named_parameters()}
    fused = TrainEngine.from_hf(hf_dir, tp)
    fused.fused_logprobs = True
    out_f = fused.forward_backward(batch, "cross_entropy")
    lps_f = fused.forward_logprobs(batch)
    diff_f, fb_vs_fwd_f = 0.0, True
    with torch.no_grad():
        for d, o, lp in zip(batch, out_f.loss_fn_outputs, lps_f):
            ref = torch.log_softmax(hf(torch.tensor([d.model_input])).logits[0].double(), -1)
            ref = ref.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0]
            diff_f = max(diff_f, float((ref - o["logprobs"].double()).abs().max()))
            fb_vs_fwd_f &= bool(torch.allclose(o["logprobs"], lp, atol=1e-6, rtol=0))
    grad_diff = max(float((p.main_grad - plain[n]).abs().max() / plain[n].abs().max().clamp_min(1e-12))
                    for n, p in fused.model[0].module.named_parameters())
    results["tp2_fused_logprobs"] = {"max_abs_diff_vs_hf": diff_f, "fb_close_to_forward": fb_vs_fwd_f,
                                     "max_rel_grad_diff_vs_plain": grad_diff}
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
