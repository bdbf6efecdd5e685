"""A ``dist_pool`` job that runs one rank of a ferrule multi-rank worker call (the test-side stand-in for the
ranks :func:`ferrule.converters.workers._run` spawns; see the ``pooled_ranks`` fixture in conftest.py).

Usage (in both pool ranks): ``rank_call.py CALL_FILE`` where ``CALL_FILE`` is a pickle of
``(fn, args, err_dir, world)``. The rank runs :func:`ferrule.converters.workers._spawn_entry` exactly as a
spawned rank does (the same environment variables, the same ``error-rankN.txt`` report on failure), minus
the parent-death watch: the pool's ranks already leave with the test process.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def main(call_file: str) -> None:
    from ferrule.converters.workers import _spawn_entry

    fn, args, err_dir, world = pickle.loads(Path(call_file).read_bytes())
    _spawn_entry(int(os.environ["RANK"]), world, str(Path(err_dir) / "rendezvous"), fn, args, err_dir)


if __name__ == "__main__":
    main(sys.argv[1])
