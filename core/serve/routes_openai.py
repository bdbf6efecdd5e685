"""OpenAI-compatible inference: ``POST /oai/api/v1/chat/completions``, ``POST /oai/api/v1/completions``
and ``GET /oai/api/v1/models``, over any served base and any sampler checkpoint, as hosted Tinker
serves them (tinker-docs "OpenAI-Compatible API": point an OpenAI client at ``<server>/oai/api/v1``
with a Tinker API key).

``model`` takes the forms hosted Tinker documents:

- a base model: a served ``--model-name`` (Tinker's ``<name>:peft:<context>`` IDs are accepted too:
  the suffix caps prompt + ``max_tokens`` at that context length);
- a sampler checkpoint: ``tinker://<model_id>/sampler_weights/<name>`` (``save_weights_for_sampler``),
  sampled on the base it was trained on;
- ``<base>;<checkpoint path>``: the same checkpoint, with the base (and its context length) named;
  the base must be the one the checkpoint was trained on.

Keys and tenants are the Tinker routes': ``Authorization: Bearer tml-...`` (what OpenAI clients send)
or ``X-API-Key``; an unknown key gets 401, another tenant's checkpoint 404 (as on the Tinker routes,
so one tenant learns nothing of another's). Errors are OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``.

Chat prompts are rendered with the base family's chat template (:meth:`EngineBackend.chat_template`:
the family's first registered template, as ``ferrule train`` picks it; else the tokenizer's own
``chat_template``), ``add_generation_prompt=True``; the template's stop tokens and the tokenizer's
EOS end a reply and are not part of its ``content``. A ``/completions`` prompt (a string, token ids,
or a list of either) is tokenized with the tokenizer's own special tokens (``add_special_tokens``)
and ends at EOS. ``stop`` strings end a choice and are cut from its text, as OpenAI does.

``logprobs`` are those of ``sample``: each sampled token's logprob under the distribution it was
drawn from (``log_softmax(logits / temperature)``; untempered at ``temperature=0``, greedy),
``top_logprobs`` / ``/completions``' ``logprobs=k`` the k most likely tokens of that distribution
(:mod:`ferrule.serve.logprobs`, at most 20). ``stream=true`` is answered as server-sent events, one
chunk per choice once sampling finished (not token by token). Not offered (400 naming the field):
``tools`` / ``functions``, ``logit_bias``, non-zero ``presence_penalty`` / ``frequency_penalty``,
``response_format`` other than text, ``echo``, ``suffix``, ``best_of`` > 1, non-text message parts.

Each request is one job of the tenant on the service's worker (:meth:`Service.run_and_wait`: the
same queue, fairness and per-tenant limit as ``asample``), answered in the same HTTP response.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .backend import EngineBackend, SampleSpec, SavedWeights
from .logprobs import Extras
from .scheduler import json_body
from .memory import load_need, sample_need
from .service import HTTPError, Service, service
from .sampling_params import DEFAULT_MAX_TOKENS
from ferrule.chat import ChatTemplateError, render_chat_ids, stop_token_ids
from ferrule.rollout.base import SamplingParams

__all__ = ["router", "PREFIX", "resolve_model", "openai_error"]

PREFIX = "/oai/api/v1"
#: most ``top_logprobs`` (chat) / ``logprobs`` (completions) alternatives per token, as OpenAI allows
MAX_TOP_LOGPROBS = 20
_PEFT_SUFFIX = re.compile(r"^(?P<name>.+):peft:(?P<context>[0-9]+)$")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 410: "not_found_error", 429: "rate_limit_error"}
#: fields with a value other than these are refused (400 naming the field)
_UNSUPPORTED = {"tools": None, "functions": None, "tool_choice": None, "logit_bias": None, "presence_penalty": 0,
                "frequency_penalty": 0, "echo": False, "suffix": None, "best_of": 1}

router = APIRouter()


def openai_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """An error answer in OpenAI's shape (the ``openai`` client reads ``error.message``)."""
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                                   "param": None, "code": None}}, status_code=status, headers=headers)


def _bad(message: str) -> HTTPError:
    return HTTPError(400, message)


