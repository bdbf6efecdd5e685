"""``ferrule train`` at DP=1 vs DP=N on one machine: step time and scaling efficiency, side by side.

Runs the same GRPO config twice through the CLI, ``ferrule train CONFIG`` (one process) and
``ferrule train --nproc N CONFIG`` (torchrun, DP=N; NCCL on CUDA, gloo on CPU), each with
``rollout.prompts_per_shard = prompts_per_step / N`` so both runs sample the same responses
(docs/train.md "Several ranks"), no evaluation and no checkpoints, then reads both
``metrics.jsonl`` files and prints the median step / rollout / train / sync times (steps after
``--skip`` warm-up steps), the speed-up and the strong-scaling efficiency
``t_step(1) / (N * t_step(N))`` (same global batch), and the first steps' rewards of both runs
(equal up to fp32/bf16 rounding of the DP gradient sum).

Usage (the lead's 2-GPU H200 run; SmolLM2 assets from ``ferrule assets smollm2 DIR``)::

    python bench/bench_rl_dp.py --config examples/configs/smollm2_arithmetic.yaml \\
        --hf-dir /tmp/assets/smollm2/hf --steps 30 --nproc 2 --out /tmp/bench_rl_dp
    python bench/bench_rl_dp.py ... --append-docs      # also append the table to docs/results.md

Extra config overrides go after ``--set`` (e.g. ``--set train.prompts_per_step=16``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args: argparse.Namespace, nproc: int, run_dir: Path, overrides: list[str]) -> float:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "ferrule", "train", str(args.config), *overrides, f"logging.run_dir={run_dir}"]
    if nproc > 1:
        cmd[4:4] = ["--nproc", str(nproc)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ))
    return time.perf_counter() - t0


def _median(entries: list[dict], key: str, skip: int) -> float:
    vals = [e[key] for e in entries[skip:] if key in e]
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "smollm2_arithmetic.yaml")
    ap.add_argument("--hf-dir", type=Path, required=True, help="model.hf_dir (the SmolLM2 HF folder)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_rl_dp"))
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="more section.key=value overrides")
    ap.add_argument("--append-docs", action="store_true")
    args = ap.parse_args()

    from ferrule.rl.config import load_config
    from ferrule.rl.metrics import read_metrics

    common = [f"model.hf_dir={args.hf_dir}", f"train.steps={args.steps}", "eval.interval=0",
              "checkpoint.enabled=false", "logging.plot_at_end=false", *args.extra]
    cfg = load_config(args.config, common)
    per_shard = -(-cfg.train.prompts_per_step // args.nproc)
    common.append(f"rollout.prompts_per_shard={per_shard}")
    walls, metrics = {}, {}
    for n in (1, args.nproc):
        run_dir = args.out / f"dp{n}"
        walls[n] = _run(args, n, run_dir, common)
        metrics[n] = read_metrics(run_dir / "metrics.jsonl")
    rows = []
    for key in ("time_step_s", "time_rollout_s", "time_train_s", "time_sync_s"):
        a, b = _median(metrics[1], key, args.skip), _median(metrics[args.nproc], key, args.skip)
        rows.append((key, a, b, a / b if b else float("nan")))
    t1, tn = rows[0][1], rows[0][2]
    eff = t1 / (args.nproc * tn)
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        pass
    lines = [f"### `ferrule train` DP=1 vs DP={args.nproc} ({datetime.date.today()}, {device}, "
             f"{platform.python_version()})", "",
             f"`python bench/bench_rl_dp.py --config {args.config.name} --steps {args.steps} --nproc {args.nproc}"
             + (f" --set {' '.join(args.extra)}" if args.extra else "") + f"`: {cfg.train.prompts_per_step} prompts x "
             f"{cfg.rollout.n_samples_per_prompt} samples per step, rollout.prompts_per_shard={per_shard}, "
             f"medians over steps {args.skip + 1}..{args.steps}.", "",
             f"| median (s) | DP=1 | DP={args.nproc} | speed-up |", "|---|---|---|---|"]
    lines += [f"| {k} | {a:.3f} | {b:.3f} | {r:.2f}x |" for k, a, b, r in rows]
    lines += [f"| wall (setup + {args.steps} steps) | {walls[1]:.0f} | {walls[args.nproc]:.0f} | |", "",
              f"Strong-scaling efficiency t_step(1) / ({args.nproc} x t_step({args.nproc})) = {eff:.2f}.",
              "Rewards of steps 1-3, DP=1 vs DP=N: "
              + ", ".join(f"{a['reward_mean']:.4f} / {b['reward_mean']:.4f}"
                          for a, b in zip(metrics[1][:3], metrics[args.nproc][:3])), ""]
    text = "\n".join(lines)
    print(text)
    (args.out / "result.json").write_text(json.dumps({"rows": rows, "efficiency": eff, "walls": walls}, indent=1))
    if args.append_docs:
        with open(REPO / "docs" / "results.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
