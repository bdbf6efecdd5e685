"""Shared request plumbing of the service's routes: JSON bodies, tenancy checks, retries,
``seq_id`` bookkeeping and the hand-off of a job to the scheduler (:class:`Service`)."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import IntegrityError

from .backend import EngineBackend
from .registry import BaseRegistry
from .limits import ServeLimits
from .memory import MemoryBudget
from .paths import CheckpointPath, PathError, parse_tinker_path
from .scheduler import Job, Scheduler
from .store import Store
from .telemetry import Telemetry

__all__ = ["HTTPError", "Service"]


class HTTPError(Exception):
    """An error answered as ``{"detail": message}`` with ``status`` (never an empty body: the SDK
    would retry a bare 400 as a proxy rejection)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


@dataclass
class Service:
    """What every route needs: the store, the scheduler, the served bases (:class:`BaseRegistry`),
    metrics, the storage root.

    The ``own_*`` checks answer 404 for rows of another tenant (as for rows that do not exist),
    so one tenant learns nothing about another's sessions, models or checkpoints."""

    store: Store
    scheduler: Scheduler
    bases: BaseRegistry
    telemetry: Telemetry
    storage: Path
    limits: ServeLimits = field(default_factory=ServeLimits)
    memory: MemoryBudget = field(default_factory=MemoryBudget)

    @property
    def backend(self) -> EngineBackend:
        """The default (first) base's backend."""
        return self.bases.default

    def base(self, name: Any) -> EngineBackend:
        """The backend of base model ``name``.

        Raises:
            HTTPError: 400 naming the served bases when ``name`` is not one.
        """
        try:
            return self.bases.get(name)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    def base_of_model(self, model_id: str) -> EngineBackend:
        """The backend of training client ``model_id``'s base (its row in the store)."""
        row = self.store.model(model_id)
        return self.base(None if row is None else row["base_model"])

    @staticmethod
    async def body_json(request: Request) -> dict:
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise HTTPError(400, f"request body is not JSON ({exc}).") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object.")
        return data

    @staticmethod
    def need(body: dict, key: str, typ: type | tuple = str) -> Any:
        if key not in body or not isinstance(body[key], typ) or isinstance(body[key], bool) and typ is int:
            raise HTTPError(400, f"field {key!r} is missing or not a {getattr(typ, '__name__', typ)}.")
        return body[key]

    def own_session(self, request: Request, session_id: str) -> dict:
        row = self.store.session(session_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"session {session_id!r} does not exist for this API key; create a session first.")
        return row

    def own_model(self, request: Request, model_id: str) -> dict:
        row = self.store.model(model_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"model {model_id!r} does not exist for this API key.")
        if self.scheduler.expected_seq(model_id) is None:
            raise HTTPError(410, f"model {model_id!r} is gone from this server process (created before a restart or "
                                 "its session finished); create a training client from a saved state.")
        return row

    def sweep_expired(self) -> int:
        """Delete checkpoints whose ``ttl_seconds`` ran out (files, then records); returns how many."""
        expired = self.store.expired_checkpoints(time.time())
        for uri in expired:
            try:
                directory = parse_tinker_path(uri).directory(self.storage)
            except PathError:
                directory = None
            self.delete_checkpoint(uri, directory)
        return len(expired)

    def delete_checkpoint(self, uri: str, directory: Path | None) -> None:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self.store.delete_checkpoint(uri)

    @staticmethod
    def checkpoint_extras(body: dict) -> tuple[float | None, dict | None]:
        """``(expires_at, user_metadata)`` of a save request (``ttl_seconds``: int >= 1 or None;
        ``user_metadata``: a str -> str mapping or None).

        Raises:
            HTTPError: 400 for another type or value.
        """
        ttl, meta = body.get("ttl_seconds"), body.get("user_metadata")
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1):
            raise HTTPError(400, f"ttl_seconds = {ttl!r}; expected an int >= 1 (seconds) or null (never expires).")
        if meta is not None and (not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                                        for k, v in meta.items())):
            raise HTTPError(400, "user_metadata must be a mapping of strings to strings.")
        return (None if ttl is None else time.time() + ttl), meta

    def own_checkpoint(self, request: Request, uri: str, kind: str) -> tuple[CheckpointPath, Path]:
        self.sweep_expired()
        try:
            cp = parse_tinker_path(uri)
            directory = cp.directory(self.storage)
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        row = self.store.checkpoint(cp.uri)
        if row is None or row["tenant"] != request.state.tenant or not directory.is_dir():
            raise HTTPError(404, f"checkpoint {uri!r} does not exist for this API key.")
        if cp.kind != kind:
            raise HTTPError(400, f"checkpoint {uri!r} is a {cp.kind} checkpoint; this call needs {kind} "
                                 f"({'save_state' if kind == 'weights' else 'save_weights_for_sampler'} makes those).")
        return cp, directory

    def dedupe(self, request: Request, model_id: str | None, seq_id: int | None) -> JSONResponse | None:
        """The first request's id for a retry (same idempotency key, or same model + seq_id)."""
        key = request.headers.get("x-idempotency-key")
        row = self.store.future_by_key(request.state.tenant, key) if key else None
        if row is None and model_id is not None and seq_id is not None:
            row = self.store.future_by_seq(model_id, seq_id)
        if row is not None:
            self.telemetry.deduplicated.inc()
            return JSONResponse({"request_id": row["request_id"], "model_id": row["model_id"]})
        return None

    def admit(self, request: Request, model_id: str, seq_id: int) -> tuple[dict, JSONResponse | None]:
        """The prelude of every request in a model's ``seq_id`` sequence, in its required order:
        the caller owns the model (404 otherwise), a retry gets the first request's answer
        (:meth:`dedupe`), and only a new request has its ``seq_id`` checked (:meth:`check_seq`).

        Returns:
            ``(model row, retry answer or None)``.
        """
        row = self.own_model(request, model_id)
        hit = self.dedupe(request, model_id, seq_id)
        if hit is None:
            self.check_seq(model_id, seq_id)
        return row, hit

    def check_seq(self, model_id: str, seq_id: int) -> None:
        expected = self.scheduler.expected_seq(model_id)
        if expected is not None and seq_id < expected:
            raise HTTPError(400, f"seq_id {seq_id} of model {model_id!r} was already used (next is {expected}); "
                                 "seq_ids increase by one per training-client request.")

    def over_memory(self, what: str, need: int, detail: str) -> str | None:
        """The ``--max-memory`` refusal for a request needing ``need`` bytes, or None when it fits
        (:meth:`ferrule.serve.memory.MemoryBudget.check`)."""
        message = self.memory.check(what, need, detail)
        if message is not None:
            self.telemetry.refused.inc()
        return message

    def enqueue(self, request: Request, op: str, run, model_id: str | None = None, seq_id: int | None = None,
                num_data: int = 0, num_tokens: int = 0, extra: dict | None = None,
                batch: tuple | None = None, base: str | None = None, mem: int = 0,
                grow: int = 0) -> JSONResponse:
        """Record the future and queue the job; ``batch`` = ``(batch_key, batch_run, payload)``;
        ``base``: the base model it runs on, for the op log (default: the training client's base);
        ``mem``: bytes it needs while it runs; ``grow``: bytes it will keep, reserved against
        ``--max-memory`` until it has run (:mod:`ferrule.serve.memory`).

        Raises:
            HTTPError: 429 when the tenant has ``limits.max_queued_per_tenant`` requests queued or
                running (the ``seq_id`` is not consumed: the SDK retries the same request).
        """
        queued = self.scheduler.queued(request.state.tenant)
        if queued >= self.limits.max_queued_per_tenant:
            self.telemetry.refused.inc()
            raise HTTPError(429, f"{op}: this API key's tenant has {queued} requests queued or running, the server's "
                                 f"limit max_queued_per_tenant = {self.limits.max_queued_per_tenant}; wait for results "
                                 f"before sending more (the SDK retries this request), or start the server with a "
                                 f"larger --max-queued-per-tenant.", {"Retry-After": "1"})
        rid = f"req-{uuid.uuid4().hex}"
        try:
            self.store.add_future(rid, request.state.tenant, op, model_id, seq_id, request.headers.get("x-idempotency-key"))
        except IntegrityError:  # a concurrent retry of the same (model_id, seq_id) won the race
            hit = self.dedupe(request, model_id, seq_id)
            if hit is None:
                raise
            return hit
        key, batch_run, payload = batch or (None, None, None)
        if base is None and model_id is not None:
            row = self.store.model(model_id)
            base = None if row is None else row["base_model"]
        self.memory.reserve(rid, grow)
        self.scheduler.submit(Job(rid, op, request.state.tenant, run, model_id, seq_id, num_data, num_tokens,
                                  batch_key=key, batch_run=batch_run, payload=payload, base=base, mem=mem))
        return JSONResponse({"request_id": rid, **({"model_id": model_id} if model_id else {}), **(extra or {})})

    async def run_and_wait(self, request: Request, op: str, run, num_data: int = 0,
                           num_tokens: int = 0, base: str | None = None, mem: int = 0) -> tuple[str, bytes]:
        """Queue ``run`` as a job of the request's tenant (:meth:`enqueue`: its future, fairness, the
        per-tenant limit) and wait for its result without blocking the event loop: for routes that
        answer in the same HTTP response (the OpenAI-compatible ones).

        Returns:
            ``(content_type, body)`` of ``run``.

        Raises:
            HTTPError: 429 (the tenant's queue is full), 400 (the job failed for a reason the client
                controls: a user error), 500 (any other failure).
        """
        import asyncio

        answer = self.enqueue(request, op, run, num_data=num_data, num_tokens=num_tokens, base=base, mem=mem)
        rid = json.loads(answer.body)["request_id"]
        while (ev := self.scheduler.event(rid)) is not None and not ev.is_set():
            await asyncio.sleep(0.01)
        row = self.store.future(rid)
        while row["status"] == "pending":   # the event fires after the row is written; a short grace
            await asyncio.sleep(0.01)
            row = self.store.future(rid)
        if row["status"] == "failed":
            raise HTTPError(400 if row["category"] == "user" else 500, row["error"])
        return row["content_type"], row["result"]

    def refuse(self, model_id: str, seq_id: int, status: int, message: str) -> HTTPError:
        self.scheduler.skip(model_id, seq_id)
        self.telemetry.refused.inc()
        return HTTPError(status, message)


def service(request: Request) -> Service:
    """The :class:`Service` of the app serving ``request`` (set by :func:`ferrule.serve.app.create_app`)."""
    return request.app.state.service