def resolve_model(svc: Service, request: Request, model: Any) -> tuple[EngineBackend, SavedWeights | None, int | None]:
    """``model`` (module docstring) -> ``(base backend, sampler checkpoint as of now or None, context
    length or None)``.

    Raises:
        HTTPError: 400 (malformed, a training-state path, a base the checkpoint was not trained on),
            404 (an unknown base; a checkpoint that does not exist for this key).
    """
    if not isinstance(model, str) or not model.strip():
        raise _bad("model is missing; give a served base model name, a tinker://.../sampler_weights/NAME path, or "
                   "'<base>;<path>'.")
    base_name, path = model.split(";", 1) if ";" in model else \
        ((None, model) if model.startswith("tinker://") else (model, None))
    backend, context = None, None
    if base_name is not None:
        name = base_name.strip()
        if name not in svc.bases.names and (m := _PEFT_SUFFIX.match(name)) and m["name"] in svc.bases.names:
            name, context = m["name"], int(m["context"])
        if name not in svc.bases.names:
            raise HTTPError(404, f"model {base_name!r} is not served here; this server serves "
                                 f"{', '.join(repr(n) for n in svc.bases.names)} (or a tinker://.../sampler_weights/"
                                 "NAME path of yours).")
        backend = svc.bases.get(name)
    if path is None:
        return backend, None, context
    path = path.strip()
    if not path.startswith("tinker://"):
        raise _bad(f"model {model!r}: after ';' comes a tinker://.../sampler_weights/NAME path.")
    cp, directory = svc.own_checkpoint(request, path, "sampler_weights")
    trained = svc.store.model(cp.model_id)
    trained_base = trained["base_model"] if trained is not None else svc.bases.default.model_name
    if backend is not None and backend.model_name != trained_base:
        raise _bad(f"model {model!r}: checkpoint {path} was trained on base {trained_base!r}, not "
                   f"{backend.model_name!r}; name its own base (or give the path alone).")
    backend = svc.base(trained_base)
    return backend, backend.saved_weights(directory), context


def _check_unsupported(body: dict) -> None:
    for key, default in _UNSUPPORTED.items():
        value = body.get(key)
        if key == "tool_choice" and value in ("none", "auto") and not body.get("tools"):
            continue   # some clients send it without tools: nothing to choose from
        if value is not None and value != default and value not in ([], {}):
            raise _bad(f"{key} = {value!r} is not supported by ferrule serve's OpenAI-compatible routes; leave it "
                       "unset.")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad(f"response_format = {fmt!r} is not supported (plain text only); leave it unset.")


