"""Decoupled ``forward_backward`` + ``optim_step`` vs megatron's fused train step, side by side.

Both paths train the same model on the same batch (same micro-batches, same summed weighted
cross entropy, same optimizer): the *fused* path is megatron's standard step —
``get_forward_backward_func()`` with ``finalize_model_grads`` inside, then
``optimizer.step()`` and ``zero_grad_buffer()`` — and the *decoupled* path is
``TrainEngine.forward_backward`` (finalize swapped for a no-op, per-datum outputs gathered in
the caller's order, metrics) followed by ``TrainEngine.optim_step`` (finalize, non-finite
check, clip, step, zero). Iterations alternate A/B; medians are reported.

Usage::

    python bench/bench_train.py                    # CPU: small model, fp32
    python bench/bench_train.py --size 0.5b        # CUDA (H200): Qwen2-0.5B shape, bf16
    python bench/bench_train.py --append-docs      # also append the result to docs/benchmarks.md

Multi-GPU: ``torchrun --nproc-per-node N bench/bench_train.py --size 0.5b`` (DP=N).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # HF Qwen2 config kwargs
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
}


def _hf_dir(size: str, root: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6, **SIZES[size])
    out = root / f"qwen2_{size}"
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--batch", type=int, default=8, help="data per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per datum")
    ap.add_argument("--max-tokens", type=int, default=None, help="micro-batch token budget (default: 1 datum)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 params (default on CUDA)")
    ap.add_argument("--append-docs", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one decoupled step (torch.profiler) and print top ops")
    args = ap.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401  (import before the CPU patches)

    from ferrule.megatron.device import get_backend
    from ferrule.megatron.engine import Datum, OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout

    backend = get_backend()
    bf16 = args.bf16 or backend.kind == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        import torch.distributed as dist

        hf_dir = Path(tmp) / f"qwen2_{args.size}"
        rank = int(__import__("os").environ.get("RANK", "0"))
        if rank == 0:
            _hf_dir(args.size, Path(tmp))
        engine = None
        if "RANK" in __import__("os").environ:
            from ferrule.megatron.parallel import init_distributed

            init_distributed(ParallelLayout())
            obj = [str(hf_dir)]
            dist.broadcast_object_list(obj, src=0)
            hf_dir = Path(obj[0])
            dist.barrier()
        engine = TrainEngine.from_hf(hf_dir, ParallelLayout(), params_dtype=dtype,
                                     optimizer=OptimizerSettings(lr=1e-5), max_tokens_per_microbatch=args.max_tokens)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(1)
    total = args.batch * args.seq
    batch = []
    for _ in range(args.batch):
        toks = torch.randint(0, vocab, (args.seq + 1,), generator=g)
        batch.append(Datum(toks[:-1].tolist(), {"target_tokens": toks[1:], "weights": torch.full((args.seq,), 1 / total)}))
    tokens_per_step = total  # every rank receives the whole batch; tokens/s is per job

    fused = _fused_step_factory(engine, batch)

    def decoupled():
        engine.forward_backward(batch, "cross_entropy")
        engine.optim_step()

    times = {"fused": [], "decoupled": []}
    for i in range(args.warmup + args.iters):
        for name, fn in (("fused", fused), ("decoupled", decoupled)) if i % 2 == 0 else (("decoupled", decoupled), ("fused", fused)):
            backend.synchronize()
            t0 = time.perf_counter()
            fn()
            backend.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    if args.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.kind == "cuda" else [])
        with profile(activities=acts) as prof:
            decoupled()
            backend.synchronize()
        key = "self_cuda_time_total" if backend.kind == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    ratio = med["decoupled"] / med["fused"]
    result = {"size": args.size, "device": backend.kind, "dtype": str(dtype).removeprefix("torch."),
              "world_size": dist.get_world_size() if dist.is_initialized() else 1,
              "batch": args.batch, "seq": args.seq, "max_tokens": args.max_tokens,
              "fused_s": round(med["fused"], 4), "decoupled_s": round(med["decoupled"], 4),
              "fused_tok_s": round(tps["fused"]), "decoupled_tok_s": round(tps["decoupled"]),
              "decoupled_over_fused": round(ratio, 4)}
    if rank == 0:
        print(json.dumps(result))
        print(f"decoupled / fused step time = {ratio:.4f} ({(ratio - 1) * 100:+.1f}% extra)")
        if args.append_docs:
            _append_docs(result)


def _fused_step_factory(engine, batch):
    """megatron's standard step on the engine's model/optimizer (finalize inside the schedule)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from ferrule.megatron.batching import assign_dp_ranks, pack_microbatches

    lengths = [len(d.model_input) for d in batch]
    ranks = assign_dp_ranks(lengths, engine.dp_size)
    mine = [i for i, r in enumerate(ranks) if r == engine.dp_rank]
    prepared, _ = engine._prepare(batch, "cross_entropy", None)
    mbs = [engine._microbatch(prepared, idx)
           for idx in pack_microbatches(mine, lengths, engine.max_tokens_per_microbatch, packed=engine.packed_sequences)]
    weights = {i: d.loss_fn_inputs["weights"] for i, d in enumerate(batch)}

    def forward_step(it, model):
        mb = next(it)
        extra = {"packed_seq_params": mb["packed_seq_params"]} if mb["packed_seq_params"] is not None else {}
        out = model(mb["tokens"], mb["position_ids"], attention_mask=None, **extra)

        def loss_func(logits):
            lp = -vocab_parallel_cross_entropy(logits.float(), mb["labels"])
            w = torch.zeros_like(lp)
            for i, (row, a, n) in zip(mb["idx"], mb["spans"]):
                w[row, a:a + n] = weights[i].to(w.device)
            return -(lp * w).sum(), torch.tensor(sum(mb["lengths"]), dtype=torch.int), {}

        return out, loss_func

    def step():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs), model=engine.model,
                                    num_microbatches=len(mbs), seq_length=mbs[0]["tokens"].shape[1],
                                    micro_batch_size=mbs[0]["tokens"].shape[0], forward_only=False)
        engine.optimizer.step()
        for chunk in engine.model:
            chunk.zero_grad_buffer()
        engine.optimizer.zero_grad()

    return step


def _append_docs(result: dict) -> None:
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    header = "\n## Train engine: decoupled fb + step vs fused megatron step\n\n" \
             "`python bench/bench_train.py` (side by side, alternating, medians). Ratio = decoupled / fused step time.\n\n" \
             "| date | machine | device | dtype | model | batch x seq | micro-batch tokens | fused tok/s | decoupled tok/s | ratio |\n" \
             "|---|---|---|---|---|---|---|---|---|---|\n"
    title = "## Train engine: decoupled fb + step vs fused megatron step"
    if title not in text:
        text = text.rstrip("\n") + "\n" + header
    row = (f"| {datetime.date.today().isoformat()} | {platform.node()} ({platform.processor() or platform.machine()}) | "
           f"{result['device']} x{result['world_size']} | {result['dtype']} | qwen2 {result['size']} | "
           f"{result['batch']} x {result['seq']} | {result['max_tokens'] or '1 datum'} | {result['fused_tok_s']} | {result['decoupled_tok_s']} | "
           f"{result['decoupled_over_fused']:.4f} |\n")
    lines = text.rstrip("\n").split("\n")
    at = lines.index(title) + 1
    while at < len(lines) and not lines[at].startswith("|"):
        at += 1
    while at < len(lines) and lines[at].startswith("|"):
        at += 1  # end of this section's table (other sections may follow)
    lines.insert(at, row.rstrip("\n"))
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
