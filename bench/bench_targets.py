"""Every target row of issue 40's table, measured with the product's defaults in one run on one GPU.

Sections (``--sections a,b,...``; default all, in this order; each reuses an existing bench module):

a. **warm-up**: two fresh processes one after the other (``bench/bench_rollout.py --warmup-sequence``),
   the first with cold compile caches (an emptied ``--cache-dir`` as ``FERRULE_CACHE_DIR``), the second
   on the caches the first left; each runs, on one engine, the first ``EmbeddedEngine.generate`` of every
   shape a run meets: 256 x 256, the RL-shaped load (64 prompts x 8), 64 x 128 (a new batch size), and
   a first greedy call (16 x 64). Target: first calls <= 20 s in all in the first process, <= 5 s in the
   second (interpreter start and model build not counted).
b. **steady 256 x 256** (prompt 32, EOS ignored): tok/s, ms per step (median of ``--reps`` calls after a
   first one), and the share of the step's bandwidth limit: (weights + the KV of the filled prefix, on
   average prompt + 128 slots per row) / the GPU's peak memory bandwidth (H100 SXM 3.35 TB/s, H200
   4.8 TB/s, H100 PCIe 2.0 TB/s, from the device name). Target >= 40%.
c. **steady RL-shaped**: 64 prompts x 8 samples, prompts U[32, 256], <= 512 new, EOS on (a stop id every
   300th id), static batch vs continuous batching (``max_batch`` 128, 256; each with
   ``rollout_engine.continuous_fast`` off, the default, and on: ``--continuous-fast``); real tok/s of a
   second call (``bench_rollout.bench_rl_shaped``). Targets: static >= 100k real tok/s, continuous >= static.
d. **60 RL steps of that load** (rollout only, as the issue's row): warm-up + 59 x the steady RL-shaped
   call, where warm-up = the cold process's first calls of 256 x 256 and the RL-shaped load (a run's
   first rollout pays the compile, whichever shape it has); also with the second process's warm-up.
   Target <= 90 s. Needs a and c (from this run or the state file of an earlier ``--sections`` call).
e. **train step** (``bench/bench_train_hf.py`` in a subprocess: Liger patches transformers' Qwen2
   process-wide): ferrule's defaults vs HF + Liger on 8 x 2048 (tok/s, peak GiB; target >= 1.15x at <=
   Liger's memory) and on the RL-shaped batch vs Liger padded (target >= 2x).
f. **LoRA r16 adapter sync vs full sync** (``bench/bench_lora_sync.py --no-decode`` in a subprocess):
   median ms of each; target adapter <= full.
g. **profile of the steady decode step** (``bench/profile_decode.profile_engine`` on b's engine): the
   top kernels and their share of the summed kernel time, graph replay GPU ms vs the whole call's ms per
   step (the difference: host time between steps). No target; printed under the table.

Prints one table (row, target, measured, met / missed by how much); ``--record`` appends it, dated, with the
GPU's name, to docs/benchmarks.md. Results also accumulate in ``--state`` (JSON), so a run split across two
calls (``--sections a`` then ``--sections b,c,d,e,f,g``) prints the whole table at the end of the second.

GPU (one lent H100, ~8 minutes in all; or in two calls of ~4.5 and ~4 minutes)::

    python bench/bench_targets.py --record
    python bench/bench_targets.py --sections a && python bench/bench_targets.py --sections b,c,d,e,f,g --record

CPU smoke run of every section (tiny model, times meaningless, ~1-2 minutes)::

    python bench/bench_targets.py --tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SECTIONS = "abcdefg"
#: --warmup-shapes of bench_rollout.py: 256 x 256, RL-shaped, 64 x 128, 16 x 64 greedy
WARMUP_SHAPES = "0,1,2,5"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench_targets {time.perf_counter() - _T0:6.1f} s] {msg}", flush=True)


def peak_bandwidth(device_name: str) -> float | None:
    """Peak memory bandwidth (bytes/s) from the device name (NVIDIA datasheets); None if unknown."""
    name = device_name.upper()
    if "H200" in name:
        return 4.8e12
    if "H100" in name:
        return 2.0e12 if "PCIE" in name else 3.35e12
    return None


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:] if len(text) > n else text


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd``, echo its output as it comes; (exit code or None on timeout, all output)."""
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            proc.wait()
            log(f"timed out after {timeout:.0f} s")
            return None, "".join(lines)
        if sel.select(timeout=min(left, 1.0)):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            print("    " + line, end="", flush=True)
    return proc.wait(), "".join(lines)


