"""LoRA on the Megatron train engine (ferrule.lora), CPU + gloo, fp32.

Referees: HF transformers + ``peft.PeftModel.from_pretrained`` on the exported adapter (logprobs
within 1e-5), PEFT's own ``get_peft_model`` adapters (import), and the engine itself under another
call split / a fresh engine / TP=2 (bit-identical invariants). The TP=2 checks run in ONE torchrun
launch (tests/dist/lora_worker.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import lora_worker as lw  # noqa: E402
import train_engine_worker as tw  # noqa: E402

from ferrule.lora import AdapterFormatError, LoraSettings, LoraTargetError  # noqa: E402
from ferrule.lora import hf_adapter_state_dict, load_hf_adapter, peft_config  # noqa: E402
from inproc import run_ferrule  # noqa: E402

peft = pytest.importorskip("peft", reason="peft (the dev extra) is the HF PEFT referee")

PEFT_ATOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from ferrule.conformance import numeric as cn

    root = tmp_path_factory.mktemp("lora")
    return {"qwen2": tw.make_hf_dir(root / "qwen2", family="qwen2"), "llama": lw.make_llama_dir(root / "llama"),
            "qwen3_moe": cn.tiny_hf_dir("qwen3_moe", root / "qwen3_moe"), "root": root}


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for d in batch:
            ref = torch.log_softmax(model(torch.tensor([d.model_input])).logits[0].double(), -1)
            out.append(ref.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0])
    return out


def max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def test_settings_scaling_and_errors():
    assert LoraSettings(rank=4, alpha=12).scaling == 3.0
    assert LoraSettings(rank=4, alpha=12, use_rslora=True).scaling == 6.0  # alpha / sqrt(r)
    assert LoraSettings.from_dict({"rank": 2, "alpha": 4, "target_modules": ["q_proj"]}).target_modules == ("q_proj",)
    for bad, field in (({"rank": 0, "alpha": 1}, "rank"), ({"rank": 2, "alpha": -1}, "alpha"),
                       ({"rank": 2, "alpha": 1, "dropout": 1.0}, "dropout"),
                       ({"rank": 2, "alpha": 1, "target_modules": "everything"}, "target_modules")):
        with pytest.raises(ValueError, match=field):
            LoraSettings(**bad)
    with pytest.raises(ValueError, match="unknown LoRA settings"):
        LoraSettings.from_dict({"rank": 2, "alpha": 1, "lora_r": 3})


@pytest.mark.parametrize("family,settings", [
    ("qwen2", LoraSettings(rank=4, alpha=12)),
    ("qwen2", LoraSettings(rank=4, alpha=12, use_rslora=True, target_modules=("linear_qkv", "o_proj", "lm_head"))),
    ("llama", LoraSettings(rank=3, alpha=5, use_rslora=True, dropout=0.25)),  # dropout: fb only, not logprobs
])
def test_logprobs_match_hf_peft(dirs, tmp_path, family, settings):
    hf_cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[family]
    engine = lw.lora_engine(dirs[family], settings=settings)
    tensors = lw.randomize_adapter(engine, seed=7)
    config = peft_config(engine)
    adapter = lw.write_peft_dir(tmp_path / "adapter", tensors, config)
    batch = tw.make_batch(seed=3)
    ours = engine.forward_logprobs(batch)
    base = hf_cls.from_pretrained(dirs[family], dtype=torch.float32).eval()
    base_lp = hf_logprobs(base, batch)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert model.peft_config["default"].r == settings.rank
    ref = hf_logprobs(model, batch)
    assert max_diff(ours, ref) <= PEFT_ATOL
    assert max_diff(ref, base_lp) > 1e-2  # the adapter does change the model (B != 0)
    # PEFT's merge respects alpha/r (rsLoRA): merged weights give the same logprobs
    merged = model.merge_and_unload()
    assert max_diff(ours, hf_logprobs(merged, batch)) <= PEFT_ATOL
    if "lm_head" in str(settings.target_modules):
        assert any(k.endswith("lm_head.lora_B.weight") and v.shape[0] == tw.VOCAB for k, v in tensors.items())


def test_qwen3_moe_routed_experts_match_hf_peft(dirs, tmp_path):
    """Routed experts: one A per layer and linear shared by the experts, per-expert B; PEFT loads it
    through target_parameters on transformers' fused 3-D expert parameters."""
    engine = lw.lora_engine(dirs["qwen3_moe"], settings=LoraSettings(rank=2, alpha=5))
    a_params = {id(e.adapter.lora_A) for e in __import__("ferrule.lora", fromlist=["x"]).adapter_entries(engine.model)
                if e.kind == "routed_experts"}
    assert len(a_params) == 2 * 2  # layers x (linear_fc1, linear_fc2)
    tensors = lw.randomize_adapter(engine, seed=9)
    config = peft_config(engine)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = lw.write_peft_dir(tmp_path / "adapter", tensors, config)
    batch = tw.make_batch(seed=3)
    ours = engine.forward_logprobs(batch)
    base = Qwen3MoeForCausalLM.from_pretrained(dirs["qwen3_moe"], dtype=torch.float32).eval()
    base_lp = hf_logprobs(base, batch)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    ref = hf_logprobs(model, batch)
    assert max_diff(ours, ref) <= PEFT_ATOL and max_diff(ref, base_lp) > 1e-2
    fresh = lw.lora_engine(dirs["qwen3_moe"], settings=LoraSettings(rank=2, alpha=5))
    load_hf_adapter(fresh, tensors, config)
    assert lw.same({k: v.cpu() for k, v in hf_adapter_state_dict(fresh).items()}, tensors)
    base0 = lw.base_snapshot(fresh)
    fresh.forward_backward(batch, "cross_entropy")
    assert fresh.optim_step()["success"] and lw.same(base0, lw.base_snapshot(fresh))
    with pytest.raises(LoraTargetError, match="dropout"):
        lw.lora_engine(dirs["qwen3_moe"], settings=LoraSettings(rank=2, alpha=5, dropout=0.1))


