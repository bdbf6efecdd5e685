"""``ferrule serve`` and the tinker 0.38.0 SDK: protocol semantics (seq_id order, retries, metrics),
auth, bad input, the CLI process, sessions, sampling batches. Same in-process server as
tests/test_serve.py; bad input is checked against a client that never saw it.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
import train_engine_worker as w  # noqa: E402
from serve_helpers import (ALICE, LR, MODEL_NAME, adam, base, close_sdk_clients, poll, poll_done, raw,  # noqa: E402,F401
                           sampler_weights, sdk_data, server, track_sdk_clients)  # base, server: fixtures
from tinker import types  # noqa: E402


# ---------------------------------------------------------------------------- protocol semantics

def test_seq_order_idempotency_and_metrics(server):
    sess = raw(server, "/api/v1/create_session", json={"tags": []}).json()["session_id"]
    rid = raw(server, "/api/v1/create_model", json={"session_id": sess, "model_seq_id": 0,
                                                     "base_model": MODEL_NAME}).json()["request_id"]
    model_id = poll_done(server, rid).json()["model_id"]
    # optim_step (seq 2) arrives before forward_backward (seq 1); the step must still see fb's gradient
    from ferrule.serve.wire import pb

    req = pb().ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = torch.tensor([1, 2, 3], dtype=torch.int32).numpy().tobytes()
    for k, v, dt in (("target_tokens", [2, 3, 4], 2), ("weights", [1.0, 1.0, 1.0], 1)):
        t = d.loss_fn_inputs[k]
        t.dtype, t.dense = dt, torch.tensor(v, dtype=torch.int64 if dt == 2 else torch.float32).numpy().tobytes()
        t.shape.append(3)
    body = req.SerializeToString()
    step = raw(server, "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                   "adam_params": {"learning_rate": LR}}).json()["request_id"]
    assert poll(server, step).json()["type"] == "try_again"     # waits for seq 1
    hdr = {"Content-Type": "application/x-protobuf", "X-Idempotency-Key": "k-" + uuid.uuid4().hex}
    fb1 = raw(server, "/api/v1/forward_backward", content=body, headers=dict(hdr)).json()["request_id"]
    fb2 = raw(server, "/api/v1/forward_backward", content=body, headers=dict(hdr)).json()["request_id"]
    fb3 = raw(server, "/api/v1/forward_backward", content=body,
              headers={"Content-Type": "application/x-protobuf", "X-Idempotency-Key": "other"}).json()["request_id"]
    assert fb1 == fb2 == fb3   # same idempotency key, or a retry of the same (model, seq_id)
    out = poll_done(server, fb1)
    assert out.headers["content-type"] == "application/x-protobuf"
    metrics = poll_done(server, step).json()["metrics"]
    assert metrics["grad_norm:mean"] > 0                 # the step saw fb's gradient: fb ran first
    assert all(k.count(":") == 1 for k in metrics)
    text = httpx.get(server.url + "/metrics").text
    runs = [line for line in text.splitlines() if line.startswith('ferrule_serve_ops_total{op="forward_backward"')]
    assert runs and float(runs[0].split()[-1]) >= 1
    assert "ferrule_serve_deduplicated_total" in text and "ferrule_serve_op_seconds_bucket" in text


def test_auth_wrong_or_missing_key_is_401_and_touches_nothing(server):
    from ferrule.serve.store import sessions

    def count():
        with server.app.state.store.engine.connect() as c:
            return c.execute(sessions.select()).fetchall().__len__()

    before = count()
    for key in (None, "tml-wrong-key", "not-a-key"):
        r = raw(server, "/api/v1/create_session", key, json={"tags": []})
        assert r.status_code == 401 and "API key" in r.json()["detail"]
    assert count() == before
    with pytest.raises(tinker.AuthenticationError):
        server.client("tml-unknown-key").create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    assert count() == before
    health = httpx.get(server.url + "/api/v1/healthz").json()   # open: no key needed
    assert health["status"] == "ok"
    # where the sampler runs (issue 46): this CPU machine's sampler is the exact fp32 CPU path
    # and what a LoRA client's sampler weights are (the default: its adapter, merged only where it must be)
    from ferrule.serve.backend import SAMPLER_CHECKPOINTS

    assert health["samplers"][MODEL_NAME] == {"device": "cpu", "dtype": "float32", "loaded": True,
                                              "fast_decode": False, "cuda_graph": False, "checkpoints": "auto",
                                              "checkpoints_rule": SAMPLER_CHECKPOINTS["auto"]}
    assert health["cuda_memory"] is None   # no CUDA in this process (on a GPU: its allocator's bytes)
    caps = httpx.get(server.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": ALICE}).json()
    assert caps["supported_models"][0]["sampler"] == health["samplers"][MODEL_NAME]


def test_bad_input_is_4xx_and_leaves_the_model_unchanged(server):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    ref = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    good = sdk_data(seed=51, lengths=(5, 4))
    tc.forward_backward(good, "cross_entropy").result()          # an open accumulation window
    ref.forward_backward(good, "cross_entropy").result()
    vocab = w.VOCAB
    bad_calls = {
        "unknown loss": lambda: tc.forward_backward(good, "no_such_loss"),
        "token outside vocab": lambda: tc.forward_backward([types.Datum(
            model_input=types.ModelInput.from_ints([1, vocab + 5]),
            loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})], "cross_entropy"),
        "target outside vocab": lambda: tc.forward_backward([types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={"target_tokens": [2, vocab], "weights": [1.0, 1.0]})], "cross_entropy"),
        "mismatched lengths": lambda: tc.forward_backward([types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})], "cross_entropy"),
        "missing advantages": lambda: tc.forward_backward(good, "importance_sampling"),
        "unknown model": lambda: sc.create_lora_training_client(base_model="no/such-model", rank=4),
    }
    for what, call in bad_calls.items():
        with pytest.raises(tinker.BadRequestError) as info:
            call().result()
        assert info.value.status_code == 400 and info.value.body, what
    # raw: malformed protobuf, unknown model id, unknown future id, a path escaping the storage root
    r = raw(server, "/api/v1/forward_backward", content=b"\xff\x00garbage", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]
    r = raw(server, "/api/v1/optim_step", json={"model_id": "sess-nope:train:0", "seq_id": 1, "adam_params": {}})
    assert r.status_code == 404 and "sess-nope:train:0" in r.json()["detail"]
    r = poll(server, "req-does-not-exist")
    assert r.status_code == 404 and "req-does-not-exist" in r.json()["detail"]
    for uri in (f"tinker://{tc.model_id}/weights/..", f"tinker://../weights/x", "tinker:///etc/weights/passwd",
                "/etc/passwd"):
        with pytest.raises((tinker.BadRequestError, ValueError)):
            sc.create_training_client_from_state(uri).result()
    with pytest.raises(tinker.BadRequestError):
        tc.save_state("../escape").result()
    # the window holds exactly the good batch: the same step as the reference client, bit for bit
    tc.optim_step(adam()).result()
    ref.optim_step(adam()).result()
    got = sampler_weights(server, tc.save_weights_for_sampler("after-bad").result().path)
    want = sampler_weights(server, ref.save_weights_for_sampler("ref").result().path)
    assert all(torch.equal(got[k], want[k]) for k in got)
    # and the client keeps working after the refusals
    assert tc.forward(good, "cross_entropy").result().metrics["loss:sum"] > 0


def test_api_keys_and_tinker_paths_are_checked(tmp_path, monkeypatch):
    from ferrule.serve.paths import PathError, load_api_keys, parse_tinker_path

    f = tmp_path / "keys"
    f.write_text("# team keys\ntml-first-key alice\ntml-second-key\n")
    monkeypatch.setenv("FERRULE_SERVE_API_KEYS", "tml-env-key-1=carol")
    keys = load_api_keys(f)
    assert keys["tml-first-key"] == "alice" and keys["tml-env-key-1"] == "carol"
    assert keys["tml-second-key"].startswith("tenant-")
    f.write_text("sk-wrong\n")
    with pytest.raises(ValueError, match="tml-"):
        load_api_keys(f)
    cp = parse_tinker_path("tinker://sess-1:train:0/weights/step_10")
    assert (cp.model_id, cp.kind, cp.name) == ("sess-1:train:0", "weights", "step_10")
    assert cp.directory(tmp_path) == (tmp_path / "checkpoints" / "sess-1:train:0" / "weights" / "step_10").resolve()
    for bad in ("tinker://a/weights/..", "tinker://../weights/x", "tinker://a/weights/b/c", "tinker://a/other/b",
                "tinker://a/weights/.hidden", "file:///etc/passwd", "tinker:///weights/x"):
        with pytest.raises(PathError):
            parse_tinker_path(bad)


def test_cli_refuses_missing_keys_in_one_line(base, tmp_path, monkeypatch):
    from inproc import run_ferrule

    monkeypatch.delenv("FERRULE_SERVE_API_KEYS", raising=False)
    r = run_ferrule(["serve", "--base-model", base, "--storage", tmp_path / "s"])
    assert r.returncode == 2 and "API keys" in r.stderr and "Traceback" not in r.stderr
    r = run_ferrule(["serve", "--base-model", tmp_path / "nope", "--api-keys", tmp_path / "k"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # the keys are checked before the model loads (minutes for a real one): an unloadable model is not
    # even opened when no key is given
    import shutil

    broken = shutil.copytree(base, tmp_path / "broken")
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    r = run_ferrule(["serve", "--base-model", broken, "--storage", tmp_path / "s"])
    assert r.returncode == 2 and "no API keys" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_ferrule_serve_command_on_loopback(base, tmp_path):
    """The real `ferrule serve` process: the SDK trains through it, each operation is logged
    once (client, op, data, tokens, seconds) and counted at /metrics."""
    import os
    import signal
    import socket
    import subprocess

    keys = tmp_path / "keys.txt"
    keys.write_text("tml-cli-key-1 carol\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {k: v for k, v in os.environ.items() if k != "FERRULE_SERVE_API_KEYS"}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("ferrule")), "serve", "--base-model", str(base),
                                 "--model-name", MODEL_NAME, "--port", str(port), "--storage", str(tmp_path / "s"),
                                 "--api-keys", str(keys)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        os.environ["TINKER_TELEMETRY"] = "0"
        track_sdk_clients()
        tc = tinker.ServiceClient(base_url=url, api_key="tml-cli-key-1").create_lora_training_client(
            base_model=MODEL_NAME, rank=4).result()
        data = sdk_data(seed=61, lengths=(5, 7))
        first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(adam()).result()
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < first
        text = httpx.get(url + "/metrics").text
        assert 'ferrule_serve_ops_total{op="forward_backward",status="ok"} 1.0' in text
        tc.save_state("kept").result()
    finally:
        close_sdk_clients(url)  # the SDK session's heartbeat would outlive the server (nothing sent to it)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    # Ctrl-C: exit code 0 and one line saying what stays on disk (it printed nothing and exited 130)
    stopped = [ln for ln in log.read_text().splitlines() if ln.startswith("ferrule serve: stopped")]
    assert rc == 0 and stopped == [f"ferrule serve: stopped; {tmp_path / 's'} keeps serve.sqlite3 and 1 saved "
                                   "checkpoint(s); 1 training client(s) held their state in memory only (gone; resume "
                                   "from a saved state with create_training_client_from_state_with_optimizer)."], \
        (rc, log.read_text()[-3000:])
    assert "Traceback" not in log.read_text()
    assert "Loading weights" not in log.read_text()  # transformers' bar of each model load, between the log lines
    lines = [ln for ln in log.read_text().splitlines() if "op=forward_backward" in ln]
    assert len(lines) == 1 and "client=carol" in lines[0] and "data=2" in lines[0] and "tokens=12" in lines[0] \
        and f"base={MODEL_NAME} " in lines[0] \
        and "run_s=" in lines[0], lines
    # a ready line once it listens; megatron's per-parameter INFO lines for each new client's engine stay out
    text = log.read_text()
    assert f"ferrule serve: ready on http://127.0.0.1:{port}" in text, text[-3000:]
    assert "sampler checkpoints auto: a LoRA client's PEFT adapter" in text, text[-3000:]
    assert "Params for bucket" not in text and not any(ln.startswith("\t") for ln in text.splitlines()), text[-3000:]


def test_finishing_a_session_frees_its_training_clients(server):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    tc.forward_backward(sdk_data(seed=71, lengths=(3,)), "cross_entropy").result()
    assert tc.model_id in server.app.state.backend.engines
    sc.close("success").result()
    r = raw(server, "/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 2, "adam_params": {}})
    assert r.status_code == 410 and "saved state" in r.json()["detail"]
    deadline = time.monotonic() + 30
    while tc.model_id in server.app.state.backend.engines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tc.model_id not in server.app.state.backend.engines


def test_concurrent_unseeded_samples_share_one_generate_call(server, caplog):
    """Greedy requests waiting together run as one batched generate call and give the tokens
    each gives alone (a seeded request always runs alone)."""
    import logging

    sc = server.client()
    sampler = sc.create_sampling_client(base_model=MODEL_NAME)
    prompts = [[5, 9, 2], [17, 3, 44, 8, 1], [60], [7, 7, 7, 7]]
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    alone = [sampler.sample(types.ModelInput.from_ints(p), 1, types.SamplingParams(max_tokens=5, temperature=0.0,
                                                                                   seed=1)).result()
             for p in prompts]
    blocker = tinker.ServiceClient(base_url=server.url, api_key=ALICE).create_lora_training_client(
        base_model=MODEL_NAME, rank=4).result()
    with caplog.at_level(logging.INFO, logger="ferrule.serve"):
        busy = blocker.forward_backward(sdk_data(seed=81), "cross_entropy")   # keeps the worker busy
        futs = [sampler.sample(types.ModelInput.from_ints(p), 1, greedy) for p in prompts]
        together = [f.result() for f in futs]
        busy.result()
    assert [r.sequences[0].tokens for r in together] == [r.sequences[0].tokens for r in alone]
    for a, b in zip(together, alone):
        assert max(abs(x - y) for x, y in zip(a.sequences[0].logprobs, b.sequences[0].logprobs)) < 1e-5
    batches = [int(r.getMessage().split("batch=")[1].split()[0]) for r in caplog.records
               if r.getMessage().startswith("op=sample")]
    assert max(batches) > 1, batches


def test_engine_forward_matches_forward_backward_without_touching_gradients(base):
    """TrainEngine.forward (what the service's `forward` runs): the outputs and metrics of
    forward_backward, no gradient accumulated; check_batch raises what forward_backward raises."""
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    engine = TrainEngine.from_hf(base, optimizer=OptimizerSettings())
    batch = w.make_batch(seed=91, lengths=(4, 6))
    fwd = engine.forward(batch, "cross_entropy")
    assert all(float(p.main_grad.abs().max()) == 0 for p in engine.model[0].module.parameters())
    fb = engine.forward_backward(batch, "cross_entropy")
    assert fwd.metrics == fb.metrics and set(fwd.metrics) >= {"loss:sum", "tokens:sum"}
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs):
        assert torch.equal(a["logprobs"], b["logprobs"]) and torch.equal(a["elementwise_loss"], b["elementwise_loss"])
    with pytest.raises(ValueError, match="outside"):
        engine.check_batch([{"model_input": [1, w.VOCAB], "loss_fn_inputs": {"target_tokens": [1, 2],
                                                                             "weights": [1.0, 1.0]}}], "cross_entropy")


@pytest.mark.timeout(120)
def test_stopping_a_test_server_stops_its_sdk_clients_heartbeats(base, tmp_path):
    """An SDK client must not outlive its test server: the SDK's heartbeat task otherwise keeps running and, 2
    minutes later, logs warnings into whichever test this worker runs next (a CLI test asserting its exact stderr
    failed on them in a CI rehearsal). The referee is the SDK's own heartbeat task: running before, cancelled
    after, also for a client the test dropped."""
    import asyncio
    import gc

    from serve_helpers import RunningServer

    srv = RunningServer(base, tmp_path / "storage")
    try:
        sc = srv.client()
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        task = sc._session_holder._session_heartbeat_task  # tinker 0.38: a concurrent future of the asyncio task
        task = task if isinstance(task, asyncio.Task) else task.result(timeout=10)
        assert not task.done()
        del sc  # a client the test dropped: collected, while its session's heartbeat would run on
        gc.collect()
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while not task.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert task.cancelled()
