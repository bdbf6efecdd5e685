"""Cold compile time of the fast decode step: whole step vs the decoder layer as a nested compile region.

``rollout_engine.compile_regions`` (:data:`ferrule.rollout._fast_decode._LAYER_REGION`): with it torch.compile
traces and compiles one decoder layer and reuses it for every layer instead of unrolling all of them into the
step. Each mode runs in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` in a new temporary folder), on a random Qwen2-shaped model (``--layers`` deep, narrow: the
compile time follows the op count, not the width): the first ``EmbeddedEngine.generate`` of a sampled call
(compiles of the sampler and the step, CUDA graph captures on CUDA), a second identical call (steady), then a
greedy call of the same shape; tokens and logprobs are checked against the plain eager path (fp32).

CPU (the fast path forced on, compiled by inductor, no graphs), ~5-10 minutes on a busy 2-core machine::

    python bench/bench_compile_regions.py --layers 24

CUDA (bf16; also run bench/bench_targets.py --sections a --compile-regions 0/1 for the product's shapes)::

    python bench/bench_compile_regions.py --layers 24 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def one(args) -> dict:
    import torch
    import transformers

    from ferrule.engine_settings import RolloutEngineSettings
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=512,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(cfg).eval().to(args.device)
    for p in model.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    cuda = args.device.startswith("cuda")
    if cuda:
        model = model.to(torch.bfloat16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    plain = EmbeddedEngine(model=model, fast_decode=False, compile_decode=False, cuda_graph=False)
    fast = EmbeddedEngine(model=model, settings=RolloutEngineSettings(compile_regions=bool(args.regions)))
    if not cuda:  # CPU: the fast path is off by default; forced on here (tests/test_rollout_fast_decode.py does too)
        fast.fast_decode = True
        fast._fuse_weights()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 1, 12, 8, 3)]
    out: dict = {"layers": args.layers, "regions": bool(args.regions), "device": args.device}
    with torch.inference_mode():
        for name, params in (("sampled", SamplingParams(temperature=0.9, max_new_tokens=args.new_tokens, seed=3,
                                                        ignore_eos=True, return_raw_logprobs=True)),
                             ("greedy", SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True))):
            times = []
            for _ in range(2):
                sync()
                t0 = time.perf_counter()
                got = fast.generate(prompts, params)
                sync()
                times.append(round(time.perf_counter() - t0, 3))
            want = plain.generate(prompts, params)
            out[name] = {"first_s": times[0], "second_s": times[1],
                         "tokens_equal_plain": [r.token_ids for r in got] == [r.token_ids for r in want],
                         "max_logprob_diff_plain": max(abs(a - b) for x, y in zip(got, want)
                                                       for a, b in zip(x.logprobs, y.logprobs)),
                         "tokens": [list(r.token_ids) for r in got]}
    out["compiles"] = fast.info()["compiles"]
    out["graph_captures"] = fast.info()["graph_captures"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="0,1", help="compile_regions values to run, each in a fresh process")
    ap.add_argument("--regions", type=int, default=None, help=argparse.SUPPRESS)  # one child process
    args = ap.parse_args(argv)
    if args.regions is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="ferrule_regions_") as tmp:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
            env.pop("FERRULE_CACHE_DIR", None)
            cmd = [sys.executable, __file__, "--regions", mode] + [a for a in (argv or sys.argv[1:])]
            t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            # CPU seconds of the process and the compile workers it waited for: the compile work, less
            # sensitive than wall time to other jobs on a shared machine
            cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"compile_regions={mode}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        res = json.loads(line[len("RESULT "):])
        res["process_s"], res["process_cpu_s"] = round(wall, 1), round(cpu, 1)
        results.append(res)
        print(f"compile_regions={mode}: process {wall:.1f} s wall, {cpu:.1f} s CPU; sampled first {res['sampled']['first_s']} s, second "
              f"{res['sampled']['second_s']} s; greedy first {res['greedy']['first_s']} s, second "
              f"{res['greedy']['second_s']} s; compiles {res['compiles']}, graph captures {res['graph_captures']}; "
              f"tokens equal plain: {res['sampled']['tokens_equal_plain']}/{res['greedy']['tokens_equal_plain']}, "
              f"max |logprob - plain| {max(res['sampled']['max_logprob_diff_plain'], res['greedy']['max_logprob_diff_plain']):.2e}",
              flush=True)
    if len(results) == 2:
        a, b = results
        same = all(a[k]["tokens"] == b[k]["tokens"] for k in ("sampled", "greedy"))
        print(f"whole step vs regions: sampled first call {a['sampled']['first_s']} s vs {b['sampled']['first_s']} s "
              f"({a['sampled']['first_s'] / b['sampled']['first_s']:.2f}x); same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
