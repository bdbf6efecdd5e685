"""Faults of ``ferrule serve`` found by replaying public reports and a load / fault trial (issue 26),
each driven by the unmodified ``tinker`` 0.38.0 SDK where the SDK can trigger it.

Referees: PEFT 0.21 (``PeftModel.from_pretrained`` + ``merge_and_unload`` on the adapter the engine
exports) for the Qwen3-MoE merge, HF transformers' log-softmax over the weights a checkpoint holds
on disk for the re-saved sampler, and the SDK's own futures (a wedged client never resolves).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
peft = pytest.importorskip("peft", reason="peft (the dev extra) is the HF PEFT referee")
from serve_helpers import (ALICE, BOB, MODEL_NAME, RunningServer, adam, base, raw,  # noqa: E402,F401
                           sampler_weights, sdk_data, server)  # base, server: fixtures
from tinker import types  # noqa: E402

PROMPT = [3, 17, 42, 5, 60, 11, 29]
#: a Qwen3-MoE LoRA delta must match PEFT's merge_and_unload to float32 rounding
MERGE_ATOL = 1e-6


def prompt_logprobs(sc, tokens=PROMPT) -> torch.Tensor:
    lp = sc.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=120)
    return torch.tensor(lp[1:], dtype=torch.float64)


def hf_prompt_logprobs(model, tokens=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokens])
        lp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return lp[:-1].gather(-1, ids[0, 1:, None])[:, 0]


def train(tc, steps: int, seed: int = 1) -> None:
    for i in range(steps):
        tc.forward_backward(sdk_data(seed=seed + i), "cross_entropy")
        tc.optim_step(adam()).result(timeout=120)


# ---------------------------------------------------------------------------- the API-key file format

def test_serve_help_shows_the_full_api_keys_format():
    from typer.testing import CliRunner

    from ferrule.cli import app

    for columns in ("200", "80"):  # at 80 columns rich cuts a word longer than the help column with '…'
        res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": columns, "NO_COLOR": "1"})
        assert res.exit_code == 0, res.output
        text = re.sub(r"[\s│]+", " ", res.output)
        assert "'tml-KEY [TENANT]'" in text and "tml-KEY[=TENANT]" in text and "'#' starts a comment" in text, columns
        assert "FERRULE_SERVE_API_KEYS" in text and "…" not in res.output, res.output


def test_ctrl_c_while_the_base_loads_prints_one_line(tmp_path, monkeypatch):
    """A Ctrl-C before the server listens (here: raised where the base model loads) ends with one line and exit 130,
    no traceback, and nothing in --storage (it exited 130 silently)."""
    from typer.testing import CliRunner

    import ferrule.cli.serve as serve_cli
    from ferrule.cli import app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, "build_app", interrupted)
    res = CliRunner().invoke(app, ["serve", "--base-model", str(tmp_path), "--storage", str(tmp_path / "s")],
                             env={"FERRULE_SERVE_API_KEYS": "tml-ctrl-c-key"})
    assert res.exit_code == 130 and not isinstance(res.exception, KeyboardInterrupt), res.output
    assert re.fullmatch(r"ferrule serve: stopped while loading the base model, before it was ready \(\d+ s\); "
                        r"nothing was served\.\n", res.output), res.output
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------- Qwen3-MoE LoRA sampler weights

@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from ferrule.conformance import numeric as cn

    root = tmp_path_factory.mktemp("serve_moe")
    srv = RunningServer(cn.tiny_hf_dir("qwen3_moe", root / "tiny-qwen3-moe"), root / "storage")
    yield srv
    srv.stop()


def test_qwen3_moe_lora_with_train_mlp_samples_the_peft_merged_weights(moe_server, tmp_path, caplog):
    """The SDK's default LoRA (train_mlp) adapts the routed experts, which PEFT holds in its
    target_parameters layout; batched decode does not serve those unmerged, so the default
    ``--sampler-checkpoints auto`` merges them, saying so in the log (``adapter`` refuses them); the
    sampler weights must be PEFT's merge of exactly that adapter."""
    import logging

    from ferrule.lora import hf_adapter_state_dict, peft_config

    srv = moe_server
    sc = srv.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    train(tc, 2)
    caplog.set_level(logging.INFO, logger="ferrule.serve")
    path = tc.save_weights_for_sampler("moe-policy").result(timeout=120).path
    sampler = tc.save_weights_and_get_sampling_client().result()   # the unnamed snapshot merges the same way
    said = [r.getMessage() for r in caplog.records if "merged, not the adapter" in r.getMessage()]
    assert len(said) == 2 and all(tc.model_id in m and "mlp.experts.gate_up_proj" in m for m in said), said
    assert (srv.storage / "checkpoints" / tc.model_id / "sampler_weights" / "moe-policy" / "model.safetensors").is_file()
    srv.backend.sampler_checkpoints = "adapter"
    try:
        with pytest.raises(ValueError, match="--sampler-checkpoints adapter: .*target_parameters.* auto"):
            srv.backend.sampler_format(tc.model_id)
    finally:
        srv.backend.sampler_checkpoints = "auto"
    # referee: PEFT on the adapter the engine exports (routed experts in target_parameters layout)
    import lora_worker as lw

    engine = srv.backend.engines[tc.model_id]
    tensors = {k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()}
    config = peft_config(engine)
    assert "mlp.experts.gate_up_proj" in config["target_parameters"]
    assert any("mlp.experts.base_layer.lora_A" in k for k in tensors)
    base_model = Qwen3MoeForCausalLM.from_pretrained(srv.backend.base_dir, dtype=torch.float32).eval()
    base_lp = hf_prompt_logprobs(base_model)
    peft_model = peft.PeftModel.from_pretrained(base_model, lw.write_peft_dir(tmp_path / "adapter", tensors, config))
    ref_lp = hf_prompt_logprobs(peft_model.eval())
    assert float((ref_lp - base_lp).abs().max()) > 1e-3   # the adapter changes the model: a real check
    ref_sd = peft_model.merge_and_unload().state_dict()
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_bytes((srv.backend.base_dir / "config.json").read_bytes())
    from safetensors.torch import save_file

    save_file(sampler_weights(srv, path), str(served / "model.safetensors"))
    ours = Qwen3MoeForCausalLM.from_pretrained(served, dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(ref_sd)
    worst = max(float((ours[k].double() - ref_sd[k].double()).abs().max()) for k in ref_sd)
    assert worst <= MERGE_ATOL, worst
    for client in (sc.create_sampling_client(model_path=path).result(), sampler):
        assert float((prompt_logprobs(client) - ref_lp).abs().max()) < 1e-5


def test_unmergeable_adapter_key_is_an_error_before_anything_is_written(moe_server, monkeypatch):
    import ferrule.lora
    from ferrule.serve.merge import MergeError

    srv = moe_server
    backend = srv.backend
    mid = "direct:train:0"
    backend.create(mid, backend.lora_settings({"rank": 2}))
    real = ferrule.lora.hf_adapter_state_dict
    bogus = "base_model.model.model.layers.0.mlp.not_a_module"

    def with_bogus_key(engine, **kw):
        out = real(engine, **kw)
        out[bogus + ".lora_A.weight"] = torch.zeros(2, 32)
        out[bogus + ".lora_B.weight"] = torch.zeros(32, 2)
        return out

    monkeypatch.setattr(ferrule.lora, "hf_adapter_state_dict", with_bogus_key)
    target = srv.storage / "checkpoints" / mid / "sampler_weights" / "never"
    with pytest.raises(MergeError, match=re.escape(bogus)):
        backend.save_sampler_weights(mid, target)
    assert not target.exists() and not target.with_name("never.tmp").exists()
    backend.drop(mid)


# ---------------------------------------------------------------------------- a sampler checkpoint saved again

def test_resaving_a_sampler_checkpoint_serves_the_new_weights(server, base):
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    train(tc, 1, seed=31)
    path = tc.save_weights_for_sampler("policy").result(timeout=120).path
    first = sc.create_sampling_client(model_path=path).result()
    lp_first = prompt_logprobs(first)          # the rollout engine now holds these weights
    train(tc, 2, seed=41)
    assert tc.save_weights_for_sampler("policy").result(timeout=120).path == path
    hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf.load_state_dict(sampler_weights(server, path), strict=False)   # what the checkpoint holds now
    ref = hf_prompt_logprobs(hf)
    assert float((ref - lp_first).abs().max()) > 1e-3
    fresh = sc.create_sampling_client(model_path=path).result()
    assert float((prompt_logprobs(fresh) - ref).abs().max()) < 1e-5
    # an open sampling session samples what its checkpoint holds when each request is admitted
    assert float((prompt_logprobs(first) - ref).abs().max()) < 1e-5


def test_request_admitted_before_an_overwrite_never_runs_on_the_new_weights(server):
    """A request pinned to one save of a checkpoint that is saved again before it runs fails
    with a message saying so (it never runs on weights it was not admitted for)."""
    from ferrule.serve.backend import SampleSpec

    backend = server.backend
    mid = "direct:train:1"
    backend.create(mid, backend.lora_settings({"rank": 4}))
    target = server.storage / "checkpoints" / mid / "sampler_weights" / "pinned"
    backend.save_sampler_weights(mid, target)
    admitted = backend.saved_weights(target)
    backend.save_sampler_weights(mid, target)
    spec = SampleSpec(PROMPT, 1, backend.sampling_params({"max_tokens": 2}, len(PROMPT), 1), False)
    with pytest.raises(LookupError, match="saved again"):
        backend.sample(admitted, [spec])
    backend.sample(backend.saved_weights(target), [spec])
    backend.drop(mid)


# ---------------------------------------------------------------------------- refusals during decode

def test_a_request_refused_while_decoding_consumes_its_seq_id(server):
    """The SDK sends an image chunk (this server has no tower for the tiny Qwen2): the refusal
    must consume that seq_id, or every later request of the client waits forever."""
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    image = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                                             types.ImageChunk(data=b"\x89PNG", format="png",
                                                                              expected_tokens=4)]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6, 7], "weights": [1.0] * 6})
    with pytest.raises(tinker.BadRequestError, match="image"):
        tc.forward_backward([image], "cross_entropy").result(timeout=60)
    out = tc.forward_backward(sdk_data(seed=5, lengths=(4, 6)), "cross_entropy").result(timeout=60)
    assert len(out.loss_fn_outputs) == 2
    assert tc.optim_step(adam()).result(timeout=60).metrics["learning_rate:mean"] > 0


