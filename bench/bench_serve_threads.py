"""``ferrule serve``'s worker thread count, side by side in one process (issue 46).

Starts the service in process twice on a tiny random Qwen2 (tests/dist/train_engine_worker.make_hf_dir):
once as before issue 46 (the worker on torch's default thread count, every CPU), once as ``ferrule serve``
now starts it (``--worker-threads`` default: CPUs - 1; the event loop's thread 1). Each run: TENANTS LoRA
clients, one unnamed snapshot sampler each, then TENANTS threads send REQUESTS ``compute_logprobs`` each
through the tinker SDK at once. Prints seconds and requests/s per configuration, warm-up (first request)
included separately.

    python bench/bench_serve_threads.py [TENANTS] [REQUESTS] [--reversed]   (--reversed: "now" runs first)
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
PROMPT = [5, 9, 33, 2, 71, 14]


def run(base: Path, storage: Path, worker_threads, event_loop_threads, tenants: int, requests: int) -> tuple:
    import serve_helpers as h
    import uvicorn
    from tinker import types

    from ferrule.serve.app import create_app
    from ferrule.serve.backend import EngineBackend

    keys = {f"tml-bench-{i:04d}": f"t{i}" for i in range(tenants)}
    app = create_app(EngineBackend(base, model_name=h.MODEL_NAME), storage, keys, fwdbwd_max_chunk_len=1024,
                     worker_threads=worker_threads, event_loop_threads=event_loop_threads)
    srv = h.RunningServer.__new__(h.RunningServer)   # the helper's uvicorn thread, around this app
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv.port = sock.getsockname()[1]
    sock.close()
    srv.url, srv.app, srv.storage = f"http://127.0.0.1:{srv.port}", app, storage
    srv.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=srv.port, log_level="warning"))
    srv.thread = threading.Thread(target=srv.server.run, daemon=True)
    srv.thread.start()
    while not srv.server.started:
        time.sleep(0.02)
    try:
        samplers = []
        for i, key in enumerate(keys):
            tc = srv.client(key).create_lora_training_client(base_model=h.MODEL_NAME, rank=4, seed=i).result()
            samplers.append(tc.save_weights_and_get_sampling_client().result())
        t0 = time.monotonic()
        samplers[0].compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=600)
        first = time.monotonic() - t0

        def tenant(i: int) -> None:
            futs = [samplers[i].compute_logprobs(types.ModelInput.from_ints(PROMPT)) for _ in range(requests)]
            for f in futs:
                f.result(timeout=900)

        start = time.monotonic()
        threads = [threading.Thread(target=tenant, args=(i,)) for i in range(tenants)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return first, time.monotonic() - start
    finally:
        srv.stop()


def main() -> None:
    import torch
    import train_engine_worker as w

    from ferrule.serve.placement import default_worker_threads

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tenants = int(args[0]) if args else 4
    requests = int(args[1]) if len(args) > 1 else 50
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-threads-"))
    base = w.make_hf_dir(tmp / "tiny-qwen2")
    default = torch.get_num_threads()
    rows = []
    configs = [(f"before: worker on torch's default ({default} threads)", default, None),
               (f"now: --worker-threads {default_worker_threads()}, event loop 1", default_worker_threads(), 1)]
    if "--reversed" in sys.argv:
        configs.reverse()
    for label, wt, et in configs:
        first, seconds = run(base, tmp / f"s{len(rows)}", wt, et, tenants, requests)
        rows.append((label, first, seconds))
        torch.set_num_threads(default)
    n = tenants * requests
    for label, first, seconds in rows:
        print(f"{label}: first request {first:.2f} s; {n} requests in {seconds:.1f} s = {n / seconds:.1f} req/s")
    before, now = (rows[1], rows[0]) if "--reversed" in sys.argv else (rows[0], rows[1])
    print(f"requests/s, now / before: {before[2] / now[2]:.2f}x")


if __name__ == "__main__":
    main()
