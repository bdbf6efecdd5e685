"""Bootstrap and session routes: health, metrics, the SDK's client config and server capabilities,
create_session, heartbeats, SDK telemetry, finishing a session (reference/tinker_protocol.md §3-§4)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .scheduler import JSON, Job, json_body
from .service import HTTPError, service

__all__ = ["cuda_memory", "router"]

router = APIRouter()


@router.get("/api/v1/healthz")
async def healthz(request: Request):
    """``{"status": "ok", "samplers": {base name: {"device", "dtype", "loaded", ...}}, "memory": {"max_memory",
    "held", "reserved", "left"}, "cuda_memory": {"device", "allocated", "max_allocated", "reserved"} | None}``:
    where each base's sampler runs (:meth:`EngineBackend.sampler_info`), the ``--max-memory`` accounting in bytes
    (:mod:`ferrule.serve.memory`; None: no budget) and the process's CUDA memory (:func:`cuda_memory`); open, no
    key needed."""
    svc = service(request)
    return {"status": "ok", "samplers": {name: svc.bases.get(name).sampler_info() for name in svc.bases.names},
            "memory": svc.memory.as_json(), "cuda_memory": cuda_memory()}


def cuda_memory() -> dict | None:
    """The process's memory on its current CUDA device, in bytes, as torch's caching allocator counts it:
    ``{"device": name, "allocated", "max_allocated" (the peak since start or the last
    ``torch.cuda.reset_peak_memory_stats``), "reserved" (held by the allocator, allocated or not)}``;
    None where CUDA was never initialised in this process (a CPU machine)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return {"device": torch.cuda.get_device_name(), "allocated": torch.cuda.memory_allocated(),
            "max_allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved()}


@router.get("/metrics")
async def metrics(request: Request):
    svc = service(request)
    return Response(svc.telemetry.render(), media_type=svc.telemetry.content_type)


@router.post("/api/v1/client/config")
async def client_config(request: Request):
    return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": request.app.state.fwdbwd_max_chunk_len, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/api/v1/client/dynamic_config")
async def dynamic_config(request: Request):
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.get("/api/v1/get_server_capabilities")
async def capabilities(request: Request):
    svc = service(request)
    # "sampler" (device, dtype) is ferrule's own field: the SDK's SupportedModel ignores extra fields
    return {"supported_models": [{"model_name": name, "max_context_length": svc.bases.get(name).max_positions,
                                  "trainable": True, "sampleable": True, "sampler": svc.bases.get(name).sampler_info()}
                                 for name in svc.bases.names]}


@router.post("/api/v1/create_session")
async def create_session(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    sid = f"sess-{uuid.uuid4().hex[:16]}"
    svc.store.add_session(sid, request.state.tenant, list(body.get("tags") or []))
    return {"session_id": sid, "type": "create_session"}


@router.get("/api/v1/sessions")
async def list_sessions(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned"):
    """``RestClient.list_sessions``: the ids of the key's tenant's sessions, oldest first (``access_scope``
    is accepted; a tenant owns exactly what it can access here)."""
    svc = service(request)
    if limit < 0 or offset < 0:
        raise HTTPError(400, f"limit = {limit}, offset = {offset}; both must be >= 0.")
    rows = svc.store.sessions(request.state.tenant)
    return {"sessions": [r["session_id"] for r in rows[offset:offset + limit]]}


@router.get("/api/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, access_scope: str = "owned"):
    """``RestClient.get_session``: the session's training runs (model ids) and sampling sessions."""
    svc = service(request)
    svc.own_session(request, session_id)
    return {"training_run_ids": svc.store.session_models(session_id),
            "sampler_ids": svc.store.session_samplers(session_id), "user_metadata": None}


@router.post("/api/v1/session_heartbeat")
async def heartbeat(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    row = svc.store.session(str(body.get("session_id")))
    if row is None or row["tenant"] != request.state.tenant:
        raise HTTPError(410, "unknown session; heartbeats stop.")
    svc.store.heartbeat(row["session_id"])
    return {"type": "session_heartbeat"}


@router.post("/api/v1/telemetry")
async def sdk_telemetry(request: Request):
    return {"status": "accepted"}


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request):
    svc = service(request)
    svc.own_session(request, session_id)
    body = await svc.body_json(request)
    svc.store.finish_session(session_id, str((body.get("reason") or {}).get("type", "unknown")))
    for model_id in svc.store.session_models(session_id):  # free the session's engines
        for job in svc.scheduler.close_model(model_id):
            svc.store.fail(job.request_id, f"{job.op}: the session finished before this request ran.", "user")
        backend = svc.base_of_model(model_id)
        svc.scheduler.submit(Job(f"drop-{uuid.uuid4().hex}", "drop_model", request.state.tenant,
                             lambda mid=model_id, b=backend: (b.drop(mid), (JSON, b"{}"))[1], model_id=None))
    return {}


@router.post("/api/v1/unload_model")
async def unload_model(request: Request):
    """Tinker's ``UnloadModelRequest``: free a training client's engine (its queued requests
    fail, later ones get 410); answered as a future of ``{"model_id", "type": "unload_model"}``.
    Its saved checkpoints stay. A base with no live client left may then be unloaded to make room
    for another (:mod:`ferrule.serve.registry`)."""
    svc = service(request)
    body = await svc.body_json(request)
    model_id = svc.need(body, "model_id")
    svc.own_model(request, model_id)
    backend = svc.base_of_model(model_id)
    for job in svc.scheduler.close_model(model_id):
        svc.store.fail(job.request_id, f"{job.op}: the model was unloaded (unload_model) before this request ran.",
                       "user")

    def run():
        backend.drop(model_id)
        return json_body({"model_id": model_id, "type": "unload_model"})
    return svc.enqueue(request, "unload_model", run)