def test_an_undecodable_body_with_readable_ids_consumes_its_seq_id(server):
    """A body whose model_id / seq_id fields are readable but whose data are not (a truncated
    datum) is refused with 400 and its seq_id consumed; a body naming no client is a plain 400."""
    from ferrule.serve.wire import pb

    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    msg = pb().ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy")
    body = msg.SerializeToString() + b"\x1a\x40\x0a"   # field 3 (data): 64 bytes announced, 1 sent
    res = raw(server, "/api/v1/forward_backward", ALICE, content=body,
              headers={"Content-Type": "application/x-protobuf"})
    assert res.status_code == 400 and "protobuf" in res.json()["detail"]
    assert server.app.state.scheduler.expected_seq(tc.model_id) in (1, 2)
    # the SDK's own next request carries seq_id 1 as well (it did not send the raw one): refused as used;
    # the one after runs, so the client goes on instead of waiting for seq 1 forever
    with pytest.raises(tinker.BadRequestError, match="already used"):
        tc.forward_backward(sdk_data(seed=6, lengths=(4,)), "cross_entropy").result(timeout=60)
    assert tc.optim_step(adam()).result(timeout=60).metrics["learning_rate:mean"] > 0
    res = raw(server, "/api/v1/forward_backward", ALICE, content=b"\xff\xff\xff",
              headers={"Content-Type": "application/x-protobuf"})
    assert res.status_code == 400 and "names no training client" in res.json()["detail"]


