"""``ferrule plot RUN_DIR [RUN_DIR ...]``: write the reward-curve PNG of a run, or compare runs (see :mod:`ferrule.rl.plot`).

Mounted by ``ferrule.cli`` with ``app.command("plot")(plot_command)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def plot_command(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folder(s) containing metrics.jsonl; two or more: "
                                                        "one comparison PNG.", show_default=False)],
    out: Annotated[Path | None, typer.Option("--out", "-o",
                                             help="PNG path (default RUN_DIR/reward_curve.png for one run; "
                                                  "required for a comparison).")] = None,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="Legend name of each run, in order "
                                                                          "(comparison; default: folder names).")] = None,
) -> None:
    """Plot reward, accuracy, response length, KL and grad norm of a run to a PNG; with several runs,
    one PNG comparing them (reward, accuracy, length, step time, peak memory)."""
    from ferrule.rl.plot import plot_comparison, plot_run

    try:
        if len(run_dirs) == 1:
            if label:
                raise ValueError("--label is for comparisons (two or more run folders)")
            path = plot_run(run_dirs[0], out)
        else:
            if out is None:
                raise ValueError("a comparison of several runs needs --out PNG")
            path = plot_comparison(run_dirs, out, labels=label or None)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
