"""PEFT adapters in: ``ferrule lora import`` (CLI) and ``settings_from_peft_config`` + ``load_hf_adapter``
(API), for every module kind PEFT targets on its own, CPU + gloo, fp32 (issue 28 items 1-4).

Referees: HF transformers + PEFT 0.21 (``get_peft_model`` / ``PeftModel.from_pretrained``): the adapters
are made or loaded by PEFT itself, the imported checkpoint's logprobs must equal PEFT's within 1e-5,
and for the target-name rule the set of adapted tensors (names and shapes) must equal the one PEFT
creates from the same ``target_modules`` / ``target_parameters``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import (InklingForCausalLM, InklingForConditionalGeneration, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3MoeForCausalLM)
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
sys.path.insert(0, str(REPO / "tests"))
import lora_worker as lw  # noqa: E402
import train_engine_worker as tw  # noqa: E402
from inkling_fixtures import tiny_inkling_dir, tiny_inkling_mm_dir  # noqa: E402

from ferrule.lora import (AdapterFormatError, LoraSettings, LoraTargetError, checkpoint_settings,  # noqa: E402
                          hf_adapter_state_dict, load_hf_adapter, peft_config, read_peft_dir,
                          settings_from_peft_config)

peft = pytest.importorskip("peft", reason="peft (the dev extra) is the HF PEFT referee")
from peft.utils import get_peft_model_state_dict  # noqa: E402

PEFT_ATOL = 1e-5
TEXT_VOCAB = 80  # below the tiny multimodal model's placeholder ids (90, 91)
SHARED = tuple(f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
ROUTED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from ferrule.conformance import numeric as cn

    root = tmp_path_factory.mktemp("peft_import")
    torch.manual_seed(0)
    tied = Qwen2ForCausalLM(Qwen2Config(vocab_size=tw.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))
    tied.save_pretrained(root / "qwen2_tied")
    return {"inkling": tiny_inkling_dir(root / "inkling"), "inkling_mm": tiny_inkling_mm_dir(root / "inkling_mm"),
            "qwen3_moe": cn.tiny_hf_dir("qwen3_moe", root / "qwen3_moe"), "qwen2_tied": root / "qwen2_tied",
            "llama": lw.make_llama_dir(root / "llama", tie=False)}


HF_CLS = {"inkling": InklingForCausalLM, "inkling_mm": InklingForConditionalGeneration, "qwen3_moe": Qwen3MoeForCausalLM,
          "qwen2_tied": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


def _hf(dirs, name):
    return HF_CLS[name].from_pretrained(dirs[name], dtype=torch.float32, attn_implementation="eager").eval()


def _batch():
    return tw.make_batch(seed=3) if TEXT_VOCAB >= tw.VOCAB else _text_batch()


def _text_batch():
    from ferrule.megatron.batching import Datum

    g = torch.Generator().manual_seed(5)
    out = []
    for n in (6, 11, 4, 9):
        t = torch.randint(0, TEXT_VOCAB, (n,), generator=g)
        out.append(Datum(t[:-1], {"target_tokens": t[1:].clone(), "weights": torch.ones(n - 1)}))
    return out


def _hf_logprobs(model, batch):
    out = []
    with torch.no_grad():
        for d in batch:
            lp = torch.log_softmax(model(input_ids=torch.as_tensor(d.model_input)[None]).logits[0].double(), -1)
            out.append(lp.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0])
    return out


def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def _cli_import(adapter, base, out):
    from ferrule.cli import app

    return CliRunner().invoke(app, ["lora", "import", str(adapter), str(base), str(out)])


def _resume(out):
    from ferrule.megatron.engine import TrainEngine

    return TrainEngine.from_torch_dist(out, load_optimizer=False, lora=checkpoint_settings(out))


def _api_engine(dirs, name, adapter):
    """The API path: settings from the PEFT config, a fresh engine, load_hf_adapter."""
    tensors, config = read_peft_dir(adapter)
    engine = lw.lora_engine(dirs[name], settings=settings_from_peft_config(config, tensors))
    load_hf_adapter(engine, tensors, config)
    return engine


def _share_a(model):
    """Make PEFT's per-expert lora_A blocks equal (expert 0's), as ferrule's one shared A per expert linear;
    and gate / up of a dense MLP share A as megatron's fused linear_fc1 does. B stays PEFT's random init."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod).__name__ == "ParamWrapper" and ".experts" in name and "shared_experts" not in name:
                a = mod.lora_A["default"].weight
                r = mod.r["default"]
                a.copy_(a[:r].repeat(a.shape[0] // r, 1))
            if name.endswith("mlp.up_proj") and hasattr(mod, "lora_A"):
                gate = model.get_submodule(name.removesuffix("up_proj") + "gate_proj")
                mod.lora_A["default"].weight.copy_(gate.lora_A["default"].weight)
    return model


def _peft_adapter(dirs, name, path, *, share_a=True, **config):
    config.setdefault("target_modules", [])
    model = peft.get_peft_model(_hf(dirs, name), peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, **config))
    model = _share_a(model) if share_a else model
    model.eval().save_pretrained(path)
    return model, path


@pytest.mark.parametrize("name", ["inkling", "inkling_mm"])
def test_cli_imports_ferrule_all_export_of_inkling(dirs, tmp_path, name):
    """Item 1: ferrule's own ``target_modules: all`` export (attention, dense, routed and shared experts)
    goes back in through the CLI, text and multimodal, and equals PEFT's logprobs."""
    engine = lw.lora_engine(dirs[name], settings=LoraSettings(rank=2, alpha=5))
    tensors = lw.randomize_adapter(engine, seed=6)
    config = peft_config(engine)
    assert set(SHARED) | set(ROUTED) <= set(config["target_parameters"])
    adapter = lw.write_peft_dir(tmp_path / "adapter", tensors, config)
    res = _cli_import(adapter, dirs[name], tmp_path / "out")
    assert res.exit_code == 0, res.output
    back = _resume(tmp_path / "out")
    assert {e.kind for e in __import__("ferrule.lora", fromlist=["x"]).adapter_entries(back.model)} == {
        "attention", "dense_mlp", "routed_experts", "shared_experts"}
    assert lw.same({k: v.cpu() for k, v in hf_adapter_state_dict(back).items()}, tensors)
    batch = _text_batch()
    ref = _hf_logprobs(peft.PeftModel.from_pretrained(_hf(dirs, name), adapter).eval(), batch)
    assert _max_diff(ref, _hf_logprobs(_hf(dirs, name), batch)) > 1e-2
    for engine in (back, _api_engine(dirs, name, adapter)):  # CLI, then API (settings_from_peft_config)
        assert _max_diff(engine.forward_logprobs(batch), ref) <= PEFT_ATOL


@pytest.mark.parametrize("config", [
    {"target_modules": ["o_proj", "down_proj"]},                                       # dense MLP only, no experts
    {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},  # the usual list
    {"target_parameters": ["mlp.shared_experts.down_proj"]},                           # one shared-expert parameter
    {"target_modules": ["r_proj"], "target_parameters": list(ROUTED)},                 # routed experts, no shared ones
    {"target_modules": ["down_proj"], "target_parameters": ["mlp.experts.down_proj", "mlp.shared_experts.down_proj"]},
], ids=["o_down", "usual_list", "shared_down", "routed_only", "all_down"])
def test_peft_adapters_on_inkling_moe_import_per_module_kind(dirs, tmp_path, config):
    """Items 2-3: adapters made by PEFT on Inkling's MoE model, each module kind on its own, import through
    the CLI and the API and equal PEFT's logprobs; ferrule adapts exactly the tensors PEFT saved."""
    model, adapter = _peft_adapter(dirs, "inkling", tmp_path / "adapter", **config)
    batch = _text_batch()
    ref = _hf_logprobs(model, batch)
    assert _max_diff(ref, _hf_logprobs(_hf(dirs, "inkling"), batch)) > 1e-3
    res = _cli_import(adapter, dirs["inkling"], tmp_path / "out")
    assert res.exit_code == 0, res.output
    for engine in (_resume(tmp_path / "out"), _api_engine(dirs, "inkling", adapter)):
        assert _max_diff(engine.forward_logprobs(batch), ref) <= PEFT_ATOL
        saved = {k: tuple(v.shape) for k, v in read_peft_dir(adapter)[0].items()}
        assert {k: tuple(v.shape) for k, v in hf_adapter_state_dict(engine).items()} == saved


def test_per_expert_a_and_separate_gate_up_are_refused_by_name(dirs, tmp_path):
    """What ferrule cannot hold exactly (PEFT's independent per-expert / per-part lora_A) is refused
    through the CLI with one line naming the module, and nothing is written."""
    _, adapter = _peft_adapter(dirs, "inkling", tmp_path / "routed", share_a=False, target_parameters=list(ROUTED))
    res = _cli_import(adapter, dirs["inkling"], tmp_path / "out")
    assert res.exit_code == 2 and "mlp.experts.linear_fc1" in res.output and "per-expert lora_A differ" in res.output
    _, adapter = _peft_adapter(dirs, "inkling", tmp_path / "gu", share_a=False, target_parameters=list(SHARED))
    res = _cli_import(adapter, dirs["inkling"], tmp_path / "out")
    assert res.exit_code == 2 and "shared_experts.linear_fc1" in res.output and "lora_A differ" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["qwen3_moe", "inkling"])
