"""Train-step throughput and peak memory: HF transformers (eager, + Liger kernels) vs ferrule's
Megatron train engine, side by side in one process, on one GPU.

Model: Qwen2-0.5B shape (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocab
151936, tied embeddings), random weights, bf16. One step = forward + backward over the whole
batch + global-norm clip (1.0) + AdamW:

- ``hf``: ``Qwen2ForCausalLM`` (SDPA attention), bf16 parameters, ``torch.optim.AdamW(fused=True)``,
  loss = ``model(input_ids, labels=...)`` (mean token cross entropy).
- ``hf_liger``: the same after ``liger_kernel.transformers.apply_liger_kernel_to_qwen2`` (RMSNorm,
  SwiGLU, RoPE, fused linear cross entropy), when ``liger-kernel`` is importable.
- ``hf_liger_rl``: HF + Liger on the RL-shaped batch of ``ferrule_rl`` as an HF trainer runs it:
  sorted by length, ``--hf-rl-micro`` sequences per micro-batch padded to the longest, gradient
  accumulation, one step; reported as real tokens per second.
- ``ferrule``: ``TrainEngine.forward_backward(batch, "cross_entropy")`` + ``optim_step()`` (bf16
  parameters with fp32 master weights and fp32 gradients, megatron's mixed-precision optimizer).
- ``ferrule``: the product's defaults (:class:`ferrule.engine_settings.TrainEngineSettings()`: every
  verified CUDA path on), unless ``--train-setting KEY=VALUE`` changes one.
- ``ferrule_plain``: the same with every fast path of ``TrainEngineSettings`` off: plain fp32 logits,
  unfused SwiGLU / RoPE, padded micro-batches, no lean activations, megatron's Adam.
- ``ferrule_rl``: the RL-shaped batch (``--rl-batch`` sequences, lengths uniform in
  ``[--rl-min, --rl-max]``); reported as *real* (unpadded) tokens per second and as a share of
  ferrule's fixed-length rate.

Each mode runs ``--warmup`` + ``--iters`` steps; the first step's time (compiles included) and the
median step time are reported, with
``torch.cuda.max_memory_allocated`` over the mode's steps (reset between modes). MFU counts
``6 * params * tokens`` plus attention (``12 * layers * hidden * seq`` per token, causal halved)
against the H200's 989 TFLOP/s dense bf16 peak.

Usage (on the GPU machine)::

    python bench/bench_train_hf.py                          # 8 x 2048, all modes
    python bench/bench_train_hf.py --modes ferrule --profile  # top CUDA ops of ferrule's step
    python bench/bench_train_hf.py --append-docs             # also append rows to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)
#: TrainEngineSettings of ``ferrule_plain``: every fast path off
PLAIN = dict(fused_logprobs=False, cuda_fusions=False, packed_sequences=False, grad_accum_fusion=False,
             lean_activations=False, logprob_one_pass=False, fused_adam=False)
#: ``--tiny``: a code-path smoke run (CPU ok, fp32; Liger modes skipped without CUDA; times meaningless)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: the model shape, device and dtype of this run (``--tiny`` switches them)
SHAPE, DEVICE, DTYPE = QWEN2_05B, "cuda", "bfloat16"


def _cuda() -> bool:
    return DEVICE == "cuda"


def _sync() -> None:
    import torch

    if _cuda():
        torch.cuda.synchronize()


#: H200 SXM dense bf16 peak (NVIDIA datasheet), FLOP/s.
H200_PEAK = 989e12


def _flops_per_token(cfg: dict, seq: int, n_params: int) -> float:
    attn = 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq / 2  # causal: half the score matrix
    return 6 * n_params + attn


def _time_steps(step, warmup: int, iters: int) -> tuple[float, float, float, float]:
    """(median step seconds, peak GiB allocated over the steps, GiB allocated after the first step:
    parameters, gradient buffers and optimizer state, the resident part; the first step's seconds)."""
    import torch

    _sync()
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    resident = 0.0
    times = []
    for i in range(warmup + iters):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if i == 0:
            resident = torch.cuda.memory_allocated() / 2**30 if _cuda() else float("nan")
            first = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if _cuda() else float("nan")
    return statistics.median(times), peak, resident, first


def _hf_mode(hf_dir: Path, tokens, liger: bool):
    import torch
    from transformers import Qwen2ForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, DTYPE), attn_implementation="sdpa",
                                             use_kernels=False).to(DEVICE)  # no `kernels` hub fetch (transformers 5.25)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=_cuda())
    x = tokens.to(DEVICE)

    def step():
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n_params = sum(p.numel() for p in model.parameters())
    return step, n_params, lambda: None


