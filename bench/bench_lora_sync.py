"""Adapter-only sync vs full weight sync, train engine -> embedded rollout engine, side by side in one run.

Qwen2-0.5B shape (tied embeddings, random weights) in bf16 on one CUDA device:

1. full: ``TrainEngine`` (all parameters) -> ``sync_weights`` (update groups -> HF buckets ->
   ``update_weights``);
2. LoRA: ``TrainEngine(lora=LoraSettings(rank, alpha, "all"))`` -> ``sync_lora_adapter`` (PEFT
   tensors -> ``update_lora_adapter``, copied in place into the served adapter).

Each is timed as the median of ``--iters`` calls after one verified warm-up call (the warm-up of
the LoRA sync also injects the adapter into the rollout model). Printed per mode: bytes, tensors,
median / min ms, CUDA memory allocated before and after the timed calls (a leaking export shows
up there), and the ratio full / LoRA. With ``--decode`` (default) also the greedy decode time of
a ``batch x new_tokens`` rollout with and without the served adapter (the cost of serving it
unmerged).

    python bench/bench_lora_sync.py                 # CUDA, Qwen2-0.5B shape
    python bench/bench_lora_sync.py --tiny          # smoke run of the code path (CPU ok; times meaningless)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)


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


def _decode_s(rollout, batch: int, new_tokens: int, cuda: bool) -> float:
    import torch

    from ferrule.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [[1 + (i % 50), 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
    rollout.generate(prompts, params)  # warm-up / graph capture
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rollout.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--tiny", action="store_true", help="tiny model (code-path smoke run, CPU ok)")
    ap.add_argument("--no-decode", dest="decode", action="store_false")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ferrule.lora import LoraSettings
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout import get_rollout_engine
    from ferrule.sync import sync_lora_adapter, sync_weights

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("bench_lora_sync.py needs a CUDA device for the 0.5B shape; use --tiny for a CPU smoke run.")
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else QWEN2_05B
    out: dict = {"shape": "tiny" if args.tiny else "qwen2-0.5b", "dtype": str(dtype).removeprefix("torch."),
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "rank": args.rank, "alpha": args.alpha}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen2"
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype).save_pretrained(hf_dir)

        # 1. full sync
        engine = TrainEngine.from_hf(hf_dir, params_dtype=dtype)
        rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=dtype, device=device)
        sync_weights(engine, rollout, 0, check_equal=True)
        times, stats, before, after = _sync_ms(lambda v: sync_weights(engine, rollout, v), args.iters, cuda)
        out["full"] = {"bytes": stats.bytes, "tensors": stats.tensors, "median_ms": round(statistics.median(times), 3),
                       "min_ms": round(min(times), 3), "mem_before_mib": before and round(before / 2**20, 1),
                       "mem_after_mib": after and round(after / 2**20, 1)}
        if args.decode:
            out["decode_base_s"] = round(_decode_s(rollout, args.batch, args.new_tokens, cuda), 3)
        del engine, rollout
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

        # 2. adapter-only sync
        lora = LoraSettings(rank=args.rank, alpha=args.alpha, target_modules="all")
        engine = TrainEngine.from_hf(hf_dir, params_dtype=dtype, lora=lora)
        rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=dtype, device=device)
        sync_lora_adapter(engine, rollout, 0, check_equal=True)  # injects the adapter; verified equal
        times, stats, before, after = _sync_ms(lambda v: sync_lora_adapter(engine, rollout, v), args.iters, cuda)
        out["lora"] = {"bytes": stats.bytes, "tensors": stats.tensors, "median_ms": round(statistics.median(times), 3),
                       "min_ms": round(min(times), 3), "mem_before_mib": before and round(before / 2**20, 1),
                       "mem_after_mib": after and round(after / 2**20, 1),
                       "last_call_mem_delta_bytes": (None if stats.device_memory_after is None
                                                     else stats.device_memory_after - stats.device_memory_before)}
        if args.decode:
            out["decode_lora_s"] = round(_decode_s(rollout, args.batch, args.new_tokens, cuda), 3)
        out["full_over_lora_time"] = round(out["full"]["median_ms"] / out["lora"]["median_ms"], 1)
        out["full_over_lora_bytes"] = round(out["full"]["bytes"] / out["lora"]["bytes"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
