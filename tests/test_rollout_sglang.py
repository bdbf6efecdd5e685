"""SGLang engine client.

Offline part: request bodies and response parsing against the field names of SGLang's source
(``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` / ``UpdateWeightFromDiskReqInput``
/ ``InitWeightsUpdateGroupReqInput`` / ``UpdateWeightsFromDistributedReqInput``,
``python/sglang/srt/sampling/sampling_params.py`` ``SamplingParams``, and the ``/generate`` answer
built by ``TokenizerManager``), plus our own HTTP error surfacing against a stdlib HTTP server
that returns fixed statuses (this checks our client's error handling, not SGLang).

Live part (runs only where ``sglang`` is importable, a GPU is present and
``FERRULE_SGLANG_MODEL`` names an HF checkpoint dir): launch the server, compare greedy
logprobs with an HF transformers forward, push weights and check the version.
"""

from __future__ import annotations

import http.server
import json
import os
import threading

import pytest

from ferrule.rollout import GenerateRequest, RolloutError, SamplingParams
from ferrule.rollout.sglang import (
    SGLangEngine,
    SGLangHTTPError,
    build_generate_payload,
    build_init_weights_update_group_payload,
    build_update_from_disk_payload,
    build_load_lora_payload,
    build_update_from_distributed_payload,
    parse_generate_response,
    write_peft_adapter_dir,
)

# Field names copied from SGLang's dataclasses (see module docstring) -- the contract we build against.
GENERATE_REQ_FIELDS = {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "stream", "lora_path"}
SGLANG_SAMPLING_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "ignore_eos",
                          "skip_special_tokens", "no_stop_trim", "n", "sampling_seed"}
REQS = [GenerateRequest((1, 2, 3), request_id="a"), GenerateRequest((4, 5), request_id="b")]
# LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput (io_struct.py); lora_id is filled in by the TokenizerManager.
LOAD_LORA_FIELDS = {"lora_name", "lora_path", "pinned"}
UNLOAD_LORA_FIELDS = {"lora_name"}


def test_generate_payload_uses_sglang_field_names_and_prompt_major_rows():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=16, stop_token_ids=(7,),
                            stop=("\n\n",), n=2, seed=10)
    body = build_generate_payload(REQS, params, lora_name="adapter0")
    assert set(body) <= GENERATE_REQ_FIELDS
    assert body["input_ids"] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert body["return_logprob"] is True and body["lora_path"] == ["adapter0"] * 4
    for k, sp in enumerate(body["sampling_params"]):
        assert set(sp) <= SGLANG_SAMPLING_FIELDS
        assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == 5 and sp["max_new_tokens"] == 16
        assert sp["stop_token_ids"] == [7] and sp["stop"] == ["\n\n"] and sp["sampling_seed"] == 10 + k
    greedy = build_generate_payload(REQS, SamplingParams(temperature=0, max_new_tokens=4))
    assert all(sp["top_k"] == -1 and "sampling_seed" not in sp for sp in greedy["sampling_params"])
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        build_generate_payload(REQS, SamplingParams(return_raw_logprobs=True))


