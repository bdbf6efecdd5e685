"""Where the embedded engine's decode step spends its time (CUDA): whole-call rate, graph replay
alone, sampler alone, per-step host bookkeeping, and a kernel table of one eager compiled step.

    python bench/profile_decode.py --batch 64 256 --new-tokens 256
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_rollout import build_model  # noqa: E402


def cuda_ms(fn, n=50):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    w0 = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n, (time.perf_counter() - w0) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--kernels", type=int, default=25)
    ap.add_argument("--plain", action="store_true", help="profile the plain path (fast_decode=False)")
    args = ap.parse_args()
    args.hf_dir, args.dtype, args.device = None, "bfloat16", "cuda"
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = 64
    model, _ = build_model(args)
    for batch in args.batch:
        g = torch.Generator().manual_seed(0)
        reqs = torch.randint(1, model.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
        engine = EmbeddedEngine(model=model, fast_decode=not args.plain)
        profile_engine(engine, reqs, params, args.kernels)
        engine.shutdown()


def _top_kernels(ka, n: int) -> tuple[list[dict], float]:
    """The ``n`` CUDA kernels of a profile's ``key_averages()`` with the most device time: name, us per
    profiled call, share of the summed kernel time; and that sum (us)."""
    kern = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in kern) or 1.0
    top = sorted(kern, key=lambda e: -e.device_time_total)[:n]
    return [dict(name=e.key[:120], us=e.device_time_total, calls=e.count, share=e.device_time_total / total)
            for e in top], total


def profile_engine(engine, reqs, params, kernels: int = 25) -> dict:
    """Profile the decode step of ``engine`` (CUDA) on ``reqs`` under ``params`` (EOS ignored:
    ``params.max_new_tokens`` steps): a first call (compiles, captures), a timed whole call, each
    captured graph's replay (GPU and wall ms), and a kernel table of 3 replays of the last graph (or
    of the compiled step run eagerly where CUPTI records no kernels inside a graph). Prints as it
    goes; returns ``{first_s, tok_s, step_ms, replay_gpu_ms (mean over the graphs), host_ms_per_step
    (whole-call step minus that), kernels_per_replay, kernel_us, top: [{name, us, calls, share}]}``
    (``top``'s ``us`` summed over the 3 profiled replays)."""
    from torch.profiler import ProfilerActivity, profile

    batch, steps = len(reqs), params.max_new_tokens
    t0 = time.perf_counter()
    engine.generate(reqs, params)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(reqs, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = dict(first_s=first, tok_s=batch * steps / dt, step_ms=dt * 1e3 / steps)
    print(f"== batch {batch}: first call {first:.1f} s; {batch * steps / dt:.0f} tok/s, "
          f"{dt * 1e3 / steps:.3f} ms per step (whole call)", flush=True)
    state = next(iter(engine._states.values()))
    fast = getattr(state, "fast", None)
    if fast is not None and fast.graphs:
        replays = []
        for key, graph in fast.graphs.items():
            fast.col.zero_()
            gpu, wall = cuda_ms(graph.replay, n=20)
            replays.append(gpu)
            print(f"  fast step graph replay, attended slots {key[3] or state.max_len}: GPU {gpu:.3f} ms, "
                  f"wall {wall:.3f} ms", flush=True)
        noise = fast.noise
        gpu, wall = cuda_ms(lambda: noise.exponential_(1), n=50)
        print(f"  noise draw (eager)       : GPU {gpu:.3f} ms, wall {wall:.3f} ms", flush=True)
        fast.col.zero_()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        kern = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
        n_k = sum(e.count for e in kern) / 3
        gpu_us = sum(e.device_time_total for e in kern) / 3
        print(f"  last graph ({key}): {n_k:.0f} kernels per replay, {gpu_us:.0f} us summed kernel time")
        if not kern:  # CUPTI recorded no kernels inside the graph: profile the compiled step eagerly
            from ferrule.rollout import _fast_decode

            # FastStatic._graph's key: (stop-id buffer size, attention, sampler chunks, attended length, lora)
            fn = _fast_decode._compiled("step" if key[3] is None else "step_kv", fast.dynamic)
            fargs = fast._args(engine._fused[1], key[3], key[1])
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(*fargs)
                torch.cuda.synchronize()
            ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=kernels, max_name_column_width=90))
        top, total = _top_kernels(ka, kernels)
        mean_replay = sum(replays) / len(replays)
        out.update(replay_gpu_ms=mean_replay, host_ms_per_step=out["step_ms"] - mean_replay,
                   kernels_per_replay=n_k, kernel_us=total / 3, top=top)
        return out
    gpu, wall = cuda_ms(state.step)
    print(f"  graph replay             : GPU {gpu:.3f} ms, wall {wall:.3f} ms", flush=True)
    sampler = engine._sampler(params, state.batch)
    gen = engine._generator(params)
    logits = state.static_logits
    gpu_s, wall = cuda_ms(lambda: sampler(logits, gen))
    print(f"  sampler                  : GPU {gpu_s:.3f} ms, wall {wall:.3f} ms", flush=True)
    tok = torch.zeros(state.batch, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        g2, wall = cuda_ms(lambda: state.set_step(tok, tok + 40, 40))
        print(f"  set_step                 : GPU {g2:.3f} ms, wall {wall:.3f} ms", flush=True)
        state._eager_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                state._eager_step()
            torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=kernels, max_name_column_width=70))
    top, total = _top_kernels(ka, kernels)
    out.update(replay_gpu_ms=gpu, host_ms_per_step=out["step_ms"] - gpu, kernels_per_replay=None,
               kernel_us=total / 3, top=top)
    return out


if __name__ == "__main__":
    with torch.inference_mode():
        main()