def test_inkling_dense_moe_and_attention_match_hf_peft(tmp_path):
    """Inkling text (dense + MoE layers, local/global attention with q/k/v/r/o projections): its own
    attention and shared-expert appliers, the core dense-MLP and routed-expert appliers. The stacked
    shared experts (``[S, ...]`` bmm weights) load in PEFT through ``target_parameters``."""
    from transformers import InklingForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    import inkling_fixtures as inf

    hf_dir = inf.tiny_inkling_dir(tmp_path / "inkling")
    settings = LoraSettings(rank=2, alpha=5, use_rslora=True)
    engine = lw.lora_engine(hf_dir, settings=settings)
    adapted = {n: p for n, p in engine.model[0].module.named_parameters() if p.requires_grad}
    shared = {n: p for n, p in adapted.items() if "shared_experts" in n}
    assert sorted(shared) == sorted(f"decoder.layers.{i}.mlp.shared_experts.linear_fc{j}.lora.lora_{f}"
                                    for i in (1, 2) for j in (1, 2) for f in "AB")
    # per shared expert (S = 2) one A / B pair, replicated over TP (no TP attribute), dense (not expert-parallel)
    assert tuple(shared["decoder.layers.1.mlp.shared_experts.linear_fc1.lora.lora_A"].shape) == (2, 2, 32)
    assert tuple(shared["decoder.layers.1.mlp.shared_experts.linear_fc1.lora.lora_B"].shape) == (2, 32, 2)
    assert not any(getattr(p, "tensor_model_parallel", False) or getattr(p, "allreduce", True) is False
                   for p in shared.values())
    assert any("linear_r.lora" in n for n in adapted) and any("local_experts" in n for n in adapted)
    tensors = lw.randomize_adapter(engine, seed=4)
    config = peft_config(engine)
    assert "r_proj" in config["target_modules"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                           "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj",
                                           "mlp.shared_experts.up_proj"]
    adapter = lw.write_peft_dir(tmp_path / "adapter", tensors, config)
    batch = tw.make_batch(seed=3)
    ours = engine.forward_logprobs(batch)
    base = InklingForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    base_lp = hf_logprobs(base, batch)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    # PEFT's own saved names and shapes (nested ParamWrapper: gate innermost, down outermost)
    from peft.utils import get_peft_model_state_dict

    peft_sd = get_peft_model_state_dict(model)
    assert {k: tuple(v.shape) for k, v in peft_sd.items()} == {k: tuple(v.shape) for k, v in tensors.items()}
    assert tuple(tensors["base_model.model.model.layers.1.mlp.shared_experts.base_layer.base_layer.lora_A.weight"]
                 .shape) == (2 * 2, 32)  # gate_proj: [S * r, hidden]
    ref = hf_logprobs(model, batch)
    assert max_diff(ours, ref) <= PEFT_ATOL and max_diff(ref, base_lp) > 1e-2
    # the shared experts' adapters alone change the model, and PEFT agrees on that part too
    only_shared = {k: (v if "shared_experts" in k or ".lora_A." in k else torch.zeros_like(v)) for k, v in tensors.items()}
    load_hf_adapter(engine, only_shared)
    ref_shared = hf_logprobs(peft.PeftModel.from_pretrained(
        InklingForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(),
        lw.write_peft_dir(tmp_path / "only_shared", only_shared, config)).eval(), batch)
    assert max_diff(engine.forward_logprobs(batch), ref_shared) <= PEFT_ATOL and max_diff(ref_shared, base_lp) > 1e-3
    fresh = lw.lora_engine(hf_dir, settings=settings)
    load_hf_adapter(fresh, tensors, config)
    assert lw.same({k: v.cpu() for k, v in hf_adapter_state_dict(fresh).items()}, tensors)
    # one step changes only adapter factors, shared-expert ones included
    base0, ad0 = lw.base_snapshot(fresh), lw.adapter_snapshot(fresh)
    fresh.forward_backward(batch, "cross_entropy")
    assert fresh.optim_step()["success"] and lw.same(base0, lw.base_snapshot(fresh))
    ad1 = lw.adapter_snapshot(fresh)
    assert all(not torch.equal(ad0[k], ad1[k]) for k in ad0 if "shared_experts" in k)
    with pytest.raises(LoraTargetError, match="shared experts.*dropout"):
        lw.lora_engine(hf_dir, settings=LoraSettings(rank=2, alpha=5, dropout=0.1, target_modules=(),
                                                     target_parameters=("mlp.shared_experts.down_proj",)))