# ---------------------------------------------------------------------------- sampler snapshots

def test_unnamed_snapshots_are_per_tenant_and_an_evicted_one_says_so(server):
    from ferrule.serve.backend import MAX_SNAPSHOTS

    bob_tc = server.client(BOB).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    bob_sampler = bob_tc.save_weights_and_get_sampling_client().result()
    bob_lp = prompt_logprobs(bob_sampler)
    alice_tc = server.client(ALICE).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    alice = [alice_tc.save_weights_and_get_sampling_client().result() for _ in range(MAX_SNAPSHOTS + 1)]
    # alice's snapshots never evict bob's
    assert float((prompt_logprobs(bob_sampler) - bob_lp).abs().max()) == 0.0
    prompt_logprobs(alice[-1])
    with pytest.raises(Exception, match=r"evicted .* by ephemeral:.*per tenant"):
        prompt_logprobs(alice[0])


# ---------------------------------------------------------------------------- request-size limits, fair scheduling

def sampling_session(srv, key: str) -> str:
    sid = raw(srv, "/api/v1/create_session", key, json={"tags": []}).json()["session_id"]
    res = raw(srv, "/api/v1/create_sampling_session", key,
              json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL_NAME})
    return res.json()["sampling_session_id"]


def post_sample(srv, key: str, sid: str, seed: int, n: int = 1, max_tokens: int = 2):
    return raw(srv, "/api/v1/asample", key, json={
        "sampling_session_id": sid, "seq_id": seed, "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": seed, "temperature": 1.0}})