@pytest.mark.parametrize("modules,params", [
    (("q_proj", "k_proj", "v_proj", "o_proj"), ROUTED),
    ((), ("mlp.experts.down_proj",)),
    (("o_proj", "down_proj"), ("experts.gate_up_proj",)),
])
def test_one_target_rule_for_every_moe_family(dirs, name, modules, params):
    """Item 3: HF names mean what they mean to PEFT, in every family: ``target_modules`` selects
    transformers modules, ``target_parameters`` the routed experts' 3-D parameters (Qwen3-MoE and
    Inkling alike). Referee: the tensors PEFT itself creates from the same lists."""
    if name == "qwen3_moe" and "down_proj" in modules:
        modules = ("o_proj",)  # every Qwen3-MoE layer is sparse: no dense down_proj module exists
    engine = lw.lora_engine(dirs[name], settings=LoraSettings(rank=2, alpha=3, target_modules=modules,
                                                              target_parameters=params))
    model = peft.get_peft_model(_hf(dirs, name), peft.LoraConfig(r=2, lora_alpha=3, target_modules=list(modules),
                                                                target_parameters=list(params)))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    assert {k: tuple(v.shape) for k, v in hf_adapter_state_dict(engine).items()} == want
    cfg = peft_config(engine)
    assert sorted(cfg["target_modules"]) == sorted({m.rsplit(".", 1)[-1] for m in modules})


