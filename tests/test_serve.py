"""``ferrule serve`` driven by the unmodified ``tinker`` 0.38.0 SDK on a loopback port.

The server runs in this process (uvicorn in a thread, tests/serve_helpers.py) over a tiny
random Qwen2 on CPU. Referees: a :class:`TrainEngine` driven directly in this test (the same
data in one call), HF transformers' log-softmax over the sampler's weights, the same client
run alone, and the server's own state before a bad request. ``chunk_len=3`` makes the SDK split
every batch of more than three data into concurrent requests, the first one sent last.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402
from serve_helpers import KEYS, MODEL_NAME, RunningServer  # noqa: E402

tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
from tinker import types  # noqa: E402

ALICE, BOB = "tml-alice-0001", "tml-bob-00002"
LR = 1e-2
LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return w.make_hf_dir(tmp_path_factory.mktemp("serve_base") / "tiny-qwen2")


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    srv = RunningServer(base, tmp_path_factory.mktemp("serve_storage"))
    yield srv
    srv.stop()


def sdk_data(seed: int = 1, loss: str = "cross_entropy", lengths=LENGTHS) -> list:
    return [types.Datum(model_input=types.ModelInput.from_ints(list(d.model_input)),
                        loss_fn_inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()})
            for d in w.make_batch(seed=seed, lengths=lengths, loss=loss)]


def sampler_weights(srv: RunningServer, uri: str) -> dict:
    from safetensors.torch import load_file

    model_id, kind, name = uri.removeprefix("tinker://").split("/")
    return load_file(str(srv.storage / "checkpoints" / model_id / kind / name / "model.safetensors"))


def adam() -> types.AdamParams:
    return types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)


def raw(srv: RunningServer, path: str, key: str | None = ALICE, **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.post(srv.url + path, headers=headers, timeout=30, **kw)


def poll(srv: RunningServer, request_id: str, key: str = ALICE) -> httpx.Response:
    return raw(srv, "/api/v1/retrieve_future", key, json={"request_id": request_id, "allow_metadata_only": False})


# ---------------------------------------------------------------------------- training loops

def test_supervised_loop_loss_decreases_and_logprobs_match_hf(server, base):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    data = sdk_data(seed=11)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")   # chunked: 8 data, 3 per request
        step = tc.optim_step(adam())                       # pipelined behind the fb chunks
        out = fb.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == len(data)
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == list(LENGTHS)
        assert step.result().metrics["learning_rate:mean"] == pytest.approx(LR)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # logprobs of the trained model: the server's forward vs HF transformers over its sampler weights
    fwd = tc.forward(data, "cross_entropy").result()
    path = tc.save_weights_for_sampler("sl-final").result().path
    hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf.load_state_dict(sampler_weights(server, path), strict=False)
    with torch.no_grad():
        for d, o in zip(data, fwd.loss_fn_outputs):
            toks = torch.tensor([d.model_input.to_ints()])
            ref = torch.log_softmax(hf(toks).logits[0].double(), -1)
            ref = ref.gather(-1, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())[:, None])[:, 0]
            assert float((ref - torch.tensor(o["logprobs"].tolist()).double()).abs().max()) < 1e-5
    # the forward pass accumulated nothing: a step right after it changes nothing but Adam's clock
    assert fwd.metrics["loss:sum"] < losses[-1]


def test_chunked_forward_backward_is_bit_identical_to_one_engine_call(server, base):
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    data = sdk_data(seed=21)
    out = tc.forward_backward(data, "cross_entropy").result()   # 3 requests: seq 2, 3, then 1
    tc.optim_step(adam()).result()
    served = sampler_weights(server, tc.save_weights_for_sampler("split").result().path)
    from ferrule.serve.store import futures

    with server.app.state.store.engine.connect() as c:
        rows = c.execute(futures.select().where(futures.c.model_id == tc.model_id,
                                                futures.c.op == "forward_backward")).mappings().all()
    assert sorted(r["seq_id"] for r in rows) == [1, 2, 3]   # the SDK sent three chunks (3 + 3 + 2 data)

    ref = TrainEngine.from_hf(base, optimizer=OptimizerSettings(clip_grad=0.0))  # SDK: grad_clip_norm 0 = off
    ref_out = ref.forward_backward(w.make_batch(seed=21, lengths=LENGTHS), "cross_entropy")
    ref.optim_step(adam_params={"learning_rate": LR, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                "weight_decay": 0.0})
    for o, r in zip(out.loss_fn_outputs, ref_out.loss_fn_outputs):
        assert torch.equal(torch.tensor(o["logprobs"].tolist()), r["logprobs"])
    assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=1e-12)
    exported = dict(ref.export_hf_state())
    assert served.keys() <= exported.keys()
    assert all(torch.equal(served[k], exported[k]) for k in served)


def test_rl_loop_sampler_reflects_the_update(server, base):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    prompt = [3, 17, 42, 5]
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=123)
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
    assert len(res.sequences) == 4 and all(s.logprobs is not None for s in res.sequences)
    target = 7
    data = []
    for s in res.sequences:
        reward = sum(t == target for t in s.tokens) / len(s.tokens)
        toks = prompt + list(s.tokens)
        n_prompt = len(prompt) - 1
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "logprobs": [0.0] * n_prompt + list(s.logprobs),
                            "advantages": [0.0] * n_prompt + [reward - 0.25] * len(s.tokens)}))
    data.append(types.Datum(model_input=types.ModelInput.from_ints(prompt),
                            loss_fn_inputs={"target_tokens": prompt[1:] + [target], "logprobs": [0.0] * 3 + [-4.6],
                                            "advantages": [0.0] * 3 + [1.0]}))
    fb = tc.forward_backward(data, "importance_sampling").result()
    assert all("logprobs" in o for o in fb.loss_fn_outputs) and "loss:sum" in fb.metrics
    ppo = tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    assert "loss:sum" in ppo.metrics
    tc.optim_step(adam()).result()
    after = tc.save_weights_and_get_sampling_client()
    before_lp = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + [target])).result()
    after_lp = after.compute_logprobs(types.ModelInput.from_ints(prompt + [target])).result()
    assert before_lp[0] is None and after_lp[0] is None
    assert after_lp[-1] > before_lp[-1] + 1e-3   # the rewarded token became more likely
    # the new sampler's prompt logprobs equal the trainer's own (Megatron vs transformers engines)
    check = types.Datum(model_input=types.ModelInput.from_ints(prompt),
                        loss_fn_inputs={"target_tokens": prompt[1:] + [target], "weights": [0.0] * 4})
    trainer = tc.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(trainer, after_lp[1:])) < 1e-5


def _interleave_steps(tc, data_a, data_b):
    """fb(a) + fb(b) + step, twice; returns the fb losses."""
    losses = []
    for _ in range(2):
        losses.append(tc.forward_backward(data_a, "cross_entropy").result().metrics["loss:sum"])
        losses.append(tc.forward_backward(data_b, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(adam()).result()
    return losses


def test_two_tenants_interleaved_equal_each_alone(server):
    a_data, b_data = (sdk_data(seed=31, lengths=(4, 6)), sdk_data(seed=32, lengths=(5, 3))), \
        (sdk_data(seed=33, lengths=(7,)), sdk_data(seed=34, lengths=(2, 8)))
    alone = {}
    for key, data in ((ALICE, a_data), (BOB, b_data)):
        tc = server.client(key).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        alone[key] = (_interleave_steps(tc, *data), sampler_weights(server, tc.save_weights_for_sampler("alone").result().path))
    ta = server.client(ALICE).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    tb = server.client(BOB).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    futs = []
    for _ in range(2):  # submit both clients' requests before waiting on any
        futs.append((ALICE, ta.forward_backward(a_data[0], "cross_entropy")))
        futs.append((BOB, tb.forward_backward(b_data[0], "cross_entropy")))
        futs.append((ALICE, ta.forward_backward(a_data[1], "cross_entropy")))
        futs.append((BOB, tb.forward_backward(b_data[1], "cross_entropy")))
        ta.optim_step(adam()), tb.optim_step(adam())
    got = {ALICE: [], BOB: []}
    for key, f in futs:
        got[key].append(f.result().metrics["loss:sum"])
    for key, tc in ((ALICE, ta), (BOB, tb)):
        assert got[key] == alone[key][0]
        mixed = sampler_weights(server, tc.save_weights_for_sampler("mixed").result().path)
        assert all(torch.equal(mixed[k], alone[key][1][k]) for k in mixed)
    # tenant isolation: bob cannot load or sample alice's checkpoints, nor read her futures
    alice_state = ta.save_state("private").result().path
    alice_sampler = ta.save_weights_for_sampler("private-s").result().path
    bob = server.client(BOB)
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(alice_state).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=alice_sampler).sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result()
    sess = raw(server, "/api/v1/create_session", ALICE, json={"tags": []}).json()["session_id"]
    rid = raw(server, "/api/v1/create_model", ALICE, json={"session_id": sess, "model_seq_id": 0,
                                                             "base_model": MODEL_NAME}).json()["request_id"]
    assert poll(server, rid, BOB).status_code == 404
    assert poll(server, rid, ALICE).json()["model_id"] == f"{sess}:train:0"
    listing = httpx.get(server.url + "/api/v1/checkpoints", headers={"X-API-Key": BOB}).json()
    assert listing["checkpoints"] and all(not c["tinker_path"].startswith(f"tinker://{ta.model_id}/")
                                          for c in listing["checkpoints"])


# ---------------------------------------------------------------------------- persistence

def test_restart_keeps_checkpoints_and_resume_is_bit_identical(base, tmp_path):
    storage = tmp_path / "storage"
    srv = RunningServer(base, storage)
    try:
        tc = srv.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        data = sdk_data(seed=41, lengths=(6, 4))
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(adam()).result()
        state = tc.save_state("mid").result().path
        expected = []
        for _ in range(2):
            expected.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(adam()).result()
        expected_w = sampler_weights(srv, tc.save_weights_for_sampler("end").result().path)
        old_model = tc.model_id
        # a finished future and one that never ran (its seq_id waits for a predecessor forever)
        done_id = raw(srv, "/api/v1/save_weights", json={"model_id": old_model, "seq_id": 11, "path": "extra"}).json()["request_id"]
        assert poll(srv, done_id).json()["path"].endswith("/weights/extra")
        stuck_id = raw(srv, "/api/v1/optim_step", json={"model_id": old_model, "seq_id": 99,
                                                        "adam_params": {"learning_rate": 0.0}}).json()["request_id"]
    finally:
        srv.stop()
    srv = RunningServer(base, storage)
    try:
        assert srv.app.state.store.journal_mode() == "wal"
        assert poll(srv, done_id).json()["path"] == f"tinker://{old_model}/weights/extra"
        failed = poll(srv, stuck_id).json()
        assert failed["category"] == "server" and "restarted" in failed["error"]
        sc = srv.client()
        paths = {c.tinker_path for c in sc.create_rest_client().list_checkpoints(old_model).result().checkpoints}
        assert {state, f"tinker://{old_model}/sampler_weights/end"} <= paths
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        got = []
        for _ in range(2):
            got.append(resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            resumed.optim_step(adam()).result()
        assert got == expected
        w2 = sampler_weights(srv, resumed.save_weights_for_sampler("end2").result().path)
        assert all(torch.equal(w2[k], expected_w[k]) for k in w2)
        # without the optimizer: same weights, Adam restarts, so the continuation differs
        fresh = sc.create_training_client_from_state(state).result()
        first = fresh.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        assert first == expected[0]
        fresh.optim_step(adam()).result()
        assert fresh.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] != expected[1]
        # the old model id is gone from this process: a clear 410, not a hang
        r = raw(srv, "/api/v1/optim_step", json={"model_id": old_model, "seq_id": 12, "adam_params": {}})
        assert r.status_code == 410 and "saved state" in r.json()["detail"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- protocol semantics

def test_seq_order_idempotency_and_metrics(server):
    sess = raw(server, "/api/v1/create_session", json={"tags": []}).json()["session_id"]
    rid = raw(server, "/api/v1/create_model", json={"session_id": sess, "model_seq_id": 0,
                                                     "base_model": MODEL_NAME}).json()["request_id"]
    model_id = poll(server, rid).json()["model_id"]
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
    out = poll(server, fb1)
    assert out.headers["content-type"] == "application/x-protobuf"
    metrics = poll(server, step).json()["metrics"]
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
    assert httpx.get(server.url + "/api/v1/healthz").json() == {"status": "ok"}


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
    import subprocess

    monkeypatch.delenv("FERRULE_SERVE_API_KEYS", raising=False)
    exe = Path(sys.executable).with_name("ferrule")
    r = subprocess.run([str(exe), "serve", "--base-model", str(base), "--storage", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "API keys" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([str(exe), "serve", "--base-model", str(tmp_path / "nope"), "--api-keys", str(tmp_path / "k")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr


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
        tc = tinker.ServiceClient(base_url=url, api_key="tml-cli-key-1").create_lora_training_client(
            base_model=MODEL_NAME, rank=4).result()
        data = sdk_data(seed=61, lengths=(5, 7))
        first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(adam()).result()
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < first
        text = httpx.get(url + "/metrics").text
        assert 'ferrule_serve_ops_total{op="forward_backward",status="ok"} 1.0' in text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    lines = [ln for ln in log.read_text().splitlines() if "op=forward_backward" in ln]
    assert len(lines) == 1 and "client=carol" in lines[0] and "data=2" in lines[0] and "tokens=12" in lines[0] \
        and "run_s=" in lines[0], lines


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