def _int(body: dict, key: str, default: int | None, low: int, high: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        raise _bad(f"{key} = {v!r}; expected an int in {low}..{'' if high is None else high}.")
    return v


def _float(body: dict, key: str, default: float, low: float, high: float) -> float:
    v = body.get(key, default)
    v = default if v is None else v
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
        raise _bad(f"{key} = {v!r}; expected a number in [{low}, {high}].")
    return float(v)


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise _bad(f"stop = {body.get('stop')!r}; expected a non-empty string or a list of at most 4.")
    return tuple(stop)


def _text_messages(messages: Any) -> list[dict]:
    """OpenAI messages with string content (a list of text parts is joined); other parts refused."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content}.")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}] is not an object.")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content[{j}]: only text parts are supported.")
                parts.append(part["text"])
            content = "".join(parts)
        out.append({k: v for k, v in {**msg, "content": content}.items() if k != "name" or v is not None})
    return out


class _Plan:
    """One validated request: the prompts' token ids, ferrule ``SamplingParams``, what stops a reply,
    what to report."""

    def __init__(self, backend, source, prompts, params, stop_ids, top_k, want_logprobs, chat, tok):
        self.backend, self.source, self.prompts, self.params = backend, source, prompts, params
        self.stop_ids, self.top_k, self.want_logprobs, self.chat, self.tok = stop_ids, top_k, want_logprobs, chat, tok


def _sampling(svc: Service, backend: EngineBackend, body: dict, prompts: list[list[int]], context: int | None,
              stop_ids: tuple[int, ...], chat: bool) -> Any:
    n = _int(body, "n", 1, 1)
    if over := svc.limits.over("max_samples_per_request", n * len(prompts), "n x prompts"):
        raise _bad(over)
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
        else body.get("max_tokens")
    limit = min(x for x in (context, backend.max_positions) if x is not None) \
        if (context or backend.max_positions) else None
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if limit is None else max(1, min(DEFAULT_MAX_TOKENS, limit - longest))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad(f"max_tokens = {max_tokens!r}; expected an int >= 1.")
    if limit is not None and longest + max_tokens > limit:
        raise _bad(f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens; "
                   "shorten the prompt or max_tokens.")
    if over := svc.limits.over("max_tokens_per_request", n * sum(len(p) + max_tokens for p in prompts),
                               "n x (prompt tokens + max_tokens)"):
        raise _bad(over)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _bad(f"seed = {seed!r}; expected an int.")
    try:
        return SamplingParams(temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_float(body, "top_p", 1.0, 0.0, 1.0) or 1.0, max_new_tokens=max_tokens,
                              stop=_stop_strings(body), stop_token_ids=stop_ids, n=n, seed=seed)
    except ValueError as exc:
        raise _bad(str(exc)) from None


def _prepare_chat(svc: Service, backend: EngineBackend, body: dict, context: int | None) -> tuple:
    """(runs in a thread: tokenizer loading and rendering) prompt ids, stop ids, params."""
    messages = _text_messages(body.get("messages"))
    try:
        tok = backend.tokenizer()
    except LookupError as exc:
        raise _bad(str(exc)) from None
    spec = backend.chat_template()
    try:
        if spec is not None:
            ids = list(render_chat_ids(spec, tok, messages, add_generation_prompt=True).token_ids)
            stops = set(stop_token_ids(spec, tok))
        elif getattr(tok, "chat_template", None):
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
            stops = set()
        else:
            raise _bad(f"base model {backend.model_name!r}: its family registers no chat template and its tokenizer "
                       "has none; use /completions with a prompt.")
    except ChatTemplateError as exc:
        raise _bad(f"messages: {exc}") from None
    if tok.eos_token_id is not None:
        stops.add(int(tok.eos_token_id))
    return tok, [ids], tuple(sorted(stops))


def _prepare_completion(backend: EngineBackend, body: dict) -> tuple:
    try:
        tok = backend.tokenizer()
    except LookupError as exc:
        raise _bad(str(exc)) from None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      for t in p)) for p in prompt):
        raise _bad("prompt must be a string, a list of token ids, or a non-empty list of either.")
    ids = [list(tok.encode(p)) if isinstance(p, str) else list(p) for p in prompt]
    for i, p in enumerate(ids):
        try:
            backend.check_prompt(p)
        except ValueError as exc:
            raise _bad(f"prompt[{i}]: {exc}") from None
    stops = () if tok.eos_token_id is None else (int(tok.eos_token_id),)
    return tok, ids, stops


def _token_text(tok: Any, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def _choice_tokens(plan: _Plan, tokens: list[int], lps: list[float], reason: str) -> tuple[str, int, str]:
    """(text, tokens kept, finish_reason): a final stop token is dropped, a stop string cut off."""
    keep = len(tokens)
    if reason == "stop" and keep and tokens[-1] in plan.stop_ids:
        keep -= 1
    text = plan.tok.decode(tokens[:keep], skip_special_tokens=False)
    for s in plan.params.stop:
        at = text.find(s)
        if at >= 0:
            text, reason = text[:at], "stop"
    return text, keep, reason


def _run(plan: _Plan, model: str, request_id: str) -> dict:
    """(on the worker) sample, then the OpenAI response object."""
    extras = Extras(topk_sample=plan.top_k) if plan.top_k else None
    specs = [SampleSpec(p, plan.params.n, plan.params, False, extras) for p in plan.prompts]
    results = plan.backend.sample(plan.source, specs)
    choices, completion_tokens = [], 0
    for i, (seqs, _, extra) in enumerate(results):
        topk = extra.get("topk_sample") if extra else None
        for j, (tokens, lps, reason) in enumerate(seqs):
            text, keep, reason = _choice_tokens(plan, tokens, lps, reason)
            completion_tokens += len(tokens)
            index = i * plan.params.n + j
            logprobs = None
            if plan.want_logprobs:
                alts = [[(int(a), float(b)) for a, b in zip(*(x[t] for x in topk[j]))] for t in range(keep)] \
                    if topk else [[] for _ in range(keep)]
                logprobs = _chat_logprobs(plan.tok, tokens[:keep], lps[:keep], alts) if plan.chat else \
                    _completion_logprobs(plan.tok, tokens[:keep], lps[:keep], alts, plan.top_k)
            if plan.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": reason, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs})
    prompt_tokens = sum(len(p) for p in plan.prompts)
    return {"id": request_id, "object": "chat.completion" if plan.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _chat_logprobs(tok: Any, tokens: list[int], lps: list[float], alts: list) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = _token_text(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alt]}
                        for t, lp, alt in zip(tokens, lps, alts)]}


def _completion_logprobs(tok: Any, tokens: list[int], lps: list[float], alts: list, k: int) -> dict:
    strings = [_token_text(tok, t) for t in tokens]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    top = [{_token_text(tok, a): b for a, b in alt} for alt in alts] if k else None
    return {"tokens": strings, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def _sse(response: dict, chat: bool):
    """The response as server-sent events: per choice one chunk with its whole text and one with its
    finish reason, then ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: response[k] for k in ("id", "created", "model")}
    for c in response["choices"]:
        if chat:
            first = {"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                     "logprobs": c["logprobs"], "finish_reason": None}
            last = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            first = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}
            last = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        for choice in (first, last):
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"
    yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


