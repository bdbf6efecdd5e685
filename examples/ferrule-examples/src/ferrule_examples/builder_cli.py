"""The command line of the example asset builders (``python -m ferrule_examples.<family>_synthetic OUT_DIR``
and the ``shapes`` task builders): one positional ``OUT_DIR``, ``--help`` from the module's docstring."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["builder_main"]


def builder_main(module: str, doc: str | None, build: Callable[[Path], Path], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run ``build(OUT_DIR)`` and print the folder it wrote (exit code 0;
    a usage error, e.g. no OUT_DIR or an unknown option such as a mistyped ``--hlep``, is argparse's exit code 2).
    The builders are deterministic (seed 0): running one again into the same OUT_DIR rewrites the same files."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").strip().split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to write (created if absent)")
    args = parser.parse_args(argv)
    print(build(args.out_dir))
    return 0
