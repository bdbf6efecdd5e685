"""Embedded rollout engine vs HF ``model.generate``: new tokens per second, side by side in one run.

Both sample at temperature 1 (no top-k/top-p), ignore EOS and produce exactly
``batch * new_tokens`` tokens from the same random prompts on the same random-weight model.
Prints both rates and their ratio and appends a dated row to the "Rollout" section of
docs/benchmarks.md.

Examples::

    python bench/bench_rollout.py --model small --batch 8 --new-tokens 64 --device cpu
    python bench/bench_rollout.py --model qwen2-0.5b --batch 64 --new-tokens 256 --device cuda --dtype bfloat16
    python bench/bench_rollout.py --hf-dir /path/to/Qwen2.5-0.5B --batch 64 --new-tokens 256 --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

import torch

# Random-weight Qwen2 shapes. "qwen2-0.5b" is the Qwen2-0.5B / Qwen2.5-0.5B shape.
PRESETS = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}
SECTION = "## Rollout"
HEADER = ("| date | machine | device | model | dtype | batch | prompt | new tokens | HF generate tok/s | "
          "embedded tok/s | ratio | cuda graph |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.hf_dir:
        model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype, attn_implementation="sdpa")
        name = os.path.basename(os.path.normpath(args.hf_dir))
    else:
        torch.manual_seed(0)
        cfg = Qwen2Config(max_position_embeddings=4096, eos_token_id=None, attn_implementation="sdpa",
                          **PRESETS[args.model])
        model = Qwen2ForCausalLM(cfg)
        name = f"random {args.model}"
    return model.to(device=args.device, dtype=dtype).eval(), name


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, device: str) -> float:
    ids = prompts.to(device)
    mask = torch.ones_like(ids)

    def run(n):
        return model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)

    with torch.inference_mode():
        run(4)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = run(new_tokens)
        sync(device)
    assert out.shape[1] - ids.shape[1] == new_tokens
    return ids.shape[0] * new_tokens / (time.perf_counter() - t0)


def step_bytes(model, batch: int, filled: float) -> tuple[int, float]:
    """Bytes one decode step must read at least: ``(weight bytes, KV bytes)``; every weight once
    (a tied embedding once) and the K and V of ``filled`` slots per row on average, per layer."""
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    esize = next(iter(params)).element_size()
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = batch * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * d * esize * filled
    return sum(p.numel() for p in params) * esize, kv_bytes


def step_limit_ms(model, batch: int, filled: float) -> float:
    """Physical lower bound of one decode step (ms) on an H200: every weight byte and the filled KV
    cache (``filled`` slots per row on average) read once at 4.3 TB/s (the device-to-device copy
    rate measured there, docs/benchmarks.md), or the matrix FLOPs at 790 TFLOP/s, whichever is
    larger."""
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    weight_bytes, kv_bytes = step_bytes(model, batch, filled)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    matmul_params = sum(p.numel() for p in params if p.dim() == 2)  # tied embedding counted once: lm_head
    flops = 2 * batch * matmul_params + 4 * batch * cfg.num_hidden_layers * cfg.num_attention_heads * d * filled
    return max((weight_bytes + kv_bytes) / 4.3e12, flops / 790e12) * 1e3


def settings_of(variant: tuple[str | None, str | None] | None):
    """The engine's :class:`RolloutEngineSettings`: the product defaults, with a fast-path variant's
    ``(kv bucket, attention)`` where ``--kv-buckets`` / ``--attn`` name one (None: the default)."""
    from ferrule.engine_settings import RolloutEngineSettings

    k, a = variant or (None, None)
    given = {**({} if k is None else {"kv_bucket": int(k)}), **({} if a is None else {"attention": a})}
    return RolloutEngineSettings(**given)


def bench_embedded(model, prompts: torch.Tensor, new_tokens: int, cuda_graph: bool,
                   compile_decode: bool | None = None, fast_decode: bool | None = None,
                   variant: tuple[str | None, str | None] | None = None) -> tuple[float, bool]:
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model=model, cuda_graph=cuda_graph, compile_decode=compile_decode,
                            fast_decode=fast_decode, settings=settings_of(variant))
    reqs = prompts.tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    engine.generate(reqs, params)  # warm-up: same bucket, captures the CUDA graph
    sync(str(engine.device))
    print(f"first call {len(reqs)} x {new_tokens} (warm-up, compiles included): {time.perf_counter() - t0:.1f} s",
          flush=True)
    t0 = time.perf_counter()
    res = engine.generate(reqs, params)
    sync(str(engine.device))
    dt = time.perf_counter() - t0
    produced = sum(len(r.token_ids) for r in res)
    assert produced == len(reqs) * new_tokens, produced
    graph = engine.cuda_graph
    engine.shutdown()
    return produced / dt, graph


def fast_variants(args) -> list[tuple[str | None, str | None]]:
    """(kv bucket, attention) pairs of the fast path to time, from ``--kv-buckets`` x ``--attn``
    (None: the product default of ``RolloutEngineSettings``)."""
    return [(k, a) for k in (args.kv_buckets or [None]) for a in (args.attn or [None])]


def bench_grid(model, args) -> list[dict]:
    """Every ``--batches`` size: HF anchor (unless --no-hf), plain path, and each fast variant, in
    this process; returns one dict per (batch, mode) with the rate, step time and share of limit."""
    rows, hf_rates = [], {}

    def prompts_of(batch):
        g = torch.Generator().manual_seed(0)
        return torch.randint(1, model.config.vocab_size, (batch, args.prompt_len), generator=g)

    for batch in args.batches:  # HF first: the engine makes the model's attention its own opaque op
        hf_rates[batch] = float("nan") if args.no_hf else bench_hf(model, prompts_of(batch), args.new_tokens,
                                                                    args.device)
        print(f"HF generate batch {batch}: {hf_rates[batch]:.1f} new tok/s", flush=True)
    for batch in args.batches:
        prompts, hf = prompts_of(batch), hf_rates[batch]
        limit = step_limit_ms(model, batch, args.prompt_len + args.new_tokens / 2)
        runs = [] if args.no_plain else [("plain", None, None, False)]
        runs += [(f"fast kv_bucket={k or 'default'} attn={a or 'default'}", k, a, True) for k, a in fast_variants(args)]
        plain = float("nan")
        for mode, k, a, fast in runs:
            try:
                rate, _ = bench_embedded(model, prompts, args.new_tokens, True, fast_decode=fast,
                                         variant=(k, a) if fast else None)
            except Exception as exc:  # one failing variant must not hide the others' rows
                print(f"batch {batch} {mode}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
                continue
            plain = rate if not fast else plain
            step = batch * 1e3 / rate
            row = dict(batch=batch, mode=mode, tok_s=round(rate, 1), step_ms=round(step, 3), hf_tok_s=round(hf, 1),
                       x_hf=round(rate / hf, 2), x_plain=round(rate / plain, 3), limit_ms=round(limit, 3),
                       of_limit=round(limit / step, 3))
            print(row, flush=True)
            rows.append(row)
    return rows


def bench_rl_shaped(model, args) -> list[tuple[str, float, float, float]]:
    """RL-shaped decode: ``--rl-prompts`` prompts x ``--rl-n`` samples, prompt lengths uniform in
    [32, 256], EOS on, response lengths varying (a random-weight model has no EOS habit, so every
    ``--rl-stop-every``-th token id stops a sample: lengths are roughly geometric, capped at
    ``--new-tokens``). Static batching (all rows in one batch) vs continuous batching at
    ``--rl-max-batch``; returns ``(mode, real new tok/s, mean length, seconds)`` per mode."""
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    lens = torch.randint(32, 257, (args.rl_prompts,), generator=g).tolist()
    reqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    stops = tuple(range(args.rl_stop_every, vocab, args.rl_stop_every))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.rl_n, seed=0,
                            stop_token_ids=stops)
    out = []
    modes = [] if args.rl_skip_plain else [("static, plain decode", None, False, None)]
    modes += [
        (f"static, fast kv_bucket={k or 'default'} attn={a or 'default'}", None, True, (k, a))
        for k, a in fast_variants(args)]
    # continuous modes: the product default, or each --rl-continuous-fast value (rollout_engine.continuous_fast)
    cfast = args.rl_continuous_fast or [None]
    modes += [(f"continuous max_batch={m}" + ("" if c is None else f" continuous_fast={c}"), m, None, c)
              for m in args.rl_max_batch for c in cfast]
    for mode, mb, fast, var in modes:
        if mb is None:  # static modes: var is the fast variant
            settings = settings_of(var)
        else:  # continuous modes: var is the continuous_fast value (None: the default)
            settings = settings_of(None) if var is None else dataclasses.replace(settings_of(None),
                                                                                continuous_fast=bool(var))
        engine = EmbeddedEngine(model=model, max_batch=mb, fast_decode=fast, settings=settings)
        try:
            t0 = time.perf_counter()
            engine.generate(reqs, params)  # warm-up: compile + capture this bucket
            sync(str(engine.device))
            print(f"RL-shaped {mode}: first call (warm-up) {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            res = engine.generate(reqs, params)
            sync(str(engine.device))
            dt = time.perf_counter() - t0
        except Exception as exc:  # one failing variant must not hide the others' rows
            print(f"RL-shaped {mode}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            engine.shutdown()
            continue
        produced = sum(len(r.token_ids) for r in res)
        out.append((mode, produced / dt, produced / len(res), dt))
        print(f"RL-shaped {mode:28s}: {produced / dt:10.1f} real new tok/s, mean length {produced / len(res):6.1f}, "
              f"{dt:6.2f} s", flush=True)
        engine.shutdown()
    return out


def compile_seconds() -> dict[str, float]:
    """torch.compile's time so far per timed phase (``torch._dynamo.utils.compile_times``, summed over
    compiles), seconds. The phases nest (``_compile.compile_inner`` contains tracing and the backend's
    ``compile_fx_inner``, which contains inductor's code generation and its wait for the Triton compile
    workers), so they are read side by side, not added."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {n: float(v) for n, v in zip(names, values)}


