"""Many LoRA tenants sampling at once through ``ferrule serve`` and the tinker SDK (issue 46, item 7).

What a Tinker service exists for: N users, each with their own LoRA adapter of one shared base, sampling
at the same time. This bench starts the service exactly as ``ferrule serve`` builds it
(:func:`ferrule.cli.serve.build_app`, uvicorn on a loopback port in a thread of this process, so that the
bench can reset the GPU's peak-memory counter between configurations) on a random-weight Qwen2-0.5B-shaped
HF folder written here (no network: no tokenizer either, the SDK sends token ids; the config has no
``eos_token_id``, so no sample stops early: EOS is in effect ignored, which the SDK cannot ask for), with
one API key per tenant. For each rank, N tenants' LoRA training clients are created through the SDK
(``create_lora_training_client``), each trained one step (``forward_backward`` of one 16-token datum +
``optim_step``, so that the adapter's B is non-zero), then each takes a sampler snapshot
(``save_weights_and_get_sampling_client``) under each sampling path:

- **adapter** (``--sampler-checkpoints auto``, the default, or ``adapter``): the snapshot holds the adapter;
  the requests of several tenants waiting together are decoded in ONE batch on the shared base, each row
  applying its own adapter (at most ``MAX_BATCH_JOBS`` = 16 requests per batch, :mod:`ferrule.serve.scheduler`);
- **merged** (``--sampler-checkpoints merged``, the baseline): the snapshot is a full merged copy of the model
  (merged on the training device in float64, kept in host memory: :func:`ferrule.serve.merge.merged_hf_state`);
  each request's weights are swapped into the sampler in turn (merge-and-swap).

The path is the backend's ``sampler_checkpoints`` attribute, which the service reads only when a snapshot
is taken (what ``--sampler-checkpoints`` sets); the bench flips it between the two snapshot passes so that
one sampler (one compile) serves both. The sampler holds up to ``--tenants``' largest adapters at once
(``--engine-setting rollout_engine.max_lora_adapters=N``; the default 16 would split 32 tenants' batch
into two, see the output's note). ``--max-snapshots 1``: a tenant's new snapshot drops its previous one,
so at most one merged copy per tenant is held at a time.

The configurations run in this order: the adapter path at every rank, then the merged path at every rank
(the rows the target is about come first, within ``--budget-s``). The merged path measures the tenant counts
whose merged copies (:func:`ferrule.serve.memory.model_copy_bytes` each, in host memory) fit in 75% of the host
memory available
when its snapshots are taken; the others are printed as skipped, with the numbers.

Then, per configuration (path, rank, N tenants): every round, N threads send one request each at the same
moment (``num_samples`` samples of a fixed random ``--prompt-len``-token prompt per tenant, ``max_tokens``,
temperature 1, no seed: seeded requests never share a batch) and wait for it; ``--warmup-rounds`` first
(their time printed apart: the first call of a new batch shape compiles or captures a CUDA graph; the merged
path only before its first configuration, since it decodes every request alone, in one shape), then
``--rounds`` measured (``--merged-rounds`` for the merged path). Reported: aggregate sampled tokens/s of the measured rounds (tokens counted from the
responses), p50 / p99 latency of one request (submit to result, client side; nearest-rank over N x rounds
requests), GPU memory (``/api/v1/healthz``'s ``cuda_memory``: allocated before the warm-up, and the
service process's peak allocated during the configuration's rounds; the training clients of every rank so
far stay live, so they are in both), the ratio of N tenants' tok/s to one tenant's (same path, rank), and
from the service's op log how many ``generate`` calls the configuration's rounds (warm-up included) took
and how many requests shared one.

    python bench/bench_serve_tenants.py                 # GPU: tenants 1 8 32 x ranks 16 32 x both paths
    python bench/bench_serve_tenants.py --record        # ... and append the rows to docs/benchmarks.md
    python bench/bench_serve_tenants.py --tiny          # CPU smoke run: tiny model, 1 and 2 tenants, ~1-2 min

``--budget-s`` (330) skips the configurations that would start after that many seconds (printed as
skipped), so a slow machine still ends near the budget.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
MODEL_NAME = "qwen2-0.5b-random"
GIB = 2**30


def build_base(out: Path, preset: str) -> Path:
    """A random-weight Qwen2 HF folder (``bench_rollout.PRESETS[preset]``; bfloat16 on disk for 0.5B, as Qwen
    releases it; float32 for the tiny one); no tokenizer, no ``eos_token_id``."""
    import torch
    from bench_rollout import PRESETS
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, **PRESETS[preset])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):   # random init of 0.5B parameters takes ~20 s on a CPU, well under 1 s on a GPU
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.float32 if preset == "tiny" else torch.bfloat16)
    model.save_pretrained(out)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class OpLog(logging.Handler):
    """The service's op log (``ferrule.serve``: one line per operation, ``batch`` = the requests that shared
    one ``generate`` call) kept as ``(op, batch, run_s, status)`` of each sampling request."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ops: list[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        a = record.args
        if isinstance(a, tuple) and len(a) == 11 and a[0] == "sample":
            self.ops.append((a[0], a[9], a[8], a[10]))

    def take(self) -> dict:
        """``{"calls": generate calls, "per_call": sorted distinct requests per call, "failed": n}`` since the last take."""
        ops, self.ops = self.ops, []
        return {"calls": round(sum(1 / b for _, b, _, _ in ops)), "per_call": sorted({b for _, b, _, _ in ops}),
                "failed": sum(s != "ok" for *_, s in ops)}


