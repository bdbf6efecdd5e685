"""Futures: retrieve_future (long poll, then ``try_again``; reference/tinker_protocol.md §6). The
checkpoint listing is in :mod:`.routes_rest`."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .scheduler import JSON
from .service import HTTPError, service

__all__ = ["router"]

router = APIRouter()


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    rid = svc.need(body, "request_id")
    row = svc.store.future(rid)
    if row is None or row["tenant"] != request.state.tenant:
        raise HTTPError(404, f"future {rid!r} does not exist for this API key.")
    deadline = time.monotonic() + request.app.state.long_poll_s
    while row["status"] == "pending" and time.monotonic() < deadline:
        ev = svc.scheduler.event(rid)   # long poll: a 10 ms tick on the event, the row re-read when it fires
        while ev is not None and not ev.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if ev is None:
            await asyncio.sleep(0.01)
        row = svc.store.future(rid)
    if row["status"] == "done":
        return Response(row["result"], media_type=row["content_type"] or JSON)
    if row["status"] == "failed":
        return JSONResponse({"error": row["error"], "category": row["category"] or "server"})
    return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