def compile_profile(before: dict[str, float], after: dict[str, float], top: int = 8) -> list[tuple[str, float]]:
    """The ``top`` phases by the seconds they grew between two :func:`compile_seconds` readings."""
    grown = [(n, after[n] - before.get(n, 0.0)) for n in after]
    return sorted([(n, round(d, 2)) for n, d in grown if d >= 0.005], key=lambda x: -x[1])[:top]


def warmup_sequence(model, args) -> list[dict]:
    """Issue 40's warm-up rows: one engine with the product defaults (what ``ferrule train`` and
    ``ferrule serve`` build) meets, in turn, 256 x 256 (prompt ``--prompt-len``, EOS ignored), the RL-shaped
    load (``--rl-prompts`` x ``--rl-n``, prompts U[32, 256], a stop id every ``--rl-stop-every``, at most
    512 new tokens), then 64 x 128 (a new batch size). For each: the first call (compiles and graph
    captures included), the steady rate of a second identical call, ``EmbeddedEngine.info()``'s counts and
    where the first call's compile time went (``compile_phases_s``, :func:`compile_profile`: what the
    warm-up profile is read from; first call minus ``_compile.compile_inner`` is mostly CUDA graph capture).
    Run twice in a row, the second process shows what the on-disk compile caches save."""
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    from ferrule.engine_settings import RolloutEngineSettings

    t_build = time.perf_counter()
    chosen = {k: v for k, v in (("decode_dynamic", args.decode_dynamic),
                                ("compile_regions", None if args.compile_regions is None else bool(args.compile_regions)),
                                ("compile_step", None if args.compile_step is None else bool(args.compile_step)))
              if v is not None}
    settings = RolloutEngineSettings(**chosen)
    engine = EmbeddedEngine(model=model, settings=settings)
    t_build_s = time.perf_counter() - t_build
    print(f"engine built in {time.perf_counter() - t_build:.1f} s; settings {engine.settings.describe()}; "
          f"fast_decode={engine.fast_decode}; compile cache {engine.info()['compile_cache']}", flush=True)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    k = max(1, args.warmup_div)  # --warmup-div: every batch size and token count divided (a CPU smoke run)
    fixed = torch.randint(1, vocab, (256 // k, args.prompt_len), generator=g).tolist()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(32, 257, (args.rl_prompts,), generator=g).tolist()
    rl = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    stops = tuple(range(args.rl_stop_every, vocab, args.rl_stop_every))

    def sampled(rows, new):
        return (f"{rows // k} x {new // k}", fixed[:rows // k],
                SamplingParams(temperature=1.0, max_new_tokens=new // k, ignore_eos=True, seed=0))

    shapes = [sampled(256, 256),
              (f"RL-shaped {args.rl_prompts} x {args.rl_n}", rl,
               SamplingParams(temperature=1.0, max_new_tokens=512 // k, n=args.rl_n, seed=0, stop_token_ids=stops)),
              sampled(64, 128),
              # two more new rungs (8, 128) and a greedy call (another compiled variant: no sampling noise)
              sampled(8, 64), sampled(128, 64),
              (f"{16 // k} x {64 // k} greedy", fixed[:16 // k],
               SamplingParams(temperature=0.0, max_new_tokens=64 // k, ignore_eos=True))]
    if args.warmup_shapes:  # a subset, by position in the list above (bench/bench_targets.py picks four)
        shapes = [shapes[int(i)] for i in args.warmup_shapes.split(",")]
    rows, total_first = [], 0.0
    for label, reqs, params in shapes:
        times = []
        before = compile_seconds()
        for _ in range(2):
            sync(args.device)
            t0 = time.perf_counter()
            res = engine.generate(reqs, params)
            sync(args.device)
            times.append(time.perf_counter() - t0)
            if len(times) == 1:
                phases = compile_profile(before, compile_seconds())
        produced = sum(len(r.token_ids) for r in res)
        info = engine.info()
        total_first += times[0]
        row = dict(shape=label, first_s=round(times[0], 2), steady_s=round(times[1], 3),
                   steady_tok_s=round(produced / times[1], 1), mean_len=round(produced / len(res), 1),
                   warmup_s=round(times[0] - times[1], 2), decode_shapes=info["decode_shapes"],
                   graph_captures=info["graph_captures"], compiles=info["compiles"],
                   distinct_shapes=info["distinct_shapes"], compile_phases_s=dict(phases))
        rows.append(row)
        print(row, flush=True)
        if args.json_out:  # after every shape: a run cut off by a time limit keeps the shapes it finished
            with open(args.json_out, "w") as f:
                json.dump({"build_s": round(t_build_s, 2), "rows": rows}, f)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"{device}: first calls {total_first:.1f} s in all (the whole sequence, steady calls and engine build "
          f"included, {time.perf_counter() - t_build:.1f} s)", flush=True)
    return rows


def append_row(path: str, row: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + (f"\n\n{SECTION}\n\nEmbedded rollout engine vs HF `model.generate` "
                                    "(bench/bench_rollout.py; temperature 1, EOS ignored, random prompts).\n\n"
                                    + HEADER)
        text += row
    else:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        end = len(text) if nxt == -1 else nxt
        body = text[start:end].rstrip("\n")
        if HEADER.splitlines()[0] not in body:
            body += "\n\n" + HEADER.rstrip("\n")
        text = text[:start] + body + "\n" + row + text[end:]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="small", help="random-weight Qwen2 preset")
    ap.add_argument("--hf-dir", default=None, help="HF checkpoint directory (overrides --model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="run the embedded decode step eagerly on CUDA")
    ap.add_argument("--machine", default=platform.node(), help="machine name for the table row")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md"))
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to --out")
    ap.add_argument("--compare-compile", action="store_true",
                    help="also time the embedded engine with compile_decode=False (the pre-compile path)")
    ap.add_argument("--rl-shaped", action="store_true", help="run the RL-shaped static vs continuous comparison")
    ap.add_argument("--rl-prompts", type=int, default=64)
    ap.add_argument("--rl-n", type=int, default=8)
    ap.add_argument("--rl-stop-every", type=int, default=300)
    ap.add_argument("--rl-max-batch", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--rl-continuous-fast", type=int, nargs="*", choices=[0, 1], default=None,
                    help="RL-shaped: time the continuous modes with rollout_engine.continuous_fast at each value "
                         "(default: the product default only)")
    ap.add_argument("--rl-skip-plain", action="store_true", help="RL-shaped: time only the fast path variants")
    ap.add_argument("--compare-fast", action="store_true",
                    help="also time the embedded engine with fast_decode=False (the plain compiled path)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate anchor (ratio prints nan)")
    ap.add_argument("--no-plain", action="store_true", help="grid mode: skip the plain path (x plain prints nan)")
    ap.add_argument("--skip-fixed", action="store_true", help="skip the fixed-length HF vs embedded comparison")
    ap.add_argument("--batches", type=int, nargs="*", default=None,
                    help="grid mode: time every batch size (HF, plain, each fast variant) in this process")
    ap.add_argument("--kv-buckets", nargs="*", default=None,
                    help="fast path RolloutEngineSettings.kv_bucket values (default: the product's)")
    ap.add_argument("--attn", nargs="*", default=None,
                    help="fast path RolloutEngineSettings.attention values (default: the product's)")
    ap.add_argument("--warmup-sequence", action="store_true",
                    help="issue 40's sequence on ONE engine with the product defaults: 256 x 256, the RL-shaped "
                         "load, then 64 x 128 (a new batch size); first call and steady rate of each")
    ap.add_argument("--warmup-shapes", default=None,
                    help="--warmup-sequence: comma-separated positions of the shapes to run (0: 256 x 256, 1: RL-shaped, "
                         "2: 64 x 128, 3: 8 x 64, 4: 128 x 64, 5: 16 x 64 greedy; default all, in that order)")
    ap.add_argument("--warmup-div", type=int, default=1,
                    help="--warmup-sequence: divide every batch size and token count by this (a CPU smoke run)")
    ap.add_argument("--json-out", default=None, help="--warmup-sequence: also write the rows to this JSON file")
    ap.add_argument("--decode-dynamic", choices=["all", "auto", "marked"], default=None,
                    help="--warmup-sequence: rollout_engine.decode_dynamic (default: the product default)")
    ap.add_argument("--compile-regions", type=int, choices=[0, 1], default=None,
                    help="--warmup-sequence: rollout_engine.compile_regions (default: the product default)")
    ap.add_argument("--compile-step", type=int, choices=[0, 1], default=None,
                    help="--warmup-sequence: rollout_engine.compile_step (0: the fast step uncompiled under its CUDA "
                         "graphs; default: the product default)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    import torch._dynamo as dynamo

    # one compile per (batch, cache) bucket and variant: more than dynamo's default 8 in one process
    dynamo.config.recompile_limit = 64

    model, name = build_model(args)
    if args.warmup_sequence:
        warmup_sequence(model, args)
        return 0
    if args.rl_shaped:
        bench_rl_shaped(model, args)
        if args.skip_fixed:
            return 0
    if args.batches:
        rows = bench_grid(model, args)
        print("| batch | mode | tok/s | step ms | HF tok/s | x HF | x plain | limit ms | share of limit |")
        for r in rows:
            print(f"| {r['batch']} | {r['mode']} | {r['tok_s']} | {r['step_ms']} | {r['hf_tok_s']} | {r['x_hf']} | "
                  f"{r['x_plain']} | {r['limit_ms']} | {r['of_limit']:.0%} |")
        return 0
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), generator=g)
    hf = float("nan") if args.no_hf else bench_hf(model, prompts, args.new_tokens, args.device)
    if args.compare_compile:
        plain, _ = bench_embedded(model, prompts, args.new_tokens, not args.no_cuda_graph, compile_decode=False)
        print(f"embedded, compile_decode=False: {plain:10.1f} new tok/s ({plain / hf:.2f}x HF)")
    if args.compare_fast:
        plain, _ = bench_embedded(model, prompts, args.new_tokens, not args.no_cuda_graph, fast_decode=False)
        print(f"embedded, fast_decode=False: {plain:10.1f} new tok/s ({plain / hf:.2f}x HF), "
              f"{args.batch * 1e3 / plain:.3f} ms per step")
    ours, graph = bench_embedded(model, prompts, args.new_tokens, not args.no_cuda_graph, fast_decode=True)
    ratio = ours / hf
    step_ms = args.batch * 1e3 / ours
    if args.device.startswith("cuda"):
        limit = step_limit_ms(model, args.batch, args.prompt_len + args.new_tokens / 2)
        print(f"decode step  : {step_ms:.3f} ms; physical limit {limit:.3f} ms ({limit / step_ms:.0%} of it)")
    print(f"model={name} device={args.device} dtype={args.dtype} batch={args.batch} prompt={args.prompt_len} "
          f"new_tokens={args.new_tokens}")
    print(f"HF generate : {hf:10.1f} new tok/s")
    print(f"embedded    : {ours:10.1f} new tok/s (cuda_graph={graph}, fast_decode where supported)")
    print(f"ratio       : {ratio:10.2f}x")
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"CPU ({torch.get_num_threads()} threads)"
    row = (f"| {datetime.date.today().isoformat()} | {args.machine} | {device} | {name} | {args.dtype} | "
           f"{args.batch} | {args.prompt_len} | {args.new_tokens} | {hf:.1f} | {ours:.1f} | {ratio:.2f}x | "
           f"{'yes' if graph else 'no'} |\n")
    if not args.no_record:
        append_row(os.path.normpath(args.out), row)
        print(f"appended to {os.path.normpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
