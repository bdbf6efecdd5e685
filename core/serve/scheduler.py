"""Futures and ordering: every compute request becomes a job run by ONE worker thread.

Rules (reference/tinker_protocol.md §5, §6.5, §6.6):

- Jobs of one training client (model id) run in ``seq_id`` order, whatever order they arrive
  in: the SDK submits the chunks of a large ``forward_backward`` concurrently and the first
  chunk last, and pipelines ``optim_step`` behind it. A job waits until every lower ``seq_id``
  of its model has run; ``create_model`` / create-via-load is seq 0.
- A request id is issued once per ``(model_id, seq_id)`` and per idempotency key; a retry of
  either gets the first request's id back and runs nothing (the app checks the store).
- A request refused on arrival (bad input) still consumes its ``seq_id`` (:meth:`Scheduler.skip`),
  so the client's later requests are not left waiting for it.
- Fair between tenants: of the jobs that are ready, the worker runs one of the tenant it served
  least recently (round robin over tenants; arrival order within a tenant), so a tenant that
  queues many jobs delays another tenant's job by at most one job per other waiting tenant.
  :meth:`Scheduler.queued` counts each tenant's queued and running jobs (the service's
  per-tenant queue limit).
- Sampling jobs carry no model id and run in arrival order between training jobs. Unseeded
  sampling jobs with the same weights and sampling parameters that are waiting together run as
  one batched ``generate`` call (at most :data:`MAX_BATCH_JOBS`); a seeded request always runs
  alone, so its result depends only on its own prompt and seed.

The worker sets its own torch intra-op thread count when it starts (``threads``; ``ferrule serve``
passes ``--worker-threads``, :mod:`ferrule.serve.placement`).

Results are written to the store (JSON or protobuf bytes) before the job counts as done, so a
poll after a restart is answered from the database.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable
from .placement import set_thread_count

__all__ = ["Job", "Scheduler", "UserError", "JSON", "PROTOBUF"]

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

log = logging.getLogger("ferrule.serve")

#: most sampling requests merged into one ``generate`` call
MAX_BATCH_JOBS = 16


class UserError(ValueError):
    """A request that cannot run for a reason the client controls (reported with category 'user')."""


@dataclass
class Job:
    """One queued operation. ``run`` returns ``(content_type, body bytes)``."""

    request_id: str
    op: str
    tenant: str
    run: Callable[[], tuple[str, bytes]]
    model_id: str | None = None
    seq_id: int | None = None
    num_data: int = 0
    num_tokens: int = 0
    submitted: float = field(default_factory=time.monotonic)
    #: jobs with the same key may run together: ``batch_run(jobs)`` returns one ``run()`` result per job
    batch_key: str | None = None
    batch_run: Callable[[list["Job"]], list[tuple[str, bytes]]] | None = None
    payload: Any = None
    #: the served base model the job runs on (the op log names it), or None
    base: str | None = None
    #: bytes it needs while it runs (:mod:`ferrule.serve.memory`); batched sampling jobs' needs add up
    mem: int = 0


class Scheduler:
    """Per-model ``seq_id`` queues and one worker thread that runs ready jobs in arrival order.

    Args:
        store: :class:`ferrule.serve.store.Store` (results and failures are written there).
        observe: ``observe(job, status, seconds, batch_size)`` called after each job (metrics, logging).
        threads: torch intra-op threads of the worker thread (``torch.set_num_threads`` there, which
            changes no other thread's count); None: the count of the thread that builds the scheduler
            (a fresh thread would otherwise take the count last set by any thread, e.g. the event loop's 1).
        after: ``after(jobs)`` called on the worker after each run (the memory budget's refresh).
        room: bytes one batch of jobs may need together (``Job.mem`` summed; None: unbounded).
    """

    def __init__(self, store: Any, observe: Callable[[Job, str, float, int], None] | None = None,
                 threads: int | None = None, after: Callable[[list[Job]], None] | None = None,
                 room: Callable[[], int | None] | None = None):
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"--worker-threads {threads!r}: expected an int >= 1.")
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.store = store
        self.observe = observe
        self.after, self.room = after, room
        self.threads = threads
        self._cv = threading.Condition()
        self._pending: list[Job] = []
        self._next_seq: dict[str, int] = {}
        self._done: dict[str, threading.Event] = {}
        self._queued: collections.Counter[str] = collections.Counter()   # tenant -> queued + running jobs
        self._served: dict[str, int] = {}                                 # tenant -> tick it was last served
        self._tick = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ferrule-serve-worker", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- submission
    def open_model(self, model_id: str, next_seq: int = 1) -> None:
        """Start a model's queue: its next job must carry ``next_seq``."""
        with self._cv:
            self._next_seq[model_id] = next_seq
            self._cv.notify_all()

    def close_model(self, model_id: str) -> list[Job]:
        """Stop accepting jobs for ``model_id``; returns its queued jobs, now removed (not run)."""
        with self._cv:
            self._next_seq.pop(model_id, None)
            dropped = [j for j in self._pending if j.model_id == model_id]
            self._pending = [j for j in self._pending if j.model_id != model_id]
            for job in dropped:
                self._queued[job.tenant] -= 1
        return dropped

    def expected_seq(self, model_id: str) -> int | None:
        with self._cv:
            return self._next_seq.get(model_id)

    def queued(self, tenant: str) -> int:
        """Jobs of ``tenant`` queued or running now."""
        with self._cv:
            return self._queued[tenant]

    def submit(self, job: Job) -> None:
        with self._cv:
            self._done[job.request_id] = threading.Event()
            self._pending.append(job)
            self._queued[job.tenant] += 1
            self._cv.notify_all()

    def skip(self, model_id: str, seq_id: int) -> None:
        """Consume ``seq_id`` of ``model_id`` without running anything (a refused request)."""
        self.submit(Job(request_id=f"skip-{model_id}-{seq_id}-{time.monotonic_ns()}", op="refused", tenant="",
                        run=lambda: (JSON, b"{}"), model_id=model_id, seq_id=seq_id))

    def event(self, request_id: str) -> threading.Event | None:
        return self._done.get(request_id)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- worker
    def _ready(self) -> list[Job] | None:
        """The next jobs to run: the first ready job of the tenant served least recently (a refused
        request's no-op ``skip`` first of all), with the jobs that may share its batch."""
        best, best_rank = None, None
        for i, job in enumerate(self._pending):
            if job.model_id is None or job.seq_id is None or self._next_seq.get(job.model_id) == job.seq_id:
                rank = -2 if job.op == "refused" else self._served.get(job.tenant, -1)
                if best_rank is None or rank < best_rank:
                    best, best_rank = i, rank
                    if rank == -2:
                        break
        if best is None:
            return None
        job = self._pending.pop(best)
        self._tick += 1
        self._served[job.tenant] = self._tick
        if job.batch_key is None:
            return [job]
        group = [job] + [j for j in self._pending if j.batch_key == job.batch_key][:MAX_BATCH_JOBS - 1]
        room = None if self.room is None else self.room()
        if room is not None:   # batched jobs' memory needs add up: keep the batch within the budget
            need, keep = 0, []
            for j in group:
                if keep and need + j.mem > room:
                    break
                need += j.mem
                keep.append(j)
            group = keep
        self._pending = [j for j in self._pending if j not in group]
        return group

    def _loop(self) -> None:
        set_thread_count(self.threads)
        while True:
            with self._cv:
                jobs = self._ready()
                while jobs is None and not self._stop:
                    self._cv.wait()
                    jobs = self._ready()
                if self._stop:
                    return
            self._execute(jobs)
            with self._cv:
                for job in jobs:
                    self._queued[job.tenant] -= 1
                    if job.model_id is not None and job.seq_id is not None and job.model_id in self._next_seq:
                        self._next_seq[job.model_id] = job.seq_id + 1
                self._cv.notify_all()

    def _execute(self, jobs: list[Job]) -> None:
        start = time.monotonic()
        status = "ok"
        op = jobs[0].op
        try:
            if jobs[0].batch_run is not None:
                results = jobs[0].batch_run(jobs)
            else:
                results = [jobs[0].run()]
            for job, (content_type, body) in zip(jobs, results, strict=True):
                if job.op != "refused":
                    self.store.complete(job.request_id, content_type, body)
        except (UserError, ValueError, TypeError, LookupError, FileNotFoundError) as exc:
            status = "user_error"
            for job in jobs:
                self.store.fail(job.request_id, f"{op}: {exc}", "user")
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged with its traceback
            status = "server_error"
            log.error("%s %s failed:\n%s", op, jobs[0].request_id, traceback.format_exc())
            for job in jobs:
                self.store.fail(job.request_id, f"{op}: internal error {type(exc).__name__}: {exc}", "server")
        finally:
            seconds = time.monotonic() - start
            if self.after is not None:   # before the results are announced: a poller sees the new state
                try:
                    self.after(jobs)
                except Exception:  # noqa: BLE001 - bookkeeping must not stop the worker
                    log.error("after-job hook failed:\n%s", traceback.format_exc())
            for job in jobs:
                ev = self._done.pop(job.request_id, None)
                if ev is not None:
                    ev.set()
                if self.observe is not None and job.op != "refused":
                    self.observe(job, status, seconds, len(jobs))


def json_body(obj: Any) -> tuple[str, bytes]:
    return JSON, json.dumps(obj).encode()
