"""One rank of the test session's 2-process gloo pool (:mod:`dist_pool`); started under torchrun.

Instead of a ``torchrun`` per test (two interpreters importing torch, transformers and megatron-core:
20-30 s on a loaded 2-core machine before the first line of the test runs), the session starts this
program once and hands it *jobs*: a worker script (or ``-m module``) with its argv and environment,
run here exactly as torchrun would run it (``runpy`` with ``__name__ == "__main__"``, the torchrun
environment variables already set), in both ranks at once.

Protocol (all through files in CONTROL_DIR, written atomically by renaming):

- ``job-N.json`` (from the client): ``{"argv": [...], "env": {...}, "cwd": "..."}``; ``argv`` is
  what follows ``torchrun --nproc-per-node 2``: ``[SCRIPT, *args]`` or ``["-m", MODULE, *args]``.
- ``job-N.rankR.out`` / ``.err``: the job's stdout / stderr in rank R (file descriptors 1 and 2
  are pointed there, so C-level output is caught too).
- ``job-N.rankR.done`` (from rank R): ``{"rc": int, "threads": int, "reset": bool}``: 0, the ``SystemExit``
  code, or 1 for an exception (its traceback is in ``.err``); ``reset``: the reset after the job worked.
- ``job-N.next`` (from the client, after a job every rank finished with 0): the ranks take the next job.
- ``job-N.recover`` (from the client, after a failed job that every rank finished): the ranks replace the
  default process group and take the next job; ``job-N.rankR.recovered`` (from rank R) says it has.
- ``stop`` (from the client): both ranks leave their loop.

Between jobs each rank tears down megatron's model-parallel groups (keeping the default process
group), resets ferrule's plugin registry, restores ``os.environ``, ``sys.argv`` and ``sys.path``, and
meets the other rank at a barrier. A job that calls ``dist.init_process_group`` or
``dist.destroy_process_group`` on the default group (as a standalone worker does) finds the group
already there / kept: both are no-ops here. A job that fails (an exception or a non-zero exit) in every
rank, or in one rank after the other finished, leaves the ranks waiting for the client's word: on
``recover`` they destroy the default group and make a new one through the same store under a new
prefix (:func:`_renew_world`), so that a collective one rank started and the other never joined
cannot leave its messages or sequence numbers behind, and go on (a fresh pool would cost two
interpreter starts, ~25 s here). A job that hangs in one rank while the other waits in a collective is
the client's business: it kills the pool and starts a new one.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

POLL_S = 0.02
_real_destroy = None  # torch.distributed.destroy_process_group, before the patch below
_real_init = None  # torch.distributed.init_process_group, before the patch below
# set by torchrun for this rank: a job's environment (often a copy of the test's, with these popped) never changes them
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "CUDA_VISIBLE_DEVICES")  # the pool's ranks are gloo on the CPU on any machine


def _patch_process_group_calls() -> None:
    """Make a job's own init / destroy of the *default* process group no-ops (the pool owns it)."""
    import torch.distributed as dist

    global _real_destroy, _real_init
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    _real_destroy, _real_init = real_destroy, real_init

    def init_process_group(*args, **kwargs):
        if dist.is_initialized():
            return None
        return real_init(*args, **kwargs)

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return real_destroy(group)

    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one. megatron's ``destroy_model_parallel`` forgets its
    groups without destroying them, and torch keeps each in its registry with its gloo threads: measured,
    ~1,080 threads per rank after a dozen layouts, which a fresh process per job used to hide."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.GroupMember.WORLD
    for group in [g for g in list(c10d._world.pg_map) if g is not world]:
        try:
            _real_destroy(group)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _reset_between_jobs() -> None:
    import gc

    from ferrule.megatron.parallel import destroy_distributed

    # megatron's groups, its rotary caches and the module globals that keep groups alive (destroy_model_parallel
    # forgets them; their gloo threads stay), every process group but the default one
    destroy_distributed(keep_process_group=True)
    _destroy_subgroups()
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
    except (ImportError, AttributeError):  # pragma: no cover - megatron layout changed
        pass
    try:
        from ferrule.contract import registry
        registry.reset_registry()
    except ImportError:  # pragma: no cover
        pass
    gc.collect()


