"""REST routes of the SDK's ``RestClient`` (tinker 0.38 ``lib/public_interfaces/rest_client.py``):
training runs, checkpoints (list, delete, archive download) and ``weights_info``.

Everything is confined to the API key's tenant: another tenant's run or checkpoint is answered
404 exactly like one that does not exist. A checkpoint saved with ``ttl_seconds`` expires then:
expired checkpoints are deleted (files and records) whenever checkpoints are listed or addressed
(:meth:`Service.sweep_expired`), so an expired path answers 404.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from .paths import PathError, check_name, parse_tinker_path
from .service import HTTPError, Service

__all__ = ["add_rest_routes", "checkpoint_json", "EXTERNAL_FILES", "EXTERNAL_URL_TTL_S"]

#: route prefix of signed external-weights file downloads (no API key: the signature is the credential)
EXTERNAL_FILES = "/api/v1/external_weights_files"
#: lifetime of a signed download URL, seconds
EXTERNAL_URL_TTL_S = 3600


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def checkpoint_json(svc: Service, row: dict) -> dict:
    """A checkpoint row as the SDK's ``Checkpoint``."""
    info = svc.store.checkpoint_info(row["path"])
    return {"checkpoint_id": f"{row['kind']}/{row['name']}", "tinker_path": row["path"],
            "checkpoint_type": {"weights": "training", "sampler_weights": "sampler"}.get(row["kind"], "external"),
            "time": _iso(row["created"]), "size_bytes": row["size_bytes"], "public": False,
            "user_metadata": info["user_metadata"], "expires_at": _iso(info["expires_at"])}


def training_run_json(svc: Service, row: dict) -> dict:
    """A model row as the SDK's ``TrainingRun``."""
    info = svc.store.model_info(row["model_id"])
    cps = svc.store.checkpoints(row["tenant"], row["model_id"])
    last = {kind: next((checkpoint_json(svc, r) for r in reversed(cps) if r["kind"] == kind), None)
            for kind in ("weights", "sampler_weights")}
    lrt = svc.store.last_request_time(row["model_id"]) or row["created"]
    return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": row["tenant"],
            "is_lora": row["lora_rank"] is not None, "corrupted": False, "lora_rank": row["lora_rank"],
            "last_request_time": _iso(lrt), "last_checkpoint": last["weights"],
            "last_sampler_checkpoint": last["sampler_weights"], "user_metadata": info["user_metadata"]}


def _write_tar(tar_path: Path, directory: Path, arcname: str) -> None:
    with tarfile.open(tar_path, "w") as tar:
        tar.add(directory, arcname=arcname)