# ---------------------------------------------------------------- sections


def section_a(args, res: dict) -> None:
    """Two fresh processes of bench_rollout.py --warmup-sequence on one cache dir (the first on an empty one)."""
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    os.makedirs(args.cache_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["FERRULE_CACHE_DIR"] = args.cache_dir
    out: dict = {}
    for proc, timeout in (("cold", args.warmup_timeout[0]), ("warm", args.warmup_timeout[1])):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, str(HERE / "bench_rollout.py"), "--model", args.model, "--device", args.device,
               "--warmup-sequence", "--warmup-shapes", WARMUP_SHAPES, "--json-out", path, "--no-record"]
        if args.tiny:
            cmd += ["--warmup-div", "16", "--rl-prompts", "4", "--rl-n", "2"]
        if args.compile_regions is not None:
            cmd += ["--compile-regions", str(args.compile_regions)]
        if args.compile_step is not None:
            cmd += ["--compile-step", str(args.compile_step)]
        t0 = time.perf_counter()
        rc, text = _run(cmd, env, timeout)
        wall = time.perf_counter() - t0
        try:
            got = json.loads(Path(path).read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            got = {}
        os.unlink(path)
        rows = got.get("rows", [])
        out[proc] = {"rc": rc, "process_wall_s": round(wall, 1), "rows": rows,
                     "first_calls_s": round(sum(r["first_s"] for r in rows), 2),
                     "complete": len(rows) == len(WARMUP_SHAPES.split(","))}
        if rc not in (0, None):
            out[proc]["error"] = _tail(text, 1500)
        log(f"warm-up, {proc} process: {out[proc]['first_calls_s']} s of first calls over {len(rows)} shapes "
            f"(process {wall:.1f} s in all, rc {rc})")
    res["a"] = out


def _rollout_model(args):
    from bench_rollout import build_model

    ns = argparse.Namespace(model=args.model, hf_dir=None, device=args.device, dtype=args.dtype)
    return build_model(ns)[0]


def section_b(args, res: dict, model, keep: dict) -> None:
    """Steady 256 x 256 (prompt 32, EOS ignored) on one engine with the product defaults."""
    import torch

    from bench_rollout import step_bytes, sync
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    batch, prompt, new = args.fixed
    g = torch.Generator().manual_seed(0)
    reqs = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
    from ferrule.engine_settings import RolloutEngineSettings

    engine = EmbeddedEngine(model=model, settings=RolloutEngineSettings(**args.chosen))
    t0 = time.perf_counter()
    engine.generate(reqs, params)
    sync(args.device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
        sync(args.device)
        t0 = time.perf_counter()
        out = engine.generate(reqs, params)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    assert sum(len(r.token_ids) for r in out) == batch * new
    dt = statistics.median(times)
    w, kv = step_bytes(model, batch, prompt + new / 2)
    bw = peak_bandwidth(res["device"])
    step_ms = dt * 1e3 / new
    limit_ms = None if bw is None else (w + kv) / bw * 1e3
    res["b"] = {"shape": f"{batch} x {new}, prompt {prompt}", "first_s": round(first, 2), "tok_s": round(batch * new / dt, 1),
                "step_ms": round(step_ms, 4), "weight_bytes": w, "kv_bytes": int(kv), "bandwidth": bw,
                "limit_ms": None if limit_ms is None else round(limit_ms, 4),
                "of_limit": None if limit_ms is None else round(limit_ms / step_ms, 4),
                "fast_decode": engine.fast_decode, "info": {k: v for k, v in engine.info().items()
                                                           if k in ("compiles", "graph_captures", "decode_shapes")}}
    log(f"steady {res['b']['shape']}: {res['b']['tok_s']} tok/s, {step_ms:.3f} ms per step, limit "
        f"{limit_ms and round(limit_ms, 3)} ms ({res['b']['of_limit']})")
    keep["engine"], keep["reqs"], keep["params"] = engine, reqs, params


def section_c(args, res: dict, model) -> None:
    """Steady RL-shaped load: static batch vs continuous batching (bench_rollout.bench_rl_shaped)."""
    from bench_rollout import bench_rl_shaped

    prompts, n, new = args.rl
    ns = argparse.Namespace(rl_prompts=prompts, rl_n=n, rl_stop_every=300, new_tokens=new, rl_skip_plain=True,
                            kv_buckets=None, attn=None, rl_max_batch=args.rl_max_batch,
                            rl_continuous_fast=args.continuous_fast)
    rows = bench_rl_shaped(model, ns)
    res["c"] = {"shape": f"{prompts} prompts x {n}, prompts U[32, 256], <= {new} new, EOS on",
                "modes": [{"mode": m, "real_tok_s": round(r, 1), "mean_len": round(ml, 1), "call_s": round(dt, 3)}
                          for m, r, ml, dt in rows]}


def section_d(res: dict) -> None:
    a, c = res.get("a"), res.get("c")
    if not a or not c:
        res["d"] = {"missing": "needs sections a and c (this run or --state)"}
        return
    static = next((m for m in c["modes"] if m["mode"].startswith("static")), None)
    if static is None:
        res["d"] = {"missing": "section c has no static row"}
        return
    out = {"steady_call_s": static["call_s"]}
    for proc in ("cold", "warm"):
        rows = a[proc]["rows"]
        first = [r["first_s"] for r in rows[:2]]  # 256 x 256, RL-shaped
        if len(first) == 2:
            out[f"warmup_{proc}_s"] = round(sum(first), 2)
            out[f"total_{proc}_s"] = round(sum(first) + 59 * static["call_s"], 1)
    res["d"] = out


def section_e(args, res: dict) -> None:
    cmd = [sys.executable, str(HERE / "bench_train_hf.py"), "--modes", "hf_liger,ferrule,hf_liger_rl,ferrule_rl",
           "--iters", str(args.train_iters), "--warmup", "1"]
    if args.tiny:
        cmd += ["--tiny", "--batch", "2", "--seq", "64", "--rl-batch", "8", "--rl-min", "16", "--rl-max", "64",
                "--max-tokens", "256", "--modes", "hf,ferrule,ferrule_rl"]
    rc, text = _run(cmd, dict(os.environ), args.train_timeout)
    summary = next((json.loads(line)["summary"] for line in text.splitlines()[::-1]
                    if line.startswith('{"summary"')), None)
    res["e"] = {"rc": rc, "summary": summary} if summary is not None else {"rc": rc, "error": _tail(text, 1500)}


def section_f(args, res: dict) -> None:
    cmd = [sys.executable, str(HERE / "bench_lora_sync.py"), "--no-decode", "--iters", str(args.sync_iters)]
    if args.tiny:
        cmd.append("--tiny")
    rc, text = _run(cmd, dict(os.environ), args.sync_timeout)
    last = next((line for line in text.splitlines()[::-1] if line.startswith("{")), None)
    try:
        got = json.loads(last) if last else None
    except json.JSONDecodeError:
        got = None
    if got is None or "lora" not in got:
        res["f"] = {"rc": rc, "error": _tail(text, 1500)}
        return
    res["f"] = {k: got[k] for k in ("full", "lora", "rank", "shape") if k in got}


def section_g(args, res: dict, model, keep: dict) -> None:
    """Profile of the steady 256 x 256 step on b's engine (a new one where b did not run)."""
    import torch

    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    if "engine" not in keep:
        batch, prompt, new = args.fixed
        g = torch.Generator().manual_seed(0)
        keep["reqs"] = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).tolist()
        keep["params"] = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
        keep["engine"] = EmbeddedEngine(model=model)
    engine, reqs, params = keep["engine"], keep["reqs"], keep["params"]
    if not args.device.startswith("cuda"):  # no graphs on the CPU: the ops of one whole call (self time)
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(reqs, params)
        ka = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ka) or 1.0
        res["g"] = {"kind": "CPU ops of one whole call, self time",
                    "top": [dict(name=e.key[:120], us=e.self_cpu_time_total, calls=e.count,
                                 share=e.self_cpu_time_total / total)
                            for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:args.kernels]]}
        return
    from profile_decode import profile_engine

    with torch.inference_mode():
        got = profile_engine(engine, reqs, params, args.kernels)
    res["g"] = {"kind": "CUDA kernels of 3 replays of the last decode graph", **{
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in got.items()}}