async def _complete(request: Request, chat: bool):
    svc = service(request)
    body = await svc.body_json(request)
    _check_unsupported(body)
    model = body.get("model")
    backend, source, context = resolve_model(svc, request, model)
    if chat:
        want = body.get("logprobs") or False
        if not isinstance(want, bool):
            raise _bad(f"logprobs = {want!r}; expected true or false (top_logprobs gives alternatives).")
        top_k = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
        if top_k and not want:
            raise _bad("top_logprobs needs logprobs = true.")
        tok, prompts, stops = await run_in_threadpool(_prepare_chat, svc, backend, body, context)
    else:
        k = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        want, top_k = k is not None, k or 0
        tok, prompts, stops = await run_in_threadpool(_prepare_completion, backend, body)
    params = _sampling(svc, backend, body, prompts, context, stops, chat)
    need = load_need(backend) + sum(sample_need(backend.hf_config, backend.sampler_dtype_bytes, params.n, len(p),
                                                params.max_new_tokens, bool(top_k)) for p in prompts)
    if msg := svc.over_memory("the request", need, f"n = {params.n} x {len(prompts)} prompt(s) of up to "
                              f"{max(len(p) for p in prompts)} tokens + max_tokens {params.max_new_tokens}: KV cache, "
                              "activations and logits"):
        raise _bad(msg)
    plan = _Plan(backend, source, prompts, params, set(stops), top_k, want, chat, tok)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    _, out = await svc.run_and_wait(
        request, "oai_chat" if chat else "oai_completion", lambda: json_body(_run(plan, model, rid)),
        num_data=params.n * len(prompts), num_tokens=sum(len(p) for p in prompts), base=backend.model_name, mem=need)
    response = json.loads(out)
    if body.get("stream"):
        return StreamingResponse(_sse(response, chat), media_type="text/event-stream")
    return JSONResponse(response)


@router.post(f"{PREFIX}/chat/completions")
async def chat_completions(request: Request):
    return await _complete(request, chat=True)


@router.post(f"{PREFIX}/completions")
async def completions(request: Request):
    return await _complete(request, chat=False)


@router.get(f"{PREFIX}/models")
async def models(request: Request):
    """The served bases (OpenAI's model list); sampler checkpoints are addressed by path, not listed."""
    svc = service(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ferrule"}
                                       for name in svc.bases.names]}
