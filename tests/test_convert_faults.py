"""Faults around ``ferrule convert`` (issue 28): a kill of a multi-rank conversion, a full disk,
temporary folders of killed conversions.

Each fault is injected from outside ferrule: a signal from the test to the ``ferrule convert``
process (or its whole group, as a terminal's Ctrl-C does), ``shutil.disk_usage`` reporting
little free space, a write that raises ``ENOSPC``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrule import conformance_numeric as cn

#: Runs ``ferrule convert`` (``ferrule.cli.main``); with FAULT_SLOW_WRITE=PREFIX every torch_dist
#: tensor write of every rank touches PREFIX<pid>, then sleeps. The patch sits at module level so the
#: spawned ranks (which import this file as ``__mp_main__``) get it too.
RUNNER = """\
import os, sys, time
from pathlib import Path

prefix = os.environ.get("FAULT_SLOW_WRITE")
if prefix:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def slow_write_item(*args, **kwargs):
        Path(prefix + str(os.getpid())).write_text("")
        time.sleep(300)

    fa._write_item = slow_write_item
if __name__ == "__main__":
    from ferrule.cli import main
    sys.argv = ["ferrule", *sys.argv[1:]]
    main()
"""


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return cn.tiny_hf_dir("qwen2", tmp_path_factory.mktemp("src") / "hf")


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", FERRULE_PLUGINS="qwen", **extra)


def _group_members(pgid: int) -> list[str]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error):
            continue
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_no_rank_outlives_a_killed_multi_rank_conversion(qwen2_dir, tmp_path, how):
    """``ferrule convert --tp 2`` run as a script's background job (``ferrule convert ... &``: SIGINT
    ignored) is signalled while both ranks are inside a torch_dist write: afterwards its process group
    is empty (bounded wait), and after a SIGTERM no temporary folder or lock is left. torch's spawn
    gives its ranks SIGINT as the death signal, which such a rank ignores (as one blocked in a C call
    never acts on it): after a kill -9 both ranks lived on under PID 1; after a SIGTERM the
    temporary output stayed."""
    (tmp_path / "runner.py").write_text(RUNNER)
    prefix, out = tmp_path / "writing-", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), "convert", "hf-to-torch-dist",
                             str(qwen2_dir), str(out), "--tp", "2"], env=_env(FAULT_SLOW_WRITE=str(prefix)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 180
        while len(list(tmp_path.glob("writing-*"))) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("writing-*"))) == 2, f"the ranks never wrote: {proc.stderr.read().decode()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
        rc = proc.wait(timeout=60)
        left = _group_members(proc.pid)
        for _ in range(50):  # children of a killed parent need a moment to be reaped or reparented
            if not left:
                break
            time.sleep(0.2)
            left = _group_members(proc.pid)
        assert left == [], f"processes outlived the {how} of ferrule convert: {left}"
        assert not out.exists()
        if how != "kill -9":  # the parent lived to clean up: no temporary folder, no lock file
            assert rc != 0 and sorted(p.name for p in tmp_path.iterdir()) == ["runner.py"] + sorted(
                p.name for p in tmp_path.glob("writing-*")), list(tmp_path.iterdir())
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stderr.close()