class Bench:
    def __init__(self, args, base: Path, storage: Path):
        import uvicorn

        from ferrule.cli.serve import build_app
        from ferrule.serve.placement import default_worker_threads

        os.environ["TINKER_TELEMETRY"] = "0"
        self.args = args
        n = max(args.tenants)
        self.keys = [f"tml-bench-tenant-{i:03d}" for i in range(n)]
        keyfile = storage / "keys.txt"
        storage.mkdir(parents=True, exist_ok=True)
        keyfile.write_text("".join(f"{k} t{i}\n" for i, k in enumerate(self.keys)))
        # as `ferrule serve --sampler-checkpoints adapter --max-snapshots 1 --engine-setting
        # rollout_engine.max_lora_adapters=N` builds it (the worker's and event loop's thread counts included)
        self.app = build_app(base, storage / "serve", keyfile, MODEL_NAME, max_snapshots=1,
                             worker_threads=default_worker_threads(), event_loop_threads=1,
                             sampler_checkpoints="adapter",
                             engine_settings=[f"rollout_engine.max_lora_adapters={max(n, 16)}"])
        self.backend = self.app.state.bases.get(MODEL_NAME)
        import socket

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        import tinker

        self.oplog = OpLog()
        logger = logging.getLogger("ferrule.serve")
        logger.addHandler(self.oplog)
        logger.setLevel(logging.INFO)
        self.clients = [tinker.ServiceClient(base_url=self.url, api_key=k) for k in self.keys]
        self.pool = ThreadPoolExecutor(max_workers=n)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/api/v1/healthz", timeout=60).json()

    def stop(self) -> None:
        self.pool.shutdown()
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.app.state.scheduler.shutdown()
        self.app.state.store.engine.dispose()

    def trainers(self, rank: int) -> list:
        """One LoRA training client per tenant, trained one step so that its adapter is non-zero."""
        import torch
        from tinker import types

        vocab = self.backend.vocab_size

        def one(i: int):
            tc = self.clients[i].create_lora_training_client(base_model=MODEL_NAME, rank=rank, seed=i).result()
            g = torch.Generator().manual_seed(10_000 * rank + i)
            toks = torch.randint(0, vocab, (17,), generator=g).tolist()
            datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16})
            fb = tc.forward_backward([datum], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fb.result()
            step.result()
            return tc
        return list(self.pool.map(one, range(len(self.keys))))

    def snapshots(self, trainers: list, path: str) -> list:
        """Each tenant's sampler snapshot under ``path`` (the backend's ``sampler_checkpoints``)."""
        self.backend.sampler_checkpoints = path
        return list(self.pool.map(lambda tc: tc.save_weights_and_get_sampling_client().result(), trainers))

    def round(self, samplers: list, prompts: list) -> tuple[float, list[float], int]:
        """One round: every sampler sends one request at once; (wall s, latencies s, sampled tokens)."""
        from tinker import types

        a = self.args
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0)
        start = threading.Barrier(len(samplers) + 1)

        def one(i: int):
            start.wait()
            t0 = time.perf_counter()
            resp = samplers[i].sample(types.ModelInput.from_ints(prompts[i]), num_samples=a.num_samples,
                                      sampling_params=params).result(timeout=900)
            return time.perf_counter() - t0, sum(len(s.tokens) for s in resp.sequences)

        futs = [self.pool.submit(one, i) for i in range(len(samplers))]
        start.wait()
        t0 = time.perf_counter()
        res = [f.result() for f in futs]
        return time.perf_counter() - t0, [r[0] for r in res], sum(r[1] for r in res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, tenants 1 2, rank 8, few tokens")
    ap.add_argument("--tenants", type=int, nargs="+", default=None, help="default 1 8 32 (--tiny: 1 2)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="default 16 32 (--tiny: 8)")
    ap.add_argument("--paths", nargs="+", choices=("adapter", "merged"), default=["adapter", "merged"])
    ap.add_argument("--num-samples", type=int, default=None, help="samples per request (default 64; --tiny 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 48; --tiny 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per sample (default 128; --tiny 8)")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per configuration")
    ap.add_argument("--merged-rounds", type=int, default=1,
                    help="measured rounds of the merged path (N swaps per round: slow; default 1)")
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="skip configurations that would start after this many seconds from the start")
    ap.add_argument("--record", action="store_true", help="append the rows to --out")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.tenants = sorted(args.tenants or ([1, 2] if tiny else [1, 8, 32]))
    args.ranks = args.ranks or ([8] if tiny else [16, 32])
    args.num_samples = args.num_samples or (4 if tiny else 64)
    args.prompt_len = args.prompt_len or (8 if tiny else 48)
    args.max_tokens = args.max_tokens or (8 if tiny else 128)
    t_start = time.perf_counter()

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-tenants-"))
    base = build_base(tmp / MODEL_NAME, "tiny" if tiny else "qwen2-0.5b")
    print(f"base written in {time.perf_counter() - t_start:.1f} s: {base}", flush=True)
    bench = Bench(args, base, tmp)
    health = bench.health()
    sampler = health["samplers"][MODEL_NAME]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"service ready at {time.perf_counter() - t_start:.1f} s on {device_name}; sampler {sampler}", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, bench.backend.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in bench.keys]
    rows, skipped = [], []
    merged_warm = False

    def over() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    trainers: dict[int, list] = {}
    try:
        # the adapter rows of every rank first (what the target is about), the merged baseline after
        for path, rank in [(p, r) for p in args.paths for r in args.ranks]:
            if over():
                skipped += [f"{path} r{rank} x{n}" for n in args.tenants]
                continue
            if rank not in trainers:
                t0 = time.perf_counter()
                trainers[rank] = bench.trainers(rank)
                print(f"r{rank}: {len(trainers[rank])} LoRA training clients created and stepped in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            counts = list(args.tenants)
            if path == "merged":   # N full copies in host memory: only the tenant counts that fit
                import psutil

                from ferrule.serve.memory import model_copy_bytes

                copy = model_copy_bytes(bench.backend)   # the service's own estimate of one merged copy
                avail = psutil.virtual_memory().available
                fit = int(0.75 * avail // copy) if copy else max(counts)
                for n in [n for n in counts if n > fit]:
                    print(f"merged r{rank} x{n} skipped: {n} merged copies of {copy / GIB:.2f} GiB do not fit 75% "
                          f"of the {avail / GIB:.1f} GiB host memory available", flush=True)
                    skipped.append(f"merged r{rank} x{n} (does not fit host memory)")
                counts = [n for n in counts if n <= fit]
                if not counts:
                    continue
            t0 = time.perf_counter()
            samplers = bench.snapshots(trainers[rank][:max(counts)], path)
            held = list(bench.backend._snapshots.values())   # what the service holds (private: a bench's look)
            merged = [h for h in held if isinstance(h, dict)]
            print(f"r{rank} {path}: {len(samplers)} snapshots in {time.perf_counter() - t0:.1f} s; the service "
                  f"holds {len(held) - len(merged)} adapter and {len(merged)} merged snapshots ("
                  f"{sum(t.nbytes for h in merged for t in h.values()) / GIB:.2f} GiB, "
                  f"{sorted({str(t.dtype) for h in merged for t in h.values()})} on "
                  f"{sorted({str(t.device) for h in merged for t in h.values()})})", flush=True)
            rounds = args.rounds if path == "adapter" else args.merged_rounds
            for n in counts:
                if over():
                    skipped.append(f"{path} r{rank} x{n}")
                    continue
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                bench.oplog.take()
                before = (bench.health()["cuda_memory"] or {}).get("allocated", float("nan"))
                # the merged path decodes every request alone (one tenant's rows, one shape): once that shape
                # is warm, a warm-up round would only repeat the measured swaps
                nwarm = 0 if path == "merged" and merged_warm else args.warmup_rounds
                merged_warm = merged_warm or path == "merged"
                warm = [bench.round(samplers[:n], prompts[:n])[0] for _ in range(nwarm)]
                walls, lats, toks = [], [], 0
                for _ in range(rounds):
                    wall, lat, tok = bench.round(samplers[:n], prompts[:n])
                    walls.append(wall)
                    lats += lat
                    toks += tok
                peak = (bench.health()["cuda_memory"] or {}).get("max_allocated", float("nan"))
                ops = bench.oplog.take()   # warm-up and measured rounds
                row = dict(path=path, rank=rank, tenants=n, rows=n * args.num_samples,
                           warmup_s=round(sum(warm), 2) if warm else "-", rounds=rounds,
                           round_s=round(statistics.mean(walls), 3),
                           tok_s=round(toks / sum(walls), 1), p50_s=round(nearest_rank(lats, 0.5), 3),
                           p99_s=round(nearest_rank(lats, 0.99), 3), requests=len(lats),
                           tokens=toks, generate_calls=ops["calls"], requests_per_call=ops["per_call"],
                           before_gib=round(before / GIB, 2), peak_gib=round(peak / GIB, 2))
                expect = n * rounds * args.num_samples * args.max_tokens
                if ops["failed"]:
                    row["failed"] = ops["failed"]
                if toks != expect:
                    row["short"] = f"{toks} of {expect} tokens (a sample stopped early)"
                rows.append(row)
                print(row, flush=True)
    finally:
        bench.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the random base (1 GB for 0.5B) and the service's storage
    total = time.perf_counter() - t_start
    print(f"{device_name}: {total:.1f} s in all" + (f"; skipped (over --budget-s {args.budget_s:.0f} unless said "
                                                    f"otherwise): {', '.join(skipped)}" if skipped else ""),
          flush=True)
    by = {(r["path"], r["rank"], r["tenants"]): r for r in rows}
    fewest, most = args.tenants[0], args.tenants[-1]
    date = datetime.date.today().isoformat()
    preset = "tiny random Qwen2" if tiny else "random Qwen2-0.5B shape"
    header = ("| date | device | path | rank | tenants | rows per round | warm-up s | tok/s | x 1 tenant | "
              "p50 s | p99 s | requests | generate calls (requests each) | GPU GiB before / peak |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        one = by.get((r["path"], r["rank"], fewest))
        rel = f"{r['tok_s'] / one['tok_s']:.2f}" if one else "-"
        lines.append(f"| {date} | {device_name} | {r['path']} | {r['rank']} | {r['tenants']} | {r['rows']} | "
                     f"{r['warmup_s']} | {r['tok_s']:,.0f} | {rel} | {r['p50_s']} | {r['p99_s']} | {r['requests']} | "
                     f"{r['generate_calls']} ({', '.join(map(str, r['requests_per_call']))}) | "
                     f"{r['before_gib']} / {r['peak_gib']} |")
    print(header)
    print("\n".join(lines))
    summary = []
    for rank in args.ranks:
        for path in args.paths:
            a, b = by.get((path, rank, fewest)), by.get((path, rank, most))
            if a and b:
                summary.append(f"{path} r{rank}: {most} tenants / {fewest} tenant = {b['tok_s'] / a['tok_s']:.2f}"
                               + (" (target >= 0.70: " + ("met)" if b["tok_s"] / a["tok_s"] >= 0.70 else "missed)")
                                  if path == "adapter" and most >= 32 and fewest == 1 else ""))
        a, b = by.get(("adapter", rank, most)), by.get(("merged", rank, most))
        if a and b:
            summary.append(f"r{rank}, {most} tenants: adapter / merged = {a['tok_s'] / b['tok_s']:.1f}x")
    print("\n".join(summary))
    if args.record:
        cmd = " ".join(["python bench/bench_serve_tenants.py"] + (argv if argv is not None else sys.argv[1:]))
        with open(args.out, "a") as f:
            f.write(f"\n### `ferrule serve` through the SDK: LoRA tenants sampling at once (issue 46, {date}, "
                    f"{device_name})\n\n`{cmd}`: {preset}, sampler {sampler.get('dtype')} on {sampler.get('device')} "
                    f"(fast decode {sampler.get('fast_decode')}, CUDA graph {sampler.get('cuda_graph')}); each "
                    f"request {args.num_samples} samples x {args.max_tokens} tokens of a {args.prompt_len}-token "
                    f"prompt, temperature 1; {args.warmup_rounds} warm-up round(s), then {args.rounds} measured "
                    f"(merged: {args.merged_rounds}); {total:.0f} s in all"
                    + (f"; skipped: {', '.join(skipped)}" if skipped else "") + ".\n\n"
                    + header + "\n" + "\n".join(lines) + "\n\n" + "\n".join(f"- {s}" for s in summary) + "\n")
        print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
