"""Sampling routes: create_sampling_session, get_sampler, asample (reference/tinker_protocol.md §5).
``asample`` validates on arrival and queues one job; unseeded requests with the same weights and
parameters may share one generate call."""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .backend import SampleSpec, SavedWeights
from .logprobs import parse_extras
from .memory import load_need, sample_need
from .media_chunks import decoder, parts_from_json
from .service import HTTPError, service
from .wire import encode_sample_response

__all__ = ["router"]

router = APIRouter()


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    session_id, sseq = svc.need(body, "session_id"), svc.need(body, "sampling_session_seq_id", int)
    svc.own_session(request, session_id)
    path = body.get("model_path")
    if path is not None:  # a sampler checkpoint samples on the base it was trained on
        cp, _ = svc.own_checkpoint(request, path, "sampler_weights")
        trained = svc.store.model(cp.model_id)
        backend = svc.base(trained["base_model"] if trained is not None else svc.bases.default.model_name)
    else:                 # a frozen base: any served one (a teacher, a reference model)
        backend = svc.base(body.get("base_model"))
    sid = f"{session_id}:sample:{sseq}"
    svc.store.add_sampling_session(sid, request.state.tenant, session_id, path, backend.model_name)
    return {"sampling_session_id": sid, "type": "create_sampling_session"}


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    svc = service(request)
    row = svc.store.sampling_session(sampler_id)
    if row is None or row["tenant"] != request.state.tenant:
        raise HTTPError(404, f"sampler {sampler_id!r} does not exist for this API key.")
    path = row["model_path"] if row["model_path"] and row["model_path"].startswith("tinker://") else None
    return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": path}


@router.post("/api/v1/asample")
async def asample(request: Request):
    svc = service(request)
    body = await svc.body_json(request)
    sid = svc.need(body, "sampling_session_id")
    n = body.get("num_samples", 1)
    if isinstance(n, int) and (over := svc.limits.over("max_samples_per_request", n, "num_samples")):
        raise HTTPError(400, f"asample: {over}")   # before anything is sized by n
    rid_seq = [f"{sid}:{body.get('seq_id', 0)}:{i}" for i in range(n if isinstance(n, int) else 0)]
    key = request.headers.get("x-idempotency-key")
    prev = svc.store.future_by_key(request.state.tenant, key) if key else None
    if prev is not None:  # a retry with the same idempotency key: the first request's id
        svc.telemetry.deduplicated.inc()
        return JSONResponse({"request_id": prev["request_id"], "sample_sequence_ids": rid_seq})
    row = svc.store.sampling_session(sid)
    if row is None or row["tenant"] != request.state.tenant:
        raise HTTPError(404, f"sampling session {sid!r} does not exist for this API key.")
    backend = svc.base(row["base_model"])
    source: SavedWeights | str | None = None
    if row["model_path"] is not None and row["model_path"].startswith(("ephemeral:", "inflight:")):
        source = row["model_path"]   # inflight: the client's latest published weights when it runs
    elif row["model_path"] is not None:  # pinned to the save the checkpoint holds now
        source = backend.saved_weights(svc.own_checkpoint(request, row["model_path"], "sampler_weights")[1])
    try:
        # image / dmel chunks -> placeholder tokens + the towers' inputs (ferrule.serve.media_chunks)
        pieces = parts_from_json((body.get("prompt") or {}).get("chunks") or [], "prompt")
        tokens, media = decoder(backend, svc.limits).assemble(pieces)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_samples = {n!r}; expected an int >= 1.")
        backend.check_prompt(tokens)
        params = backend.sampling_params(body.get("sampling_params") or {}, len(tokens), n)
        over = svc.limits.over(
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
    spec = SampleSpec(tokens, n, params, bool(body.get("prompt_logprobs", False)), extras, media)
    need = load_need(backend) + sample_need(backend.hf_config, backend.sampler_dtype_bytes, n, len(tokens),
                                            params.max_new_tokens, spec.prompt_logprobs or bool(extras and extras.any))
    if msg := svc.over_memory("the request", need, f"num_samples {n} x (prompt {len(tokens)} + max_tokens "
                              f"{params.max_new_tokens}) tokens: KV cache, activations and logits"):
        raise HTTPError(400, f"asample: {msg}")

    def encode(seqs, prompt_lp, extras_out, last_n, extras):
        if prompt_lp is not None and last_n is not None:
            prompt_lp = [math.nan] * (len(prompt_lp) - last_n) + prompt_lp[-last_n:]
        return "application/x-protobuf", encode_sample_response(seqs, prompt_lp, extras, extras_out)

    def run_batch(jobs):  # each job's own source: adapters of several sessions share one decode batch
        results = backend.sample_many([(j.payload[2], j.payload[0]) for j in jobs])
        return [encode(*res, j.payload[1], j.payload[0].extras) for j, res in zip(jobs, results)]

    def run():
        (res,) = backend.sample(source, [spec])
        return encode(*res, last_n, extras)
    # unseeded requests with the same parameters may share one generate call: of the same weights, or of the
    # base and LoRA adapters on it (each row its own adapter: batched multi-adapter decode)
    weights = f"{backend.model_name}+adapters" if backend.batchable(source) else str(source)
    key = None if params.seed is not None else f"sample|{weights}|{params!r}"
    return svc.enqueue(request, "sample", run, num_data=n, num_tokens=len(tokens),
                   extra={"sample_sequence_ids": rid_seq}, batch=(key, run_batch, (spec, last_n, source)),
                   base=backend.model_name, mem=need)
