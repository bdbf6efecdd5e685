"""Full weight sync, train engine -> embedded rollout engine, on one device (time and memory).

Qwen2-0.5B shape (tied embeddings, random weights) in bf16: ``TrainEngine`` and
``EmbeddedEngine`` on the same CUDA device (the fast decode path's fused q/k/v and gate/up
buffers as destinations). Side by side in one run, median of ``--iters`` after one warm-up each:

- ``copy_limit``: one flat ``copy_`` of the same number of bytes, device to device (what any sync
  of these weights costs at least);
- ``bucketed``: ``sync_weights(engine, rollout, version, direct=False)`` (update groups ->
  HF-named buckets -> ``update_weights``), the path for SGLang and other processes;
- ``direct``: ``sync_weights(engine, rollout, version)``: the plan of strided copies resolved once
  (:mod:`ferrule.sync.direct`), ``torch._foreach_copy_`` per sync;
- ``direct_loop``: the same copies one ``copy_`` each (``WeightSyncSettings(foreach_copies=False)``);
- ``direct_other_rows``: ``direct`` with the other setting of ``WeightSyncSettings.row_gathers`` (the
  strided q/k/v copies of a layer as one ``index_select`` of rows into the fused buffer, or not).

Both warm-ups run with ``check_equal=True`` (every tensor compared). Prints one JSON line with the
milliseconds, the ratios, and the device memory allocated before and after the timed calls.

    python bench/bench_sync.py              # CUDA
    python bench/bench_sync.py --device cpu --scaled --iters 20   # host overhead on CPU
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
#: ``--scaled``: the same 290 tensors and head structure with small widths (host overhead on CPU)
SCALED = dict(QWEN2_05B, hidden_size=112, intermediate_size=608, vocab_size=1024, max_position_embeddings=256)


def _sync_device() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(fn, iters: int) -> tuple[float, float]:
    import torch

    fn()  # warm-up
    times = []
    for _ in range(iters):
        _sync_device()
        t0 = time.perf_counter()
        fn()
        _sync_device()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3), round(1e3 * min(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run, with --scaled)")
    ap.add_argument("--scaled", action="store_true", help="small widths, same 290 tensors (see SCALED)")
    args = ap.parse_args()
    cuda = args.device == "cuda"

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout import get_rollout_engine
    from ferrule.sync import sync_weights

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen2_0.5b"
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**(SCALED if args.scaled else QWEN2_05B))).to(torch.bfloat16).save_pretrained(hf_dir)
        t0 = time.perf_counter()
        engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16)
        rollout = get_rollout_engine("embedded", hf_dir=hf_dir, dtype=torch.bfloat16, device=args.device)
        build_s = time.perf_counter() - t0
        version = [0]

        from ferrule.engine_settings import WeightSyncSettings

        def sync(**kw):
            version[0] += 1
            return sync_weights(engine, rollout, version[0], **kw)

        out: dict = {}
        for name, kw in (("bucketed", {"direct": False}), ("direct", {})):
            t0 = time.perf_counter()
            stats = sync(check_equal=True, **kw)  # first call: the direct plan is resolved and checked here
            out[f"{name}_first_s"] = round(time.perf_counter() - t0, 3)
            assert stats.checked and stats.direct == (name == "direct"), stats
            out.update(bytes=stats.bytes, tensors=stats.tensors)
        _sync_device()
        before = torch.cuda.memory_allocated() if cuda else 0
        out["bucketed_ms"], out["bucketed_min_ms"] = _time(lambda: sync(direct=False), args.iters)
        out["direct_ms"], out["direct_min_ms"] = _time(lambda: sync(), args.iters)
        out["direct_loop_ms"], _ = _time(lambda: sync(settings=WeightSyncSettings(foreach_copies=False)), args.iters)
        rows_default = WeightSyncSettings().row_gathers
        out["direct_other_rows_ms"], _ = _time(
            lambda: sync(settings=WeightSyncSettings(row_gathers=not rows_default)), args.iters)
        _sync_device()
        after = torch.cuda.memory_allocated() if cuda else 0
        assert sync(check_equal=True).checked  # still every tensor equal after the timed calls
        from ferrule.sync import direct

        plan = direct._PLANS[rollout][1]
        n = out["bytes"] // 2
        src = torch.empty(n, dtype=torch.bfloat16, device=args.device)
        dst = torch.empty_like(src)
        out["copy_limit_ms"], _ = _time(lambda: dst.copy_(src), args.iters)
        del src, dst
        out.update(
            copies=len(plan.copies), strided_copies=sum(not c.contiguous() for c in plan.copies),
            fallback=len(plan.fallback), row_gathers=len(plan.gathers),
            rows_default=int(rows_default),
            bucketed_over_direct=round(out["bucketed_ms"] / out["direct_ms"], 2),
            direct_over_copy_limit=round(out["direct_ms"] / out["copy_limit_ms"], 2),
            fused=rollout.fast_decode, build_s=round(build_s, 1),
            mem_before_mib=round(before / 2**20, 1), mem_after_mib=round(after / 2**20, 1),
            device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
