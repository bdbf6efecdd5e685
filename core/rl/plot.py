"""Reward-curve PNG of a run (matplotlib, Agg backend; no display needed).

:func:`plot_run` reads ``RUN_DIR/metrics.jsonl`` (names from :data:`ferrule.rl.metrics.METRICS`)
and draws five panels against the step:

1. ``reward_mean`` with a band of +- ``reward_group_std_mean`` (the mean within-group spread,
   i.e. the signal GRPO normalizes), plus ``eval_reward_mean`` points where logged;
2. ``accuracy`` (and ``eval_accuracy`` points);
3. ``response_length_mean``;
4. ``kl`` (and ``clip_fraction`` on a second axis);
5. ``grad_norm``.

A metric that was never logged leaves its panel with a "not logged" note. ``null`` values
(non-finite at logging time) are gaps.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ferrule.rl.metrics import METRICS_FILE, read_metrics

from ferrule.fsutil import apply_default_mode

PLOT_FILE = "reward_curve.png"


def _series(entries: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for e in entries:
        v = e.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(e["step"])
            ys.append(float(v))
    return xs, ys


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

    fig, axes = plt.subplots(5, 1, figsize=(8, 13), sharex=True)
    fig.suptitle(title or f"ferrule run: {run_dir.name}  ({len(entries)} steps)")

    def panel(ax: Any, key: str, label: str, color: str, eval_key: str | None = None) -> bool:
        xs, ys = _series(entries, key)
        if xs:
            ax.plot(xs, ys, color=color, lw=1.5, label=key)
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
    if panel(ax, "reward_mean", "reward", "tab:blue", "eval_reward_mean"):
        xs, mean = _series(entries, "reward_mean")
        bx, spread = _series(entries, "reward_group_std_mean")
        if bx == xs:
            lo = [m - s for m, s in zip(mean, spread)]
            hi = [m + s for m, s in zip(mean, spread)]
            ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.2, label="+- mean within-group std")
    ax.legend(loc="best", fontsize=8)
    panel(axes[1], "accuracy", "accuracy", "tab:green", "eval_accuracy")
    axes[1].legend(loc="best", fontsize=8)
    panel(axes[2], "response_length_mean", "response length\n(tokens)", "tab:purple")
    panel(axes[3], "kl", "KL (nats/token)", "tab:red")
    cx, cy = _series(entries, "clip_fraction")
    if cx:
        twin = axes[3].twinx()
        twin.plot(cx, cy, color="tab:orange", lw=1, ls="--", label="clip_fraction")
        twin.set_ylabel("clip fraction", color="tab:orange")
    panel(axes[4], "grad_norm", "grad norm", "tab:brown")
    axes[4].set_xlabel("step")
    fig.tight_layout()

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