def _row(ids, lps, finish):
    # TokenizerManager: {"text", "output_ids", "meta_info"}; output_token_logprobs = [(logprob, id, None)].
    return {"text": "", "output_ids": ids,
            "meta_info": {"id": "x", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
                          "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)]}}


def test_parse_generate_response():
    params = SamplingParams(n=2, max_new_tokens=3)
    body = [_row([9, 8], [-0.1, -0.2], {"type": "stop", "matched": 8}),
            _row([7, 7, 7], [-1.0, -1.5, -2.0], {"type": "length", "length": 3}),
            _row([1], [-0.3], {"type": "stop", "matched": "\n"}),
            _row([2, 3, 4], [-0.4, -0.5, -0.6], {"type": "length", "length": 3})]
    res = parse_generate_response(body, REQS, params, weights_version=3)
    assert [(r.prompt_index, r.sample_index, r.request_id) for r in res] == [(0, 0, "a"), (0, 1, "a"), (1, 0, "b"),
                                                                            (1, 1, "b")]
    assert res[0].token_ids == (9, 8) and res[0].logprobs == (-0.1, -0.2) and res[0].finish_reason == "stop"
    assert res[1].finish_reason == "length" and res[3].weights_version == 3

    with pytest.raises(RolloutError, match="expected 4"):
        parse_generate_response(body[:3], REQS, params)
    aborted = body[:3] + [_row([], [], {"type": "abort", "message": "out of memory"})]
    with pytest.raises(RolloutError, match="out of memory"):
        parse_generate_response(aborted, REQS, params)
    bad = [dict(body[0], output_ids=[9, 9])] + body[1:]
    with pytest.raises(RolloutError, match="disagree"):
        parse_generate_response(bad, REQS, params)


def test_weight_update_payloads():
    assert build_update_from_disk_payload("/ckpt", 4) == {"model_path": "/ckpt", "weight_version": "4"}
    assert build_init_weights_update_group_payload("10.0.0.1", 29500, 1, 3) == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "weight_update_group", "backend": "nccl"}
    body = build_update_from_distributed_payload(["a.weight"], ["torch.bfloat16"], [(2, 3)], 5)
    assert body == {"names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                    "group_name": "weight_update_group", "flush_cache": True, "weight_version": "5"}
    with pytest.raises(ValueError, match="lengths differ"):
        build_update_from_distributed_payload(["a", "b"], ["float32"], [[1]], 1)


def test_load_lora_payload():
    assert build_load_lora_payload("policy-v3-1", "/adapters/policy-v3-1") == {
        "lora_name": "policy-v3-1", "lora_path": "/adapters/policy-v3-1", "pinned": False}
    assert set(build_load_lora_payload("a", "/p", pinned=True)) == LOAD_LORA_FIELDS
    with pytest.raises(ValueError, match="lora_name"):
        build_load_lora_payload("", "/p")


def test_adapter_folder_loads_in_peft(tmp_path):
    """The folder SGLang is pointed at is a valid PEFT adapter: PeftModel.from_pretrained reads it back."""
    import copy

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "down_proj"],
                                                         init_lora_weights=False)).eval()
    tensors = get_peft_model_state_dict(ref)
    path = write_peft_adapter_dir(str(tmp_path / "a"), tensors, ref.peft_config["default"].to_dict())
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".partial")]
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
    with pytest.raises(FileExistsError):
        write_peft_adapter_dir(path, tensors, {})
    with pytest.raises(ValueError, match="lora_A / lora_B"):
        write_peft_adapter_dir(str(tmp_path / "b"), {"model.embed_tokens.weight": torch.zeros(1)}, {})


class _RecordingHandler(http.server.BaseHTTPRequestHandler):
    """Records POST bodies; answers like SGLang's LoRA routes (LoRAUpdateOutput) unless told to refuse."""

    calls: list = []
    refuse_load = False

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"null")
        type(self).calls.append((self.path, body))
        ok = not (self.path == "/load_lora_adapter" and type(self).refuse_load)
        data = json.dumps({"success": ok, "error_message": None if ok else "rank too large"}).encode()
        self.send_response(200 if ok else 400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_update_lora_adapter_loads_new_then_unloads_old(tmp_path):
    """Our client's call sequence (a recording stub, not SGLang): load vN under a fresh name, unload vN-1."""
    import torch

    _RecordingHandler.calls, _RecordingHandler.refuse_load = [], False
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng = SGLangEngine(url=f"http://127.0.0.1:{srv.server_address[1]}", lora_dir=str(tmp_path))
        tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2)}
        cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
        eng.update_lora_adapter(tensors, cfg, version=1)
        first = eng.served_lora
        eng.update_lora_adapter(tensors, cfg, version=2)
        second = eng.served_lora
        assert [c[0] for c in _RecordingHandler.calls] == ["/load_lora_adapter", "/load_lora_adapter",
                                                           "/unload_lora_adapter"]
        loads = [b for p, b in _RecordingHandler.calls if p == "/load_lora_adapter"]
        assert all(set(b) == LOAD_LORA_FIELDS for b in loads)
        assert [b["lora_name"] for b in loads] == [first[0], second[0]] and first[0] != second[0]
        assert loads[1]["lora_path"] == second[1] and os.path.isfile(os.path.join(second[1], "adapter_config.json"))
        assert _RecordingHandler.calls[2][1] == {"lora_name": first[0]} and not os.path.exists(first[1])
        assert eng.weights_version == 2
        _RecordingHandler.refuse_load = True
        with pytest.raises(SGLangHTTPError, match="rank too large"):
            eng.update_lora_adapter(tensors, cfg, version=3)
        assert eng.served_lora == second and eng.weights_version == 2 and os.listdir(tmp_path) == [
            os.path.basename(second[1])]
        with pytest.raises(ValueError, match="older"):
            eng.update_lora_adapter(tensors, cfg, version=1)
        eng.shutdown()
    finally:
        srv.shutdown()
        srv.server_close()


class _FixedHandler(http.server.BaseHTTPRequestHandler):
    routes = {"/flush_cache": (404, "text/plain", "Not Found"),
              "/load_lora_adapter": (200, "application/json", json.dumps({"success": False, "message": "no lora"})),
              "/get_model_info": (200, "application/json", json.dumps({"model_path": "m", "weight_version": "0"}))}

    def _answer(self):
        status, ctype, text = self.routes.get(self.path, (500, "text/plain", "boom"))
        data = text.encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture()
