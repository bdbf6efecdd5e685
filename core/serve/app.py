"""The FastAPI application: Tinker's HTTP routes (reference/tinker_protocol.md §3-§6).

Every ``/api/v1`` route except ``healthz`` needs an ``X-API-Key`` the server knows (401
otherwise, before anything is read or written). Compute routes validate the request on arrival
(4xx with a message, nothing queued, the model untouched) and answer ``{"request_id"}``; the
result comes through ``retrieve_future``, which long-polls up to ``long_poll_s`` and then
answers ``try_again``. Sessions, models, futures and checkpoints are rows of
:class:`ferrule.serve.store.Store`; the sessions' resources belong to the API key's tenant,
and another tenant asking for them gets 404.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .backend import EngineBackend, SampleSpec, SavedWeights
from .limits import ServeLimits
from .logprobs import parse_extras
from .routes_rest import add_rest_routes
from .routes_train import add_training_routes
from .scheduler import JSON, Job, Scheduler
from .service import HTTPError, Service
from .store import Store
from .telemetry import Telemetry
from .wire import encode_sample_response

__all__ = ["create_app", "HTTPError"]

log = logging.getLogger("ferrule.serve")


def create_app(backend: EngineBackend, storage: str | Path, api_keys: dict[str, str], *,
               long_poll_s: float = 30.0, fwdbwd_max_chunk_len: int = 1024,
               limits: ServeLimits | None = None) -> FastAPI:
    """Build the service. ``api_keys`` maps each ``tml-`` key to its tenant name; ``limits``
    bound each request and each tenant's queue (:class:`~ferrule.serve.limits.ServeLimits`).

    Raises:
        ValueError: no API keys (the service refuses to run open).
    """
    if not api_keys:
        raise ValueError("no API keys: give --api-keys FILE or set FERRULE_SERVE_API_KEYS=tml-... "
                         "(the service never runs without authentication).")
    storage = Path(storage).absolute()
    store = Store(storage)
    lost = store.fail_unfinished()
    telemetry = Telemetry()
    scheduler = Scheduler(store, observe=telemetry.observe_job)
    app = FastAPI(title="ferrule serve", version="0.38.0-compatible")
    app.state.store, app.state.scheduler, app.state.backend, app.state.telemetry = store, scheduler, backend, telemetry
    if lost:
        log.warning("%d request(s) were unfinished when the server last stopped; polls for them now fail.", lost)

    @app.on_event("shutdown")
    def _shutdown() -> None:
        scheduler.shutdown()

    # ------------------------------------------------------------------ plumbing
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        start = time.monotonic()
        path = request.url.path
        open_paths = ("/api/v1/healthz", "/metrics")
        if path.startswith("/api/") and path not in open_paths:
            tenant = api_keys.get(request.headers.get("x-api-key", ""))
            if tenant is None:
                telemetry.observe_http(request.method, "unauthorized", 401, time.monotonic() - start)
                return JSONResponse({"detail": "missing or unknown API key (X-API-Key: tml-...)."}, status_code=401)
            request.state.tenant = tenant
        response = await call_next(request)
        route = request.scope.get("route")
        telemetry.observe_http(request.method, getattr(route, "path", "unmatched"), response.status_code,
                               time.monotonic() - start)
        return response

    limits = limits or ServeLimits()
    svc = Service(store, scheduler, backend, telemetry, storage, limits)
    add_training_routes(app, svc)
    add_rest_routes(app, svc)
    body_json, need, own_session, own_checkpoint, enqueue = (svc.body_json, svc.need, svc.own_session,
                                                             svc.own_checkpoint, svc.enqueue)

    # ------------------------------------------------------------------ bootstrap and sessions
    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(telemetry.render(), media_type=telemetry.content_type)

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_len": fwdbwd_max_chunk_len, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        return {"supported_models": [{"model_name": backend.model_name, "max_context_length": backend.max_positions,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        body = await body_json(request)
        sid = f"sess-{uuid.uuid4().hex[:16]}"
        store.add_session(sid, request.state.tenant, list(body.get("tags") or []))
        return {"session_id": sid, "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await body_json(request)
        row = store.session(str(body.get("session_id")))
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(410, "unknown session; heartbeats stop.")
        store.heartbeat(row["session_id"])
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def sdk_telemetry(request: Request):
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        own_session(request, session_id)
        body = await body_json(request)
        store.finish_session(session_id, str((body.get("reason") or {}).get("type", "unknown")))
        for model_id in store.session_models(session_id):  # free the session's engines
            for job in scheduler.close_model(model_id):
                store.fail(job.request_id, f"{job.op}: the session finished before this request ran.", "user")
            scheduler.submit(Job(f"drop-{uuid.uuid4().hex}", "drop_model", request.state.tenant,
                                 lambda mid=model_id: (backend.drop(mid), (JSON, b"{}"))[1], model_id=None))
        return {}

    # ------------------------------------------------------------------ sampling
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await body_json(request)
        session_id, sseq = need(body, "session_id"), need(body, "sampling_session_seq_id", int)
        own_session(request, session_id)
        path = body.get("model_path")
        if path is not None:
            own_checkpoint(request, path, "sampler_weights")
        elif body.get("base_model") != backend.model_name:
            raise HTTPError(400, f"base_model {body.get('base_model')!r} is not served here; this server serves "
                                 f"{backend.model_name!r}.")
        sid = f"{session_id}:sample:{sseq}"
        store.add_sampling_session(sid, request.state.tenant, session_id, path, backend.model_name)
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        row = store.sampling_session(sampler_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"sampler {sampler_id!r} does not exist for this API key.")
        path = row["model_path"] if row["model_path"] and row["model_path"].startswith("tinker://") else None
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = await body_json(request)
        sid = need(body, "sampling_session_id")
        n = body.get("num_samples", 1)
        if isinstance(n, int) and (over := limits.over("max_samples_per_request", n, "num_samples")):
            raise HTTPError(400, f"asample: {over}")   # before anything is sized by n
        rid_seq = [f"{sid}:{body.get('seq_id', 0)}:{i}" for i in range(n if isinstance(n, int) else 0)]
        key = request.headers.get("x-idempotency-key")
        prev = store.future_by_key(request.state.tenant, key) if key else None
        if prev is not None:  # a retry with the same idempotency key: the first request's id
            telemetry.deduplicated.inc()
            return JSONResponse({"request_id": prev["request_id"], "sample_sequence_ids": rid_seq})
        row = store.sampling_session(sid)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"sampling session {sid!r} does not exist for this API key.")
        source: SavedWeights | str | None = None
        if row["model_path"] is not None and row["model_path"].startswith("ephemeral:"):
            source = row["model_path"]
        elif row["model_path"] is not None:  # pinned to the save the checkpoint holds now
            source = backend.saved_weights(own_checkpoint(request, row["model_path"], "sampler_weights")[1])
        try:
            tokens: list[int] = []
            for chunk in (body.get("prompt") or {}).get("chunks") or []:
                if chunk.get("type", "encoded_text") != "encoded_text":
                    raise ValueError(f"prompt chunk type {chunk.get('type')!r} is not served (encoded_text only).")
                tokens += [int(t) for t in chunk.get("tokens") or []]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"num_samples = {n!r}; expected an int >= 1.")
            backend.check_prompt(tokens)
            params = backend.sampling_params(body.get("sampling_params") or {}, len(tokens), n)
            over = limits.over(
                "max_tokens_per_request", n * (len(tokens) + params.max_new_tokens),
                "num_samples * (prompt tokens + max_tokens)")
            if over:
                raise ValueError(over)
        except (ValueError, TypeError) as exc:
            raise HTTPError(400, f"asample: {exc}") from None
        if body.get("record_stability_info"):
            raise HTTPError(400, "asample: record_stability_info is not supported by ferrule serve (stable_reinforce "
                                 "is not offered); leave it unset.")
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and (not isinstance(last_n, int) or not 1 <= last_n <= len(tokens) - 1):
            raise HTTPError(400, f"asample: prompt_logprobs_last_n = {last_n!r}; expected 1..{len(tokens) - 1}.")
        try:
            extras = parse_extras(body, len(tokens), backend.vocab_size, last_n)
        except (ValueError, TypeError) as exc:
            raise HTTPError(400, f"asample: {exc}") from None
        spec = SampleSpec(tokens, n, params, bool(body.get("prompt_logprobs", False)), extras)

        def encode(seqs, prompt_lp, extras_out, last_n, extras):
            if prompt_lp is not None and last_n is not None:
                prompt_lp = [math.nan] * (len(prompt_lp) - last_n) + prompt_lp[-last_n:]
            return "application/x-protobuf", encode_sample_response(seqs, prompt_lp, extras, extras_out)

        def run_batch(jobs):
            results = backend.sample(source, [j.payload[0] for j in jobs])
            return [encode(*res, j.payload[1], j.payload[0].extras) for j, res in zip(jobs, results)]

        def run():
            (res,) = backend.sample(source, [spec])
            return encode(*res, last_n, extras)
        # unseeded requests with the same weights and parameters may share one generate call
        key = None if params.seed is not None else f"sample|{source}|{params!r}"
        return enqueue(request, "sample", run, num_data=n, num_tokens=len(tokens),
                       extra={"sample_sequence_ids": rid_seq}, batch=(key, run_batch, (spec, last_n)))

    # ------------------------------------------------------------------ futures
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await body_json(request)
        rid = need(body, "request_id")
        row = store.future(rid)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"future {rid!r} does not exist for this API key.")
        deadline = time.monotonic() + long_poll_s
        while row["status"] == "pending" and time.monotonic() < deadline:
            ev = scheduler.event(rid)   # long poll: a 10 ms tick on the event, the row re-read when it fires
            while ev is not None and not ev.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if ev is None:
                await asyncio.sleep(0.01)
            row = store.future(rid)
        if row["status"] == "done":
            return Response(row["result"], media_type=row["content_type"] or JSON)
        if row["status"] == "failed":
            return JSONResponse({"error": row["error"], "category": row["category"] or "server"})
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})

    return app
