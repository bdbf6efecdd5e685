"""Full weight sync, train engine -> embedded rollout engine, on one device (time and memory).

Qwen2-0.5B shape (tied embeddings, random weights) in bf16: ``TrainEngine`` and
``EmbeddedEngine`` on the same CUDA device; one timed call is ``sync_weights(engine, rollout,
version)`` (update groups -> HF-named buckets -> ``update_weights``), median of ``--iters`` after
one warm-up. Prints the synced bytes, the median time, and the device memory allocated before and
after the calls (a leaking export shows up there).

    python bench/bench_sync.py              # CUDA
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout import get_rollout_engine
    from ferrule.sync import sync_weights

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen2_0.5b"
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).to(torch.bfloat16).save_pretrained(hf_dir)
        engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16)
        rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=torch.bfloat16, device="cuda")
        stats = sync_weights(engine, rollout, 0, check_equal=True)  # warm-up, and proof the weights arrive
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        times = []
        for v in range(1, args.iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = sync_weights(engine, rollout, v)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        after = torch.cuda.memory_allocated()
        print(json.dumps({"bytes": stats.bytes, "tensors": stats.tensors, "buckets": stats.buckets,
                          "median_ms": round(1e3 * statistics.median(times), 2), "min_ms": round(1e3 * min(times), 2),
                          "mem_before_mib": round(before / 2**20, 1), "mem_after_mib": round(after / 2**20, 1),
                          "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
