"""Offload backends side by side: ferrule's HostStash (plain page-locked copies) vs torch-memory-saver.

The same bytes (``--gib`` of bf16 random tensors, ``--tensors`` of them) are moved off the GPU and
back ``--repeats`` times by each backend:

- ``host_stash``: :class:`ferrule.offload.HostStash` (copy to page-locked host memory, resize the
  storages to 0, ``empty_cache``; back: resize, copy);
- ``torch_memory_saver``: tensors allocated inside ``torch_memory_saver.region(enable_cpu_backup=True)``
  in its ``hook_mode="torch"`` (a pluggable allocator; no ``LD_PRELOAD``), then ``pause()`` /
  ``resume()`` (the physical pages are unmapped and remapped at the same virtual addresses).

Printed per backend: seconds of the first and the median offload / onload, device memory freed
(``cudaMemGetInfo``), and whether every tensor came back bit-identical.

    python bench/bench_offload_backends.py --gib 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _tensors(n: int, numel: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(n)]


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _summary(offs, ons, freed, same) -> dict:
    return {"offload_first_s": round(offs[0], 4), "offload_median_s": round(statistics.median(offs[1:] or offs), 4),
            "onload_first_s": round(ons[0], 4), "onload_median_s": round(statistics.median(ons[1:] or ons), 4),
            "freed_gib": round(freed / 2**30, 2), "bit_identical": same}


def bench_host_stash(n, numel, repeats) -> dict:
    import torch

    from ferrule.offload import HostStash, unique_storages

    ts = _tensors(n, numel)
    ref = [t.sum(dtype=torch.float64).item() for t in ts] + [t[:4096].clone() for t in ts]
    offs, ons, freed = [], [], 0
    stash = None
    for _ in range(repeats):
        stash = HostStash(unique_storages(ts, ts[0].device), ts[0].device, "bench", reuse=stash)
        before = torch.cuda.mem_get_info()[0]
        offs.append(_timed(lambda: (stash.offload(), torch.cuda.empty_cache())))
        freed = torch.cuda.mem_get_info()[0] - before
        ons.append(_timed(stash.onload))
    same = [t.sum(dtype=torch.float64).item() for t in ts] + [t[:4096] for t in ts]
    ok = same[:n] == ref[:n] and all(torch.equal(a, b) for a, b in zip(same[n:], ref[n:]))
    del ts, stash
    torch.cuda.empty_cache()
    return _summary(offs, ons, freed, ok)


def bench_tms(n, numel, repeats) -> dict:
    import torch
    import torch_memory_saver

    tms = torch_memory_saver.torch_memory_saver
    tms.hook_mode = "torch"
    with tms.region(tag="bench", enable_cpu_backup=True):
        ts = _tensors(n, numel)
    ref = [t.sum(dtype=torch.float64).item() for t in ts] + [t[:4096].clone() for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    offs, ons, freed = [], [], 0
    for _ in range(repeats):
        before = torch.cuda.mem_get_info()[0]
        offs.append(_timed(lambda: tms.pause("bench")))
        freed = torch.cuda.mem_get_info()[0] - before
        ons.append(_timed(lambda: tms.resume("bench")))
    same = [t.sum(dtype=torch.float64).item() for t in ts] + [t[:4096] for t in ts]
    ok = same[:n] == ref[:n] and all(torch.equal(a, b) for a, b in zip(same[n:], ref[n:]))
    out = _summary(offs, ons, freed, ok)
    out["same_addresses"] = ptrs == [t.data_ptr() for t in ts]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    numel = int(args.gib * 2**30 / 2 / args.tensors)
    out = {"gib": args.gib, "tensors": args.tensors, "repeats": args.repeats}
    for name, fn in (("host_stash", bench_host_stash), ("torch_memory_saver", bench_tms)):
        try:
            out[name] = fn(args.tensors, numel, args.repeats)
        except Exception as exc:  # noqa: BLE001 - report why a backend could not run here
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps({name: out[name]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
