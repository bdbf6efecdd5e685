"""Several base models behind one ``ferrule serve``, through the unmodified ``tinker`` 0.38.0 SDK:
``get_server_capabilities`` lists them, training and sampling clients of each run on that base
(logprobs equal HF transformers' log-softmax of that checkpoint), a frozen sampler of another
base (an on-policy distillation teacher) samples it, bases load on first use and unload least
recently used under ``max_loaded``, a full house of live training clients refuses naming the
limit, and ``unload_model`` frees a client so the base can go.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
from serve_helpers import ALICE, RunningServer, poll_done, raw, sdk_data  # noqa: E402
from tinker import types  # noqa: E402

PROMPT = [3, 17, 42, 5, 60, 11, 29]
NAMES = ("base-a", "base-b", "base-c")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    import train_engine_worker as w

    root = tmp_path_factory.mktemp("serve_bases")
    return [w.make_hf_dir(root / "a", "qwen2", seed=0), w.make_hf_dir(root / "b", "qwen3", seed=1),
            w.make_hf_dir(root / "c", "qwen2", seed=2)]


@pytest.fixture(scope="module")
def multi(bases, tmp_path_factory):
    from ferrule.serve.registry import BaseRegistry

    registry = BaseRegistry(list(zip(NAMES, bases)), max_loaded=2)
    srv = RunningServer(registry, tmp_path_factory.mktemp("serve_bases_storage"))
    yield srv
    srv.stop()


def hf_logprobs(directory: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
    return lp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def served_logprobs(sampler, tokens=PROMPT) -> torch.Tensor:
    return torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=120)[1:],
                        dtype=torch.float64)


def test_capabilities_training_and_teacher_samplers_of_each_base(multi, bases):
    sc = multi.client()
    caps = sc.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == list(NAMES)
    registry = multi.app.state.bases
    assert registry.loaded() == ["base-a"] and not registry.get("base-b").loaded   # only the first at start
    # a LoRA client of base-b: its untrained forward is base-b's own log-softmax (not base-a's)
    tc = sc.create_lora_training_client(base_model="base-b", rank=4).result(timeout=120)
    assert tc.get_info().model_data.model_name == "base-b"
    data = sdk_data(seed=3, lengths=(6, 9))
    out = tc.forward(data, "cross_entropy").result(timeout=120)
    for d, o in zip(data, out.loss_fn_outputs):
        tokens = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].tolist()[-1])]
        ref = hf_logprobs(bases[1], tokens)
        assert float((ref - torch.tensor(o["logprobs"].tolist()).double()).abs().max()) < 1e-5
    assert registry.loaded() == ["base-a", "base-b"]
    # a frozen teacher of base-c: loading it unloads base-a (least recently used, no live client)
    teacher = sc.create_sampling_client(base_model="base-c").result(timeout=60)
    assert float((served_logprobs(teacher) - hf_logprobs(bases[2], PROMPT)).abs().max()) < 1e-5
    assert registry.loaded() == ["base-b", "base-c"] and registry.unloads == ["base-a"]
    # base-a again: base-c goes (base-b has a live client); the result is still base-a's
    ref_a = sc.create_sampling_client(base_model="base-a").result(timeout=60)
    assert float((served_logprobs(ref_a) - hf_logprobs(bases[0], PROMPT)).abs().max()) < 1e-5
    assert registry.unloads == ["base-a", "base-c"]
    # the training client's sampler samples base-b plus its adapters, i.e. base-b at init
    snap = tc.save_weights_and_get_sampling_client()
    assert float((served_logprobs(snap) - hf_logprobs(bases[1], PROMPT)).abs().max()) < 1e-5
    with pytest.raises(tinker.BadRequestError, match="is not served here.*'base-a', 'base-b', 'base-c'"):
        sc.create_lora_training_client(base_model="base-z", rank=4).result(timeout=60)


def test_full_house_refuses_naming_the_limit_until_unload_model(multi, bases):
    sc = multi.client()
    tb = sc.create_lora_training_client(base_model="base-b", rank=4).result(timeout=120)
    tc = sc.create_lora_training_client(base_model="base-c", rank=4).result(timeout=120)
    snap_c = tc.save_weights_and_get_sampling_client()   # held by base-c, dropped when base-c unloads
    sampler = sc.create_sampling_client(base_model="base-a").result(timeout=60)
    with pytest.raises(Exception, match="--max-loaded-bases = 2"):
        sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)
    # unload_model (Tinker's UnloadModelRequest; the 0.38 SDK has the types, no call): base-c is then idle
    res = raw(multi, "/api/v1/unload_model", ALICE, json=types.UnloadModelRequest(model_id=tc.model_id).model_dump())
    assert res.status_code == 200, res.text
    done = types.UnloadModelResponse.model_validate(poll_done(multi, res.json()["request_id"]).json())
    assert done.model_id == tc.model_id and done.type == "unload_model"
    assert raw(multi, "/api/v1/get_info", ALICE, json={"model_id": tc.model_id}).status_code == 410
    assert float((served_logprobs(sampler) - hf_logprobs(bases[0], PROMPT)).abs().max()) < 1e-5
    assert multi.app.state.bases.loaded() == ["base-b", "base-a"]
    with pytest.raises(Exception, match="base model 'base-c' was unloaded .*least recently used"):
        snap_c.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)
    assert tb.forward(sdk_data(seed=4, lengths=(5,)), "cross_entropy").result(timeout=120).loss_fn_outputs


def test_models_file_and_repeated_base_model(bases, tmp_path):
    from ferrule.cli.serve import served_bases

    (tmp_path / "models.txt").write_text(f"# teacher and reference\n{bases[1]} teacher\n\nrel-dir\n")
    got = served_bases([bases[0]], ["student"], tmp_path / "models.txt")
    assert got == [("student", bases[0]), ("teacher", bases[1]), (None, tmp_path / "rel-dir")]
    with pytest.raises(ValueError, match="2 --model-name for 1 --base-model"):
        served_bases([bases[0]], ["a", "b"])
    (tmp_path / "bad.txt").write_text(f"{bases[0]} a b\n")
    with pytest.raises(ValueError, match="bad.txt:1.*3 fields"):
        served_bases(None, None, tmp_path / "bad.txt")
    from ferrule.serve.registry import BaseRegistry

    with pytest.raises(ValueError, match="two base models are named 'x'"):
        BaseRegistry([("x", bases[0]), ("x", bases[1])])


def test_max_loaded_bytes_unloads_idle_bases_or_refuses_naming_it_and_the_op_log_names_base_and_tenant(
        multi, bases, caplog):
    """``--max-loaded-bytes``: a base that would not fit next to the bases with live training clients is
    refused naming the limit, unloading nothing; one that fits once an idle base goes unloads it. Every
    operation's log line names the tenant (``client=``) and the base it ran on."""
    import logging

    from ferrule.serve.memory import backend_bytes, fmt_bytes, load_need

    registry = multi.app.state.bases
    sc = multi.client()
    if not registry.get("base-b").engines:
        sc.create_lora_training_client(base_model="base-b", rank=4).result(timeout=120)
    ref_a = sc.create_sampling_client(base_model="base-a").result(timeout=60)
    served_logprobs(ref_a)                                  # base-a loaded, idle
    for name in registry.loaded():
        if name not in ("base-a", "base-b"):
            registry.unload(name)   # the earlier tests' state, whatever it is: base-c not loaded
    assert registry.loaded() == ["base-b", "base-a"]
    held_b = backend_bytes(registry.get("base-b"), set())
    held_a = backend_bytes(registry.get("base-a"), set())
    need_c = load_need(registry.get("base-c"))
    teacher = sc.create_sampling_client(base_model="base-c").result(timeout=60)
    registry.max_loaded, registry.max_loaded_bytes = 3, held_b + need_c - 1   # only the bytes can bind
    try:
        with pytest.raises(Exception, match=f"cannot load base model 'base-c': it needs about {fmt_bytes(need_c)} "
                           r".*live training clients hold .* --max-loaded-bytes = "):
            teacher.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)
        assert registry.loaded() == ["base-b", "base-a"] and "base-a" not in registry.unloads[-1:]   # nothing went
        registry.max_loaded_bytes = held_b + need_c + held_a // 2     # fits once idle base-a goes
        with caplog.at_level(logging.INFO, logger="ferrule.serve"):
            got = served_logprobs(teacher)
        assert float((got - hf_logprobs(bases[2], PROMPT)).abs().max()) < 1e-5
        assert registry.loaded() == ["base-b", "base-c"] and registry.unloads[-1] == "base-a"
    finally:
        registry.max_loaded, registry.max_loaded_bytes = 2, None
    ops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("op=sample")]
    assert ops and all(" client=alice base=base-c " in line for line in ops), ops
