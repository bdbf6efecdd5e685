"""The FastAPI application: Tinker's HTTP routes (reference/tinker_protocol.md §3-§6).

Every ``/api/v1`` route except ``healthz`` needs an ``X-API-Key`` the server knows (401
otherwise, before anything is read or written); the OpenAI-compatible routes under ``/oai/api/v1``
(:mod:`.routes_openai`) take the same keys as ``Authorization: Bearer``. Compute routes validate the request on arrival
(4xx with a message, nothing queued, the model untouched) and answer ``{"request_id"}``; the
result comes through ``retrieve_future``, which long-polls up to ``long_poll_s`` and then
answers ``try_again``. Sessions, models, futures and checkpoints are rows of
:class:`ferrule.serve.store.Store`; the sessions' resources belong to the API key's tenant,
and another tenant asking for them gets 404.

The routes are FastAPI routers, one module per concern (:mod:`.routes_session`,
:mod:`.routes_train`, :mod:`.routes_sample`, :mod:`.routes_state`); each handler takes the
app's :class:`~ferrule.serve.service.Service` from ``request.app.state``
(:func:`~ferrule.serve.service.service`). The REST client's routes (training runs, checkpoints)
are added by :func:`.routes_rest.add_rest_routes`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .backend import EngineBackend
from .registry import BaseRegistry
from .limits import ServeLimits
from .memory import MemoryBudget
from . import routes_openai, routes_rest, routes_sample, routes_session, routes_state, routes_train, unserved
from .scheduler import Scheduler
from .service import HTTPError, Service
from .store import Store
from .telemetry import Telemetry
from .placement import set_thread_count

__all__ = ["create_app", "HTTPError"]

log = logging.getLogger("ferrule.serve")


def create_app(backend: EngineBackend | BaseRegistry, storage: str | Path, api_keys: dict[str, str], *,
               long_poll_s: float = 30.0, fwdbwd_max_chunk_len: int = 1024,
               limits: ServeLimits | None = None, worker_threads: int | None = None,
               event_loop_threads: int | None = None) -> FastAPI:
    """Build the service for one base (an :class:`EngineBackend`) or several (a
    :class:`BaseRegistry`). ``api_keys`` maps each ``tml-`` key to its tenant name; ``limits``
    bound each request and each tenant's queue (:class:`~ferrule.serve.limits.ServeLimits`);
    ``worker_threads``: torch threads of the worker (None: the calling thread's count; ``ferrule
    serve`` passes ``--worker-threads``); ``event_loop_threads``: the event loop thread's, set when
    the app starts (None: unchanged; ``ferrule serve`` passes 1). Both per thread
    (:mod:`ferrule.serve.placement`); an in-process test server leaves them None, so the worker
    computes with the test's own thread count (bit-identical comparisons with in-test references).

    Raises:
        ValueError: no API keys (the service refuses to run open).
    """
    if not api_keys:
        raise ValueError("no API keys: give --api-keys FILE or set FERRULE_SERVE_API_KEYS=tml-... "
                         "(the service never runs without authentication).")
    storage = Path(storage).absolute()
    bases = backend if isinstance(backend, BaseRegistry) else BaseRegistry([backend])
    store = Store(storage)
    lost = store.fail_unfinished()
    telemetry = Telemetry()
    limits = limits or ServeLimits()
    memory = MemoryBudget(limits.max_memory)

    def _after(jobs) -> None:   # on the worker: what is held now; the jobs' reservations end
        for job in jobs:
            memory.release(job.request_id)
        memory.refresh(bases.backends())

    scheduler = Scheduler(store, observe=telemetry.observe_job, threads=worker_threads, after=_after,
                          room=memory.room)
    memory.refresh(bases.backends())
    app = FastAPI(title="ferrule serve", version="0.38.0-compatible")
    app.state.store, app.state.scheduler, app.state.backend, app.state.telemetry = store, scheduler, bases.default, telemetry
    app.state.bases = bases
    if lost:
        log.warning("%d request(s) were unfinished when the server last stopped; polls for them now fail.", lost)

    if event_loop_threads is not None:
        @app.on_event("startup")
        def _event_loop_threads() -> None:
            # the handlers' own tensor work is small (input checks); torch's count is per thread

            set_thread_count(event_loop_threads)

    @app.on_event("shutdown")
    def _shutdown() -> None:
        scheduler.shutdown()

    # ------------------------------------------------------------------ plumbing
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        if request.url.path.startswith(routes_openai.PREFIX):
            return routes_openai.openai_error(exc.status, exc.message, exc.headers)
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        start = time.monotonic()
        path = request.url.path
        open_paths = ("/api/v1/healthz", "/metrics")
        signed = path.startswith(routes_rest.EXTERNAL_FILES + "/")   # a signed download URL is its own credential
        if (path.startswith("/api/") and path not in open_paths and not signed) or path.startswith("/oai/"):
            key = request.headers.get("x-api-key", "")
            bearer = request.headers.get("authorization", "")
            if not key and bearer[:7].lower() == "bearer ":   # what OpenAI clients send
                key = bearer[7:].strip()
            tenant = api_keys.get(key)
            if tenant is None:
                telemetry.observe_http(request.method, "unauthorized", 401, time.monotonic() - start)
                message = "missing or unknown API key (X-API-Key: tml-..., or Authorization: Bearer tml-...)."
                if path.startswith("/oai/"):
                    return routes_openai.openai_error(401, message)
                return JSONResponse({"detail": message}, status_code=401)
            request.state.tenant = tenant
        response = await call_next(request)
        route = request.scope.get("route")
        telemetry.observe_http(request.method, getattr(route, "path", "unmatched"), response.status_code,
                               time.monotonic() - start)
        return response

    app.state.service = Service(store, scheduler, bases, telemetry, storage, limits, memory)
    app.state.long_poll_s, app.state.fwdbwd_max_chunk_len = long_poll_s, fwdbwd_max_chunk_len
    for router in (routes_session.router, routes_train.router, routes_sample.router, routes_state.router,
                   routes_openai.router):
        app.include_router(router)
    routes_rest.add_rest_routes(app, app.state.service)
    unserved.install(app)   # the SDK's other routes: a message naming each, not a bare 404
    return app
