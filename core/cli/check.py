"""``ferrule check HF_DIR``: convert, round trip, logits parity and a per-layer divergence report."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer

from ferrule import envs

__all__ = ["check_command"]


@contextlib.contextmanager
def _quiet_check() -> Iterator[None]:
    """Silence, for the check's duration only, what would bury its report: warnings (megatron's deprecation
    chatter; ``PYTHONWARNINGS`` for the --tp conversion workers) and transformers' "Loading weights" bar of
    each HF reference load (``HF_HUB_DISABLE_PROGRESS_BARS`` in the workers). Everything is restored on exit:
    a caller's process (a notebook, a test session calling the command in-process) keeps its own warning
    filters, environment and progress bars; before, later subprocesses inherited ``PYTHONWARNINGS=ignore``."""
    from transformers.utils import logging as hf_logging

    quiet = {k: envs.get(k) or v for k, v in (("PYTHONWARNINGS", "ignore"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"))}
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with envs.scoped(quiet), warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def check_command(
    hf_dir: Annotated[Path, typer.Argument(help="HF checkpoint directory (config.json + safetensors).")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size (processes) for the conversion, the round trip and the logits.")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel size (MoE); the check runs tp*ep processes.")] = 1,
    etp: Annotated[Optional[int], typer.Option("--etp", help="Expert tensor-parallel size (MoE; default: --tp). "
                                               "MoE families with biases need --etp 1.")] = None,
    family: Annotated[Optional[str], typer.Option("--family", help="Family name (default: from config.json).")] = None,
    seqs: Annotated[int, typer.Option("--seqs", help="Random test sequences.")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per random test sequence.")] = 32,
    text: Annotated[Optional[str], typer.Option("--text", help="Use this text (checkpoint tokenizer) instead of random ids.")] = None,
    atol: Annotated[float, typer.Option("--atol", help="Logits tolerance (fp32, max abs difference).")] = 1e-5,
    grads: Annotated[bool, typer.Option("--grads", help="Also compare every parameter's gradient with HF's "
                                                        "(fp32, one backward pass at the layout).")] = False,
) -> None:
    """Check that ferrule reproduces an HF checkpoint: config translation, HF -> torch_dist at --tp,
    a bit-exact round trip, Megatron (at --tp) vs HF logits, and the first layer/op that departs when they differ.

    Exit code 0 when every step passes, 1 when a step fails (the plugin is wrong), 2 for unusable
    input (no HF directory, no family, a config the family refuses, a --tp the model cannot split),
    3 when plugin code crashed.
    """
    from rich.console import Console
    from rich.table import Table

    from ferrule.converters.check import EXIT_BAD_INPUT, run_check

    err = Console(stderr=True)
    bad = [f"--{name} {value}: expected {want}" for name, value, ok, want in (
        ("tp", tp, tp >= 1, "a whole number >= 1 (tensor-parallel processes; default 1)"),
        ("ep", ep, ep >= 1, "a whole number >= 1 (expert-parallel size; default 1)"),
        ("etp", etp, etp is None or etp >= 1, "a whole number >= 1 (expert tensor-parallel size; default: --tp)"),
        ("seqs", seqs, seqs >= 1, "a whole number >= 1 (random test sequences; default 2)"),
        ("seq-len", seq_len, seq_len >= 1, "a whole number >= 1 (tokens per test sequence; default 32)"),
        ("atol", atol, atol >= 0, "a tolerance >= 0 (default 1e-05)"),
        ("grads", "with --ep > 1", not grads or ep == 1,
         "--ep 1 (megatron's raw expert gradients are partial per rank until DDP sums them over the "
         "expert-data-parallel group, which the check does not run)")) if not ok]
    if bad:  # before any work: --seqs 0 ran three steps, then reported a CRASH (IndexError) with exit code 3
        err.print(f"[bold red]error:[/] {'; '.join(bad)}.", highlight=False)
        raise typer.Exit(code=EXIT_BAD_INPUT)
    try:
        with _quiet_check():
            report = run_check(hf_dir, tp=tp, ep=ep, etp=etp, family=family, seqs=seqs, seq_len=seq_len, text=text,
                               atol=atol, grads=grads)
    except Exception as exc:  # noqa: BLE001 - unusable input: one line, exit 2 (the line `ferrule convert` prints)
        from ferrule.cli.errors import print_user_error, user_error_message

        print_user_error(user_error_message(exc) or f"{type(exc).__name__}: {exc}")
        raise typer.Exit(code=EXIT_BAD_INPUT) from None
    console = Console()
    table = Table(title=f"ferrule check {hf_dir} (family {report.family})", title_justify="left")
    for col in ("step", "status", "detail", "seconds"):
        table.add_column(col, overflow="fold")
    colour = {"ok": "green", "FAIL": "red", "CRASH": "red", "WARN": "yellow", "skipped": "yellow"}
    for row in report.rows:
        table.add_row(row.step, f"[{colour[row.status]}]{row.status}[/]", row.detail, f"{row.seconds:.1f}")
    console.print(table)
    if report.divergence:
        div = Table(title="per-layer divergence (max |megatron - HF|)", title_justify="left")
        for col in ("layer", "op", "max abs diff", "note"):
            div.add_column(col)
        for layer, op, diff, note in report.divergence:
            div.add_row(str(layer), op or "-", "-" if diff is None else f"{diff:.3g}", note or "")
        console.print(div)
    raise typer.Exit(code=report.exit_code)
