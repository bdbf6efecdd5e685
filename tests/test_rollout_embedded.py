"""Embedded rollout engine against independent HF transformers references (tiny fp32 models).

Reference for logprobs: one full-sequence HF forward of ``prompt + generated`` per sample (no
padding, no cache), ``log_softmax(logits / T)`` at the generated positions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from ferrule.rollout import GenerateRequest, SamplingParams, get_rollout_engine
from ferrule.rollout.embedded import EmbeddedEngine

VOCAB = 96
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
MAX_POS = 256
INIT_STD = 0.2  # larger than HF's 0.02 so that greedy continuations vary
TOL = 1e-5
EXPERTS = 4
EXPERTS_PER_TOK = 2
MOE_FFN = 16
PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 9], [27, 18, 28]]


def tiny_qwen3(seed: int = 0, tied: bool = False, eos: int | None = None, attn: str = "sdpa") -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=MAX_POS, tie_word_embeddings=tied, initializer_range=INIT_STD,
                      eos_token_id=eos, pad_token_id=None, attn_implementation=attn)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen3_moe(seed: int = 0, attn: str = "sdpa") -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                         num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOK, norm_topk_prob=True,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, tie_word_embeddings=False,
                         initializer_range=INIT_STD, eos_token_id=None, pad_token_id=None, attn_implementation=attn)
    return Qwen3MoeForCausalLM(cfg).eval()


def reference_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1: -1]
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], torch.log_softmax(logits, -1)[len(prompt) - 1: -1]


class CharTokenizer:
    """Test tokenizer: id -> one lowercase letter (decode only, as the engine needs)."""

    @staticmethod
    def decode(ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, return_raw_logprobs=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, n=2, seed=3, return_raw_logprobs=True),
    SamplingParams(temperature=1.3, max_new_tokens=8, seed=5),
], ids=["greedy", "t0.7-topk-topp-n2", "t1.3"])
def test_logprobs_match_hf_forward(params, attn):
    model = tiny_qwen3(attn=attn)
    engine = EmbeddedEngine(model=model)
    results = engine.generate(PROMPTS, params)
    assert len(results) == len(PROMPTS) * params.n
    for r in results:
        assert len(r.token_ids) == params.max_new_tokens and r.finish_reason == "length"
        ref, ref_raw_all = reference_logprobs(model, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=TOL, rtol=0)
        if params.return_raw_logprobs:
            raw_ref = ref_raw_all.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.raw_logprobs, dtype=torch.float64), raw_ref, atol=TOL, rtol=0)
        if params.greedy:  # greedy picks the argmax of the reference distribution
            assert r.token_ids == tuple(ref_raw_all.argmax(-1).tolist())


def test_sliding_window_layers_match_hf_forward():
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      initializer_range=INIT_STD, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                      eos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    assert "sliding_attention" in model.config.layer_types
    params = SamplingParams(temperature=0.9, max_new_tokens=7, seed=0)
    for r in EmbeddedEngine(model=model).generate(PROMPTS, params):
        ref, _ = reference_logprobs(model, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=TOL, rtol=0)


def test_greedy_equals_hf_generate():
    model = tiny_qwen3(seed=2)
    engine = EmbeddedEngine(model=model)
    new = 12
    ours = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True))
    for r in ours:
        prompt = torch.tensor([PROMPTS[r.prompt_index]])
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, eos_token_id=None, pad_token_id=0)
        assert list(r.token_ids) == ref[0, prompt.shape[1]:].tolist()
    assert len({r.token_ids for r in ours}) == len(PROMPTS)  # outputs are not degenerate


def test_seed_determinism_and_n_ordering():
    engine = EmbeddedEngine(model=tiny_qwen3())
    reqs = [GenerateRequest(tuple(p), request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=11)
    a, b = engine.generate(reqs, params), engine.generate(reqs, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [(r.prompt_index, r.sample_index, r.request_id) for r in a] == \
        [(i, j, f"r{i}") for i in range(len(PROMPTS)) for j in range(3)]
    assert len({r.token_ids for r in a}) > len(PROMPTS)  # samples of one prompt differ
    c = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=12))
    assert [r.token_ids for r in c] != [r.token_ids for r in a]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the fast decode path's prefill)")])])
def test_n_samples_prefill_their_prompt_once_with_the_same_results(device):
    """``prefill_once``: the prompt forward runs on one row per request (3 rows for 3 prompts x n=4,
    not 12), its keys/values and logits copied into the n rows; tokens equal the per-row prefill's
    and logprobs agree within TOL (sampled with a seed, and greedy)."""
    import dataclasses

    from ferrule.engine_settings import RolloutEngineSettings

    model = tiny_qwen3(seed=4).to(device)
    rows_seen = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: rows_seen.append(kwargs["input_ids"].shape) if kwargs.get("logits_to_keep") == 1
        else None, with_kwargs=True)
    once = EmbeddedEngine(model=model)
    assert once.settings.prefill_once  # the default
    per_row = EmbeddedEngine(model=model, settings=dataclasses.replace(RolloutEngineSettings(), prefill_once=False))
    for params in (SamplingParams(temperature=1.0, max_new_tokens=10, n=4, seed=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_new_tokens=10, n=2, ignore_eos=True)):
        rows_seen.clear()
        a = once.generate(PROMPTS, params)
        if device == "cpu":  # the prefill forward (the only one with logits_to_keep) saw 3 rows
            assert [s[0] for s in rows_seen] == [len(PROMPTS)], rows_seen
        rows_seen.clear()
        b = per_row.generate(PROMPTS, params)
        if device == "cpu":
            assert [s[0] for s in rows_seen] == [len(PROMPTS) * params.n], rows_seen
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=TOL, rtol=0)
    assert len({r.token_ids for r in a}) == len(PROMPTS)  # greedy: one continuation per prompt
    hook.remove()


def test_finish_reasons_stop_token_eos_stop_string_length():
    model = tiny_qwen3(seed=4)
    engine = EmbeddedEngine(model=model, tokenizer=CharTokenizer())
    base_params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, ignore_eos=True)
    base = engine.generate(PROMPTS, base_params)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 10 for r in base)

    # stop token id: row 0 stops at the first occurrence; the RNG stream of other rows is untouched.
    stop_id = base[0].token_ids[3]
    first = base[0].token_ids.index(stop_id)
    stopped = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, ignore_eos=True,
                                                      stop_token_ids=(stop_id,)))
    for b, s in zip(base, stopped):
        if stop_id in b.token_ids:
            cut = b.token_ids.index(stop_id) + 1
            assert s.token_ids == b.token_ids[:cut] and s.finish_reason == "stop"
            assert s.logprobs == b.logprobs[:cut]
        else:
            assert s.token_ids == b.token_ids and s.finish_reason == "length"
    assert stopped[0].token_ids[-1] == stop_id and len(stopped[0].token_ids) == first + 1

    # EOS from the config stops unless ignore_eos.
    eos_engine = EmbeddedEngine(model=tiny_qwen3(seed=4, eos=stop_id))
    eos_run = eos_engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=7))
    assert [r.token_ids for r in eos_run] == [r.token_ids for r in stopped]
    assert [r.finish_reason for r in eos_run] == [r.finish_reason for r in stopped]

    # stop string: text of tokens 4..5 of row 1; expected cut computed from the decoded text.
    text_stop = CharTokenizer.decode(base[1].token_ids[4:6])
    cut = next(m for m in range(1, 11) if text_stop in CharTokenizer.decode(base[1].token_ids[:m]))
    s = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, ignore_eos=True,
                                                stop=(text_stop,)))
    assert s[1].token_ids == base[1].token_ids[:cut] and s[1].finish_reason == "stop"

    # max_new_tokens
    short = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True))
    assert [r.token_ids for r in short] == [r.token_ids[:3] for r in base]

    with pytest.raises(ValueError, match="tokenizer"):
        EmbeddedEngine(model=model).generate(PROMPTS, SamplingParams(stop=("x",)))


def test_update_weights_matches_fresh_model_and_rejects_bad_input():
    src = tiny_qwen3(seed=0, tied=True)
    new = tiny_qwen3(seed=1, tied=True)
    engine = EmbeddedEngine(model=src)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    snapshot = {k: v.clone() for k, v in engine.get_hf_state_dict().items()}

    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_projj.weight"):
        engine.update_weights([("model.layers.0.mlp.gate_projj.weight", torch.zeros(FFN, HIDDEN))], version=1)
    good = new.state_dict()["model.norm.weight"]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", good), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))],
                              version=1)
    with pytest.raises(ValueError, match="tied"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(VOCAB, HIDDEN)),
                               ("lm_head.weight", torch.ones(VOCAB, HIDDEN))], version=1)
    for k, v in engine.get_hf_state_dict().items():  # rejected calls wrote nothing
        assert torch.equal(v, snapshot[k]), k
    assert engine.weights_version == 0

    sd = new.state_dict()
    bucket1 = [(k, v) for k, v in sd.items() if k != "model.embed_tokens.weight"]  # includes tied lm_head.weight
    engine.update_weights(bucket1, version=1)
    assert engine.weights_version == 1
    for k, v in engine.get_hf_state_dict().items():
        assert torch.equal(v, sd[k]), k  # tied embedding updated through lm_head.weight

    fresh = EmbeddedEngine(model=tiny_qwen3(seed=1, tied=True))
    after, ref = engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)
    assert [r.token_ids for r in after] == [r.token_ids for r in ref]
    assert [r.logprobs for r in after] == [r.logprobs for r in ref]
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert all(r.weights_version == 1 for r in after)
    with pytest.raises(ValueError, match="backwards"):
        engine.update_weights([], version=0)


def _kernels_available() -> bool:
    from transformers.utils import is_kernels_available

    return bool(is_kernels_available())


def test_build_from_hf_dir_and_from_config(tmp_path):
    model = tiny_qwen3(seed=5)
    model.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=1)
    ref = EmbeddedEngine(model=model).generate(PROMPTS, params)
    from_dir = get_rollout_engine("embedded", hf_dir=tmp_path)  # class from the qwen3 family spec
    assert type(from_dir.model).__name__ == "Qwen3ForCausalLM"
    # transformers >= 5.25 kernelizes a from_pretrained model with `kernels` hub kernels by default when that package
    # is installed (a download at run time, on CUDA other numerics): ferrule's loaders turn it off
    from ferrule.rl.reference import ReferencePolicy
    from transformers import Qwen3ForCausalLM as HFQwen3

    assert HFQwen3.from_pretrained(tmp_path).use_kernels is _kernels_available()  # the default being overridden
    assert from_dir.model.use_kernels is False and ReferencePolicy(tmp_path).model.use_kernels is False
    from_cfg = get_rollout_engine(hf_config=model.config, state_dict=model.state_dict())
    for eng in (from_dir, from_cfg):
        out = eng.generate(PROMPTS, params)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
        assert eng.health()["status"] == "ok" and eng.health()["model_type"] == "qwen3"
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):  # LoRA serving: tests/test_rollout_lora.py
        from_dir.load_lora_adapter("a", "/nonexistent")
    from_dir.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        from_dir.generate(PROMPTS, params)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"n": 0}, "n"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"stop": ("",)}, "stop"), ({"seed": -1}, "seed"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_and_factory_errors():
    with pytest.raises(ValueError, match="empty prompt"):
        GenerateRequest(())
    with pytest.raises(ValueError, match="known kinds"):
        get_rollout_engine("vllm")
    engine = EmbeddedEngine(model=tiny_qwen3())
    with pytest.raises(ValueError, match="vocab"):
        engine.generate([[VOCAB + 1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=MAX_POS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA-graph decode path)")
def test_cuda_graph_decode_matches_hf_forward_and_eager():
    model = tiny_qwen3(seed=6).cuda()
    graph_engine = EmbeddedEngine(model=model)  # cuda_graph defaults on for CUDA
    eager_engine = EmbeddedEngine(model=model, cuda_graph=False)
    assert graph_engine.cuda_graph and not eager_engine.cuda_graph
    cpu_model = tiny_qwen3(seed=6)
    for prompts, params in [
        (PROMPTS, SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)),
        (PROMPTS[::-1] + [[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0.8, max_new_tokens=9, n=2, seed=1)),
    ]:  # second call reuses the (8, 128) bucket with a different prompt length
        graph_out = graph_engine.generate(prompts, params)
        eager_out = eager_engine.generate(prompts, params)
        assert [r.token_ids for r in graph_out] == [r.token_ids for r in eager_out]
        for r in graph_out:
            ref, _ = reference_logprobs(cpu_model, prompts[r.prompt_index], r.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    assert graph_engine.health()["captured_buckets"] == [[8, 128]]
    # weights copied in place keep the captured graph valid
    new = tiny_qwen3(seed=7)
    graph_engine.update_weights(new.state_dict().items(), version=1)
    greedy = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)
    got = graph_engine.generate(PROMPTS, greedy)
    for r in got:
        ref, ref_all = reference_logprobs(new, PROMPTS[r.prompt_index], r.token_ids, 0)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- Qwen3-MoE
@pytest.mark.parametrize("attn, params", [
    ("sdpa", SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=8, n=2, seed=1, return_raw_logprobs=True)),
    ("eager", SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)),
], ids=["sdpa-sampled-n2", "eager-greedy"])
def test_qwen3_moe_logprobs_match_hf_forward(attn, params):
    """Qwen3MoeModel takes no per-layer-type mask dict (it has no ``layer_types``): the engine
    passes its one 4-D mask; padded rows route through the experts without touching real rows."""
    model = tiny_qwen3_moe(attn=attn)
    results = EmbeddedEngine(model=model).generate(PROMPTS, params)
    assert len(results) == len(PROMPTS) * params.n
    for r in results:
        assert len(r.token_ids) == params.max_new_tokens
        ref, ref_raw_all = reference_logprobs(model, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=TOL, rtol=0)
        if params.return_raw_logprobs:
            raw_ref = ref_raw_all.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.raw_logprobs, dtype=torch.float64), raw_ref, atol=TOL, rtol=0)
        if params.greedy:
            assert r.token_ids == tuple(ref_raw_all.argmax(-1).tolist())


def test_qwen3_moe_update_weights_uses_checkpoint_names(tmp_path):
    """Names in and out are the checkpoint's (one tensor per expert), as written by
    ``save_pretrained``; the reference is a model transformers loads from that checkpoint
    (its own gate/up stacking), independent of the engine's name translation."""
    new = tiny_qwen3_moe(seed=1)
    new.save_pretrained(tmp_path)
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    expert_keys = [k for k in ckpt if ".mlp.experts." in k]
    assert len(expert_keys) == LAYERS * EXPERTS * 3 and "model.layers.0.mlp.experts.3.up_proj.weight" in ckpt

    engine = EmbeddedEngine(model=tiny_qwen3_moe(seed=0))
    served = engine.get_hf_state_dict()
    snapshot = {k: v.clone() for k, v in served.items()}
    assert set(served) == set(ckpt)
    assert served["model.layers.1.mlp.experts.2.gate_proj.weight"].shape == (MOE_FFN, HIDDEN)
    assert served["model.layers.1.mlp.experts.2.down_proj.weight"].shape == (HIDDEN, MOE_FFN)
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.gate_up_proj"):  # in-memory name: rejected
        engine.update_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(EXPERTS, 2 * MOE_FFN, HIDDEN))],
                              version=1)
    with pytest.raises(ValueError, match="shape"):  # a transposed expert: rejected, nothing written
        engine.update_weights([("model.layers.0.mlp.experts.0.gate_proj.weight",
                                ckpt["model.layers.0.mlp.experts.0.gate_proj.weight"]),
                               ("model.layers.0.mlp.experts.1.up_proj.weight", torch.zeros(HIDDEN, MOE_FFN))],
                              version=1)
    for k, v in engine.get_hf_state_dict().items():
        assert torch.equal(v, snapshot[k]), k

    items = sorted(ckpt.items())
    engine.update_weights(items[: len(items) // 2], version=1)  # two buckets, split mid-layer
    engine.update_weights(items[len(items) // 2:], version=2)
    for k, v in engine.get_hf_state_dict().items():
        assert torch.equal(v, ckpt[k]), k
    fresh_model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for k, v in fresh_model.state_dict().items():  # in-memory stacked layouts agree element for element
        assert torch.equal(engine.model.state_dict()[k], v), k
    params = SamplingParams(temperature=0.9, max_new_tokens=8, n=2, seed=4)
    got, ref = engine.generate(PROMPTS, params), EmbeddedEngine(model=fresh_model).generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.logprobs for r in got] == [r.logprobs for r in ref]
    assert all(r.weights_version == 2 for r in got)

    # get_hf_state_dict aliases the stacked weights: an in-place edit of one expert reaches the model
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    with torch.no_grad():
        engine.get_hf_state_dict()[name][1, 3] += 1.0
    stacked = engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert stacked[2, MOE_FFN + 1, 3] == ckpt[name][1, 3] + 1.0
    # built from a config + checkpoint-named state dict
    from_cfg = EmbeddedEngine(hf_config=new.config, state_dict=ckpt)
    assert [r.token_ids for r in from_cfg.generate(PROMPTS, params)] == [r.token_ids for r in ref]


_TRAIN_THEN_ROLLOUT = r"""
import json, sys, torch
work = sys.argv[1]
from ferrule.megatron.batching import Datum
from ferrule.megatron.engine import TrainEngine
out = {}
for family in ("qwen3", "qwen3_moe"):
    engine = TrainEngine.from_hf(f"{work}/{family}")  # applies ferrule's CPU patches (no CUDA here)
    out[family + "_modeling_imported_before"] = f"transformers.models.{family}.modeling_{family}" in sys.modules
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine
    rollout = EmbeddedEngine(hf_dir=f"{work}/{family}")
    prompt = [3, 17, 42, 8, 61, 5]
    (res,) = rollout.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    seq = prompt + list(res.token_ids)
    (lp,) = engine.forward_logprobs([Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])})])
    out[family + "_diff"] = float((lp[-6:].float() - torch.tensor(res.logprobs)).abs().max())
out["stream_is_class"] = isinstance(torch.cuda.Stream, type)
from ferrule.megatron import cpu_compat
out["patched"] = bool(cpu_compat.applied())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are applied only without CUDA")
def test_train_engine_first_then_embedded_engine(tmp_path):
    """The RL launcher's order in one fresh process: build a TrainEngine (which applies
    ferrule's CPU patches, e.g. ``torch.cuda.Stream``), then import transformers' Qwen3 /
    Qwen3-MoE modeling code and generate; greedy logprobs equal the train engine's own
    ``forward_logprobs`` of the same checkpoint."""
    from ferrule.plugins.qwen import qwen3, qwen3_moe
    from transformers import AutoConfig

    for mod, cls in ((qwen3, Qwen3ForCausalLM), (qwen3_moe, Qwen3MoeForCausalLM)):
        torch.manual_seed(0)
        cls(AutoConfig.for_model(**mod.TINY_HF_CONFIG)).float().save_pretrained(tmp_path / mod.MAPPING.family)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", _TRAIN_THEN_ROLLOUT, str(tmp_path)], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["patched"] and out["stream_is_class"]
    assert out["qwen3_modeling_imported_before"] is False  # modeling code first imported after the patches
    assert out["qwen3_moe_modeling_imported_before"] is False
    assert out["qwen3_diff"] <= TOL and out["qwen3_moe_diff"] <= TOL, out


@pytest.mark.timeout(300)
def test_an_hf_folder_missing_a_weight_is_refused_not_initialised_at_random(tmp_path):
    """transformers fills a missing weight at random (and only logs it); the engine refuses the folder, naming the key
    (``ferrule serve`` sampled from such a model and said ready; found by a fresh-user trial)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ferrule.conformance import numeric as cn
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.formats.safetensors_io import CheckpointError

    src = cn.tiny_hf_dir("qwen2", tmp_path / "full")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors")
    gone = "model.layers.0.mlp.up_proj.weight"
    del tensors[gone]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    EmbeddedEngine(hf_dir=src)  # the complete folder loads
    with pytest.raises(CheckpointError, match=r"1 weight\(s\) .*" + gone.replace(".", r"\.")):
        EmbeddedEngine(hf_dir=bad)
