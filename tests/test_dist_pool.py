"""The session's 2-rank pool (tests/dist_pool.py) after a failed job: it keeps its ranks when every rank
finished, and the next job's collectives see only that job's data (the default group is renewed).

Reference: the values each rank sends, known here; a fresh pool's start is counted by ``DistPool.starts``.
"""

from __future__ import annotations

import textwrap

import pytest

#: rank 0 starts a send that rank 1 never receives (its job raises first) and finishes; without the renewal
#: of the default group (``pool_rank._renew_world``) the next job's send/receive hung (measured)
FAIL_AFTER_A_LONE_SEND = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if rank == 0:
        dist.isend(torch.tensor([666.0]), dst=1)
        time.sleep(0.5)
    else:
        raise RuntimeError("planted failure on rank 1")
""")

#: both ranks exit 2, as a user error in every rank does
BOTH_EXIT_2 = "import sys\nsys.exit(2)\n"

#: a clean job: rank 0 sends 7, rank 1 receives it; an all-reduce sums the ranks
SEND_7_AND_ALL_REDUCE = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1)
    else:
        got = torch.zeros(1)
        dist.recv(got, src=0)
        print("received", float(got[0]))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print("sum", float(t[0]))
""")


@pytest.mark.timeout(300)
def test_a_failed_job_keeps_the_pool_and_leaves_nothing_for_the_next(dist_pool, tmp_path):
    """A job that fails in one rank after the other sent it a tensor, then one that exits 2 in both ranks: each
    returns its code and error, the pool keeps its ranks (no new start), and the next job receives its own
    value (7, not the failed job's 666) and all-reduces to 1 + 2."""
    scripts = {}
    for name, text in {"fail": FAIL_AFTER_A_LONE_SEND, "exit2": BOTH_EXIT_2, "ok": SEND_7_AND_ALL_REDUCE}.items():
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    ok = dist_pool.run([str(scripts["ok"])], timeout=120)  # the pool is up (a start, if this worker had none)
    assert ok.returncode == 0, ok.stderr[-3000:]
    starts, recoveries = dist_pool.starts, dist_pool.recoveries

    failed = dist_pool.run([str(scripts["fail"])], timeout=120)
    assert failed.returncode == 1 and "RuntimeError: planted failure on rank 1" in failed.stderr, failed.stderr[-3000:]
    exit2 = dist_pool.run([str(scripts["exit2"])], timeout=120)
    assert exit2.returncode == 2, exit2.stderr[-3000:]
    after = dist_pool.run([str(scripts["ok"])], timeout=120)
    assert after.returncode == 0, after.stderr[-3000:]
    assert "received 7.0" in after.stdout and "666" not in after.stdout, after.stdout
    assert after.stdout.count("sum 3.0") == 2, after.stdout
    assert (dist_pool.starts, dist_pool.recoveries) == (starts, recoveries + 2)