def _renew_world(n: int) -> None:
    """Replace the default gloo group after failed job ``n``: the old one may hold a collective that only one
    rank entered (its data in a socket, its sequence number ahead of the other rank's). The new group
    meets through the old one's store (torchrun's) under a prefix of its own, so no key of the old
    rendezvous is read again."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from datetime import timedelta

    rank, world = dist.get_rank(), dist.get_world_size()
    store = c10d._get_default_store()
    _real_destroy()
    _real_init("gloo", store=dist.PrefixStore(f"ferrule-pool-renew-{n}", store), rank=rank, world_size=world,
               timeout=timedelta(seconds=900))


def _await_word(control: Path, n: int, client: int) -> str | None:
    """After job ``n``: the client's word, ``"next"`` (every rank succeeded) or ``"recover"`` (a rank failed and
    every rank finished); None on stop or a dead client. Every rank waits for it, also one whose own job
    succeeded: it must not wait at the old group's barrier while the other ranks renew the group."""
    idle = 0
    while True:
        for word in ("next", "recover"):
            if (control / f"job-{n}.{word}").exists():
                return word
        if (control / "stop").exists():
            return None
        idle += 1
        if idle % 50 == 0 and not _alive(client):
            return None
        time.sleep(POLL_S)


def _run_job(job: dict, out_path: Path, err_path: Path) -> int:
    import torch

    argv = list(job["argv"])
    extra: list[str] = []
    saved_env, saved_argv, saved_path, saved_cwd = dict(os.environ), list(sys.argv), list(sys.path), os.getcwd()
    saved_threads = torch.get_num_threads()
    sys.stdout.flush(), sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            os.environ.update({k: v for k, v in (job.get("env") or {}).items()
                               if k not in TORCHRUN_KEYS and not k.startswith("TORCHELASTIC_")})
            extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
            sys.path[:0] = extra
            if extra:
                import importlib

                importlib.invalidate_caches()
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            if job.get("cwd"):
                os.chdir(job["cwd"])
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = str(Path(argv[0]).resolve())
                sys.argv = [script, *argv[1:]]
                sys.path.insert(0, str(Path(script).parent))
                runpy.run_path(script, run_name="__main__")
            rc = 0
        except SystemExit as exc:
            code = exc.code
            rc = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported to the client as the job's failure
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            os.close(saved_fds[0]), os.close(saved_fds[1])
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.argv, sys.path[:] = saved_argv, saved_path
            roots = tuple(str(Path(p).resolve()) for p in extra)
            for name, module in list(sys.modules.items()) if roots else ():
                if str(getattr(module, "__file__", None) or "").startswith(roots):
                    del sys.modules[name]  # a plugin fixture reading a variable at import reads it anew
            torch.set_num_threads(saved_threads)
    return rc


def _native_threads() -> int:
    """This process's OS threads (Linux: /proc/self/task), 0 where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(control: Path) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # import what every job needs once, before the first job (this is the time the pool saves)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import ferrule.megatron  # noqa: F401  (before megatron: its known-harmless warnings filtered; import ferrule installs the jit deferral)
    from megatron.core import parallel_state  # noqa: F401

    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    _patch_process_group_calls()
    (control / f"ready.rank{rank}").write_text(str(os.getpid()))
    client = int((control / "client.pid").read_text())
    n = 0
    while True:
        job_file = control / f"job-{n}.json"
        idle = 0
        while not job_file.exists():
            if (control / "stop").exists():
                return
            idle += 1
            if idle % 50 == 0 and not _alive(client):  # the test process died without stopping the pool
                return
            time.sleep(POLL_S)
        job = json.loads(job_file.read_text())
        rc = _run_job(job, control / f"job-{n}.rank{rank}.out", control / f"job-{n}.rank{rank}.err")
        reset = True
        try:
            _reset_between_jobs()
        except Exception:  # noqa: BLE001 - a pool that cannot reset is replaced by the client
            traceback.print_exc()
            rc, reset = rc or 70, False
        tmp = control / f".job-{n}.rank{rank}.done"
        tmp.write_text(json.dumps({"rc": rc, "threads": _native_threads(), "reset": reset}))
        tmp.rename(control / f"job-{n}.rank{rank}.done")
        word = _await_word(control, n, client)  # a failed rank's peer may be stuck in a collective: the client
        if word is None:  # recovers the pool or replaces it
            return
        if word == "recover":
            _renew_world(n)
            (control / f"job-{n}.rank{rank}.recovered").write_text("")
        dist.barrier()
        n += 1


if __name__ == "__main__":
    main(Path(sys.argv[1]))
