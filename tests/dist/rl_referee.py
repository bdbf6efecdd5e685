"""One-process referee runs for tests/test_rl_distributed.py, in a process of their own.

Usage: python tests/dist/rl_referee.py JOBS_JSON RESULTS_JSON

``JOBS_JSON`` holds ``{"config": path, "jobs": [[override, ...], ...]}``; each job is one GRPO
run (:func:`rl_worker.run`) in this process, in order; ``RESULTS_JSON`` gets the list of their
``(metrics entries, responses, weights digest)``, or ``{"config_error": message}`` for a run refused
with a :class:`~ferrule.rl.config.ConfigError` (e.g. a resume at a layout it cannot reshard to). The test starts this with
``CUDA_VISIBLE_DEVICES=""`` so that the referee trains on the CPU (gloo, one rank) like the
2-rank gloo workers, also on a machine with GPUs, where the test process itself may already
hold a CUDA backend (ferrule's device backend is fixed per process); on a machine without CUDA the
test calls :func:`run_jobs` in its own process instead (no interpreter start).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def run_jobs(config: Path, jobs: list[list[str]]) -> list:
    """Each job (a list of overrides of ``config``) as one GRPO run in this process, in order:
    ``(metrics entries, responses, weights digest)`` or ``{"config_error": message}`` per job."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import rl_worker

    from ferrule.rl.config import ConfigError

    out = []
    for overrides in jobs:
        try:
            out.append(rl_worker.run(Path(config), overrides))
        except ConfigError as exc:  # a run refused before training (the test checks which, and the message)
            out.append({"config_error": str(exc)})
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_jobs(Path(spec["config"]), spec["jobs"])))


if __name__ == "__main__":
    main()
