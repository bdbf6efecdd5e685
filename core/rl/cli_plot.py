"""``ferrule plot RUN_DIR``: write the reward-curve PNG of a run (see :mod:`ferrule.rl.plot`).

Mounted by ``ferrule.cli`` with ``app.command("plot")(plot_command)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def plot_command(
    run_dir: Annotated[Path, typer.Argument(help="Run folder containing metrics.jsonl.")],
    out: Annotated[Path | None, typer.Option("--out", "-o",
                                             help="PNG path (default RUN_DIR/reward_curve.png).")] = None,
) -> None:
    """Plot reward, accuracy, response length, KL and grad norm of a run to a PNG."""
    from ferrule.rl.plot import plot_run

    try:
        path = plot_run(run_dir, out)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
