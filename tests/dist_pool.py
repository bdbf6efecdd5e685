"""The test session's 2-process gloo worker pool: a ``torchrun`` launch shared by every 2-rank test.

A test that needs two ranks used to start ``python -m torch.distributed.run --nproc-per-node 2
WORKER ARGS`` itself: two interpreters importing torch, transformers and megatron-core each time
(20-30 s on a loaded 2-core machine). The ``dist_pool`` fixture (root ``conftest.py``) starts one
launch of ``tests/dist/pool_rank.py`` per test session, lazily, and :meth:`DistPool.run` runs a worker
in both of its ranks with the same argv, environment and torchrun variables, returning a
:class:`subprocess.CompletedProcess` like the ``subprocess.run`` call it replaces::

    proc = dist_pool.run([str(WORKER), str(tmp_path)], env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

One pool per test process (each pytest-xdist worker starts its own on first use). Isolation between
jobs: megatron's model-parallel groups, every process group but the default one, ferrule's registry,
``os.environ``, ``sys.argv`` and ``sys.path`` are reset in the ranks after each job (``pool_rank.py``).
A job that fails in its ranks (an exception, a non-zero exit) keeps the pool when every rank has
finished: the ranks replace their default process group and take the next job (a fresh pool costs two
interpreter starts, ~25 s on the 2-core machine; tests that check planted mistakes fail a job on purpose).
A rank that does not finish within :data:`FAILED_RANK_GRACE_S` of the other's failure (it waits in a
collective), a rank that crashes, a failed recovery, or a test that ends while its job runs (a timeout,
Ctrl-C) takes the pool down with it (killed as a process group); the next job starts a fresh one. The pool never outlives the test
process: torchrun's agent gets SIGKILL when it dies (``PR_SET_PDEATHSIG``) and the ranks leave when
its pid is gone. Tests about process behaviour itself (a rank that dies, signals, torchrun's own exit
codes) keep their own ``torchrun`` (``tests/test_process_policy.py`` lists them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_PROGRAM = ROOT / "tests" / "dist" / "pool_rank.py"
NPROC = 2
START_TIMEOUT_S = 240.0
FAILED_RANK_GRACE_S = 5.0
#: seconds the ranks may take to replace their default process group after a failed job (milliseconds when idle)
RECOVER_TIMEOUT_S = 60.0
POLL_S = 0.02
#: a rank with more OS threads than this after a job's reset is replaced before the next job: some jobs leave
#: process groups that torch no longer lists but something still references, and their gloo threads stay
#: (measured in a CI rehearsal: ~880 threads per rank after a dozen jobs, 100+ of them runnable while idle,
#: load average ~200 on 2 cores); a fresh pool costs one start (~25 s). The last known cause, trained MoE engines
#: that never died (ferrule.megatron.moe.release_dispatcher_graph), is fixed: after tests/test_lora.py's and
#: tests/test_moe_tp.py's TP=2 jobs a rank has 7 threads (772 before); this stays as the guard for the next one
MAX_RANK_THREADS = 300


def _die_with_parent() -> None:
    """In the launched torchrun agent, before exec: SIGKILL when the test process dies (Linux prctl)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the ranks' own watch of client.pid still ends them
        pass


#: this process's pool events, for ``--cpu-report``'s summary (tests/cpu_report.py): each start ``(test id, seconds)``,
#: each kill ``(reason, test id)``, the failed jobs the ranks recovered from, and ``peak_threads``: ``[threads, test id]``
#: of the job after whose reset a rank had the most OS threads (a leak shows here before it reaches MAX_RANK_THREADS)
EVENTS: dict[str, list] = {"starts": [], "kills": [], "recoveries": [], "peak_threads": []}


#: CPU seconds of pool ranks that were killed rather than reaped (``os.killpg``: torchrun's agent dies before it
#: waits for them, so no ``getrusage`` counts them); tests/cpu_report.py adds it to the test process's CPU
RETIRED_CPU_S = 0.0


def _retire_ranks_cpu(agent_pid: int) -> None:
    """Before a kill: add the CPU seconds of ``agent_pid``'s descendants (the ranks) to :data:`RETIRED_CPU_S`."""
    global RETIRED_CPU_S
    try:
        import psutil

        for child in psutil.Process(agent_pid).children(recursive=True):
            try:
                t = child.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            RETIRED_CPU_S += t.user + t.system + t.children_user + t.children_system
    except Exception:  # noqa: BLE001 - psutil absent or the agent gone: the figure is approximate anyway
        pass


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


class DistPoolError(RuntimeError):
    """The pool could not start (its launch's output is in the message)."""


