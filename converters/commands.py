"""The converters' commands: ``ferrule convert`` (the sub-app :data:`convert_app`) and ``ferrule check``
(:func:`check_command`).

They live with the converters they drive, as ``ferrule export`` does (:mod:`ferrule.converters.export`),
and :mod:`ferrule.cli` mounts them by ``"module:attr"`` string, so the core imports nothing of the
converters. Importing this module costs typer and rich only (``ferrule --help`` stays torch-free): each
command imports the conversion (torch, megatron, transformers) inside its body.

Commands::

    ferrule convert hf-to-torch-dist HF_DIR OUT_DIR [--tp N] [--ep N] [--etp N] [--pp N] [--overwrite]
    ferrule convert torch-dist-to-hf CKPT_DIR OUT_DIR [--overwrite] [--max-shard-gb 5] [--keep-quantized]
    ferrule check HF_DIR [--tp N] [--ep N] [--etp N] [--family F] [--seqs N] [--seq-len N] [--text T] [--atol X] [--grads]

Errors in bad input are printed as one message (what was wrong and how to fix it) with exit code 2
(:mod:`ferrule.user_errors`); no partial output is left behind. See docs/convert.md and
:mod:`ferrule.converters.check` for the check's steps and exit codes.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from ferrule import envs
from ferrule.compat import renamed_name
from ferrule.fs.util import sigterm_as_exit
from ferrule.user_errors import print_user_error, user_error_message

from .check import EXIT_BAD_INPUT, run_check

__all__ = ["check_command", "convert_app"]


def __getattr__(name: str):  # ``app``: the convert sub-app's name in ferrule.converters.cli (ferrule.compat)
    return renamed_name(__name__, name)

convert_app = typer.Typer(
    name="convert",
    help="Convert checkpoints between Hugging Face safetensors and Megatron torch_dist.",
    no_args_is_help=True,
    add_completion=False,
)


class _Bar:
    """A rich bytes progress bar drawn from the first ``advance(n_bytes)`` on, so that an error found before
    any work (a bad layout, a missing file) prints its one line without a bar above it.
    ``with _Bar(total, label) as bar: ... bar.advance(n)``; ``total`` 0 or None: a bar without a total."""

    def __init__(self, total_bytes: int | None, label: str) -> None:
        self.total, self.label, self.progress, self.task = total_bytes or None, label, None, None

    def __enter__(self) -> _Bar:
        return self

    def advance(self, n_bytes: int) -> None:
        if self.progress is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

            self.progress = Progress(TextColumn(self.label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                     TimeElapsedColumn())
            self.task = self.progress.add_task(self.label, total=self.total)
            self.progress.start()
        self.progress.advance(self.task, n_bytes)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def _check_counts(**flags: int) -> None:
    """Refuse a process count below 1 (``--tp 0``) before anything is read, drawn or written."""
    what = {"tp": "tensor-parallel", "ep": "expert-parallel", "pp": "pipeline-parallel",
            "etp": "expert tensor-parallel"}
    for name, value in flags.items():
        if value < 1:
            raise typer.BadParameter(f"--{name} {value}: expected a whole number >= 1 ({what[name]} conversion "
                                     f"processes; --tp 1 --ep 1 --pp 1, the default, converts in this process).")


def _notice(message: str) -> None:
    typer.echo(message, err=True)


def _fail(exc: BaseException) -> None:
    """Every conversion error, including torch's ``CheckpointException`` (a ``BaseException``),
    becomes one ``error:`` line and exit code 2; Ctrl-C and exits pass through."""
    if not isinstance(exc, Exception) and user_error_message(exc) is None:
        raise exc
    if isinstance(exc, typer.BadParameter):  # a flag's value: the message names the flag
        print_user_error(str(exc))
        raise typer.Exit(code=2) from None
    print_user_error(user_error_message(exc) or f"{type(exc).__name__}: {exc}")
    raise typer.Exit(code=2) from None


@convert_app.command("hf-to-torch-dist")
def hf_to_torch_dist_cmd(
    hf_dir: Annotated[Path, typer.Argument(help="HF checkpoint directory (config.json + model.safetensors[.index.json]).")],
    out_dir: Annotated[Path, typer.Argument(help="Output directory for the torch_dist checkpoint (must not exist).")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size of the conversion processes.")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel size (MoE).")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel size.")] = 1,
    etp: Annotated[Optional[int], typer.Option("--etp", help="Expert tensor-parallel size (MoE; default: --tp). "
                                               "MoE families with biases need --etp 1.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT_DIR if it exists.")] = False,
) -> None:
    """Convert an HF checkpoint to a Megatron torch_dist checkpoint.

    Runs tp*ep*pp processes (gloo on CPU); the checkpoint loads under any layout afterwards.
    A layout the model cannot split or the family does not support is refused before any process starts.
    HF config, generation config and tokenizer files are stored in OUT_DIR/hf.
    """
    from .checkpoint import hf_to_torch_dist, hf_to_torch_dist_bytes

    try:
        _check_counts(tp=tp, ep=ep, pp=pp, **({"etp": etp} if etp is not None else {}))
        if out_dir.exists() and not overwrite:
            raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it.")
        one_process = tp * ep * pp == 1  # the ranks of a multi-process conversion report no progress
        with sigterm_as_exit(), _Bar(hf_to_torch_dist_bytes(hf_dir) if one_process else None,
                                     "hf -> torch_dist") as bar:  # SIGTERM: temp output and lock removed
            out = hf_to_torch_dist(hf_dir, out_dir, tp=tp, ep=ep, pp=pp, etp=etp, overwrite=overwrite,
                                   progress=bar.advance if one_process else None, notice=_notice)
    except BaseException as exc:  # noqa: BLE001 - every error becomes one clear message
        _fail(exc)
    typer.echo(f"wrote {out}")


@convert_app.command("torch-dist-to-hf")
def torch_dist_to_hf_cmd(
    ckpt_dir: Annotated[Path, typer.Argument(help="torch_dist checkpoint written by hf-to-torch-dist.")],
    out_dir: Annotated[Path, typer.Argument(help="Output HF directory (must not exist).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT_DIR if it exists.")] = False,
    max_shard_gb: Annotated[float, typer.Option("--max-shard-gb", help="Safetensors shard size bound (GiB).")] = 5.0,
    keep_quantized: Annotated[bool, typer.Option(
        "--keep-quantized", "--mxfp8",
        help="Write the tensors the source stored quantized back in the source's format, with its "
             "quantization_config: block-scaled FP8 such as MXFP8 with the same blocks and scale dtype (power-of-two "
             "scales only), NVFP4 as its source bytes (unchanged tensors only). Default: dequantized, in the "
             "checkpoint's dtype. --mxfp8 is its older name, from before NVFP4 sources.")] = False,
) -> None:
    """Convert a torch_dist checkpoint back to HF safetensors shards + index + config + tokenizer."""
    from .checkpoint import _family_parts, _read_config, dropped_hf_tensors, read_checkpoint_metadata
    from .checkpoint import torch_dist_to_hf, torch_dist_to_hf_bytes

    try:
        if not max_shard_gb > 0:
            raise typer.BadParameter(f"--max-shard-gb {max_shard_gb}: expected a size > 0 (GiB per safetensors "
                                     f"shard; default 5).")
        if out_dir.exists() and not overwrite:
            raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it.")
        meta = read_checkpoint_metadata(ckpt_dir)
        with sigterm_as_exit(), _Bar(torch_dist_to_hf_bytes(meta), "torch_dist -> hf") as bar:
            out = torch_dist_to_hf(ckpt_dir, out_dir, overwrite=overwrite, max_shard_bytes=int(max_shard_gb * 1024**3),
                                   progress=bar.advance, keep_quantized=keep_quantized,
                                   notice=_notice)
    except BaseException as exc:  # noqa: BLE001 - see _fail
        _fail(exc)
    typer.echo(f"wrote {out} ({json.dumps(meta.get('family'))})")
    dropped = dropped_hf_tensors(meta, _family_parts(_read_config(ckpt_dir / "hf"))[2])
    if dropped:
        typer.echo(f"not exported ({len(dropped)} source tensors HF does not load either):")
        for key, row in dropped:
            typer.echo(f"  {key}: {row.reason}")



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
                                                        "(fp32, one backward pass at the layout; --ep > 1 "
                                                        "with --tp 1 only).")] = False,
) -> None:
    """Check that ferrule reproduces an HF checkpoint: config translation, HF -> torch_dist at --tp,
    a bit-exact round trip, Megatron (at --tp) vs HF logits, and the first layer/op that departs when they differ.

    Exit code 0 when every step passes, 1 when a step fails (the plugin is wrong), 2 for unusable
    input (no HF directory, no family, a config the family refuses, a --tp the model cannot split),
    3 when plugin code crashed.
    """
    err = Console(stderr=True)
    bad = [f"--{name} {value}: expected {want}" for name, value, ok, want in (
        ("tp", tp, tp >= 1, "a whole number >= 1 (tensor-parallel processes; default 1)"),
        ("ep", ep, ep >= 1, "a whole number >= 1 (expert-parallel size; default 1)"),
        ("etp", etp, etp is None or etp >= 1, "a whole number >= 1 (expert tensor-parallel size; default: --tp)"),
        ("seqs", seqs, seqs >= 1, "a whole number >= 1 (random test sequences; default 2)"),
        ("seq-len", seq_len, seq_len >= 1, "a whole number >= 1 (tokens per test sequence; default 32)"),
        ("atol", atol, atol >= 0, "a tolerance >= 0 (default 1e-05)"),
        ("grads", f"with --tp {tp} --ep {ep}", not grads or ep == 1 or tp == 1,
         "--ep 1, or --tp 1 with --ep > 1 (the check reproduces megatron's DDP scaling of the expert gradients "
         "for EP ranks that each hold every token; at --tp > 1 the dispatcher shares the TP ranks' tokens "
         "among the experts, which it does not reproduce)")) if not ok]
    if bad:  # before any work: --seqs 0 ran three steps, then reported a CRASH (IndexError) with exit code 3
        err.print(f"[bold red]error:[/] {'; '.join(bad)}.", highlight=False)
        raise typer.Exit(code=EXIT_BAD_INPUT)
    try:
        with _quiet_check():
            report = run_check(hf_dir, tp=tp, ep=ep, etp=etp, family=family, seqs=seqs, seq_len=seq_len, text=text,
                               atol=atol, grads=grads)
    except Exception as exc:  # noqa: BLE001 - unusable input: one line, exit 2 (the line `ferrule convert` prints)
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
