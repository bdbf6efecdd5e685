"""Adapter-only sync vs full weight sync, train engine -> embedded rollout engine, side by side in one
run; and greedy decode of the base vs the same engine serving a LoRA adapter.

Qwen2-0.5B shape (tied embeddings, random weights) in bf16 on one CUDA device:

1. full: ``TrainEngine`` (all parameters) -> ``sync_weights`` (update groups -> HF buckets ->
   ``update_weights``);
2. LoRA: ``TrainEngine(lora=LoraSettings(rank, alpha, "all"))`` -> ``sync_lora_adapter`` (PEFT
   tensors -> ``update_lora_adapter``, copied in place into the served adapter).

Each is timed as the median of ``--iters`` calls after one verified warm-up call (the warm-up of
the LoRA sync also injects the adapter into the rollout model). Printed per mode: bytes, tensors,
median / min ms, CUDA memory allocated before and after the timed calls (a leaking export shows
up there), and the ratio full / LoRA.

With ``--decode`` (default), on the LoRA mode's rollout engine: greedy ``batch x new_tokens``
(median of ``--decode-reps`` calls) of the base before the adapter is served, then with it, in
both LoRA modes of the fast path (``RolloutEngineSettings.lora_merged`` true: merged once per adapter version,
prefill on the merged copy; ``=0``: merged every call, prefill through PEFT's unmerged layers),
each with the ratio to the base and one call split into the fast-layout step (the merge), the
prefill and the rest (the decode loop). Then, on CUDA, a random all-linear adapter with non-zero
``lora_B`` (a freshly initialised one has ``B = 0``) is served and the logprob error of each
path's greedy tokens against fp32 HF (+ PEFT's unmerged layers) forwards is printed, next to the
base bf16 path's error against fp32 HF.

    python bench/bench_lora_sync.py                 # CUDA, Qwen2-0.5B shape
    python bench/bench_lora_sync.py --no-sync       # decode rows only (no train engines), random adapter
    python bench/bench_lora_sync.py --tiny          # smoke run of the code path (CPU ok; times meaningless)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    """Progress on stderr (seconds since start), so a run cut off by a time limit shows how far it got."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _sync_ms(fn, iters: int, cuda: bool) -> tuple[list[float], object, int | None, int | None]:
    import torch

    def mem():
        if not cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    before, times, stats = mem(), [], None
    for v in range(1, iters + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = fn(v)
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return times, stats, before, mem()


PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _prompts(batch: int) -> list[list[int]]:
    return [[1 + (i % 50), 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]


def _decode(rollout, batch: int, new_tokens: int, reps: int, cuda: bool) -> dict:
    """Greedy ``batch x new_tokens``: median wall time of ``reps`` calls after a warm-up (graph
    capture, compile), then one more call split into the fast-layout step (adapter merge), the
    prefill and the rest (the decode loop), each timed between device synchronizations."""
    import statistics

    import torch

    from ferrule.rollout import SamplingParams
    from ferrule.rollout._static_cache import DecodeState

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    prompts = _prompts(batch)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = rollout.generate(prompts, params)  # warm-up / graph capture
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        rollout.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - t0)
    split: dict[str, float] = {}

    def timed(name, fn):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            split[name] = split.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
            return out
        return run

    layout_fn, prefill_fn = rollout._fast_layout, DecodeState.prefill
    taken = []
    rollout._fast_layout = timed("layout_ms", lambda *a, **k: taken.append(layout_fn(*a, **k)) or taken[-1])
    DecodeState.prefill = timed("prefill_ms", prefill_fn)
    try:
        sync()
        t0 = time.perf_counter()
        rollout.generate(prompts, params)
        sync()
        total = 1e3 * (time.perf_counter() - t0)
    finally:
        del rollout._fast_layout
        DecodeState.prefill = prefill_fn
    split = {k: round(v, 2) for k, v in split.items()}
    split["rest_ms"] = round(total - sum(split.values()), 2)
    merged = getattr(rollout, "_merged_lora", None)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4), "reps": reps,
            "split_of_one_call": split, "fast_path": bool(taken) and taken[-1] is not None,
            "merges_so_far": None if merged is None else merged.refreshes,
            "merged_copy_mib": None if merged is None else round(merged.nbytes / 2**20, 1), "results": results}