def _hf_padded_mode(hf_dir: Path, seqs, per_micro: int):
    """HF (+ Liger if already applied) on the RL-shaped batch the way an HF trainer packs it:
    sequences sorted by length, ``per_micro`` per micro-batch, right-padded to the micro-batch's
    longest (labels -100 on padding), gradients accumulated over the micro-batches, one step."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, DTYPE), attn_implementation="sdpa",
                                             use_kernels=False).to(DEVICE)  # no `kernels` hub fetch (transformers 5.25)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=_cuda())
    order = sorted(seqs, key=len)
    micro = []
    for i in range(0, len(order), per_micro):
        group = order[i:i + per_micro]
        n = max(len(x) for x in group) - 1
        ids = torch.zeros((len(group), n), dtype=torch.long)
        labels = torch.full((len(group), n), -100, dtype=torch.long)
        mask = torch.zeros((len(group), n), dtype=torch.long)
        for r, x in enumerate(group):
            ids[r, :len(x) - 1], labels[r, :len(x) - 1], mask[r, :len(x) - 1] = x[:-1], x[:-1], 1
        micro.append((ids.to(DEVICE), labels.to(DEVICE), mask.to(DEVICE)))

    def step():
        for ids, labels, mask in micro:
            (model(input_ids=ids, attention_mask=mask, labels=labels).loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def _ferrule_engine(hf_dir: Path, max_tokens: int | None, settings):
    import torch

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout

    return TrainEngine.from_hf(hf_dir, ParallelLayout(), params_dtype=getattr(torch, DTYPE),
                               optimizer=OptimizerSettings(lr=1e-5, clip_grad=1.0),
                               max_tokens_per_microbatch=max_tokens, settings=settings)


def _ferrule_batch(seqs):
    import torch

    from ferrule.megatron.engine import Datum

    total = sum(len(s) - 1 for s in seqs)
    return [Datum(s[:-1].tolist(), {"target_tokens": s[1:], "weights": torch.full((len(s) - 1,), 1 / total)})
            for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16384, help="ferrule micro-batch token budget")
    ap.add_argument("--rl-batch", type=int, default=64)
    ap.add_argument("--rl-min", type=int, default=256)
    ap.add_argument("--rl-max", type=int, default=1536)
    ap.add_argument("--modes", default="hf,ferrule_plain,ferrule,ferrule_rl,hf_liger,hf_liger_rl")
    ap.add_argument("--hf-rl-micro", type=int, default=8, help="sequences per HF micro-batch (RL-shaped, padded)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print the top CUDA ops of one ferrule step")
    ap.add_argument("--append-docs", action="store_true")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model, fp32, CPU unless CUDA is present (a smoke run of the code path; times meaningless)")
    ap.add_argument("--train-setting", action="append", default=[], metavar="KEY=VALUE",
                    help="a train_engine setting for the ferrule modes (default: the product defaults), repeatable")
    args = ap.parse_args()
    global SHAPE, DEVICE, DTYPE
    if args.tiny:
        import torch

        SHAPE, DTYPE = TINY, "float32"
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    from ferrule.engine_settings import TrainEngineSettings
    from ferrule.rl.config import config_from_dict

    product = config_from_dict({}, [f"train_engine.{kv}" for kv in args.train_setting], validate=False).train_engine
    print(f"ferrule train_engine settings: {product.describe()}", flush=True)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, dict] = {}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq + 1), generator=g)
    lens = torch.randint(args.rl_min, args.rl_max + 1, (args.rl_batch,), generator=g)
    rl_seqs = [torch.randint(0, SHAPE["vocab_size"], (int(n) + 1,), generator=g) for n in lens]
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen2_0.5b"
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(getattr(torch, DTYPE)).save_pretrained(hf_dir)
        n_params = None
        engine = None
        for mode in modes:
            gc.collect()
            if _cuda():
                torch.cuda.empty_cache()
            if mode in ("hf", "hf_liger", "hf_liger_rl"):
                if mode.startswith("hf_liger"):
                    if not _cuda():
                        print(f"{mode}: Liger's kernels need CUDA; skipped")
                        continue
                    try:
                        import liger_kernel  # noqa: F401
                    except ImportError:
                        print(f"{mode}: liger-kernel is not installed here; skipped")
                        continue
                if mode == "hf_liger_rl":
                    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

                    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
                    step, n_params = _hf_padded_mode(hf_dir, rl_seqs, args.hf_rl_micro)
                    real = sum(len(x) - 1 for x in rl_seqs)
                else:
                    step, n_params, _ = _hf_mode(hf_dir, tokens, liger=mode == "hf_liger")
                    real = args.batch * args.seq
            else:
                want_plain = mode == "ferrule_plain"
                if engine is None or getattr(engine, "_bench_plain", None) != want_plain:
                    engine = None
                    gc.collect()
                    if _cuda():
                        torch.cuda.empty_cache()
                    settings = TrainEngineSettings(**PLAIN) if want_plain else product
                    engine = _ferrule_engine(hf_dir, args.max_tokens, settings)
                    engine._bench_plain = want_plain
                    print(f"{mode}: fused_logprobs={engine.fused_logprobs} cuda_fusions={engine.cuda_fusions} "
                          f"packed_sequences={engine.packed_sequences} "
                          f"grad_accum_fusion={getattr(engine, 'grad_accum_fusion', None)} "
                          f"lean_activations={getattr(engine, 'lean_activations', None)} "
                          f"fused_adam={getattr(engine, 'fused_adam', None)} "
                          f"logprob_chunk={getattr(engine, 'logprob_chunk_tokens', None)}")
                    n_params = n_params or sum(p.numel() for c in engine.model for p in c.parameters())
                if mode in ("ferrule", "ferrule_plain"):
                    batch = _ferrule_batch(list(tokens))
                else:
                    batch = _ferrule_batch(rl_seqs)
                real = sum(len(d.model_input) for d in batch)

                def step(batch=batch):
                    engine.forward_backward(batch, "cross_entropy")
                    engine.optim_step()
            med, peak, resident, first = _time_steps(step, args.warmup, args.iters)
            tps = real / med
            mfu = tps * _flops_per_token(SHAPE, args.seq, n_params) / H200_PEAK
            results[mode] = {"step_s": round(med, 4), "tok_s": round(tps), "peak_gib": round(peak, 1),
                             "resident_gib": round(resident, 2), "first_step_s": round(first, 2),
                             "mfu": round(mfu, 3), "tokens": real}
            print(json.dumps({"mode": mode, **results[mode]}), flush=True)
            if mode in ("ferrule", "ferrule_plain") and args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
            if mode.startswith("hf"):
                del step
    if "hf" in results:
        base = results["hf"]["tok_s"]
        for m, r in results.items():
            r["x_hf"] = round(r["tok_s"] / base, 3)
    if "hf_liger" in results and "ferrule" in results:
        results["ferrule"]["x_hf_liger"] = round(results["ferrule"]["tok_s"] / results["hf_liger"]["tok_s"], 3)
    if "hf_liger_rl" in results and "ferrule_rl" in results:
        results["ferrule_rl"]["x_hf_liger_rl"] = round(results["ferrule_rl"]["tok_s"] / results["hf_liger_rl"]["tok_s"], 3)
    if "ferrule_rl" in results and "ferrule" in results:
        results["ferrule_rl"]["of_fixed"] = round(results["ferrule_rl"]["tok_s"] / results["ferrule"]["tok_s"], 3)
    print(json.dumps({"summary": results}))
    if args.append_docs:
        _append_docs(results, args)


def _append_docs(results: dict, args) -> None:
    import torch

    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    text = path.read_text()
    title = "## Train step: HF transformers vs ferrule (bench/bench_train_hf.py)"
    if title not in text:
        text = text.rstrip("\n") + (
            f"\n\n{title}\n\nQwen2-0.5B shape, tied embeddings, random weights, bf16, one GPU; fwd + bwd + clip + AdamW; "
            "medians. Columns as printed by the script (`x_hf` = tok/s relative to HF eager in the same run).\n\n"
            "| date | device | torch | mode | batch | tok/s | step s | peak GiB | MFU | x HF eager |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for mode, r in results.items():
        shape = (f"{args.rl_batch} x U[{args.rl_min},{args.rl_max}]" if mode.endswith("_rl")
                 else f"{args.batch} x {args.seq}")
        rows.append(f"| {datetime.date.today().isoformat()} | {torch.cuda.get_device_name()} | {torch.__version__} | "
                    f"{mode} | {shape} | {r['tok_s']} | {r['step_s']} | {r['peak_gib']} | {r['mfu']} | "
                    f"{r.get('x_hf', '')} |")
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(rows) + "\n")
    print(f"appended {len(rows)} rows to {path} ({platform.node()})")


if __name__ == "__main__":
    main()