def fixed_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FixedHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_non_2xx_and_success_false_are_raised(fixed_server):
    eng = SGLangEngine(url=fixed_server)
    with pytest.raises(SGLangHTTPError, match="404") as exc:
        eng.flush_cache()
    assert exc.value.status == 404 and exc.value.body == "Not Found" and exc.value.path == "/flush_cache"
    with pytest.raises(SGLangHTTPError, match="no lora"):
        eng.load_lora_adapter("x", "/p")
    with pytest.raises(SGLangHTTPError, match="500"):
        eng.generate(REQS, SamplingParams(max_new_tokens=2))
    assert eng.model_info()["model_path"] == "m"
    eng.shutdown()


def test_constructor_errors():
    with pytest.raises(ValueError, match="exactly one"):
        SGLangEngine()
    with pytest.raises(ValueError, match="weight_transport"):
        SGLangEngine(url="http://127.0.0.1:1", weight_transport="carrier-pigeon")


# ------------------------------------------------------------------------------- live (sglang)
@pytest.fixture(scope="module")
def live_engine():
    pytest.importorskip("sglang", reason="sglang is not installed here; live SGLang tests need it (GPU hosts)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("live SGLang tests need a CUDA GPU")
    model_dir = os.environ.get("FERRULE_SGLANG_MODEL")
    if not model_dir:
        pytest.skip("set FERRULE_SGLANG_MODEL to an HF checkpoint dir to run live SGLang tests")
    eng = SGLangEngine(model_path=model_dir, launch_args=("--dtype", "float32", "--mem-fraction-static", "0.3"),
                       startup_timeout=900)
    yield eng, model_dir
    eng.shutdown()


@pytest.mark.sglang
def test_live_greedy_logprobs_match_hf(live_engine):
    import torch
    from transformers import AutoModelForCausalLM

    eng, model_dir = live_engine
    prompts = [[1, 2, 3, 4], [5, 6]]
    res = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for r in res:
        ids = torch.tensor([prompts[r.prompt_index] + list(r.token_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(prompts[r.prompt_index]) - 1:-1]
        ref = lp.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=2e-3, rtol=0)


@pytest.mark.sglang
def test_live_update_weights_sets_version(live_engine):
    import torch
    from safetensors.torch import load_file

    eng, model_dir = live_engine
    files = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(model_dir, f)))
    before = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    eng.update_weights([(k, v.to("cuda")) for k, v in tensors.items()], version=1)
    assert eng.health()["server_weight_version"] == "1"
    after = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert after[0].token_ids == before[0].token_ids and torch.allclose(
        torch.tensor(after[0].logprobs), torch.tensor(before[0].logprobs), atol=1e-4)


def test_requests_with_media_are_refused_not_dropped(fixed_server):
    import torch

    from ferrule.rollout.base import GenerateRequest, SamplingParams

    eng = SGLangEngine(url=fixed_server)
    reqs = [GenerateRequest((1, 2)), GenerateRequest((3, 4), media={"vision": [torch.zeros(2, 3)]})]
    with pytest.raises(NotImplementedError, match=r"requests \[1\] carry media"):
        eng.generate(reqs, SamplingParams(max_new_tokens=1))
@pytest.mark.sglang
def test_live_lora_adapter_logprobs_match_hf_peft(tmp_path):
    """Needs sglang, a GPU and FERRULE_SGLANG_MODEL; launches its own server with --enable-lora."""
    pytest.importorskip("sglang", reason="sglang is not installed here; live SGLang tests need it (GPU hosts)")
    import copy

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("live SGLang tests need a CUDA GPU")
    model_dir = os.environ.get("FERRULE_SGLANG_MODEL")
    if not model_dir:
        pytest.skip("set FERRULE_SGLANG_MODEL to an HF checkpoint dir to run live SGLang tests")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False)).eval()
    eng = SGLangEngine(model_path=model_dir, lora_dir=str(tmp_path), startup_timeout=900, launch_args=(
        "--dtype", "float32", "--mem-fraction-static", "0.3", "--enable-lora", "--max-lora-rank", "8",
        "--lora-target-modules", "q_proj", "v_proj"))
    try:
        eng.update_lora_adapter(get_peft_model_state_dict(ref), ref.peft_config["default"].to_dict(), version=1)
        prompts = [[1, 2, 3, 4], [5, 6]]
        for r in eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)):
            ids = torch.tensor([prompts[r.prompt_index] + list(r.token_ids)])
            with torch.no_grad():
                lp = torch.log_softmax(ref(input_ids=ids).logits[0].double(), -1)[len(prompts[r.prompt_index]) - 1:-1]
            want = lp.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=2e-3, rtol=0)
    finally:
        eng.shutdown()