class Gate:
    """Holds the single worker on a job of its own until :meth:`open` (so requests queue up)."""

    def __init__(self, srv):
        import threading

        from ferrule.serve.scheduler import JSON, Job

        self.event = threading.Event()
        srv.app.state.scheduler.submit(Job("gate", "gate", "gate-tenant", lambda: (self.event.wait(60), (JSON, b"{}"))[1]))

    def open(self):
        self.event.set()


def wait_done(srv, request_ids, timeout: float = 120.0) -> list[dict]:
    import time

    store = srv.app.state.store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [store.future(r) for r in request_ids]
        if all(r["status"] != "pending" for r in rows):
            return rows
        time.sleep(0.05)
    raise AssertionError("requests did not finish")


@pytest.fixture(scope="module")
def limited(base, tmp_path_factory):
    from ferrule.serve.limits import ServeLimits

    srv = RunningServer(base, tmp_path_factory.mktemp("serve_limited"),
                        limits=ServeLimits(max_samples_per_request=8, max_tokens_per_request=200, max_lora_rank=8,
                                           max_queued_per_tenant=3))
    yield srv
    srv.stop()


def test_a_huge_sample_request_is_refused_up_front_by_default(server):
    sc = server.client().create_sampling_client(base_model=MODEL_NAME).result()
    with pytest.raises(tinker.BadRequestError, match=r"num_samples = 1000000 exceeds .*max_samples_per_request = 256"):
        sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=10**6,
                  sampling_params=types.SamplingParams(max_tokens=4)).result(timeout=60)
    assert server.app.state.scheduler.queued("alice") == 0   # nothing was queued


def test_limits_refuse_up_front_with_a_4xx_naming_the_limit(limited):
    srv = limited
    sc = srv.client()
    with pytest.raises(tinker.BadRequestError, match=r"lora_config.rank = 16 exceeds .*max_lora_rank = 8; use a rank <= 8 "):
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=16).result(timeout=60)
    sid = sampling_session(srv, ALICE)
    res = post_sample(srv, ALICE, sid, 1, n=9)
    assert res.status_code == 400 and "max_samples_per_request = 8" in res.json()["detail"]
    res = post_sample(srv, ALICE, sid, 1, n=4, max_tokens=50)   # 4 x (7 + 50) = 228 tokens > 200
    assert res.status_code == 400 and "max_tokens_per_request = 200" in res.json()["detail"]
    # forward_backward over the token limit: refused, its seq_id consumed, the client goes on
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens_per_request = 200"):
        tc.forward_backward(sdk_data(seed=1, lengths=(120, 100)), "cross_entropy").result(timeout=60)
    assert len(tc.forward_backward(sdk_data(seed=2, lengths=(5, 6)), "cross_entropy").result(timeout=60)
               .loss_fn_outputs) == 2


