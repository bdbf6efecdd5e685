"""torchrun worker for tests/test_rl_distributed.py: a rank that raises mid-run.

Usage: torchrun --nproc-per-node 2 tests/dist/rl_fail_worker.py FAIL_RANK FAIL_STEP MARK_FILE ferrule-train-args...

Runs ``ferrule train`` (the CLI entry point) on every rank with
:meth:`ferrule.rl.loop.GRPOTrainer.train_step` wrapped so that rank ``FAIL_RANK`` raises
``RuntimeError("injected failure on rank R at step S")`` at step ``FAIL_STEP``, after writing
the wall-clock time of the failure to ``MARK_FILE`` (the test measures how fast the job ends).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main() -> None:
    fail_rank, fail_step, mark = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    from ferrule.rl.loop import GRPOTrainer

    original = GRPOTrainer.train_step

    def train_step(self, step):
        if step == fail_step and int(os.environ["RANK"]) == fail_rank:
            mark.write_text(str(time.time()))
            raise RuntimeError(f"injected failure on rank {fail_rank} at step {step}")
        return original(self, step)

    GRPOTrainer.train_step = train_step
    sys.argv = ["ferrule", "train", *sys.argv[4:]]
    from ferrule.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
