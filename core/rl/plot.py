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
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ferrule.rl.metrics import METRICS_FILE, read_metrics

from ferrule.fsutil import apply_default_mode

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


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
             title: str | None = None) -> Path:
    """Write the reward-curve PNG of a run; return its path (default ``RUN_DIR/reward_curve.png``).

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: the file has no entries.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a ferrule run folder?")
    entries = read_metrics(path)
    if not entries:
        raise ValueError(f"{path} has no metrics entries yet")
    out_path = Path(out) if out is not None else run_dir / PLOT_FILE
    fig = build_figure(entries, title or f"ferrule run: {run_dir.name}")

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
