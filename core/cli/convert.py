"""``ferrule convert``: HF <-> Megatron torch_dist checkpoint conversion (typer sub-app ``app``).

Commands::

    ferrule convert hf-to-torch-dist HF_DIR OUT_DIR [--tp N] [--ep N] [--etp N] [--pp N] [--overwrite]
    ferrule convert torch-dist-to-hf CKPT_DIR OUT_DIR [--overwrite] [--max-shard-gb 5] [--keep-quantized]

Errors are printed as one message (what was wrong and how to fix it) with exit code 2; no
partial output is left behind. See docs/convert.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["app"]

app = typer.Typer(
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
    from ferrule.cli.errors import print_user_error, user_error_message

    if not isinstance(exc, Exception) and user_error_message(exc) is None:
        raise exc
    if isinstance(exc, typer.BadParameter):  # a flag's value: the message names the flag
        print_user_error(str(exc))
        raise typer.Exit(code=2) from None
    print_user_error(user_error_message(exc) or f"{type(exc).__name__}: {exc}")
    raise typer.Exit(code=2) from None


@app.command("hf-to-torch-dist")
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
    from ferrule.converters.checkpoint import hf_to_torch_dist, hf_to_torch_dist_bytes
    from ferrule.fs.util import sigterm_as_exit

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


@app.command("torch-dist-to-hf")
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
    import json

    from ferrule.converters.checkpoint import _family_parts, _read_config, dropped_hf_tensors, read_checkpoint_metadata
    from ferrule.converters.checkpoint import torch_dist_to_hf, torch_dist_to_hf_bytes
    from ferrule.fs.util import sigterm_as_exit

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


if __name__ == "__main__":  # pragma: no cover
    app()