def add_rest_routes(app: FastAPI, svc: Service) -> None:
    """Register the REST routes of ``svc`` on ``app``."""

    def own_run(request: Request, model_id: str) -> dict:
        row = svc.store.model(model_id)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"training run {model_id!r} does not exist for this API key.")
        return row

    def own_checkpoint_row(request: Request, model_id: str, checkpoint_id: str) -> tuple[dict, Path]:
        svc.sweep_expired()
        try:
            cp = parse_tinker_path(f"tinker://{model_id}/{checkpoint_id}")
            directory = cp.directory(svc.storage)
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        row = svc.store.checkpoint(cp.uri)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"checkpoint {cp.uri!r} does not exist for this API key.")
        return row, directory

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0):
        if limit < 0 or offset < 0:
            raise HTTPError(400, f"limit = {limit}, offset = {offset}; both must be >= 0.")
        rows = svc.store.models(request.state.tenant)
        return {"training_runs": [training_run_json(svc, r) for r in rows[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str, request: Request):
        return training_run_json(svc, own_run(request, model_id))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request):
        own_run(request, model_id)
        svc.sweep_expired()
        return {"checkpoints": [checkpoint_json(svc, r) for r in svc.store.checkpoints(request.state.tenant, model_id)]}

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request):
        svc.sweep_expired()
        return {"checkpoints": [checkpoint_json(svc, r) for r in svc.store.checkpoints(request.state.tenant)]}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request):
        if checkpoint_id.endswith("/publish"):   # unpublish_checkpoint, not a checkpoint named 'publish'
            from .unserved import explain

            raise HTTPError(400, explain("DELETE", request.url.path))
        row, directory = own_checkpoint_row(request, model_id, checkpoint_id)
        svc.delete_checkpoint(row["path"], directory)
        return {}

    secret = secrets.token_bytes(32)   # signs download URLs; they die with the process

    def signature(model_id: str, name: str, file: str, expires: int) -> str:
        msg = f"{model_id}/{name}/{file}|{expires}".encode()
        return hmac.new(secret, msg, hashlib.sha256).hexdigest()

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request):
        """``RestClient.get_external_weights_urls``: a signed URL per file of an ``external_weights``
        checkpoint (:data:`EXTERNAL_URL_TTL_S` seconds; fetched without a key, as the SDK's downloader does)."""
        row, directory = own_checkpoint_row(request, model_id, checkpoint_id)
        if row["kind"] != "external_weights" or not directory.is_dir():
            raise HTTPError(400, f"{row['path']} is a {row['kind']} checkpoint; get_external_weights_urls takes "
                                 "external_weights ones (TrainingClient.save_weights_external makes those).")
        expires = int(time.time()) + EXTERNAL_URL_TTL_S
        base = str(request.base_url).rstrip("/")
        urls = {f.name: (f"{base}{EXTERNAL_FILES}/{model_id}/{row['name']}/{f.name}?expires={expires}"
                         f"&signature={signature(model_id, row['name'], f.name, expires)}")
                for f in sorted(directory.iterdir()) if f.is_file()}
        return {"urls": urls, "expires": _iso(expires)}

    @app.get(EXTERNAL_FILES + "/{model_id}/{name}/{file}")
    async def external_file(model_id: str, name: str, file: str, expires: int, signature_: str = Query(
            alias="signature")):
        """One file of an external-weights checkpoint, for a URL :func:`external_weights_urls` signed."""
        if not hmac.compare_digest(signature(model_id, name, file, expires), signature_) or expires < time.time():
            raise HTTPError(403, "this download URL is not signed by this server or has expired; ask "
                                 "get_external_weights_urls for new ones.")
        try:
            cp = parse_tinker_path(f"tinker://{model_id}/external_weights/{name}")
            path = cp.directory(svc.storage) / check_name(file, "file name")
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        if not path.is_file():
            raise HTTPError(404, f"{cp.uri} has no file {file!r} (deleted or expired).")
        return FileResponse(path, filename=file)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request):
        """``RestClient.set_checkpoint_ttl_from_tinker_path``: ``{"ttl_seconds": int >= 1 or null}`` from
        now (null: never expires); the checkpoint's ``user_metadata`` is kept."""
        row, _ = own_checkpoint_row(request, model_id, checkpoint_id)
        body = await svc.body_json(request)
        expires_at, _ = svc.checkpoint_extras({"ttl_seconds": body.get("ttl_seconds")})
        svc.store.set_checkpoint_info(row["path"], expires_at, svc.store.checkpoint_info(row["path"])["user_metadata"])
        return {}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/archive")
    async def checkpoint_archive(model_id: str, checkpoint_id: str, request: Request):
        """The checkpoint's directory as an uncompressed tar (``<name>/...`` inside), built in a
        worker thread of the event loop's pool (a 538 MB archive held ``/healthz`` for 0.55 s when
        it was built on the loop)."""
        row, directory = own_checkpoint_row(request, model_id, checkpoint_id)
        tmp = Path(tempfile.mkdtemp(prefix="archive-", dir=svc.storage))
        tar_path = tmp / f"{row['name']}.tar"
        try:
            await run_in_threadpool(_write_tar, tar_path, directory, row["name"])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return FileResponse(tar_path, media_type="application/x-tar", filename=tar_path.name,
                            background=BackgroundTask(shutil.rmtree, tmp, ignore_errors=True))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        body = await svc.body_json(request)
        svc.sweep_expired()
        try:
            cp = parse_tinker_path(svc.need(body, "tinker_path"))
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        row = svc.store.checkpoint(cp.uri)
        if row is None or row["tenant"] != request.state.tenant:
            raise HTTPError(404, f"checkpoint {cp.uri!r} does not exist for this API key.")
        run = svc.store.model(row["model_id"]) or {}
        lora = svc.store.model_info(row["model_id"])["lora_config"]
        is_lora = run.get("lora_rank") is not None
        flags = {k: (bool((lora or {}).get(k, True)) if is_lora else None)
                 for k in ("train_unembed", "train_mlp", "train_attn")}
        return {"base_model": run.get("base_model", svc.backend.model_name), "is_lora": is_lora,
                "lora_rank": run.get("lora_rank"), **flags}