def test_inkling_shared_experts_split_invariance_resume_and_peft_import(tmp_path):
    """Shared experts only (named by their HF parameters, ``target_parameters`` as in PEFT): split
    invariance, exact resume, and an adapter trained by PEFT itself on ``shared_experts.down_proj``
    imports exactly; PEFT's separate gate / up adapters (different ``lora_A``) are refused."""
    from transformers import InklingForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    import inkling_fixtures as inf
    from peft.utils import get_peft_model_state_dict

    hf_dir = inf.tiny_inkling_dir(tmp_path / "inkling")
    shared = tuple(f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    settings = LoraSettings(rank=lw.RANK, alpha=lw.ALPHA, target_modules=(), target_parameters=shared)
    engine = lw.lora_engine(hf_dir, settings=settings)
    kinds = {e.kind for e in __import__("ferrule.lora", fromlist=["x"]).adapter_entries(engine.model)}
    assert kinds == {"shared_experts"}
    tensors = lw.randomize_adapter(engine, seed=8)
    runs = []
    for splits in ((8,), (3, 5)):
        e = lw.lora_engine(hf_dir, settings=settings)
        load_hf_adapter(e, tensors)
        start, batch = 0, tw.make_batch()
        for n in splits:
            e.forward_backward(batch[start:start + n], "cross_entropy")
            start += n
        runs.append((e.optim_step()["grad_norm"], lw.adapter_snapshot(e)))
    assert runs[0][0] == runs[1][0] and lw.same(runs[0][1], runs[1][1])
    # exact resume: 2 steps, save, 2 more vs a fresh engine from the checkpoint
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    a = lw.lora_engine(hf_dir, settings=settings)
    load_hf_adapter(a, tensors)
    tw.train_steps(a, 2, seed0=10)
    a.save(tmp_path / "ckpt")
    cont_a = tw.train_steps(a, 2, seed0=20)
    b = TrainEngine.from_torch_dist(tmp_path / "ckpt", optimizer=OptimizerSettings(lr=tw.LR), lora=settings)
    assert tw.train_steps(b, 2, seed0=20) == cont_a and lw.same(lw.adapter_snapshot(a), lw.adapter_snapshot(b))
    # the base checkpoint holds no adapter tensors (the base loads into a plain engine)
    assert not any("lora" in k for k in a.model[0].module.sharded_state_dict())
    plain = TrainEngine.from_torch_dist(tmp_path / "ckpt", load_optimizer=False)
    assert not any("lora" in n for n, _ in plain.model[0].module.named_parameters())
    # an adapter made by PEFT on the shared experts' down_proj only (random B, per-expert A)
    pm = peft.get_peft_model(InklingForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                             peft.LoraConfig(r=2, lora_alpha=3, target_modules=[],
                                             target_parameters=["mlp.shared_experts.down_proj"],
                                             init_lora_weights=False)).eval()
    down = lw.lora_engine(hf_dir, settings=LoraSettings(rank=2, alpha=3, target_modules=(),
                                                        target_parameters=("mlp.shared_experts.down_proj",)))
    load_hf_adapter(down, get_peft_model_state_dict(pm))
    batch = tw.make_batch(seed=5)
    assert max_diff(down.forward_logprobs(batch), hf_logprobs(pm, batch)) <= PEFT_ATOL
    # gate / up trained separately by PEFT: different lora_A, refused, nothing loaded
    gu = peft.get_peft_model(InklingForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                             peft.LoraConfig(r=lw.RANK, lora_alpha=lw.ALPHA, target_modules=["gate_proj", "up_proj", "down_proj"],
                                             target_parameters=["mlp.shared_experts.gate_proj",
                                                                "mlp.shared_experts.up_proj",
                                                                "mlp.shared_experts.down_proj"],
                                             init_lora_weights=False))
    eng = lw.lora_engine(hf_dir, settings=settings)
    before = lw.adapter_snapshot(eng)
    with pytest.raises(AdapterFormatError, match="shared_experts.linear_fc1.*lora_A differ"):
        load_hf_adapter(eng, get_peft_model_state_dict(gu))
    assert lw.same(before, lw.adapter_snapshot(eng))


def test_target_names_are_checked(dirs):
    with pytest.raises(LoraTargetError, match="fuses"):
        lw.lora_engine(dirs["qwen2"], settings=LoraSettings(rank=2, alpha=2, target_modules=("q_proj", "v_proj")))
    with pytest.raises(LoraTargetError, match="matches no module"):
        lw.lora_engine(dirs["qwen2"], settings=LoraSettings(rank=2, alpha=2, target_modules=("qkv_proj",)))
    with pytest.raises(LoraTargetError, match="tie_word_embeddings"):  # SmolLM2-like tied Llama
        lw.lora_engine(dirs["llama"], settings=LoraSettings(rank=2, alpha=2, target_modules=("linear_qkv", "lm_head")))


def test_only_adapters_change_and_split_invariance(dirs):
    engine = lw.lora_engine(dirs["qwen2"])
    trainable = [n for n, p in engine.model[0].module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora.lora_" in n for n in trainable)
    opt_params = [p for g in engine.optimizer.optimizer.param_groups for p in g["params"]] \
        if hasattr(engine.optimizer, "optimizer") else [p for o in engine.optimizer.chained_optimizers
                                                        for g in o.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable) and all(getattr(p, "is_lora_adapter", False) for p in opt_params)
    base0, ad0 = lw.base_snapshot(engine), lw.adapter_snapshot(engine)
    engine.forward_backward(tw.make_batch(), "cross_entropy")
    assert engine.optim_step()["success"]
    assert lw.same(base0, lw.base_snapshot(engine))
    ad1 = lw.adapter_snapshot(engine)
    assert all(not torch.equal(ad0[k], ad1[k]) for k in ad0 if k.endswith("lora_B"))  # B left zero
    # split invariance (one datum per micro-batch): bit-identical grad norm and adapters
    runs = [lw.split_run(dirs["qwen2"], None, s, hf_adapter_state_dict(engine)) for s in ((8,), (4, 4), (3, 5))]
    assert len({r[0] for r in runs}) == 1 and lw.same(runs[0][1], runs[1][1]) and lw.same(runs[0][1], runs[2][1])


def test_peft_round_trip_and_import_from_peft(dirs, tmp_path):
    engine = lw.lora_engine(dirs["qwen2"])
    tensors = lw.randomize_adapter(engine, seed=11)
    fresh = lw.lora_engine(dirs["qwen2"])
    load_hf_adapter(fresh, tensors, peft_config(engine))
    again = {k: v.cpu() for k, v in hf_adapter_state_dict(fresh).items()}
    assert lw.same(again, tensors)
    # an adapter made by PEFT itself (random B), on modules that map one to one
    base = Qwen2ForCausalLM.from_pretrained(dirs["qwen2"], dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["o_proj", "down_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(base, cfg).eval()
    pm.save_pretrained(tmp_path / "from_peft")
    from ferrule.lora import read_peft_dir

    t, c = read_peft_dir(tmp_path / "from_peft")
    eng = lw.lora_engine(dirs["qwen2"], settings=LoraSettings(rank=4, alpha=12, target_modules=tuple(c["target_modules"])))
    load_hf_adapter(eng, t, c)
    batch = tw.make_batch(seed=5)
    assert max_diff(eng.forward_logprobs(batch), hf_logprobs(pm, batch)) <= PEFT_ATOL
    # PEFT's separate q/k/v adapters cannot share megatron's one fused A: refused, naming the module
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    qkv = peft.get_peft_model(Qwen2ForCausalLM.from_pretrained(dirs["qwen2"], dtype=torch.float32), cfg)
    from peft.utils import get_peft_model_state_dict

    eng2 = lw.lora_engine(dirs["qwen2"], settings=LoraSettings(rank=4, alpha=12, target_modules=("linear_qkv",)))
    before = lw.adapter_snapshot(eng2)
    with pytest.raises(AdapterFormatError, match="linear_qkv.*shared lora_A"):
        load_hf_adapter(eng2, get_peft_model_state_dict(qkv))
    assert lw.same(before, lw.adapter_snapshot(eng2))  # nothing half-loaded
    with pytest.raises(AdapterFormatError, match="lora_alpha"):
        load_hf_adapter(eng2, tensors, dict(c, lora_alpha=7))


def test_exact_resume_and_checkpoint_layout(dirs, tmp_path):
    tensors = lw.randomize_adapter(lw.lora_engine(dirs["qwen2"]), seed=2)
    res = lw.resume_check(dirs["qwen2"], None, tensors, tmp_path / "ckpt")
    assert res["losses_equal"] and res["adapter_equal"] and res["base_untouched"], res
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "lora" / "rank_0.pt").is_file()
    cfg = json.loads((ckpt / "lora" / "adapter_config.json").read_text())
    assert cfg["r"] == lw.RANK and cfg["lora_alpha"] == lw.ALPHA
    # a full-parameter engine cannot resume a LoRA checkpoint's optimizer
    from ferrule.megatron.engine import TrainEngine

    with pytest.raises(ValueError, match="LoRA checkpoint"):
        TrainEngine.from_hf(dirs["qwen2"]).load(ckpt)


def test_load_refreshes_fp32_master_copies(dirs):
    """bf16 params: the optimizer steps fp32 masters; after load_hf_adapter the next step must start
    from the loaded values (Adam's first step moves each value by about lr)."""
    engine = lw.lora_engine(dirs["qwen2"], params_dtype=torch.bfloat16)
    engine.forward_backward(tw.make_batch(), "cross_entropy")
    engine.optim_step()
    tensors = {k: (v.float() + 0.5).to(v.dtype) if ".lora_B." in k else v for k, v in hf_adapter_state_dict(engine).items()}
    load_hf_adapter(engine, tensors)
    loaded = lw.adapter_snapshot(engine)
    engine.forward_backward(tw.make_batch(seed=4), "cross_entropy")
    engine.optim_step(learning_rate=1e-3)
    after = lw.adapter_snapshot(engine)
    for k in loaded:
        assert float((after[k].float() - loaded[k].float()).abs().max()) < 0.02, k


def test_tp2_matches_world_size_1_and_resumes(dist_pool, dirs, tmp_path):
    work = tmp_path
    (work / "qwen2").symlink_to(dirs["qwen2"])
    engine = lw.lora_engine(dirs["qwen2"])
    tensors = lw.randomize_adapter(engine, seed=5)
    lw.write_peft_dir(work / "adapter", tensors, peft_config(engine))
    out = engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    ws1 = [o["logprobs"] for o in out.loss_fn_outputs]
    # Qwen3-MoE for the EP=2 checks: world-size-1 reference of one fb + step
    (work / "qwen3_moe").symlink_to(dirs["qwen3_moe"])
    moe = lw.lora_engine(dirs["qwen3_moe"])
    moe_tensors = lw.randomize_adapter(moe, seed=6)
    lw.write_peft_dir(work / "adapter_moe", moe_tensors, peft_config(moe))
    moe_out = moe.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    moe_norm = moe.optim_step()["grad_norm"]
    moe_after = {k: v.cpu() for k, v in hf_adapter_state_dict(moe).items()}
    # Inkling text (attention + dense + routed + shared experts) for the TP=2 logprobs / round trip
    sys.path.insert(0, str(REPO / "tests"))
    import inkling_fixtures as inf

    ink_dir = inf.tiny_inkling_dir(work / "inkling")
    ink = lw.lora_engine(ink_dir, settings=LoraSettings(rank=2, alpha=5, use_rslora=True))
    lw.write_peft_dir(work / "adapter_inkling", lw.randomize_adapter(ink, seed=12), peft_config(ink))
    ink_ws1 = ink.forward_logprobs(tw.make_batch(seed=3))
    ink.forward_backward(tw.make_batch(seed=3), "cross_entropy")  # MoE LoRA training: the TP=2 step's reference
    ink_norm = ink.optim_step()["grad_norm"]
    ink_after = {k: v.cpu() for k, v in hf_adapter_state_dict(ink).items()}
    # Inkling-2 text (attention linears + routed experts), 2 KV heads so that TP=2 splits them, no padded vocabulary
    from inkling2_fixtures import CONFIGS as INK2_CONFIGS, tiny_inkling2_dir

    ink2_dir = tiny_inkling2_dir(work / "inkling2", dict(INK2_CONFIGS["mqa_full_first_softcaps"], num_key_value_heads=2,
                                                         unpadded_vocab_size=100))
    ink2 = lw.lora_engine(ink2_dir, settings=LoraSettings(rank=2, alpha=5))
    lw.write_peft_dir(work / "adapter_inkling2", lw.randomize_adapter(ink2, seed=13), peft_config(ink2))
    ink2_ws1 = ink2.forward_logprobs(tw.make_batch(seed=3))
    ink2.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    ink2_norm = ink2.optim_step()["grad_norm"]
    ink2_after = {k: v.cpu() for k, v in hf_adapter_state_dict(ink2).items()}
    proc = dist_pool.run([str(REPO / "tests" / "dist" / "lora_worker.py"), str(work)], timeout=280, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((work / "results.json").read_text())
    assert res["tp2_roundtrip"]
    assert max_diff([torch.tensor(x) for x in res["tp2_logprobs"]], ws1) <= 1e-5
    assert res["tp2_split"]["identical"], res["tp2_split"]
    assert math.isfinite(res["tp2_split"]["grad_norms"][0])
    r = res["tp2_resume"]
    assert r["losses_equal"] and r["adapter_equal"] and r["base_untouched"], r
    assert res["ep2_roundtrip"]
    assert max_diff([torch.tensor(x) for x in res["ep2_logprobs"]], [o["logprobs"] for o in moe_out.loss_fn_outputs]) <= 1e-5
    assert math.isclose(res["ep2_grad_norm"], moe_norm, rel_tol=1e-5)
    assert max(float((torch.tensor(res["ep2_after_step"][k]) - v).abs().max()) for k, v in moe_after.items()) <= 1e-6
    r = res["ep2_resume"]
    assert r["losses_equal"] and r["adapter_equal"] and r["base_untouched"], r
    assert math.isclose(res["moe_tp2_grad_norm"], moe_norm, rel_tol=1e-5), (res["moe_tp2_grad_norm"], moe_norm)
    assert max(float((torch.tensor(res["moe_tp2_after_step"][k]) - v).abs().max()) for k, v in moe_after.items()) <= 1e-6
    assert "expert tensor parallelism 1" in res["inkling_etp2_refused"], res["inkling_etp2_refused"]
    assert res["inkling_tp2_roundtrip"]
    assert max_diff([torch.tensor(x) for x in res["inkling_tp2_logprobs"]], ink_ws1) <= 1e-5
    # MoE LoRA training at TP=2 (ferrule.megatron.moe): grad norm and stepped adapter == world size 1
    # (routed + shared experts, router, attention; Inkling-2's steps are checked below)
    step = max(float((torch.tensor(res["inkling_tp2_after_step"][k]) - v).abs().max()) for k, v in ink_after.items())
    print(f"inkling LoRA TP=2 step vs world size 1: grad norm {res['inkling_tp2_grad_norm']:.9g} vs {ink_norm:.9g}, "
          f"adapter max|d| {step:.3g}")
    assert math.isclose(res["inkling_tp2_grad_norm"], ink_norm, rel_tol=1e-5), (res["inkling_tp2_grad_norm"], ink_norm)
    assert set(res["inkling_tp2_after_step"]) == set(ink_after) and step <= 1e-6, step
    assert res["inkling2_tp2_roundtrip"]
    ink2_diff = max_diff([torch.tensor(x) for x in res["inkling2_tp2_logprobs"]], ink2_ws1)
    print(f"inkling2 LoRA TP=2 vs world size 1: logprobs max|d| {ink2_diff:.3g}")
    assert ink2_diff <= 1e-5
    assert res["inkling2_ep2_roundtrip"]
    ink2_diff = max_diff([torch.tensor(x) for x in res["inkling2_ep2_logprobs"]], ink2_ws1)
    print(f"inkling2 LoRA EP=2 vs world size 1: logprobs max|d| {ink2_diff:.3g}")
    assert ink2_diff <= 1e-5
    for layout in ("tp2", "ep2"):  # one LoRA training step: grad norm and the stepped adapter == world size 1
        norm, after = res[f"inkling2_{layout}_grad_norm"], res[f"inkling2_{layout}_after_step"]
        step_diff = max(float((torch.tensor(after[k]) - v).abs().max()) for k, v in ink2_after.items())
        print(f"inkling2 LoRA step {layout}: grad norm {norm:.6g} vs {ink2_norm:.6g}, adapter max|d| {step_diff:.3g}")
        assert math.isclose(norm, ink2_norm, rel_tol=1e-5) and step_diff <= 1e-6


def test_cli_export_and_import(dirs, tmp_path):
    from ferrule.cli.lora import export_adapter, import_adapter
    from ferrule.megatron.engine import TrainEngine

    engine = lw.lora_engine(dirs["qwen2"])
    lw.randomize_adapter(engine, seed=21)
    engine.save(tmp_path / "ckpt")
    batch = tw.make_batch(seed=8)
    ours = engine.forward_logprobs(batch)
    out = export_adapter(tmp_path / "ckpt", tmp_path / "peft", base_model="tiny-qwen2")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-qwen2"
    base = Qwen2ForCausalLM.from_pretrained(dirs["qwen2"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    assert max_diff(ours, hf_logprobs(model, batch)) <= PEFT_ATOL
    ckpt = import_adapter(out, dirs["qwen2"], tmp_path / "imported")
    back = TrainEngine.from_torch_dist(ckpt, lora=LoraSettings(rank=lw.RANK, alpha=lw.ALPHA,
                                                               target_modules=tuple(model.peft_config["default"].target_modules)))
    assert all(torch.equal(a, b) for a, b in zip(ours, back.forward_logprobs(batch)))
    # user errors: one line on stderr, exit code 2, no traceback
    proc = run_ferrule(["lora", "export", dirs["qwen2"], tmp_path / "x"])
    assert proc.returncode == 2 and "not a LoRA checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()
