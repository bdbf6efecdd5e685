"""Embedded engine serving base + an HF PEFT LoRA adapter, against HF transformers + PEFT (fp32, CPU).

Reference: ``peft.get_peft_model`` on a copy of the same HF model with ``init_lora_weights=False``
(random, non-zero ``lora_B``), one full-sequence forward of ``prompt + generated`` per sample.
The adapter the engine receives is PEFT's own saved form (``get_peft_model_state_dict`` and
``LoraConfig.to_dict()``), the interchange format of ferrule's train and rollout sides.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ferrule.rollout import SamplingParams
from ferrule.rollout.embedded import EmbeddedEngine

VOCAB = 96
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
MAX_POS = 256
INIT_STD = 0.2
TOL = 1e-5
RANK = 4
ALPHA = 6  # != RANK, so a wrong scaling (1, alpha, alpha/r vs alpha/sqrt(r)) shows up
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 9], [27, 18, 28]]
PARAMS = SamplingParams(temperature=0.9, max_new_tokens=8, n=2, seed=7, ignore_eos=True)


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=MAX_POS, tie_word_embeddings=False, initializer_range=INIT_STD,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      tie_word_embeddings=True, initializer_range=INIT_STD, eos_token_id=None,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def peft_reference(base, seed: int, *, rank: int = RANK, alpha: float = ALPHA, targets=TARGETS,
                   use_rslora: bool = False, target_parameters=None):
    """HF + PEFT model with random non-zero A and B; returns ``(peft_model, saved tensors, config dict)``."""
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                     init_lora_weights=False, target_parameters=target_parameters)
    ref = get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():  # lora_B of PEFT's init_lora_weights=False is small; make the adapter matter
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(ref).items()}
    return ref, tensors, ref.peft_config["default"].to_dict()


def reference_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1: -1]
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches(engine, ref, params=PARAMS):
    results = engine.generate(PROMPTS, params)
    for r in results:
        want = reference_logprobs(ref, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=TOL, rtol=0)
    return results


def base_snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build,use_rslora", [(tiny_qwen3, False), (tiny_qwen3, True), (tiny_qwen2, False)],
                         ids=["qwen3", "qwen3-rslora", "qwen2-tied"])
def test_adapter_logprobs_match_hf_peft_across_updates(build, use_rslora):
    base = build()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    original = base_snapshot(engine.model)
    param_ids = {n: id(p) for n, p in engine.model.named_parameters()}
    base_results = engine.generate(PROMPTS, PARAMS)

    ref1, tensors1, cfg1 = peft_reference(base, seed=1, use_rslora=use_rslora)
    n_expected = 2 * LAYERS * len(TARGETS)
    assert len(tensors1) == n_expected
    engine.update_lora_adapter(tensors1, cfg1, version=1)
    assert engine.weights_version == 1
    results1 = assert_matches(engine, ref1)
    # the adapter changes what is served (it is applied, and applied once: the match above)
    assert [r.logprobs for r in results1] != [r.logprobs for r in base_results]

    ref2, tensors2, cfg2 = peft_reference(base, seed=2, use_rslora=use_rslora)
    served = engine.get_lora_state_dict()
    ptrs = {n: t.data_ptr() for n, t in served.items()}
    engine.update_lora_adapter(tensors2, cfg2, version=2)
    assert_matches(engine, ref2)
    # in place: the same storage, now holding the second adapter exactly
    after = engine.get_lora_state_dict()
    assert {n: t.data_ptr() for n, t in after.items()} == ptrs
    for n, t in tensors2.items():
        assert torch.equal(after[n], t), n
    # unmerged: the base parameters are the very same objects, bit-identical to the original
    base_now = {n.replace(".base_layer", ""): p for n, p in engine.model.named_parameters() if "lora_" not in n}
    assert set(base_now) == set(original)
    for n, p in base_now.items():
        assert torch.equal(p, original[n]), n
        assert id(p) == param_ids[n], n
    assert engine.health()["lora"]["tensors"] == n_expected


def test_unload_restores_the_exact_base_model():
    base = tiny_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = engine.model(input_ids=ids).logits
    params_before = dict(engine.model.named_parameters())
    _, tensors, cfg = peft_reference(base, seed=3)
    engine.update_lora_adapter(tensors, cfg, version=1)
    engine.unload_lora_adapter()
    assert dict(engine.model.named_parameters()) == params_before  # same names -> same Parameter objects
    assert engine.get_lora_state_dict() == {} and engine.health()["lora"] is None
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, before)
    assert_matches(engine, base)
    # another shape of adapter can be served after the unload
    ref, tensors, cfg = peft_reference(base, seed=4, rank=2, alpha=16, targets=("q_proj", "down_proj"))
    engine.update_lora_adapter(tensors, cfg, version=2)
    assert_matches(engine, ref)


def test_base_weight_sync_still_works_with_an_adapter_served():
    base, new_base = tiny_qwen3(seed=0), tiny_qwen3(seed=5)
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    _, tensors, cfg = peft_reference(base, seed=1)
    engine.update_lora_adapter(tensors, cfg, version=1)
    engine.update_weights(new_base.state_dict().items(), version=2)  # checkpoint names, not base_layer names
    ref = get_peft_model(copy.deepcopy(new_base), LoraConfig(**{k: cfg[k] for k in ("r", "lora_alpha")},
                                                            target_modules=list(TARGETS))).eval()
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(ref, tensors)
    assert_matches(engine, ref)
    assert set(engine.get_hf_state_dict()) == set(base.state_dict())


def test_refused_updates_change_nothing():
    base = tiny_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    ref1, tensors, cfg = peft_reference(base, seed=1)
    one = next(iter(tensors))

    # first call: a bad adapter leaves no LoRA layers behind
    with pytest.raises(KeyError, match="not in the adapter"):
        engine.update_lora_adapter({**tensors, one.replace("layers.0", "layers.9"): tensors[one]}, cfg, version=1)
    with pytest.raises(ValueError, match=rf"{one}: not sent"):
        engine.update_lora_adapter({k: v for k, v in tensors.items() if k != one}, cfg, version=1)
    assert not any("lora_" in n for n, _ in engine.model.named_parameters())
    assert engine.weights_version == 0 and engine.health()["lora"] is None

    engine.update_lora_adapter(tensors, cfg, version=1)
    _, other, _ = peft_reference(base, seed=2)
    bad_shape = dict(other)
    bad_shape[one] = torch.zeros(RANK + 1, bad_shape[one].shape[1])
    with pytest.raises(ValueError, match="shape"):
        engine.update_lora_adapter(bad_shape, cfg, version=2)
    with pytest.raises(ValueError, match="not sent"):
        engine.update_lora_adapter({k: v for k, v in other.items() if k != one}, cfg, version=2)
    _, r8, cfg8 = peft_reference(base, seed=2, rank=8)
    with pytest.raises(ValueError, match="'r': \\(4, 8\\).*unload_lora_adapter"):
        engine.update_lora_adapter(r8, cfg8, version=2)
    _, fewer, cfg_fewer = peft_reference(base, seed=2, targets=("q_proj",))
    with pytest.raises(ValueError, match="target_modules"):
        engine.update_lora_adapter(fewer, cfg_fewer, version=2)
    with pytest.raises(ValueError, match="older"):
        engine.update_lora_adapter(other, cfg, version=0)
    # every refusal above left the first adapter in place
    assert engine.weights_version == 1
    for n, t in engine.get_lora_state_dict().items():
        assert torch.equal(t, tensors[n]), n
    assert_matches(engine, ref1)


def test_unsupported_peft_features_are_refused():
    base = tiny_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    _, tensors, cfg = peft_reference(base, seed=1)
    with pytest.raises(ValueError, match="use_dora"):
        engine.update_lora_adapter(tensors, {**cfg, "use_dora": True}, version=1)
    with pytest.raises(ValueError, match="only LoRA"):
        engine.update_lora_adapter(tensors, {**cfg, "peft_type": "IA3"}, version=1)
    with pytest.raises(ValueError, match="do not fit"):
        engine.update_lora_adapter(tensors, {**cfg, "target_modules": ["no_such_proj"]}, version=1)
    with pytest.raises(ValueError, match="not nn.Linear"):
        engine.update_lora_adapter(tensors, {**cfg, "target_modules": ["embed_tokens"]}, version=1)
    assert not any("lora_" in n for n, _ in engine.model.named_parameters())


def test_load_lora_adapter_reads_a_saved_peft_directory(tmp_path):
    base = tiny_qwen3()
    ref, _, _ = peft_reference(base, seed=6)
    ref.save_pretrained(tmp_path / "adapter")
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    engine.load_lora_adapter("policy", str(tmp_path / "adapter"))
    assert engine.health()["lora"]["name"] == "policy"
    assert_matches(engine, ref)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.load_lora_adapter("x", str(tmp_path))
    with pytest.raises(ValueError, match="served adapter is 'policy'"):
        engine.unload_lora_adapter("x")
    engine.unload_lora_adapter("policy")


def test_global_rng_untouched_by_injection():
    base = tiny_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    _, tensors, cfg = peft_reference(base, seed=1)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.update_lora_adapter(tensors, cfg, version=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA-graph decode with an adapter)")
@pytest.mark.parametrize("compile_decode", [False, True], ids=["graph", "compiled+graph"])
@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe-experts"])
def test_cuda_graph_decode_with_adapter_updates_in_place(compile_decode, experts):
    base = tiny_qwen3_moe() if experts else tiny_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base), device="cuda", compile_decode=compile_decode)
    assert engine.cuda_graph and engine.compile_decode == compile_decode
    kw = dict(targets=("q_proj", "v_proj", "o_proj"),
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) if experts else {}
    ref1, tensors1, cfg = peft_reference(base, seed=1, **kw)
    if experts:
        # this case failed on the H200 (2026-12-01) and is refused until diagnosed; serving it needs cuda_graph=False
        with pytest.raises(NotImplementedError, match="cuda_graph=False"):
            engine.update_lora_adapter(tensors1, cfg, version=1)
        engine = EmbeddedEngine(model=copy.deepcopy(base), device="cuda", cuda_graph=False)
        engine.update_lora_adapter(tensors1, cfg, version=1)
        for r in engine.generate(PROMPTS, PARAMS):
            want = reference_logprobs(ref1, PROMPTS[r.prompt_index], r.token_ids, PARAMS.temperature)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
        return
    engine.update_lora_adapter(tensors1, cfg, version=1)
    for r in engine.generate(PROMPTS, PARAMS):  # captures the graphs (and compiles) with the adapter
        want = reference_logprobs(ref1, PROMPTS[r.prompt_index], r.token_ids, PARAMS.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    buckets = engine.health()["captured_buckets"]
    assert buckets
    ref2, tensors2, cfg2 = peft_reference(base, seed=2, **kw)
    sent = {k: v.cuda() for k, v in tensors2.items()}
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    engine.update_lora_adapter(sent, cfg2, version=2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == mem  # in-place copies: nothing allocated, nothing kept
    results = engine.generate(PROMPTS, PARAMS)  # replays the graphs captured with the first adapter's buffers
    assert engine.health()["captured_buckets"] == buckets
    for r in results:
        want = reference_logprobs(ref2, PROMPTS[r.prompt_index], r.token_ids, PARAMS.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)


def tiny_qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=MAX_POS, tie_word_embeddings=False, initializer_range=INIT_STD,
                         eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "attention+routed-experts"])
def test_qwen3_moe_adapter_matches_hf_peft(experts):
    """MoE model: attention linears, and optionally the routed experts, which transformers keeps as
    fused 3-D parameters and PEFT adapts through ``target_parameters`` (nested ``ParamWrapper`` s)."""
    base = tiny_qwen3_moe()
    engine = EmbeddedEngine(model=copy.deepcopy(base))
    original = base_snapshot(engine.model)
    params = {n: id(p) for n, p in engine.model.named_parameters()}
    tp = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None
    for version, seed in ((1, 1), (2, 2)):
        ref, tensors, cfg = peft_reference(base, seed=seed, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                                           target_parameters=tp)
        assert any("experts" in k for k in tensors) == experts
        engine.update_lora_adapter(tensors, cfg, version=version)
        assert_matches(engine, ref)
    engine.unload_lora_adapter()
    assert {n: id(p) for n, p in engine.model.named_parameters()} == params
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, original[n]), n


def test_inkling_adapter_through_the_hf_cache_path_matches_hf_peft(tmp_path):
    """Inkling decodes through transformers' own cache (ShortConv states); attention (incl. r_proj)
    and the dense MLP of layer 0 carry the adapter."""
    from inkling_fixtures import tiny_inkling_dir
    from transformers import InklingForCausalLM

    path = tiny_inkling_dir(tmp_path / "m")
    base = InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(hf_dir=path)
    assert engine._windows is None
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3, ignore_eos=True)
    targets = ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for version, seed in ((1, 1), (2, 2)):
        ref, tensors, cfg = peft_reference(base, seed=seed, targets=targets)
        engine.update_lora_adapter(tensors, cfg, version=version)
        for r in engine.generate(PROMPTS, params):
            want = reference_logprobs(ref, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=TOL, rtol=0)
