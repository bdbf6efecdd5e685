"""``ferrule serve`` driven by the unmodified ``tinker`` 0.38.0 SDK on a loopback port: training loops.

The server runs in this process (uvicorn in a thread, tests/serve_helpers.py) over a tiny
random Qwen2 on CPU. Referees: a :class:`TrainEngine` driven directly in this test (the same
data in one call), HF transformers' log-softmax over the sampler's weights, the same client
run alone, and an uninterrupted run (for resume after a restart). ``chunk_len=3`` makes the SDK
split every batch of more than three data into concurrent requests, the first one sent last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
import train_engine_worker as w  # noqa: E402
from serve_helpers import (ALICE, BOB, LENGTHS, LR, MODEL_NAME, RunningServer, adam, base, poll, raw,  # noqa: E402,F401
                           sampler_weights, sdk_data, server)  # base, server: fixtures
from tinker import types  # noqa: E402


# ---------------------------------------------------------------------------- training loops

def test_supervised_loop_loss_decreases_and_logprobs_match_hf(server, base):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4   # a LoRA engine: the forward below checks the merged adapters
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
    path = tc.save_weights_for_sampler("split").result().path
    from ferrule.serve.store import futures

    with server.app.state.store.engine.connect() as c:
        rows = c.execute(futures.select().where(futures.c.model_id == tc.model_id,
                                                futures.c.op == "forward_backward")).mappings().all()
    assert sorted(r["seq_id"] for r in rows) == [1, 2, 3]   # the SDK sent three chunks (3 + 3 + 2 data)

    from safetensors.torch import load_file

    from ferrule.lora import hf_adapter_state_dict

    lora = server.app.state.backend.lora_settings({"rank": 4})       # what create_lora_training_client(rank=4) gets
    ref = TrainEngine.from_hf(base, optimizer=OptimizerSettings(clip_grad=0.0), lora=lora)  # SDK: grad_clip_norm 0 = off
    ref_out = ref.forward_backward(w.make_batch(seed=21, lengths=LENGTHS), "cross_entropy")
    ref.optim_step(adam_params={"learning_rate": LR, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                "weight_decay": 0.0})
    for o, r in zip(out.loss_fn_outputs, ref_out.loss_fn_outputs):
        assert torch.equal(torch.tensor(o["logprobs"].tolist()), r["logprobs"])
    assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=1e-12)
    # the sampler checkpoint (a LoRA client's: its PEFT adapter, by default) holds exactly the reference's adapter
    folder = server.storage / "checkpoints" / tc.model_id / "sampler_weights" / "split"
    served = load_file(str(folder / "adapter_model.safetensors"))
    exported = {k: v.cpu() for k, v in hf_adapter_state_dict(ref).items()}
    assert served.keys() == exported.keys() and path.endswith("/split")
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
    # the two LoRA clients hold one copy of the frozen base (issue 16 item 3), their adapters apart
    frozen, trained = ({}, {}), ({}, {})
    for k, tc in enumerate((ta, tb)):
        for name, p in server.backend.engine(tc.model_id).model[0].named_parameters():
            (trained if p.requires_grad else frozen)[k][name] = p.data_ptr()
    assert frozen[0] and frozen[0] == frozen[1]
    assert trained[0] and all(trained[0][n] != trained[1][n] for n in trained[0])
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