# ---------------------------------------------------------------- table


def _pct(x: float) -> str:
    return f"{x:.0%}"


def table_rows(res: dict) -> list[tuple[str, str, str, str]]:
    """(row, target, measured, verdict) for every target row with a result."""
    rows = []

    def verdict(ok: bool, miss: str) -> str:
        return "**met**" if ok else f"missed: {miss}"

    a = res.get("a")
    if a:
        for proc, target in (("cold", 20.0), ("warm", 5.0)):
            p = a.get(proc)
            if not p:
                continue
            shapes = ", ".join(f"{r['shape']} {r['first_s']} s" for r in p["rows"])
            done = "" if p["complete"] else f" (INCOMPLETE: {len(p['rows'])} of 4 shapes; rc {p['rc']})"
            got = p["first_calls_s"]
            rows.append((f"warm-up, {'1st process (cold caches)' if proc == 'cold' else '2nd process (disk caches)'}: "
                         "first calls of 256x256, RL-shaped, 64x128, greedy",
                         f"<= {target:.0f} s in all", f"{got} s ({shapes}){done}",
                         verdict(p["complete"] and got <= target, f"{got / target:.1f}x the target"
                                 if p["complete"] else "not finished")))
    b = res.get("b")
    if b:
        if b["of_limit"] is not None:
            rows.append((f"steady decode {b['shape']}, EOS ignored", ">= 40% of the bandwidth limit",
                         f"{b['tok_s']:,.0f} tok/s, {b['step_ms']:.3f} ms/step = {_pct(b['of_limit'])} of "
                         f"{b['limit_ms']:.3f} ms ({(b['weight_bytes'] + b['kv_bytes']) / 1e9:.2f} GB at "
                         f"{b['bandwidth'] / 1e12:.2f} TB/s)",
                         verdict(b["of_limit"] >= 0.4, f"{0.4 / b['of_limit']:.2f}x too slow "
                                 f"(step must fall to {b['limit_ms'] / 0.4:.3f} ms)")))
        else:
            rows.append((f"steady decode {b['shape']}, EOS ignored", ">= 40% of the bandwidth limit",
                         f"{b['tok_s']:,.0f} tok/s, {b['step_ms']:.3f} ms/step (no bandwidth figure for this device)",
                         "n/a"))
    c = res.get("c")
    if c:
        static = next((m for m in c["modes"] if m["mode"].startswith("static")), None)
        if static:
            r = static["real_tok_s"]
            rows.append((f"steady RL-shaped ({c['shape']}), static batch", ">= 100k real tok/s",
                         f"{r:,.0f} real tok/s (mean length {static['mean_len']}, {static['call_s']} s per call)",
                         verdict(r >= 1e5, f"{1e5 / r:.2f}x too slow")))
            for m in c["modes"]:
                if m["mode"].startswith("continuous"):
                    x = m["real_tok_s"] / r
                    rows.append((f"RL-shaped, {m['mode']}", ">= the static batch",
                                 f"{m['real_tok_s']:,.0f} real tok/s = {x:.2f}x static",
                                 verdict(x >= 1.0, f"{1 / x:.2f}x slower than static")))
    d = res.get("d")
    if d and "missing" not in d:
        for proc in ("cold", "warm"):
            if f"total_{proc}_s" in d:
                t = d[f"total_{proc}_s"]
                rows.append((f"60 RL steps of that load (rollout), warm-up from the {proc} process",
                             "<= ~90 s (20 + 59 x 1.2)",
                             f"{d[f'warmup_{proc}_s']} + 59 x {d['steady_call_s']} = {t} s",
                             verdict(t <= 90, f"{t / 90:.2f}x the target")))
    e = res.get("e")
    if e and e.get("summary"):
        s = e["summary"]
        fe, li = s.get("ferrule"), s.get("hf_liger")
        if fe and li:
            x = fe["tok_s"] / li["tok_s"]
            mem_ok = fe["peak_gib"] <= li["peak_gib"]
            miss = []
            if x < 1.15:
                miss.append(f"{1.15 - x:.3f}x short")
            if not mem_ok:
                miss.append(f"{fe['peak_gib'] - li['peak_gib']:.1f} GiB over")
            rows.append(("train step 8 x 2048, defaults vs HF + Liger", ">= 1.15x at <= Liger's peak memory",
                         f"{fe['tok_s']:,} vs {li['tok_s']:,} tok/s = {x:.3f}x; {fe['peak_gib']} vs {li['peak_gib']} GiB",
                         verdict(x >= 1.15 and mem_ok, ", ".join(miss))))
        elif fe:
            rows.append(("train step, defaults", "(HF + Liger anchor absent)", f"{fe['tok_s']:,} tok/s", "n/a"))
        fr, lr = s.get("ferrule_rl"), s.get("hf_liger_rl")
        if fr and lr:
            x = fr["tok_s"] / lr["tok_s"]
            rows.append(("train step RL-shaped vs HF + Liger padded", ">= 2x",
                         f"{fr['tok_s']:,} vs {lr['tok_s']:,} real tok/s = {x:.3f}x",
                         verdict(x >= 2.0, f"{2.0 - x:.3f}x short")))
    elif e:
        rows.append(("train step", "", f"FAILED (rc {e.get('rc')})", "not measured"))
    f = res.get("f")
    if f and "lora" in f:
        lo, fu = f["lora"]["median_ms"], f["full"]["median_ms"]
        rows.append((f"LoRA r{f.get('rank', 16)} adapter sync ({f['lora']['bytes'] / 1e6:.1f} MB) vs full sync "
                     f"({f['full']['bytes'] / 1e9:.2f} GB)", "adapter <= full",
                     f"{lo} vs {fu} ms median", verdict(lo <= fu, f"{lo / fu:.2f}x the full sync")))
    elif f:
        rows.append(("LoRA adapter sync", "", f"FAILED (rc {f.get('rc')})", "not measured"))
    return rows