def test_hf_mlp_names_do_not_select_experts(dirs):
    """Item 3: ``gate_proj`` / ``up_proj`` / ``down_proj`` are modules of the dense MLP only (as in
    PEFT); on an all-MoE model they match nothing and the error says to use target_parameters."""
    from ferrule.lora import adapter_entries

    with pytest.raises(ValueError, match="target_parameters.*'all' already adapts"):
        LoraSettings(rank=2, alpha=3, target_parameters=ROUTED)
    assert LoraSettings.from_dict({"rank": 2, "alpha": 3, "target_modules": [],
                                   "target_parameters": list(ROUTED)}).target_parameters == ROUTED
    engine = lw.lora_engine(dirs["inkling"], settings=LoraSettings(rank=2, alpha=3,
                                                                   target_modules=("gate_proj", "up_proj", "down_proj")))
    assert {e.kind for e in adapter_entries(engine.model)} == {"dense_mlp"}
    with pytest.raises(LoraTargetError, match="'down_proj' names HF parameters.*target_parameters"):
        lw.lora_engine(dirs["qwen3_moe"], settings=LoraSettings(rank=2, alpha=3, target_modules=("o_proj", "down_proj")))
    with pytest.raises(LoraTargetError, match="'gate_up_proj' names HF parameters.*mlp.experts.gate_up_proj"):
        lw.lora_engine(dirs["inkling"], settings=LoraSettings(rank=2, alpha=3, target_modules=("gate_up_proj",)))
    with pytest.raises(LoraTargetError, match="target_parameters names.*shared_experts.gate_proj.*up_proj"):
        lw.lora_engine(dirs["inkling"], settings=LoraSettings(rank=2, alpha=3, target_modules=(),
                                                              target_parameters=("mlp.shared_experts.gate_proj",)))
    with pytest.raises(LoraTargetError, match="'mlp.experts.q_proj' matches no HF parameter"):
        lw.lora_engine(dirs["inkling"], settings=LoraSettings(rank=2, alpha=3, target_modules=("o_proj",),
                                                              target_parameters=("mlp.experts.q_proj",)))


def test_lm_head_adapter_with_peft_saved_base_weight(dirs, tmp_path):
    """Item 4: PEFT's default save of an lm_head adapter also writes ``lm_head.base_layer.weight``; it is
    accepted when it equals the base (CLI and API, logprobs = PEFT's) and refused by name when not."""
    model, adapter = _peft_adapter(dirs, "llama", tmp_path / "adapter", target_modules=["o_proj", "lm_head"])
    tensors, config = read_peft_dir(adapter)
    assert "base_model.model.lm_head.base_layer.weight" in tensors
    batch = tw.make_batch(seed=4)
    ref = _hf_logprobs(model, batch)
    res = _cli_import(adapter, dirs["llama"], tmp_path / "out")
    assert res.exit_code == 0, res.output
    for engine in (_resume(tmp_path / "out"), _api_engine(dirs, "llama", adapter)):
        assert _max_diff(engine.forward_logprobs(batch), ref) <= PEFT_ATOL
    tensors["base_model.model.lm_head.base_layer.weight"][3, 5] += 1e-3
    bad = lw.write_peft_dir(tmp_path / "bad", tensors, config)
    res = _cli_import(bad, dirs["llama"], tmp_path / "out2")
    assert res.exit_code == 2 and "lm_head.base_layer.weight" in res.output and "differs" in res.output
    assert "max abs diff 0.001" in res.output and not (tmp_path / "out2").exists()