def test_queued_work_per_tenant_is_bounded_and_tenants_are_served_in_turn(limited):
    srv = limited
    alice, bob = sampling_session(srv, ALICE), sampling_session(srv, BOB)
    gate = Gate(srv)
    try:
        accepted = [post_sample(srv, ALICE, alice, seed) for seed in range(3)]
        assert all(r.status_code == 200 for r in accepted)
        full = post_sample(srv, ALICE, alice, 3)
        assert full.status_code == 429 and "max_queued_per_tenant = 3" in full.json()["detail"]
        assert full.headers.get("retry-after") == "1"
        bob_res = post_sample(srv, BOB, bob, 0)      # another tenant's queue is its own
        assert bob_res.status_code == 200
    finally:
        gate.open()
    ids = [r.json()["request_id"] for r in accepted] + [bob_res.json()["request_id"]]
    rows = wait_done(srv, ids)
    assert all(r["status"] == "done" for r in rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["finished"])
    assert order.index(3) <= 1, order   # bob's one request ran second at the latest, not after all of alice's


def test_fair_scheduling_one_tenant_cannot_starve_another(server):
    alice, bob = sampling_session(server, ALICE), sampling_session(server, BOB)
    gate = Gate(server)
    try:
        mine = [post_sample(server, ALICE, alice, seed).json()["request_id"] for seed in range(10)]
        theirs = [post_sample(server, BOB, bob, seed).json()["request_id"] for seed in range(2)]
    finally:
        gate.open()
    rows = wait_done(server, mine + theirs)
    finished = sorted((r["finished"], r["tenant"]) for r in rows)
    tenants = [t for _, t in finished]
    # round robin: bob's two requests run among the first four (FIFO would run them last)
    assert sorted(tenants[:4]) == ["alice", "alice", "bob", "bob"], tenants
    assert all(a != b for a, b in zip(tenants[:4], tenants[1:4])), tenants


# ---------------------------------------------------------------- --max-memory (ferrule.serve.memory)
def test_kv_estimate_equals_what_hf_dynamic_cache_holds(base):
    """The KV bytes per token of the budget's sampling estimate are what transformers' DynamicCache holds."""
    import json

    from transformers import DynamicCache

    from ferrule.serve.memory import kv_bytes_per_token

    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held / len(PROMPT) == kv_bytes_per_token(json.loads((base / "config.json").read_text()), 4)


def test_activation_estimate_bounds_what_autograd_saves(base):
    """forward_backward's estimate covers the tensors autograd saves for HF's own forward + cross-entropy
    (eager attention, fp32; weights excluded), and is within 3x of them."""
    import json

    from ferrule.serve.memory import forward_need

    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and t.device.type != "meta":
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits.float()
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    saved = sum(seen.values())
    need = forward_need(json.loads((base / "config.json").read_text()), 40, backward=True, dtype_bytes=4)
    assert saved <= need <= 3 * saved, (saved, need)


