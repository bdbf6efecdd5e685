"""Reward-curve PNG of a run (matplotlib, Agg backend; no display needed).

:func:`plot_run` reads ``RUN_DIR/metrics.jsonl`` (names from :data:`ferrule.rl.metrics.METRICS`)
and draws five panels against the step:

1. ``reward_mean`` (thin) with its :data:`SMOOTH_STEPS`-step trailing mean (thick) and a band of
   +- ``reward_group_std_mean`` (the mean within-group spread, i.e. the signal GRPO normalizes)
   clipped to [0, 1] (widened only if the rewards themselves leave it), plus
   ``eval_reward_mean`` points where logged;
2. ``accuracy`` with its trailing mean (and ``eval_accuracy`` points);
3. ``response_length_mean``;
4. ``kl`` and ``clip_fraction`` (second axis), one legend for both;
5. ``grad_norm``.

The title counts training steps (the step-0 entry is the evaluation before training). A metric
that was never logged leaves its panel with a "not logged" note. ``null`` values (non-finite at
logging time) are gaps.

:func:`plot_comparison` draws several runs on shared axes (e.g. LoRA vs full-parameter):
smoothed reward and accuracy with evaluation points, the policy's entropy (a rising entropy is the
first sign of a run coming apart), response length, step time and peak memory.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from ferrule.rl.metrics import METRICS_FILE, read_metrics

from ferrule.fs.util import apply_default_mode

PLOT_FILE = "reward_curve.png"
#: Window of the trailing mean drawn over reward and accuracy (steps).
SMOOTH_STEPS = 5


def trailing_mean(ys: list[float], window: int = SMOOTH_STEPS) -> list[float]:
    """``out[i] = mean(ys[max(0, i - window + 1): i + 1])`` (the first points average fewer steps)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(entries: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for e in entries:
        v = e.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(e["step"])
            ys.append(float(v))
    return xs, ys


def build_figure(entries: list[dict[str, Any]], title: str) -> Any:
    """The five-panel matplotlib figure of metrics entries (module docstring); the caller closes it."""
    import matplotlib.pyplot as plt

    n_steps = len({e["step"] for e in entries if e.get("step", 0) > 0})
    fig, axes = plt.subplots(5, 1, figsize=(8, 13), sharex=True)
    fig.suptitle(f"{title}  ({n_steps} training step{'s' if n_steps != 1 else ''})")

    def panel(ax: Any, key: str, label: str, color: str, eval_key: str | None = None, smooth: bool = False) -> bool:
        xs, ys = _series(entries, key)
        if xs:
            ax.plot(xs, ys, color=color, lw=0.8 if smooth else 1.5, alpha=0.5 if smooth else 1.0, label=key)
            if smooth and len(xs) > 1:
                ax.plot(xs, trailing_mean(ys), color=color, lw=2.2, label=f"{key} ({SMOOTH_STEPS}-step mean)")
        if eval_key:
            ex, ey = _series(entries, eval_key)
            if ex:
                ax.plot(ex, ey, "o", color="black", ms=4, label=eval_key)
        if not xs:
            ax.text(0.5, 0.5, f"{key}: not logged", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        return bool(xs)

    ax = axes[0]
    if panel(ax, "reward_mean", "reward", "tab:blue", "eval_reward_mean", smooth=True):
        xs, mean = _series(entries, "reward_mean")
        bx, spread = _series(entries, "reward_group_std_mean")
        if bx == xs:
            floor, ceil = min(0.0, min(mean)), max(1.0, max(mean))  # [0, 1] unless the rewards leave it
            lo = [max(floor, m - s) for m, s in zip(mean, spread)]
            hi = [min(ceil, m + s) for m, s in zip(mean, spread)]
            ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.2, label="+- mean within-group std")
    ax.legend(loc="best", fontsize=8)
    panel(axes[1], "accuracy", "accuracy", "tab:green", "eval_accuracy", smooth=True)
    axes[1].legend(loc="best", fontsize=8)
    panel(axes[2], "response_length_mean", "response length\n(tokens)", "tab:purple")
    has_kl = panel(axes[3], "kl", "KL (nats/token)", "tab:red")
    cx, cy = _series(entries, "clip_fraction")
    handles, labels = axes[3].get_legend_handles_labels()
    if cx:
        twin = axes[3].twinx()
        twin.plot(cx, cy, color="tab:orange", lw=1, ls="--", label="clip_fraction (right axis)")
        twin.set_ylabel("clip fraction", color="tab:orange")
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if has_kl or cx:
        axes[3].legend(handles, labels, loc="upper left", fontsize=8)
    panel(axes[4], "grad_norm", "grad norm", "tab:brown")
    axes[4].set_xlabel("step")
    fig.tight_layout()
    return fig


#: Panels of :func:`build_comparison_figure`: (metric, y label, trailing mean drawn, eval metric).
COMPARE_PANELS = (
    ("reward_mean", "reward\n(5-step mean)", True, "eval_reward_mean"),
    ("accuracy", "accuracy\n(5-step mean)", True, "eval_accuracy"),
    ("entropy", "policy entropy\n(nats/token)", False, None),
    ("response_length_mean", "response length\n(tokens)", False, None),
    ("time_step_s", "step time (s, log)", False, None),
    ("memory_peak_bytes", "peak memory\n(GiB)", False, None),
)


def build_comparison_figure(runs: dict[str, list[dict[str, Any]]], title: str) -> Any:
    """Several runs on shared axes (:data:`COMPARE_PANELS`), one colour per run; the caller closes it.

    Reward and accuracy are drawn as their :data:`SMOOTH_STEPS`-step trailing means (raw values
    are too noisy to tell runs apart), evaluation points as markers in the run's colour; memory
    is in GiB (2**30 bytes). A metric no run logged leaves its panel with a note.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(COMPARE_PANELS), 1, figsize=(8, 2.6 * len(COMPARE_PANELS)), sharex=True)
    fig.suptitle(textwrap.fill(title, 90))  # long run labels wrap instead of running off the figure
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label, smooth, eval_key) in zip(axes, COMPARE_PANELS):
        drawn = False
        for i, (name, entries) in enumerate(runs.items()):
            color = colors[i % len(colors)]
            xs, ys = _series([e for e in entries if e.get("step", 0) > 0], key)
            if key == "memory_peak_bytes":
                ys = [y / 2**30 for y in ys]
            if xs:
                ax.plot(xs, trailing_mean(ys) if smooth else ys, color=color, lw=1.8, label=name)
                drawn = True
            if eval_key:
                ex, ey = _series(entries, eval_key)
                if ex:
                    ax.plot(ex, ey, "o", color=color, ms=4, label=f"{name}: {eval_key}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, f"{key}: not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        else:
            ax.legend(loc="best", fontsize=7)
        if key == "time_step_s" and drawn:
            ax.set_yscale("log")  # the first steps (CUDA-graph capture, compilation) dwarf the rest
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def _save(fig: Any, out_path: Path) -> Path:
    import matplotlib.pyplot as plt

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=".plot.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        apply_default_mode(tmp)
        os.replace(tmp, out_path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def _run_entries(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a ferrule run folder?")
    entries = read_metrics(path)
    if not entries:
        raise ValueError(f"{path} has no metrics entries yet")
    return entries


def plot_comparison(run_dirs: list[str | os.PathLike[str]], out: str | os.PathLike[str],
                    labels: list[str] | None = None, title: str | None = None) -> Path:
    """Write one PNG comparing several runs (:func:`build_comparison_figure`); return its path.

    Args:
        run_dirs: two or more run folders (each with ``metrics.jsonl``).
        out: the PNG path.
        labels: legend names, one per run (default: the folder names).

    Raises:
        FileNotFoundError: a folder has no metrics.jsonl.
        ValueError: a file has no entries, fewer than two runs, labels of the wrong length, or
            two runs with the same label.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)

    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise ValueError(f"a comparison needs two or more run folders, got {len(dirs)}; use plot_run for one")
    names = list(labels) if labels is not None else [d.name for d in dirs]
    if len(names) != len(dirs):
        raise ValueError(f"{len(names)} labels for {len(dirs)} runs; give one label per run")
    if len(set(names)) != len(names):
        raise ValueError(f"run labels must differ, got {names}; pass labels=[...] (--label in the CLI)")
    runs = {name: _run_entries(d) for name, d in zip(names, dirs)}
    fig = build_comparison_figure(runs, title or "ferrule runs: " + " vs ".join(names))
    return _save(fig, Path(out))


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
             title: str | None = None) -> Path:
    """Write the reward-curve PNG of a run; return its path (default ``RUN_DIR/reward_curve.png``).

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: the file has no entries.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)

    run_dir = Path(run_dir)
    entries = _run_entries(run_dir)
    out_path = Path(out) if out is not None else run_dir / PLOT_FILE
    fig = build_figure(entries, title or f"ferrule run: {run_dir.name}")
    return _save(fig, out_path)
