"""Many LoRA tenants sampling on one base: batched multi-adapter decode vs one tenant after another.

What ``ferrule serve``'s sampler does with N sampling sessions of different LoRA adapters waiting at
once (issue 46), on the embedded rollout engine with the product defaults:

- **batched**: every tenant's adapter held by name (``EmbeddedEngine.add_lora_adapter``), all tenants'
  requests in ONE ``generate`` call, each row applying its own adapter
  (:mod:`ferrule.rollout._multi_lora`; the service's default since issue 46, ``--sampler-checkpoints auto``);
- **one by one**: one tenant at a time, its adapter served to every row (``update_lora_adapter``, merged
  once per adapter into the fast path's weight copy), then its ``generate`` call: the cost of the swap
  path without the service's full-weight copies, so a lower bound of what merged snapshots cost;
- **base**: the same rows on the base alone (no adapter), the ceiling.

Each tenant asks for ``--rows-per-round / N`` samples of one prompt (so every N decodes the same number of
rows), temperature 1, EOS ignored, ``--new-tokens`` each. Random Qwen2-0.5B-shape weights, random rank-r
adapters on all seven projections of every layer. Prints, per N and rank: the first call (warm-up
included), the steady rate (median of ``--iters`` calls), and peak GPU memory; ``--record`` appends the rows
to docs/benchmarks.md's "Multi-LoRA" section.

    python bench/bench_multi_lora.py --tenants 1 8 32 --ranks 16 32 --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_rollout import PRESETS, build_model, sync  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model, rank: int, seed: int) -> tuple[dict, dict]:
    """PEFT-saved-form tensors of a random rank-``rank`` adapter on every projection, and its config."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.02
    return tensors, {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="qwen2-0.5b")
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16])
    ap.add_argument("--rows-per-round", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["base", "batched", "one_by_one"])
    ap.add_argument("--check", action="store_true", help="also compare batched with each adapter served alone")
    ap.add_argument("--record", action="store_true", help="append the rows to --out")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md"))
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = 64
    from ferrule.engine_settings import RolloutEngineSettings
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.base import GenerateRequest
    from ferrule.rollout.embedded import EmbeddedEngine

    model, name = build_model(args)
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    vocab = model.config.vocab_size
    rows = []
    t_start = time.perf_counter()
    for rank in args.ranks:
        for n_ten in args.tenants:
            per = max(1, args.rows_per_round // n_ten)
            engine = EmbeddedEngine(model=model, settings=RolloutEngineSettings(max_lora_adapters=max(args.tenants)))
            adapters = {f"t{i}": random_adapter(model, rank, seed=1000 * rank + i) for i in range(n_ten)}
            g = torch.Generator().manual_seed(n_ten)
            prompts = {t: tuple(torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist()) for t in adapters}
            params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=per, ignore_eos=True)
            produced = n_ten * per * args.new_tokens

            def base():
                engine.generate([GenerateRequest(prompts[t]) for t in adapters], params)

            def batched():
                engine.generate([GenerateRequest(prompts[t], lora_adapter=t) for t in adapters], params)

            version = [0]

            def one_by_one():
                for t, (tensors, cfg) in adapters.items():
                    version[0] += 1
                    engine.update_lora_adapter(tensors, cfg, version=engine.weights_version + 1)
                    engine.generate([GenerateRequest(prompts[t])], params)

            if args.check and n_ten > 1:  # batched vs each adapter served alone (merged fast path), greedy
                gp = SamplingParams(temperature=0.0, max_new_tokens=32, n=2, ignore_eos=True)
                for name_t, (tensors, cfg) in adapters.items():
                    engine.add_lora_adapter(name_t, tensors, cfg)
                together = engine.generate([GenerateRequest(prompts[t], lora_adapter=t) for t in adapters], gp)
                for name_t in list(engine.lora_adapters):
                    engine.remove_lora_adapter(name_t)
                diffs, same = [], 0
                for k, (t, (tensors, cfg)) in enumerate(adapters.items()):
                    engine.update_lora_adapter(tensors, cfg, version=engine.weights_version + 1)
                    alone = engine.generate([GenerateRequest(prompts[t])], gp)
                    for a, b in zip(together[k * 2:(k + 1) * 2], alone):
                        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                                 len(a.token_ids))
                        same += n == len(a.token_ids)
                        diffs += [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])]
                engine.unload_lora_adapter()
                print(f"check r{rank} x{n_ten}: batched vs alone (merged fast path), greedy 32 tokens: "
                      f"{same}/{2 * n_ten} rows identical, logprob |diff| over the common prefix: mean "
                      f"{statistics.mean(diffs):.2e}, max {max(diffs):.2e}", flush=True)
            for mode in args.modes:
                if mode == "batched":
                    for name_t, (tensors, cfg) in adapters.items():
                        engine.add_lora_adapter(name_t, tensors, cfg)
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                fn = {"base": base, "batched": batched, "one_by_one": one_by_one}[mode]
                first = timed(fn, args.device)
                steady = statistics.median(timed(fn, args.device) for _ in range(args.iters))
                peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
                row = dict(rank=rank, tenants=n_ten, rows=n_ten * per, mode=mode, first_s=round(first, 2),
                           steady_s=round(steady, 3), tok_s=round(produced / steady, 1), peak_gib=round(peak, 2),
                           fast=engine._multi.pool is None or engine._multi.pool.fast_factors(
                               model.config.num_hidden_layers) is not None)
                rows.append(row)
                print(row, flush=True)
                if mode == "batched":
                    for name_t in list(engine.lora_adapters):
                        engine.remove_lora_adapter(name_t)
                if mode == "one_by_one":
                    engine.unload_lora_adapter()
            engine.shutdown()
            del engine
    print(f"{device_name}: {time.perf_counter() - t_start:.1f} s in all", flush=True)
    by = {(r["rank"], r["tenants"], r["mode"]): r for r in rows}
    lines = []
    for r in rows:
        one = by.get((r["rank"], min(args.tenants), r["mode"]))
        rel = f"{r['tok_s'] / one['tok_s']:.2f}" if one else "-"
        lines.append(f"| {datetime.date.today().isoformat()} | {device_name} | {name} | r{r['rank']} | {r['tenants']} | "
                     f"{r['rows']} | {r['mode']} | {r['first_s']} | {r['tok_s']:.0f} | {rel} | {r['peak_gib']} |")
    print("| date | device | model | rank | tenants | rows | mode | first call s | steady tok/s | x fewest tenants "
          "| peak GiB |")
    print("\n".join(lines))
    if args.record:
        with open(os.path.normpath(args.out), "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