def test_max_memory_refuses_a_request_that_would_not_fit_naming_it(server):
    """With a budget, a request whose estimated need exceeds what is left gets a 400 naming --max-memory,
    the need and what is left; nothing runs (the client's weights are untouched, its seq_id consumed)."""
    import json

    from ferrule.serve.memory import fmt_bytes, forward_need, sample_need

    svc = server.app.state.service
    cfg = json.loads((server.backend.base_dir / "config.json").read_text())
    tc = server.client().create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=120)
    sc = server.client().create_sampling_client(base_model=MODEL_NAME).result(timeout=60)
    data = sdk_data(seed=5, lengths=(12, 7))   # one request (the fixture's chunks are 3 data)
    before = tc.forward(data, "cross_entropy").result(timeout=120)
    small = sample_need(cfg, 4, 1, len(PROMPT), 4)
    big = sample_need(cfg, 4, 8, len(PROMPT), 48)
    fb = forward_need(cfg, max(len(d.model_input.to_ints()) for d in data), True, 4)
    assert small * 4 < min(big, fb)
    held = svc.memory.held
    from safetensors.torch import load_file

    # independent reference: the base checkpoint's tensor bytes, which the loaded sampler holds at least once
    weights = sum(t.nbytes for f in server.backend.base_dir.glob("*.safetensors") for t in load_file(f).values())
    assert weights > 0 and held >= weights, (held, weights)
    svc.memory.limit = held + 2 * small
    try:
        left = fmt_bytes(2 * small)
        with pytest.raises(tinker.BadRequestError, match=re.escape(f"needs about {fmt_bytes(big)}") + ".*"
                           + re.escape(f"than the {left} left of the server's --max-memory = "
                                       f"{fmt_bytes(held + 2 * small)}")):
            sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=8,
                      sampling_params=types.SamplingParams(max_tokens=48)).result(timeout=60)
        with pytest.raises(tinker.BadRequestError, match=r"forward_backward: the request needs about "
                           + re.escape(fmt_bytes(fb)) + r" \(the longest datum's 12 tokens.*--max-memory"):
            tc.forward_backward(data, "cross_entropy").result(timeout=60)
        assert svc.scheduler.queued("alice") == 0
        out = sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,   # a request that fits still runs
                        sampling_params=types.SamplingParams(max_tokens=4)).result(timeout=60)
        assert len(out.sequences[0].tokens) == 4
        health = httpx.get(server.url + "/api/v1/healthz").json()["memory"]
        assert health["max_memory"] == held + 2 * small and health["held"] == held
    finally:
        svc.memory.limit = None
    after = tc.forward(data, "cross_entropy").result(timeout=120)   # the seq_id was consumed, weights unchanged
    for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs):
        assert a["logprobs"].tolist() == b["logprobs"].tolist()


def test_inflight_sampling_clients_follow_the_latest_inflight_save(server, base):
    """The SDK's ``save_weights_and_get_sampling_client(kind="inflight")``: every inflight sampler of a
    client samples its latest inflight save (an older inflight sampler too), a snapshot sampler keeps its
    weights; the referees are HF on the base (the untrained adapter) and a snapshot of the trained weights."""
    tc = server.client().create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=120)
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    fixed = tc.save_weights_and_get_sampling_client().result(timeout=120)
    w0 = hf_prompt_logprobs(Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
    assert float((prompt_logprobs(first) - w0).abs().max()) < 1e-5
    train(tc, 1, seed=11)
    assert float((prompt_logprobs(first) - w0).abs().max()) < 1e-5   # not published yet: still the first save
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    w1 = prompt_logprobs(tc.save_weights_and_get_sampling_client().result(timeout=120))
    assert float((w1 - w0).abs().max()) > 1e-3                      # the step moved the weights
    # the same adapter values (the default: adapters served unmerged, each in its own slot of the batched
    # decode's pool, so its products are summed in another order than a merged copy's: float32 rounding)
    assert float((prompt_logprobs(second) - w1).abs().max()) < 1e-5
    assert float((prompt_logprobs(first) - w1).abs().max()) < 1e-5
    assert float((prompt_logprobs(fixed) - w0).abs().max()) < 1e-5  # a snapshot keeps its weights
    backend = server.app.state.backend
    assert sum(k.startswith("inflight:") for k in backend._snapshots) >= 1 and len(
        [k for k in backend._snapshots if k.startswith(f"inflight:{tc.model_id}#")]) == 1   # one copy per client
