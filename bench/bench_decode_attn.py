"""Decode attention alone (CUDA): the fast step's "fp32" matmul formula compiled by inductor vs the
fused Triton kernel (ferrule.rollout._decode_attn_triton) per split count, each captured in a CUDA
graph of ``--layers`` calls (one per layer, as in the step) and replayed; prints us per call.

    python bench/bench_decode_attn.py --batches 64 256 --kv-lens 64 320 576
"""
from __future__ import annotations

import argparse

import torch


def graph_us(fn, layers: int, n: int = 20) -> float:
    """Mean GPU microseconds of one ``fn()`` call, from a CUDA graph of ``layers`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (n * layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--kv-lens", type=int, nargs="+", default=[64, 320, 576])
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], help="q heads, kv heads, head dim")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--blocks", type=int, nargs="*", default=[64], help="key slots per loop iteration (BLOCK_N)")
    ap.add_argument("--no-formula", action="store_true", help="skip the compiled matmul formula")
    args = ap.parse_args()
    from ferrule.rollout import _decode_attn_triton as dat
    from ferrule.rollout._decode_attn import attend, reference
    from ferrule.rollout._decode_attn_triton import decode_attention, decode_attention_rope, splits_for

    hq, hkv, d = args.heads
    block0 = dat.BLOCK_N
    scaling = d ** -0.5
    formula = torch.compile(attend, fullgraph=True, dynamic=False)
    for b in args.batches:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, hq, d, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, hkv, args.max_len, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(b, hkv, args.max_len, d, device="cuda", generator=g).bfloat16()
        for L in args.kv_lens:
            allowed = torch.zeros(b, args.max_len, dtype=torch.bool, device="cuda")
            allowed[:, :L - 1] = True
            hidden = ~allowed[:, None, None, :L]
            want = reference(q, k, v, allowed, L, scaling)
            row = {}
            if not args.no_formula:
                row["fp32 formula (inductor)"] = graph_us(lambda: formula(q, k, v, allowed, hidden, L, scaling, "fp32"),
                                                          args.layers)
            for blk in args.blocks:
                dat.BLOCK_N = blk
                for s in args.splits:
                    err = (decode_attention(q, k, v, allowed, L, scaling, s).double() - want).abs().max().item()
                    row[f"triton block={blk} splits={s} (err {err:.1e})"] = graph_us(
                        lambda: decode_attention(q, k, v, allowed, L, scaling, s), args.layers)
            dat.BLOCK_N = block0
            auto = splits_for(b, hkv)
            qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
            qn, kn, vn = qkv[:, :hq * d].view(b, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d), \
                qkv[:, (hq + hkv) * d:].view(b, hkv, d)
            cos, sin = qkv[:, :d].float().cos().bfloat16(), qkv[:, :d].float().sin().bfloat16()
            slot = torch.full((b,), L - 1, device="cuda")
            row[f"triton_rope splits={auto}"] = graph_us(
                lambda: decode_attention_rope(qn, kn, vn, cos, sin, slot, k, v, allowed, L, scaling, auto), args.layers)
            print(f"batch {b} kv_len {L} (auto splits {auto}): "
                  + ", ".join(f"{name} {us:.2f} us" for name, us in row.items()), flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
