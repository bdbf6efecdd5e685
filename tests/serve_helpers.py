"""Start ``ferrule serve``'s app on a loopback port in this process (uvicorn in a thread), for
tests/test_serve.py. The client under test is the unmodified ``tinker`` 0.38.0 SDK."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

KEYS = {"tml-alice-0001": "alice", "tml-bob-00002": "bob"}
MODEL_NAME = "tiny-qwen2"


class RunningServer:
    """A served app: ``url``, ``storage``, ``app``; :meth:`stop` shuts uvicorn and the worker."""

    def __init__(self, base: Path, storage: Path, *, chunk_len: int = 3, long_poll_s: float = 5.0):
        import uvicorn

        from ferrule.serve.app import create_app
        from ferrule.serve.backend import EngineBackend

        self.storage = storage
        backend = EngineBackend(base, model_name=MODEL_NAME)
        self.app = create_app(backend, storage, dict(KEYS), long_poll_s=long_poll_s, fwdbwd_max_chunk_len=chunk_len)
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
        return tinker.ServiceClient(base_url=self.url, api_key=key)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.scheduler.shutdown()
        self.app.state.store.engine.dispose()