def _random_adapter(shape: dict, rank: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """A random all-linear PEFT adapter (saved names, ``LoraConfig.to_dict()``) with non-zero
    ``lora_B``, so that the adapter changes the logits (a freshly trained one has ``B = 0``)."""
    import torch
    from peft import LoraConfig

    g = torch.Generator().manual_seed(seed)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for block, projs in PROJECTIONS.items():
            for proj in projs:
                n_in, n_out = dims[proj]
                name = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{name}.lora_A.weight"] = (torch.rand(rank, n_in, generator=g) * 2 - 1) / n_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[p for ps in PROJECTIONS.values() for p in ps])
    return tensors, cfg.to_dict()


def _logprob_error(model32, results, batch_prompts, rows: int) -> dict:
    """|logprob - fp32 reference logprob| of each row's own greedy tokens (mean / max over the first
    ``rows`` rows); the reference is one full-sequence forward of ``prompt + tokens``."""
    import torch

    errs = []
    with torch.no_grad():
        for r in results[:rows]:
            prompt = batch_prompts[r.prompt_index]
            ids = torch.tensor([prompt + list(r.token_ids)], device=model32.device)
            lp = torch.log_softmax(model32(input_ids=ids).logits[0, len(prompt) - 1:-1].double(), -1)
            want = lp.gather(-1, torch.tensor(r.token_ids, device=model32.device)[:, None])[:, 0].cpu()
            errs.append((torch.tensor(r.logprobs, dtype=torch.float64) - want).abs())
    e = torch.cat(errs)
    return {"mean": float(f"{e.mean().item():.3g}"), "max": float(f"{e.max().item():.3g}"), "rows": len(errs),
            "tokens": e.numel()}


def _decode_section(rollout, hf_dir, args, cuda: bool, serve_adapter, version: int) -> dict:
    """Base decode, then LoRA decode on the same engine: merged once + prefill on the merged copy
    (``lora_merged`` true) and the previous behaviour (false: merge every call, PEFT prefill),
    and the logprob error of each against fp32 HF (+ PEFT, unmerged) forwards."""

    import torch

    from ferrule.rollout import SamplingParams

    out: dict = {}
    base = _decode(rollout, args.batch, args.new_tokens, args.decode_reps, cuda)
    _log(f"base decode {base['median_s']} s")
    serve_adapter()  # the adapter under test (the sync's, or a random one)
    # the error's adapter: random values (non-zero B) under the served adapter's names and config
    g = torch.Generator().manual_seed(1)
    tensors = {n: ((torch.rand(t.shape, generator=g) * 2 - 1) / t.shape[1] ** 0.5 if ".lora_A." in n
                   else torch.randn(t.shape, generator=g) * 0.02) for n, t in rollout.get_lora_state_dict().items()}
    cfg = rollout.lora_config
    lora = {}
    settings = rollout.settings
    try:  # the two LoRA modes of the fast path on the same engine (RolloutEngineSettings.lora_merged, read per call)
        for mode in ("1", "0"):
            rollout.settings = dataclasses.replace(settings, lora_merged=mode == "1")
            lora[mode] = _decode(rollout, args.batch, args.new_tokens, args.decode_reps, cuda)
            _log(f"LoRA decode (lora_merged={mode == '1'}) {lora[mode]['median_s']} s")
        if args.logprob_error:
            # timing above used the served adapter; the error needs one that changes the logits
            version += 1
            rollout.update_lora_adapter(tensors, cfg, version)
            for mode in ("1", "0"):
                rollout.settings = dataclasses.replace(settings, lora_merged=mode == "1")
                lora[mode]["results_random"] = rollout.generate(_prompts(args.batch), SamplingParams(
                    temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True))
    finally:
        rollout.settings = settings
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("results")}  # noqa: E731
    out["decode_base"] = strip(base)
    out["decode_lora_merged"] = strip(lora["1"])
    out["decode_lora_merge_every_call"] = strip(lora["0"])
    out["lora_over_base"] = round(lora["1"]["median_s"] / base["median_s"], 3)
    out["lora_merge_every_call_over_base"] = round(lora["0"]["median_s"] / base["median_s"], 3)
    if args.logprob_error:
        from transformers import Qwen2ForCausalLM

        from ferrule.rollout._lora import ServedLoraAdapter

        model32 = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(rollout.device).eval()
        prompts = _prompts(args.batch)
        err = {"reference": "fp32 HF forward (+ PEFT's unmerged LoRA layers for the adapter rows)",
               "base": _logprob_error(model32, base["results"], prompts, args.error_rows)}
        ServedLoraAdapter.inject(model32, cfg, tensors)
        err["lora_merged_prefill_and_decode"] = _logprob_error(model32, lora["1"]["results_random"], prompts,
                                                                   args.error_rows)
        err["lora_peft_prefill_merged_decode"] = _logprob_error(model32, lora["0"]["results_random"], prompts,
                                                                    args.error_rows)
        out["logprob_error"] = err
        _log("logprob errors measured")
        del model32
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="timed syncs per mode")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--tiny", action="store_true", help="tiny model (code-path smoke run, CPU ok)")
    ap.add_argument("--no-decode", dest="decode", action="store_false")
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="decode only (no train engines): base, then a random all-linear adapter on the same engine")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-reps", type=int, default=5, help="timed generate calls per decode row (median)")
    ap.add_argument("--no-logprob-error", dest="logprob_error", action="store_false",
                    help="skip the logprob error against fp32 HF + PEFT")
    ap.add_argument("--error-rows", type=int, default=16, help="rows whose logprobs the error covers")
    args = ap.parse_args()

    import peft
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ferrule.rollout import get_rollout_engine

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("bench_lora_sync.py needs a CUDA device for the 0.5B shape; use --tiny for a CPU smoke run.")
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else QWEN2_05B
    out: dict = {"shape": "tiny" if args.tiny else "qwen2-0.5b", "dtype": str(dtype).removeprefix("torch."),
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "rank": args.rank, "alpha": args.alpha,
                 "decode": f"greedy {args.batch} x {args.new_tokens}, prompt 8",
                 "versions": {m.__name__: m.__version__ for m in (torch, transformers, peft)}}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen2"
        torch.manual_seed(0)
        with torch.device(device):  # random init on the device: seconds faster than on the host for 0.5B
            Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype).save_pretrained(hf_dir)
        _log("random model saved")

        if args.sync:
            from ferrule.lora import LoraSettings
            from ferrule.megatron.engine import TrainEngine
            from ferrule.sync import sync_lora_adapter, sync_weights

            # 1. full sync
            engine = TrainEngine.from_hf(hf_dir, params_dtype=dtype)
            rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=dtype, device=device)
            sync_weights(engine, rollout, 0, check_equal=True)
            times, stats, before, after = _sync_ms(lambda v: sync_weights(engine, rollout, v), args.iters, cuda)
            out["full"] = {"bytes": stats.bytes, "tensors": stats.tensors,
                           "median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
                           "mem_before_mib": before and round(before / 2**20, 1),
                           "mem_after_mib": after and round(after / 2**20, 1)}
            del engine, rollout
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()

            # 2. adapter-only sync (after the base decode of the same rollout engine)
            lora = LoraSettings(rank=args.rank, alpha=args.alpha, target_modules="all")
            engine = TrainEngine.from_hf(hf_dir, params_dtype=dtype, lora=lora)
            rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=dtype, device=device)

            def serve_adapter():
                sync_lora_adapter(engine, rollout, 0, check_equal=True)  # injects the adapter; verified equal
                times, stats, before, after = _sync_ms(lambda v: sync_lora_adapter(engine, rollout, v), args.iters,
                                                       cuda)
                delta = (None if stats.device_memory_after is None
                         else stats.device_memory_after - stats.device_memory_before)
                out["lora"] = {"bytes": stats.bytes, "tensors": stats.tensors,
                               "median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
                               "mem_before_mib": before and round(before / 2**20, 1),
                               "mem_after_mib": after and round(after / 2**20, 1), "last_call_mem_delta_bytes": delta}
                out["full_over_lora_time"] = round(out["full"]["median_ms"] / out["lora"]["median_ms"], 1)
                out["full_over_lora_bytes"] = round(out["full"]["bytes"] / out["lora"]["bytes"], 1)
            version = args.iters
        else:
            rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=dtype, device=device)
            tensors, cfg = _random_adapter(shape, args.rank, args.alpha, seed=0)
            serve_adapter = lambda: rollout.update_lora_adapter(tensors, cfg, 1)  # noqa: E731
            version = 1
        if args.decode:
            out.update(_decode_section(rollout, hf_dir, args, cuda, serve_adapter, version))
        elif args.sync:
            serve_adapter()
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.decode:
        b, m, e = out["decode_base"], out["decode_lora_merged"], out["decode_lora_merge_every_call"]
        print(f"decode {out['decode']}: base {b['median_s']:.4f} s {b['split_of_one_call']}; LoRA r{args.rank} merged "
              f"once + merged prefill {m['median_s']:.4f} s ({out['lora_over_base']:.3f}x base) "
              f"{m['split_of_one_call']}; LoRA merged every call + PEFT prefill {e['median_s']:.4f} s "
              f"({out['lora_merge_every_call_over_base']:.3f}x base) {e['split_of_one_call']}")
        if "logprob_error" in out:
            print(f"logprob error vs {out['logprob_error']['reference']}: "
                  + "; ".join(f"{k} mean {v['mean']} max {v['max']}" for k, v in out["logprob_error"].items()
                              if isinstance(v, dict)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
