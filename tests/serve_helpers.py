"""Start ``ferrule serve``'s app on a loopback port in this process (uvicorn in a thread), plus
the fixtures and helpers of tests/test_serve.py and tests/test_serve_protocol.py. The client
under test is the unmodified ``tinker`` 0.38.0 SDK. Import it after putting ``tests`` and
``tests/dist`` on ``sys.path``."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

KEYS = {"tml-alice-0001": "alice", "tml-bob-00002": "bob"}
MODEL_NAME = "tiny-qwen2"


#: every ``tinker.ServiceClient`` made in this process and not yet closed (:func:`track_sdk_clients`); strong
#: references: a client the test dropped is collected while its session's heartbeat task lives on
_SDK_CLIENTS: list = []


def track_sdk_clients() -> None:
    """Record every ``tinker.ServiceClient`` this process makes, so that :func:`close_sdk_clients` can stop
    them when the test's server stops. Without it an SDK session outlives its server: the SDK's
    heartbeat task keeps running on the SDK's event-loop thread (which holds the client) and, from 2 minutes
    after the server went, logs "Session heartbeat failed ..." warnings into whatever test this worker runs
    next (a CLI test asserting its exact stderr failed on them)."""
    import tinker

    cls = tinker.ServiceClient
    if getattr(cls, "_ferrule_tests_track", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _SDK_CLIENTS.append(self)

    cls.__init__, cls._ferrule_tests_track = __init__, True


def close_sdk_clients(base_url: str) -> int:
    """Stop the local side of every tracked SDK client of ``base_url``: its holders' ``close()`` (the SDK's
    ``InternalClientHolder``: heartbeat, config refresh and pollers cancelled, connections closed) without
    telling the server anything. ``ServiceClient.close`` would also finish the session on the server, which
    drops its training clients and fails their queued requests: not what a test that stops (or restarts) its
    server checks. Returns how many clients were closed."""
    mine = [c for c in _SDK_CLIENTS if getattr(c, "_base_url", None) == base_url]
    _SDK_CLIENTS[:] = [c for c in _SDK_CLIENTS if c not in mine]
    for client in mine:
        for holder in (getattr(client, "_session_holder", None), getattr(client, "_rest_holder", None)):
            if holder is not None:
                with contextlib.suppress(Exception):
                    holder.close()
    return len(mine)


class RunningServer:
    """A served app: ``url``, ``storage``, ``app``; :meth:`stop` shuts uvicorn and the worker."""

    def __init__(self, base: Path, storage: Path, *, chunk_len: int = 3, long_poll_s: float = 5.0, limits=None,
                 keys: dict[str, str] | None = None):
        import uvicorn

        from ferrule.serve.app import create_app
        from ferrule.serve.backend import EngineBackend

        track_sdk_clients()  # every SDK client of this server is stopped in stop(), made here or by the test
        self.storage = storage
        backend = EngineBackend(base, model_name=MODEL_NAME) if isinstance(base, (str, Path)) else base  # or a registry
        self.backend = backend
        self.app = create_app(backend, storage, dict(keys or KEYS), long_poll_s=long_poll_s,
                              fwdbwd_max_chunk_len=chunk_len,
                              **({} if limits is None else {"limits": limits}))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def client(self, key: str = "tml-alice-0001"):
        import tinker

        os.environ["TINKER_TELEMETRY"] = "0"
        track_sdk_clients()
        return tinker.ServiceClient(base_url=self.url, api_key=key)

    def stop(self) -> None:
        close_sdk_clients(self.url)  # their heartbeats would outlive the server
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.scheduler.shutdown()
        self.app.state.store.engine.dispose()


ALICE, BOB = "tml-alice-0001", "tml-bob-00002"
LR = 1e-2
LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Qwen2 HF checkpoint (tests/dist/train_engine_worker.make_hf_dir)."""
    import train_engine_worker as w

    return w.make_hf_dir(tmp_path_factory.mktemp("serve_base") / "tiny-qwen2")


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    srv = RunningServer(base, tmp_path_factory.mktemp("serve_storage"))
    yield srv
    srv.stop()


def sdk_data(seed: int = 1, loss: str = "cross_entropy", lengths=LENGTHS) -> list:
    """``train_engine_worker.make_batch`` data as ``tinker.types.Datum`` (what the SDK sends)."""
    import train_engine_worker as w
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(list(d.model_input)),
                        loss_fn_inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()})
            for d in w.make_batch(seed=seed, lengths=lengths, loss=loss)]


def sampler_weights(srv: RunningServer, uri: str) -> dict:
    """The full model's tensors (HF names) of a ``sampler_weights`` tinker path: the merged model the server
    wrote (``model.safetensors``, ``--sampler-checkpoints merged`` or a full-parameter client), or, for an
    adapter checkpoint (a LoRA client's default), the base with the adapter merged by PEFT itself
    (``PeftModel.from_pretrained(base, folder).merge_and_unload()``: an independent referee, in float32)."""
    from safetensors.torch import load_file

    model_id, kind, name = uri.removeprefix("tinker://").split("/")
    folder = srv.storage / "checkpoints" / model_id / kind / name
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((folder / "base.json").read_text())["base_model"]
    bases = srv.app.state.bases
    hf = AutoModelForCausalLM.from_pretrained(bases.get(base).base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(hf, folder).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def adam():
    from tinker import types

    return types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)


def raw(srv: RunningServer, path: str, key: str | None = ALICE, **kw):
    """A POST with ``X-API-Key: key`` (None: no key), outside the SDK."""
    import httpx

    headers = kw.pop("headers", {})
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.post(srv.url + path, headers=headers, timeout=30, **kw)


def poll(srv: RunningServer, request_id: str, key: str = ALICE):
    """One ``retrieve_future`` long poll: the result, or ``try_again`` if it is still pending."""
    return raw(srv, "/api/v1/retrieve_future", key, json={"request_id": request_id, "allow_metadata_only": False})


def poll_done(srv: RunningServer, request_id: str, key: str = ALICE, limit_s: float = 120.0):
    """Long-poll ``request_id`` until it is no longer ``try_again`` (as the SDK does), at most ``limit_s``.

    One long poll returns after the server's window (seconds), so a slow machine can see ``try_again``
    for work that is merely still running (a model creation under load)."""
    import time

    deadline = time.monotonic() + limit_s
    while True:
        out = poll(srv, request_id, key)
        pending = out.headers.get("content-type", "").startswith("application/json") and \
            out.json().get("type") == "try_again"
        if not pending or time.monotonic() > deadline:
            return out