class DistPool:
    """A lazily started ``torchrun --nproc-per-node 2`` of ``pool_rank.py``, reused across jobs."""

    def __init__(self, nproc: int = NPROC) -> None:
        self.nproc = nproc
        self.proc: subprocess.Popen | None = None
        self.control: Path | None = None
        self.next_job = 0
        self.starts = 0
        self.jobs_run = 0
        self.recoveries = 0
        # the environment the ranks start from: the session's, as it is when the fixture is made (a pool first
        # started inside a test's `inproc.environment(...)` would otherwise keep that test's PYTHONPATH, and a
        # plugin module found through it would stay imported with the first job's variables)
        self.base_env = dict(os.environ)

    # -- life cycle ------------------------------------------------------------------------------
    def _start(self) -> Path:
        """Launch the ranks; returns the control folder once both are ready."""
        self.control = Path(tempfile.mkdtemp(prefix="ferrule-dist-pool-"))
        self.next_job = 0
        (self.control / "client.pid").write_text(str(os.getpid()))  # the ranks leave when this process is gone
        # 2 gloo ranks on the CPU, also on a GPU machine (one GPU cannot hold two NCCL ranks)
        env = dict(self.base_env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        with open(self.control / "launch.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.nproc),
                 str(RANK_PROGRAM), str(self.control)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent)
        self.starts += 1
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT_S
        while not all((self.control / f"ready.rank{r}").exists() for r in range(self.nproc)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = (self.control / "launch.log").read_text()[-4000:]
                self.close()
                raise DistPoolError(f"the 2-rank test pool did not start:\n{text}")
            time.sleep(0.1)
        EVENTS["starts"].append((_current_test(), round(time.monotonic() - t0, 1)))
        return self.control

    def close(self) -> None:
        """Stop the ranks (kill the launch's process group) and remove the control folder."""
        if self.proc is not None:
            if self.proc.poll() is None and self.control is not None:
                (self.control / "stop").write_text("")
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                _retire_ranks_cpu(self.proc.pid)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.proc = None
        if self.control is not None:
            shutil.rmtree(self.control, ignore_errors=True)
            self.control = None

    def _kill(self, reason: str = "the test ended inside a job (timeout, interrupt)") -> None:
        if self.proc is not None and self.proc.poll() is None:
            EVENTS["kills"].append((reason, _current_test()))
            _retire_ranks_cpu(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.close()

    # -- jobs ------------------------------------------------------------------------------------
    def run(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 300.0,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` (what follows ``torchrun --nproc-per-node 2``) in every rank of the pool.

        Args:
            argv: ``[SCRIPT, *args]`` or ``["-m", MODULE, *args]``.
            env: variables set for the job (on top of the pool's environment; only these are
                applied, so pass the few the worker needs, e.g. ``{"OMP_NUM_THREADS": "1"}``).
            timeout: seconds for the job; past it the pool is killed and ``subprocess.TimeoutExpired``
                is raised, as ``subprocess.run`` would.
            cwd: working directory for the job (default: the repository root).

        Returns:
            ``CompletedProcess`` whose ``returncode`` is the first non-zero rank's code (else 0) and
            whose ``stdout`` / ``stderr`` are every rank's output, rank 0 first.
        """
        try:
            return self._run(argv, env=env, timeout=timeout, cwd=cwd)
        except BaseException:  # a timeout (ours or pytest-timeout's), Ctrl-C: no job may go on behind the test
            self._kill()
            raise

    def _run(self, argv, *, env, timeout, cwd) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None or self.control is None:
            self.close()
            control = self._start()
        else:
            control = self.control
        n = self.next_job
        self.next_job += 1
        job = {"argv": [str(a) for a in argv], "env": {k: str(v) for k, v in (env or {}).items()},
               "cwd": str(cwd or ROOT)}
        tmp = control / f".job-{n}.json"
        tmp.write_text(json.dumps(job))
        tmp.rename(control / f"job-{n}.json")
        deadline = time.monotonic() + timeout
        done: dict[int, int] = {}
        threads: dict[int, int] = {}
        reset: dict[int, bool] = {}
        failed_at: float | None = None
        while len(done) < self.nproc:
            for r in range(self.nproc):
                f = control / f"job-{n}.rank{r}.done"
                if r not in done and f.exists():
                    report = json.loads(f.read_text())
                    done[r], threads[r], reset[r] = report["rc"], report.get("threads", 0), report.get("reset", False)
                    if done[r] != 0 and failed_at is None:
                        failed_at = time.monotonic()
            if len(done) == self.nproc:
                break
            now = time.monotonic()
            if failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S:
                break  # the other rank waits in a collective for the failed one
            if self.proc.poll() is not None and failed_at is None:
                failed_at = now  # the launch ended (a rank crashed hard): collect what is there
            if now > deadline:
                out, err = self._collect(control, n)
                self._kill(f"a job past its timeout ({timeout:.0f} s)")
                raise subprocess.TimeoutExpired(["dist_pool", *job["argv"]], timeout, output=out, stderr=err)
            time.sleep(POLL_S)
        out, err = self._collect(control, n)
        rc = next((done[r] for r in sorted(done) if done[r] != 0), 0)
        if len(done) < self.nproc:
            rc = rc or 1
            missing = sorted(set(range(self.nproc)) - set(done))
            launch = (control / "launch.log").read_text()[-3000:]
            err += f"\n[dist_pool] rank(s) {missing} did not finish; launch log:\n{launch}"
        most = max(threads.values(), default=0)
        if most > (EVENTS["peak_threads"] or [0])[0]:
            EVENTS["peak_threads"] = [most, _current_test()]
        if most > MAX_RANK_THREADS:
            # ranks whose leaked gloo threads would slow every later job
            self._kill(f"{max(threads.values())} threads in a rank (> {MAX_RANK_THREADS})")
        elif rc != 0 and not (len(done) == self.nproc and all(reset.values()) and self._recover(control, n)):
            # a rank still in the job (a collective the failed one never joined), or no recovery
            self._kill("a failed job that a rank did not finish" if len(done) < self.nproc else "a failed recovery")
        elif rc == 0:
            (control / f"job-{n}.next").write_text("")
        self.jobs_run += 1
        return subprocess.CompletedProcess(["dist_pool", *job["argv"]], rc, out, err)

    def _recover(self, control: Path, n: int) -> bool:
        """After failed job ``n`` that every rank finished: let the ranks replace their default process group
        (``pool_rank._renew_world``); True once every rank says it has, False if the launch ended or timed out."""
        (control / f"job-{n}.recover").write_text("")
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while not all((control / f"job-{n}.rank{r}.recovered").exists() for r in range(self.nproc)):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        self.recoveries += 1
        EVENTS["recoveries"].append(_current_test())
        return True

    # -- lending the pool to a child test session -------------------------------------------------------
    def lend(self, child: subprocess.Popen, folder: Path, timeout: float) -> None:
        """Serve ``child``'s pool jobs until it exits: a pytest session started by a test (the conformance kit over
        the fixture families) asks for 2-rank launches through ``folder`` (:func:`lent_launch`, its
        ``ferrule_kit_tp2_launch``) and gets them run here instead of a ``torchrun`` of its own (two interpreter
        starts). Past ``timeout`` seconds ``child`` is killed and ``subprocess.TimeoutExpired`` raised, as
        ``subprocess.run`` would."""
        deadline = time.monotonic() + timeout
        n = 0
        try:
            while child.poll() is None:
                request = folder / f"request-{n}.json"
                if request.exists():
                    job = json.loads(request.read_text())
                    left = max(1.0, min(job["timeout"], deadline - time.monotonic()))
                    try:
                        proc = self.run(job["argv"], env=job["env"], timeout=left, cwd=job.get("cwd"))
                        answer = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
                    except subprocess.TimeoutExpired as exc:
                        answer = {"rc": -9, "stdout": _text(exc.output), "stderr": _text(exc.stderr) +
                                  f"\n[dist_pool] the lent job took longer than {left:.0f} s"}
                    tmp = folder / f".answer-{n}.json"
                    tmp.write_text(json.dumps(answer))
                    tmp.rename(folder / f"answer-{n}.json")
                    n += 1
                elif time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(child.args, timeout)
                else:
                    time.sleep(0.05)
        except BaseException:
            if child.poll() is None:
                child.kill()
                child.wait()
            raise

    def _collect(self, control: Path, n: int) -> tuple[str, str]:
        outs, errs = [], []
        for r in range(self.nproc):
            for suffix, acc in (("out", outs), ("err", errs)):
                f = control / f"job-{n}.rank{r}.{suffix}"
                if f.exists():
                    acc.append(f.read_text(errors="replace"))
        return "".join(outs), "".join(errs)


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


#: set by a test that lends its pool to a child pytest session (:meth:`DistPool.lend`): the folder of requests
LEND_ENV = "FERRULE_TEST_DIST_POOL_LENT"


def lent_launch():
    """In a child pytest session: a ``(argv, *, env, timeout) -> subprocess.CompletedProcess`` callable that runs
    ``argv`` in the parent test's pool (:meth:`DistPool.lend`), or None when no pool is lent
    (``FERRULE_TEST_DIST_POOL_LENT`` unset). The conformance kit's ``ferrule_kit_tp2_launch`` hook takes it."""
    folder = os.environ.get(LEND_ENV)
    if not folder:
        return None
    folder_path = Path(folder)
    counter = iter(range(1 << 30))

    def launch(argv, *, env=None, timeout=300.0, cwd=None) -> subprocess.CompletedProcess:
        n = next(counter)
        tmp = folder_path / f".request-{n}.json"
        tmp.write_text(json.dumps({"argv": [str(a) for a in argv], "env": dict(env or {}), "timeout": timeout,
                                   "cwd": str(cwd) if cwd else None}))
        tmp.rename(folder_path / f"request-{n}.json")
        answer = folder_path / f"answer-{n}.json"
        deadline = time.monotonic() + START_TIMEOUT_S + timeout + 60  # the lender's pool may have to start first
        while not answer.exists():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["dist_pool (lent)", *argv], timeout)
            time.sleep(0.05)
        result = json.loads(answer.read_text())
        return subprocess.CompletedProcess(["dist_pool (lent)", *argv], result["rc"], result["stdout"], result["stderr"])

    return launch
