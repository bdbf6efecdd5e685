"""Conversion throughput (GB/s) and peak RSS for a ~100M-parameter random Qwen3, both directions.

Usage: python bench/bench_convert.py [--write-docs] [--dtype bfloat16|float32]

Each direction runs in a fresh subprocess so its peak RSS (``ru_maxrss``) is its own; the
baseline RSS after importing torch + megatron + transformers is measured in the same process
just before the conversion, so "peak - baseline" is what the conversion itself costs. The
dist_checkpointing writer runs in forked children: their peak is reported separately
(``RUSAGE_CHILDREN``). Throughput = HF checkpoint bytes / wall seconds of the conversion call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
              num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
              tie_word_embeddings=False)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _make(hf_dir: Path, dtype: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf_dir)
    print(json.dumps({"params": n}))


def _phase(phase: str, src: Path, dst: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core  # noqa: F401  (imports counted in the baseline)
    import transformers  # noqa: F401

    from ferrule.converters import hf_to_torch_dist, torch_dist_to_hf
    from ferrule.megatron import gpt_builder  # noqa: F401

    base = _rss_mb()
    t = time.perf_counter()
    if phase == "to_td":
        hf_to_torch_dist(src, dst)
    else:
        torch_dist_to_hf(src, dst)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"wall_s": wall, "baseline_rss_mb": base, "peak_rss_mb": peak, "children_peak_rss_mb": child}))


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=1800, cwd=REPO)
    if out.returncode:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["make", "to_td", "to_hf"])
    ap.add_argument("--src")
    ap.add_argument("--dst")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.phase == "make":
        return _make(Path(args.dst), args.dtype)
    if args.phase:
        return _phase(args.phase, Path(args.src), Path(args.dst))

    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        tmp = Path(tmp)
        n = _run("--phase", "make", "--dst", str(tmp / "hf"), "--dtype", args.dtype)["params"]
        hf_bytes = sum(p.stat().st_size for p in (tmp / "hf").glob("*.safetensors"))
        fwd = _run("--phase", "to_td", "--src", str(tmp / "hf"), "--dst", str(tmp / "td"))
        td_bytes = sum(p.stat().st_size for p in (tmp / "td").rglob("*") if p.is_file())
        back = _run("--phase", "to_hf", "--src", str(tmp / "td"), "--dst", str(tmp / "back"))
    rows = []
    for name, r in (("HF -> torch_dist", fwd), ("torch_dist -> HF", back)):
        rows.append(f"| {name} | {hf_bytes / 1e9 / r['wall_s']:.3f} | {r['wall_s']:.2f} | {r['baseline_rss_mb']:.0f} | "
                    f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['baseline_rss_mb']:.0f} | "
                    f"{(r['peak_rss_mb'] - r['baseline_rss_mb']) / (hf_bytes / 2**20):.2f} | "
                    f"{r['children_peak_rss_mb']:.0f} |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = (
        "## Conversion\n\n"
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine}, CPU only (gloo), one process.\n"
        f"Model: random Qwen3, {n / 1e6:.1f} M parameters ({CONFIG['num_hidden_layers']} layers, hidden "
        f"{CONFIG['hidden_size']}, vocab {CONFIG['vocab_size']}, untied), {args.dtype}; HF checkpoint "
        f"{hf_bytes / 1e6:.1f} MB, torch_dist checkpoint {td_bytes / 1e6:.1f} MB.\n"
        "Command: `python bench/bench_convert.py --write-docs`. Throughput = HF bytes / wall time of the\n"
        "conversion call (model build + load + save; imports excluded). Baseline = RSS after importing torch,\n"
        "megatron-core and transformers; the 'x model' column is (peak - baseline) / HF checkpoint size.\n"
        "Children = the dist_checkpointing writer processes (forked).\n\n"
        "| direction | GB/s | wall s | baseline RSS MB | peak RSS MB | peak - baseline MB | x model | children peak MB |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.write_docs:
        path = REPO / "docs" / "benchmarks.md"
        old = path.read_text() if path.exists() else "# Benchmarks\n\n"
        if "## Conversion\n" in old:
            head, _, rest = old.partition("## Conversion\n")
            tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
            new = head + text + tail.lstrip("\n")
        else:
            new = old.rstrip("\n") + "\n\n" + text
        path.write_text(new)


if __name__ == "__main__":
    main()