def render(res: dict) -> str:
    chosen = res.get("settings") or {}
    setting = "product defaults" + (" except " + ", ".join(f"rollout_engine.{k}={v}" for k, v in chosen.items())
                                    if chosen else "")
    lines = [f"Device: {res['device']}; torch {res.get('torch')}; model {res['model']}; {setting}; "
             f"sections run: {''.join(sorted(res.get('ran', [])))}.", "",
             "| row | target | measured | met / missed |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows(res)]
    g = res.get("g")
    if g:
        lines += ["", f"Profile ({g['kind']}):"]
        if "replay_gpu_ms" in g:
            lines.append(f"whole call {g['step_ms']:.3f} ms per step; graph replay on the GPU {g['replay_gpu_ms']:.3f} ms "
                         f"(mean over the attended-length buckets) -> host time between steps ~"
                         f"{g['host_ms_per_step']:.3f} ms ({g['host_ms_per_step'] / g['step_ms']:.0%}); "
                         f"{g.get('kernels_per_replay')} kernels per replay, {g['kernel_us']:.0f} us summed kernel time.")
        lines += ["", "| kernel / op | share | us | calls |", "|---|---|---|---|"]
        lines += [f"| `{t['name']}` | {t['share']:.1%} | {t['us']:.0f} | {t['calls']} |" for t in g["top"][:10]]
    for key, name in (("a", "warm-up"), ("e", "train"), ("f", "LoRA sync")):
        sec = res.get(key) or {}
        errs = [sec.get("error")] + [p.get("error") for p in sec.values() if isinstance(p, dict)]
        for err in filter(None, errs):
            lines += ["", f"{name} error (tail): `{err.strip().splitlines()[-1][:300]}`"]
    return "\n".join(lines)


def record(path: Path, text: str, res: dict, cmd: str) -> None:
    title = "### Issue 40 targets, one run (bench/bench_targets.py)"
    body = path.read_text() if path.exists() else ""  # --out may name a new file (a device run's $OUT)
    head = f"\n\n{title}: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {res['device']}\n\n" \
           f"`{cmd}`\n\n"
    marker = "\n### Multi-LoRA: many tenants"
    block = head + text + "\n"
    if marker in body:  # inside the Issue 40 part of the Embedded decode section
        i = body.index(marker)
        body = body[:i].rstrip("\n") + block + body[i:]
    else:
        body = body.rstrip("\n") + block
    path.write_text(body)
    log(f"appended to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of a,b,c,d,e,f,g")
    ap.add_argument("--tiny", action="store_true", help="every section on a tiny model (CPU ok; times meaningless)")
    ap.add_argument("--record", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "ferrule_bench_targets.json"),
                    help="results of earlier --sections calls (read, then updated); --fresh ignores it")
    ap.add_argument("--fresh", action="store_true", help="start from no earlier results")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "ferrule_bench_targets_cache"),
                    help="FERRULE_CACHE_DIR of every section (emptied by section a: its first process starts cold)")
    ap.add_argument("--reps", type=int, default=3, help="b: timed calls (median)")
    ap.add_argument("--compile-regions", type=int, choices=[0, 1], default=None,
                    help="a, b: rollout_engine.compile_regions (default: the product default)")
    ap.add_argument("--compile-step", type=int, choices=[0, 1], default=None,
                    help="a, b: rollout_engine.compile_step (0: the fast step uncompiled under its CUDA graphs; default: the "
                         "product default)")
    ap.add_argument("--continuous-fast", type=int, nargs="+", choices=[0, 1], default=[0, 1],
                    help="c: time the continuous modes with rollout_engine.continuous_fast at each value (default "
                         "both: 0 is the product default, 1 the per-row-slot fast step)")
    ap.add_argument("--kernels", type=int, default=15, help="g: kernels in the table")
    ap.add_argument("--train-iters", type=int, default=3)
    ap.add_argument("--sync-iters", type=int, default=10)
    ap.add_argument("--warmup-timeout", type=float, nargs=2, default=[270.0, 120.0], metavar=("COLD", "WARM"))
    ap.add_argument("--train-timeout", type=float, default=200.0)
    ap.add_argument("--sync-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    # every section (and the subprocesses) compiles into one cache folder: b, c, g reuse a's kernels
    os.environ["FERRULE_CACHE_DIR"] = args.cache_dir
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ.pop(k, None)
    import torch

    cuda = torch.cuda.is_available()
    args.device = "cuda" if cuda else "cpu"
    args.dtype = "bfloat16" if cuda else "float32"
    args.model = "tiny" if args.tiny else "qwen2-0.5b"
    if not cuda and not args.tiny:
        raise SystemExit("bench_targets.py measures issue 40's rows on a GPU; on the CPU use --tiny (a smoke run).")
    args.fixed = (256, 32, 256) if not args.tiny else (16, 32, 32)
    args.rl = (64, 8, 512) if not args.tiny else (4, 2, 32)
    args.rl_max_batch = [128, 256] if not args.tiny else [4]
    device = torch.cuda.get_device_name() if cuda else "CPU"
    res: dict = {}
    if not args.fresh and os.path.exists(args.state):
        old = json.loads(Path(args.state).read_text())
        if old.get("device") == device and old.get("model") == args.model:
            res = old
    res.update(device=device, model=args.model, torch=torch.__version__)
    # the rollout settings given on the command line (sections a and b), named in the table's header
    args.chosen = {k: bool(v) for k, v in (("compile_regions", args.compile_regions),
                                           ("compile_step", args.compile_step)) if v is not None}
    if args.chosen or "settings" not in res:
        res["settings"] = args.chosen
    res.setdefault("ran", [])

    def save():
        Path(args.state).write_text(json.dumps(res, default=str))

    if "a" in sections:  # first: its first process must find the cache folder empty
        section_a(args, res)
        res["ran"] = sorted(set(res["ran"]) | {"a"})
        save()
    in_proc = [s for s in sections if s in "bcg"]
    keep: dict = {}
    if in_proc:
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = 64
        model = _rollout_model(args)
        # b, then g (it profiles b's engine), then c: each saved as it ends, so a run cut off by a time limit
        # keeps the sections it finished
        if "b" in sections:
            with torch.inference_mode():
                section_b(args, res, model, keep)
            res["ran"] = sorted(set(res["ran"]) | {"b"})
            save()
        if "g" in sections:
            section_g(args, res, model, keep)
            res["ran"] = sorted(set(res["ran"]) | {"g"})
            save()
        if "c" in sections:
            with torch.inference_mode():
                section_c(args, res, model)
            res["ran"] = sorted(set(res["ran"]) | {"c"})
            save()
        if "engine" in keep:
            keep["engine"].shutdown()
        del model, keep
        if cuda:
            torch.cuda.empty_cache()
    if "d" in sections:
        section_d(res)
        res["ran"] = sorted(set(res["ran"]) | {"d"})
    if "e" in sections:
        section_e(args, res)
        res["ran"] = sorted(set(res["ran"]) | {"e"})
        save()
    if "f" in sections:
        section_f(args, res)
        res["ran"] = sorted(set(res["ran"]) | {"f"})
    save()
    text = render(res)
    print("\n" + text + "\n", flush=True)
    log(f"done; results in {args.state}")
    if args.record:
        record(Path(args.out), text, res, "python bench/bench_targets.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
