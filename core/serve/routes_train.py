"""Training-client routes: create_model, get_info, forward_backward (protobuf), optim_step,
save_weights (``save_state``), save_weights_for_sampler, load_weights (reference/tinker_protocol.md §6.1-§6.2).

Each validates on arrival (4xx, the ``seq_id`` consumed, nothing run) and queues one job that the
scheduler runs in the client's ``seq_id`` order."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .paths import CheckpointPath, PathError, check_name
from .scheduler import json_body
from .service import HTTPError, service
from .media_chunks import decoder
from .memory import forward_need, load_need, model_copy_bytes
from .wire import WireError, decode_forward_backward, encode_forward_backward_output, resolve_media

__all__ = ["router"]


router = APIRouter()



@router.post("/api/v1/create_model")
async def create_model(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    session_id, mseq = svc.need(body, "session_id"), svc.need(body, "model_seq_id", int)
    svc.own_session(request, session_id)
    backend = svc.base(body.get("base_model"))
    lora = body.get("lora_config") or {}
    rank = lora.get("rank")
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise HTTPError(400, f"lora_config.rank = {rank!r}; expected an int >= 1.")
    if rank is not None and (over := svc.limits.over("max_lora_rank", rank, "lora_config.rank")):
        raise HTTPError(400, f"create_model: {over}")
    try:
        lora = backend.lora_settings(body.get("lora_config"))
    except (ValueError, TypeError, KeyError) as exc:
        raise HTTPError(400, f"lora_config: {exc}") from None
    model_id = f"{session_id}:train:{mseq}"
    if (hit := svc.dedupe(request, model_id, 0)) is not None:
        return hit
    # a new engine is built with its own base copy (a LoRA client's frozen tensors are shared afterwards);
    # a full-parameter client keeps it, with an fp32 gradient and Adam's two moments per parameter
    copy = model_copy_bytes(backend)
    need = load_need(backend) + (copy if lora is not None else copy + 12 * (backend.param_count() or 0))
    if msg := svc.over_memory("the request", need, "a new training client's engine: "
                              + ("a base copy while it is built" if lora is not None else
                                 "its weights, gradients and Adam moments")):
        raise HTTPError(400, f"create_model: {msg}")
    meta = body.get("user_metadata")
    if meta is not None and not isinstance(meta, dict):
        raise HTTPError(400, "user_metadata must be a mapping of strings to strings.")
    svc.store.add_model(model_id, session_id, request.state.tenant, backend.model_name, rank)
    svc.store.set_model_info(model_id, None if meta is None else {str(k): str(v) for k, v in meta.items()},
                             body.get("lora_config"))
    svc.scheduler.open_model(model_id, next_seq=0)

    def run():
        backend.create(model_id, lora)
        return json_body({"model_id": model_id, "type": "create_model"})
    return svc.enqueue(request, "create_model", run, model_id, 0, mem=need, grow=need)


@router.post("/api/v1/get_info")
async def get_info(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    row = svc.own_model(request, svc.need(body, "model_id"))
    backend = svc.base(row["base_model"])
    return {"model_id": row["model_id"], "type": "get_info", "model_name": backend.model_name,
            "model_data": {"arch": backend.hf_config.get("model_type"), "model_name": backend.model_name,
                           "tokenizer_id": backend.model_name},
            "is_lora": row["lora_rank"] is not None, "lora_rank": row["lora_rank"]}


@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request):
    svc = service(request)
    raw = await request.body()
    try:
        req = decode_forward_backward(raw, request.headers.get("content-encoding"))
    except WireError as exc:  # a refusal at any stage consumes the request's seq_id (no gap)
        if exc.model_id is None or exc.seq_id is None:
            raise HTTPError(400, f"{exc} The request names no training client; nothing was queued.") from None
        _, hit = svc.admit(request, exc.model_id, exc.seq_id)
        if hit is not None:
            return hit
        raise svc.refuse(exc.model_id, exc.seq_id, 400, f"forward_backward: {exc}") from None
    row, hit = svc.admit(request, req.model_id, req.seq_id)
    if hit is not None:
        return hit
    backend = svc.base(row["base_model"])
    op = "forward" if req.forward_only else "forward_backward"
    try:
        resolve_media(req, decoder(backend, svc.limits))  # image / dmel chunks -> placeholders + media
        if not req.loss_fn:
            raise ValueError("loss_fn is empty; name a loss (cross_entropy, importance_sampling, ppo, cispo, dro).")
        work = sum(len(d.model_input) * (int(d.loss_fn_inputs["target_tokens"].shape[1])
                                         if d.loss_fn_inputs.get("target_tokens") is not None
                                         and d.loss_fn_inputs["target_tokens"].dim() == 2 else 1) for d in req.data)
        if over := svc.limits.over("max_tokens_per_request", work, "the data's model_input tokens (x K for "
                                                                         "rank-2 targets)"):
            raise ValueError(over)
        if req.model_id in backend.engines:
            backend.check_forward_backward(req.model_id, req.data, req.loss_fn, req.loss_fn_config)
        longest = max((len(d.model_input) for d in req.data), default=0)
        need = forward_need(backend.hf_config, longest, not req.forward_only, backend.train_dtype_bytes)
        if msg := svc.over_memory("the request", need, f"the longest datum's {longest} tokens: activations and "
                                  "logits"):
            raise ValueError(msg)
    except (ValueError, TypeError) as exc:
        raise svc.refuse(req.model_id, req.seq_id, 400, f"{op}: {exc}") from None

    def run():
        out = backend.forward_backward(req.model_id, req.data, req.loss_fn, req.loss_fn_config, req.forward_only)
        return "application/x-protobuf", encode_forward_backward_output(out.loss_fn_outputs, out.metrics,
                                                                        out.loss_fn_output_type)
    return svc.enqueue(request, op, run, req.model_id, req.seq_id, len(req.data), req.num_tokens, mem=need)


@router.post("/api/v1/optim_step")
async def optim_step(request: Request):
    svc = service(request)
    from ferrule.megatron.optim import _check_adam_params

    body = await svc.body_json(request)
    model_id, seq_id = svc.need(body, "model_id"), svc.need(body, "seq_id", int)
    row, hit = svc.admit(request, model_id, seq_id)
    if hit is not None:
        return hit
    backend = svc.base(row["base_model"])
    adam = dict(body.get("adam_params") or {})
    try:
        if body.get("optimizer_params"):
            raise ValueError("only Adam (adam_params) is supported; optimizer_params (e.g. dimuon) is not.")
        _check_adam_params(adam)
    except ValueError as exc:
        raise svc.refuse(model_id, seq_id, 400, f"optim_step: {exc}") from None

    def run():
        res = backend.optim_step(model_id, adam)
        metrics = {"grad_norm:mean": res["grad_norm"], "learning_rate:mean": res["learning_rate"],
                   "step:max": float(res["step"]), "skipped:sum": 0.0 if res["success"] else 1.0}
        return json_body({"metrics": metrics, "type": "optim_step"})
    return svc.enqueue(request, "optim_step", run, model_id, seq_id)


@router.post("/api/v1/save_weights")
async def save_weights(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    model_id, seq_id = svc.need(body, "model_id"), svc.need(body, "seq_id", int)
    row, hit = svc.admit(request, model_id, seq_id)
    if hit is not None:
        return hit
    backend = svc.base(row["base_model"])
    try:
        cp = CheckpointPath(model_id, "weights", check_name(svc.need(body, "path")))
        directory = cp.directory(svc.storage)
        expires_at, meta = svc.checkpoint_extras(body)
    except (PathError, HTTPError) as exc:
        raise svc.refuse(model_id, seq_id, 400, f"save_weights: {getattr(exc, 'message', exc)}") from None
    overwrite = bool(body.get("overwrite", False))

    def run():
        if directory.exists() and not overwrite:
            raise ValueError(f"{cp.uri} exists; pass overwrite=True or another name.")
        size = backend.save_state(model_id, directory)
        svc.store.add_checkpoint(cp.uri, request.state.tenant, model_id, cp.kind, cp.name, size)
        svc.store.set_checkpoint_info(cp.uri, expires_at, meta)
        return json_body({"path": cp.uri, "type": "save_weights"})
    return svc.enqueue(request, "save_state", run, model_id, seq_id)


@router.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    model_id, seq_id = svc.need(body, "model_id"), svc.need(body, "seq_id", int)
    row, hit = svc.admit(request, model_id, seq_id)
    if hit is not None:
        return hit
    backend = svc.base(row["base_model"])
    sseq = body.get("sampling_session_seq_id")
    named = body.get("path") is not None
    kind = body.get("kind", "snapshot")
    try:
        if kind not in ("snapshot", "inflight"):
            raise PathError(f"kind = {kind!r}; expected 'snapshot' (fixed weights) or 'inflight' (weights that later "
                            "inflight saves of this client update).")
        if kind == "inflight" and named:
            raise PathError("kind 'inflight' publishes in-memory weights of an unnamed save (save_weights_and_get_"
                            "sampling_client(kind='inflight')); a named checkpoint is a snapshot.")
        if not named and not isinstance(sseq, int):
            raise PathError("give a path (a checkpoint name) or a sampling_session_seq_id.")
        cp = CheckpointPath(model_id, "sampler_weights", check_name(body["path"])) if named else None
        directory = cp.directory(svc.storage) if named else None
        expires_at, meta = svc.checkpoint_extras(body)
    except (PathError, HTTPError) as exc:
        raise svc.refuse(model_id, seq_id, 400, f"save_weights_for_sampler: {getattr(exc, 'message', exc)}") from None
    need = 0   # an unnamed snapshot is kept in memory: a merged copy of the model unless it is an adapter
    if not named and not (row["lora_rank"] is not None and backend.snapshot_holds_adapter(model_id)):
        need = model_copy_bytes(backend)
        if msg := svc.over_memory("the request", need, "an unnamed sampler snapshot: a merged copy of the model"):
            raise svc.refuse(model_id, seq_id, 400, f"save_weights_for_sampler: {msg}")
    tenant = request.state.tenant

    def run():
        out: dict = {"type": "save_weights_for_sampler"}
        if named:  # a checkpoint on disk, addressable by its tinker:// path
            size = backend.save_sampler_weights(model_id, directory)
            svc.store.add_checkpoint(cp.uri, tenant, model_id, cp.kind, cp.name, size)
            svc.store.set_checkpoint_info(cp.uri, expires_at, meta)
            out["path"] = source = cp.uri
        elif kind == "inflight":   # the client's shared mutable sampler weights: its inflight sessions follow
            source = backend.publish_inflight(model_id)
        else:      # Tinker's ephemeral sampler weights: an in-memory snapshot
            source = backend.snapshot(model_id, tenant)
        if isinstance(sseq, int):
            sid = f"{row['session_id']}:sample:{sseq}"
            svc.store.add_sampling_session(sid, tenant, row["session_id"], source, backend.model_name)
            out["sampling_session_id"] = sid
        return json_body(out)
    return svc.enqueue(request, "save_weights_for_sampler", run, model_id, seq_id, mem=need, grow=need)


@router.post("/api/v1/save_weights_external")
async def save_weights_external(request: Request):
    """``TrainingClient.save_weights_external(name)``: the model as an HF folder at
    ``tinker://<model_id>/external_weights/<name>`` (:meth:`EngineBackend.save_external_weights`), whose
    files ``external_weights_urls`` signs for download (``tinker checkpoint download``)."""
    svc = service(request)
    body = await svc.body_json(request)
    model_id, seq_id = svc.need(body, "model_id"), svc.need(body, "seq_id", int)
    row, hit = svc.admit(request, model_id, seq_id)
    if hit is not None:
        return hit
    backend = svc.base(row["base_model"])
    try:
        if body.get("age_encryption_recipients"):
            raise PathError("age_encryption_recipients is not supported (files are stored unencrypted on this "
                            "server); leave it unset.")
        cp = CheckpointPath(model_id, "external_weights", check_name(svc.need(body, "path")))
        directory = cp.directory(svc.storage)
        expires_at, meta = svc.checkpoint_extras(body)
    except (PathError, HTTPError) as exc:
        raise svc.refuse(model_id, seq_id, 400, f"save_weights_external: {getattr(exc, 'message', exc)}") from None
    tenant = request.state.tenant

    def run():
        size = backend.save_external_weights(model_id, directory)
        svc.store.add_checkpoint(cp.uri, tenant, model_id, cp.kind, cp.name, size)
        svc.store.set_checkpoint_info(cp.uri, expires_at, meta)
        return json_body({"path": cp.uri, "size_bytes": size, "type": "save_weights_external"})
    return svc.enqueue(request, "save_weights_external", run, model_id, seq_id)


@router.post("/api/v1/load_weights")
async def load_weights(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    optimizer = bool(body.get("optimizer", False))
    if "model_id" in body:  # legacy load_state on an existing client
        model_id, seq_id = svc.need(body, "model_id"), svc.need(body, "seq_id", int)
        row, hit = svc.admit(request, model_id, seq_id)
        if hit is not None:
            return hit
        try:
            cp, directory = svc.own_checkpoint(request, svc.need(body, "path"), "weights")
            backend = svc.base(row["base_model"])
            saved = svc.store.model(cp.model_id)
            if saved is not None and saved["base_model"] != backend.model_name:
                raise HTTPError(400, f"{cp.uri} was trained on base {saved['base_model']!r}, this client on "
                                     f"{backend.model_name!r}; load it with create_training_client_from_state.")
        except HTTPError as exc:
            raise svc.refuse(model_id, seq_id, exc.status, f"load_weights: {exc.message}") from None
    else:  # create-via-load: the SDK derives model_id = session:train:model_seq_id itself
        session_id, mseq = svc.need(body, "session_id"), svc.need(body, "model_seq_id", int)
        svc.own_session(request, session_id)
        model_id, seq_id = f"{session_id}:train:{mseq}", 0
        if (hit := svc.dedupe(request, model_id, 0)) is not None:
            return hit
        cp, directory = svc.own_checkpoint(request, svc.need(body, "path"), "weights")
        saved = svc.store.model(cp.model_id)   # the base the checkpoint was trained on
        backend = svc.base(saved["base_model"] if saved is not None else svc.backend.model_name)
        svc.store.add_model(model_id, session_id, request.state.tenant, backend.model_name,
                            None if saved is None else saved["lora_rank"])
        svc.scheduler.open_model(model_id, next_seq=0)

    def run():
        backend.load_state(model_id, directory, optimizer)
        return json_body({"path": cp.uri, "model_id": model_id, "type": "load_weights"})
    return svc.enqueue(request, "load_state", run, model_id, seq_id)