def test_refusals_name_the_option(dirs, tmp_path):
    """Item 4: embed_tokens on a tied Qwen2 is refused naming embed_tokens (not lm_head); a regular
    expression that does not compile, or that leaves saved factors unexplained, is printed as written;
    lora_bias / exclude_modules are named (CLI and API)."""
    _, adapter = _peft_adapter(dirs, "qwen2_tied", tmp_path / "emb", target_modules=["embed_tokens"])
    res = _cli_import(adapter, dirs["qwen2_tied"], tmp_path / "out")
    assert res.exit_code == 2 and "'embed_tokens'" in res.output and "drop 'lm_head'" not in res.output, res.output
    with pytest.raises(LoraTargetError, match="embed_tokens.*adapts no embedding"):
        lw.lora_engine(dirs["qwen2_tied"], settings=LoraSettings(rank=2, alpha=3, target_modules=("embed_tokens",)))
    _, adapter = _peft_adapter(dirs, "llama", tmp_path / "regex", target_modules=r".*\.o_proj")
    tensors, config = read_peft_dir(adapter)
    for regex, why in (("(o_proj", "cannot compile"), (r".*\.down_proj", "does not match")):
        res = _cli_import(lw.write_peft_dir(tmp_path / why[:4], tensors, dict(config, target_modules=regex)),
                          dirs["llama"], tmp_path / "out")
        assert res.exit_code == 2 and repr(regex) in res.output and why in res.output, res.output
    with pytest.raises(AdapterFormatError, match="no adapter tensors were given"):
        settings_from_peft_config(config)
    for option, value in (("lora_bias", True), ("exclude_modules", ["layers.0.self_attn.o_proj"])):
        _, adapter = _peft_adapter(dirs, "llama", tmp_path / option, target_modules=["o_proj"], **{option: value})
        res = _cli_import(adapter, dirs["llama"], tmp_path / "out")
        assert res.exit_code == 2 and f"{option}={value!r}" in res.output, res.output
        tensors, config = read_peft_dir(adapter)
        engine = lw.lora_engine(dirs["llama"], settings=LoraSettings(rank=2, alpha=3, target_modules=("o_proj",)))
        with pytest.raises(AdapterFormatError, match=option):
            load_hf_adapter(engine, tensors, config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("regex,adapted", [
    (r".*\.(o_proj|down_proj)", ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj",
                                 "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]),
    (r"model\.layers\.0\.(self_attn\.o_proj|mlp\.down_proj)", ["model.layers.0.mlp.down_proj",
                                                              "model.layers.0.self_attn.o_proj"]),
], ids=["every_layer", "layer0_only"])
def test_regex_target_modules_resolve_to_what_peft_adapted(dirs, tmp_path, regex, adapted):
    """Issue 45: a PEFT adapter saved with a regular-expression ``target_modules`` (PEFT's re.fullmatch
    form) imports through the CLI and the API: the expression becomes the module paths PEFT adapted
    (a subset of layers stays a subset), logprobs equal PEFT's, and ``ferrule lora export`` writes
    those paths, which PEFT loads back to the same logprobs. Referee: PEFT 0.21 itself."""
    model, adapter = _peft_adapter(dirs, "llama", tmp_path / "adapter", target_modules=regex)
    tensors, config = read_peft_dir(adapter)
    assert config["target_modules"] == regex
    assert settings_from_peft_config(config, tensors).target_modules == tuple(adapted)
    batch = tw.make_batch(seed=4)
    ref = _hf_logprobs(model, batch)
    assert _max_diff(ref, _hf_logprobs(_hf(dirs, "llama"), batch)) > 1e-3
    res = _cli_import(adapter, dirs["llama"], tmp_path / "out")
    assert res.exit_code == 0, res.output
    back = _resume(tmp_path / "out")
    for engine in (back, _api_engine(dirs, "llama", adapter)):
        assert _max_diff(engine.forward_logprobs(batch), ref) <= PEFT_ATOL
        assert sorted(hf_adapter_state_dict(engine)) == sorted(tensors)
    assert sorted(peft_config(back)["target_modules"]) == adapted
    out = lw.write_peft_dir(tmp_path / "export", hf_adapter_state_dict(back), peft_config(back))
    again = peft.PeftModel.from_pretrained(_hf(dirs, "llama"), out).eval()
    assert sorted(get_peft_model_state_dict(again)) == sorted(tensors)
    assert _max_diff(_hf_logprobs(again, batch), ref) <= PEFT_ATOL
