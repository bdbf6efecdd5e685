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
import json
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from sqlalchemy.exc import IntegrityError
from fastapi.responses import JSONResponse, Response

from .backend import EngineBackend, SampleSpec
from .paths import CheckpointPath, PathError, check_name, parse_tinker_path
from .scheduler import JSON, Job, Scheduler, json_body
from .store import Store
from .telemetry import Telemetry
from .wire import WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response

__all__ = ["create_app", "HTTPError"]

log = logging.getLogger("ferrule.serve")


class HTTPError(Exception):
    """An error answered as ``{"detail": message}`` with ``status`` (never an empty body: the SDK
    would retry a bare 400 as a proxy rejection)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def create_app(backend: EngineBackend, storage: str | Path, api_keys: dict[str, str], *,
               long_poll_s: float = 30.0, fwdbwd_max_chunk_len: int = 1024) -> FastAPI:
    """Build the service. ``api_keys`` maps each ``tml-`` key to its tenant name.

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
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

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

    async def body_json(request: Request) -> dict:
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise HTTPError(400, f"request body is not JSON ({exc}).") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object.")
        return data

    def need(body: dict, key: str, typ: type | tuple = str) -> Any:
        if key not in body or not isinstance(body[key], typ) or isinstance(body[key], bool) and typ is int:
            raise HTTPError(400, f"field {key!r} is missing or not a {getattr(typ, '__name__', typ)}.")
        return body[key]

    def own_session(request: Request, session_id: str) -> dict:
        row = store.session(session_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"session {session_id!r} does not exist for this API key; create a session first.")
        return row

    def own_model(request: Request, model_id: str) -> dict:
        row = store.model(model_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"model {model_id!r} does not exist for this API key.")
        if scheduler.expected_seq(model_id) is None:
            raise HTTPError(410, f"model {model_id!r} is gone from this server process (created before a restart or "
                                 "its session finished); create a training client from a saved state.")
        return row

    def own_checkpoint(request: Request, uri: str, kind: str) -> tuple[CheckpointPath, Path]:
        try:
            cp = parse_tinker_path(uri)
            directory = cp.directory(storage)
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        row = store.checkpoint(cp.uri)
        if row is None or row["tenant"] != request.state.tenant or not directory.is_dir():
            raise HTTPError(404, f"checkpoint {uri!r} does not exist for this API key.")
        if cp.kind != kind:
            raise HTTPError(400, f"checkpoint {uri!r} is a {cp.kind} checkpoint; this call needs {kind} "
                                 f"({'save_state' if kind == 'weights' else 'save_weights_for_sampler'} makes those).")
        return cp, directory

    def dedupe(request: Request, model_id: str | None, seq_id: int | None) -> JSONResponse | None:
        """The first request's id for a retry (same idempotency key, or same model + seq_id)."""
        key = request.headers.get("x-idempotency-key")
        row = store.future_by_key(request.state.tenant, key) if key else None
        if row is None and model_id is not None and seq_id is not None:
            row = store.future_by_seq(model_id, seq_id)
        if row is not None:
            telemetry.deduplicated.inc()
            return JSONResponse({"request_id": row["request_id"], "model_id": row["model_id"]})
        return None

    def check_seq(model_id: str, seq_id: int) -> None:
        expected = scheduler.expected_seq(model_id)
        if expected is not None and seq_id < expected:
            raise HTTPError(400, f"seq_id {seq_id} of model {model_id!r} was already used (next is {expected}); "
                                 "seq_ids increase by one per training-client request.")

    def enqueue(request: Request, op: str, run, model_id: str | None = None, seq_id: int | None = None,
                num_data: int = 0, num_tokens: int = 0, extra: dict | None = None) -> JSONResponse:
        rid = f"req-{uuid.uuid4().hex}"
        try:
            store.add_future(rid, request.state.tenant, op, model_id, seq_id, request.headers.get("x-idempotency-key"))
        except IntegrityError:  # a concurrent retry of the same (model_id, seq_id) won the race
            hit = dedupe(request, model_id, seq_id)
            if hit is None:
                raise
            return hit
        scheduler.submit(Job(rid, op, request.state.tenant, run, model_id, seq_id, num_data, num_tokens))
        return JSONResponse({"request_id": rid, **({"model_id": model_id} if model_id else {}), **(extra or {})})

    def refuse(model_id: str, seq_id: int, status: int, message: str) -> HTTPError:
        scheduler.skip(model_id, seq_id)
        telemetry.refused.inc()
        return HTTPError(status, message)

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
        return {}

    # ------------------------------------------------------------------ training clients
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await body_json(request)
        session_id, mseq = need(body, "session_id"), need(body, "model_seq_id", int)
        own_session(request, session_id)
        if body.get("base_model") != backend.model_name:
            raise HTTPError(400, f"base_model {body.get('base_model')!r} is not served here; this server serves "
                                 f"{backend.model_name!r}.")
        lora = body.get("lora_config") or {}
        rank = lora.get("rank")
        if rank is not None and (not isinstance(rank, int) or rank < 1):
            raise HTTPError(400, f"lora_config.rank = {rank!r}; expected an int >= 1.")
        model_id = f"{session_id}:train:{mseq}"
        if (hit := dedupe(request, model_id, 0)) is not None:
            return hit
        store.add_model(model_id, session_id, request.state.tenant, backend.model_name, rank)
        scheduler.open_model(model_id, next_seq=0)

        def run():
            backend.create(model_id, rank)
            return json_body({"model_id": model_id, "type": "create_model"})
        return enqueue(request, "create_model", run, model_id, 0)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await body_json(request)
        row = own_model(request, need(body, "model_id"))
        return {"model_id": row["model_id"], "type": "get_info", "model_name": backend.model_name,
                "model_data": {"arch": backend.hf_config.get("model_type"), "model_name": backend.model_name,
                               "tokenizer_id": backend.model_name},
                "is_lora": False, "lora_rank": row["lora_rank"]}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = await request.body()
        try:
            req = decode_forward_backward(raw, request.headers.get("content-encoding"))
        except WireError as exc:
            raise HTTPError(400, str(exc)) from None
        own_model(request, req.model_id)
        if (hit := dedupe(request, req.model_id, req.seq_id)) is not None:
            return hit
        check_seq(req.model_id, req.seq_id)
        op = "forward" if req.forward_only else "forward_backward"
        try:
            if not req.loss_fn:
                raise ValueError("loss_fn is empty; name a loss (cross_entropy, importance_sampling, ppo, cispo, dro).")
            if req.model_id in backend.engines:
                backend.check_forward_backward(req.model_id, req.data, req.loss_fn, req.loss_fn_config,
                                               req.forward_only)
        except (ValueError, TypeError) as exc:
            raise refuse(req.model_id, req.seq_id, 400, f"{op}: {exc}") from None

        def run():
            out = backend.forward_backward(req.model_id, req.data, req.loss_fn, req.loss_fn_config, req.forward_only)
            return "application/x-protobuf", encode_forward_backward_output(out.loss_fn_outputs, out.metrics,
                                                                            out.loss_fn_output_type)
        return enqueue(request, op, run, req.model_id, req.seq_id, len(req.data), req.num_tokens)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        from ferrule.megatron.optim import _check_adam_params

        body = await body_json(request)
        model_id, seq_id = need(body, "model_id"), need(body, "seq_id", int)
        own_model(request, model_id)
        if (hit := dedupe(request, model_id, seq_id)) is not None:
            return hit
        check_seq(model_id, seq_id)
        adam = dict(body.get("adam_params") or {})
        try:
            if body.get("optimizer_params"):
                raise ValueError("only Adam (adam_params) is supported; optimizer_params (e.g. dimuon) is not.")
            _check_adam_params(adam)
        except ValueError as exc:
            raise refuse(model_id, seq_id, 400, f"optim_step: {exc}") from None

        def run():
            res = backend.optim_step(model_id, adam)
            metrics = {"grad_norm:mean": res["grad_norm"], "learning_rate:mean": res["learning_rate"],
                       "step:max": float(res["step"]), "skipped:sum": 0.0 if res["success"] else 1.0}
            return json_body({"metrics": metrics, "type": "optim_step"})
        return enqueue(request, "optim_step", run, model_id, seq_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await body_json(request)
        model_id, seq_id = need(body, "model_id"), need(body, "seq_id", int)
        own_model(request, model_id)
        if (hit := dedupe(request, model_id, seq_id)) is not None:
            return hit
        check_seq(model_id, seq_id)
        try:
            cp = CheckpointPath(model_id, "weights", check_name(need(body, "path")))
            directory = cp.directory(storage)
        except (PathError, HTTPError) as exc:
            raise refuse(model_id, seq_id, 400, f"save_weights: {exc}") from None
        overwrite = bool(body.get("overwrite", False))

        def run():
            if directory.exists() and not overwrite:
                raise ValueError(f"{cp.uri} exists; pass overwrite=True or another name.")
            size = backend.save_state(model_id, directory)
            store.add_checkpoint(cp.uri, request.state.tenant, model_id, cp.kind, cp.name, size)
            return json_body({"path": cp.uri, "type": "save_weights"})
        return enqueue(request, "save_state", run, model_id, seq_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        body = await body_json(request)
        model_id, seq_id = need(body, "model_id"), need(body, "seq_id", int)
        row = own_model(request, model_id)
        if (hit := dedupe(request, model_id, seq_id)) is not None:
            return hit
        check_seq(model_id, seq_id)
        sseq = body.get("sampling_session_seq_id")
        named = body.get("path") is not None
        try:
            if not named and not isinstance(sseq, int):
                raise PathError("give a path (a checkpoint name) or a sampling_session_seq_id.")
            cp = CheckpointPath(model_id, "sampler_weights", check_name(body["path"])) if named else None
            directory = cp.directory(storage) if named else None
        except PathError as exc:
            raise refuse(model_id, seq_id, 400, f"save_weights_for_sampler: {exc}") from None
        tenant = request.state.tenant

        def run():
            out: dict = {"type": "save_weights_for_sampler"}
            if named:  # a checkpoint on disk, addressable by its tinker:// path
                size = backend.save_sampler_weights(model_id, directory)
                store.add_checkpoint(cp.uri, tenant, model_id, cp.kind, cp.name, size)
                out["path"] = source = cp.uri
            else:      # Tinker's ephemeral sampler weights: an in-memory snapshot
                source = backend.snapshot(model_id)
            if isinstance(sseq, int):
                sid = f"{row['session_id']}:sample:{sseq}"
                store.add_sampling_session(sid, tenant, row["session_id"], source, backend.model_name)
                out["sampling_session_id"] = sid
            return json_body(out)
        return enqueue(request, "save_weights_for_sampler", run, model_id, seq_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = await body_json(request)
        optimizer = bool(body.get("optimizer", False))
        if "model_id" in body:  # legacy load_state on an existing client
            model_id, seq_id = need(body, "model_id"), need(body, "seq_id", int)
            row = own_model(request, model_id)
            if (hit := dedupe(request, model_id, seq_id)) is not None:
                return hit
            check_seq(model_id, seq_id)
            try:
                cp, directory = own_checkpoint(request, need(body, "path"), "weights")
            except HTTPError as exc:
                raise refuse(model_id, seq_id, exc.status, f"load_weights: {exc.message}") from None
        else:  # create-via-load: the SDK derives model_id = session:train:model_seq_id itself
            session_id, mseq = need(body, "session_id"), need(body, "model_seq_id", int)
            own_session(request, session_id)
            model_id, seq_id = f"{session_id}:train:{mseq}", 0
            if (hit := dedupe(request, model_id, 0)) is not None:
                return hit
            cp, directory = own_checkpoint(request, need(body, "path"), "weights")
            store.add_model(model_id, session_id, request.state.tenant, backend.model_name, None)
            scheduler.open_model(model_id, next_seq=0)

        def run():
            backend.load_state(model_id, directory, optimizer)
            return json_body({"path": cp.uri, "model_id": model_id, "type": "load_weights"})
        return enqueue(request, "load_state", run, model_id, seq_id)

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
        row = store.sampling_session(sid)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"sampling session {sid!r} does not exist for this API key.")
        source: Path | str | None = None
        if row["model_path"] is not None and row["model_path"].startswith("ephemeral:"):
            source = row["model_path"]
        elif row["model_path"] is not None:
            _, source = own_checkpoint(request, row["model_path"], "sampler_weights")
        n = body.get("num_samples", 1)
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
        except (ValueError, TypeError) as exc:
            raise HTTPError(400, f"asample: {exc}") from None
        unsupported = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                                   "target_prompt_logprobs", "record_stability_info") if body.get(k)]
        if unsupported:
            raise HTTPError(400, f"asample: {', '.join(unsupported)} not supported by ferrule serve; leave unset.")
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and (not isinstance(last_n, int) or not 1 <= last_n <= len(tokens) - 1):
            raise HTTPError(400, f"asample: prompt_logprobs_last_n = {last_n!r}; expected 1..{len(tokens) - 1}.")
        spec = SampleSpec(tokens, n, params, bool(body.get("prompt_logprobs", False)))

        def run():
            seqs, prompt_lp = backend.sample(source, spec)
            if prompt_lp is not None and last_n is not None:
                prompt_lp = [math.nan] * (len(prompt_lp) - last_n) + prompt_lp[-last_n:]
            return "application/x-protobuf", encode_sample_response(seqs, prompt_lp)
        rid_seq = [f"{sid}:{body.get('seq_id', 0)}:{i}" for i in range(n)]
        return enqueue(request, "sample", run, num_data=n, num_tokens=len(tokens),
                       extra={"sample_sequence_ids": rid_seq})

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
            ev = scheduler.event(rid)
            if ev is not None:
                await asyncio.to_thread(ev.wait, min(1.0, max(0.0, deadline - time.monotonic())))
            else:
                await asyncio.sleep(0.01)
            row = store.future(rid)
        if row["status"] == "done":
            return Response(row["result"], media_type=row["content_type"] or JSON)
        if row["status"] == "failed":
            return JSONResponse({"error": row["error"], "category": row["category"] or "server"})
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})

    # ------------------------------------------------------------------ checkpoint listing
    def checkpoint_json(row: dict) -> dict:
        return {"checkpoint_id": f"{row['kind']}/{row['name']}", "tinker_path": row["path"],
                "checkpoint_type": "training" if row["kind"] == "weights" else "sampler",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row["created"])),
                "size_bytes": row["size_bytes"], "public": False}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request):
        row = store.model(model_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"training run {model_id!r} does not exist for this API key.")
        return {"checkpoints": [checkpoint_json(r) for r in store.checkpoints(request.state.tenant, model_id)]}

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request):
        return {"checkpoints": [checkpoint_json(r) for r in store.checkpoints(request.state.tenant)]}

    return app
