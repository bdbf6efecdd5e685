"""Continuous batching in the embedded engine against independent HF references (tiny fp32 models).

Reference: one full-sequence HF forward of ``prompt + generated`` per sample (no padding, no
cache), as in ``tests/test_rollout_embedded.py``. Rows are refilled at different steps, so these
tests catch a row that sees another prompt's keys, a stale slot or position, or a refilled row
that decodes one step from its predecessor's token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ferrule.rollout import SamplingParams
from ferrule.rollout.embedded import EmbeddedEngine
from tests.test_rollout_embedded import (CharTokenizer, INIT_STD, MAX_POS, TOL, reference_logprobs, tiny_qwen3,
                                         tiny_qwen3_moe)

# prompts of different lengths; more rows than max_batch so that rows are refilled
PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 9], [27, 18, 28], [5], [61, 2, 71, 82, 81, 82, 84], [45, 90, 4, 52]]
STOPS = (7, 11, 13, 17, 19, 23, 29, 31, 37, 41)  # ~10% of the vocabulary: responses end at varied lengths


def check_against_hf(model, results, prompts, params, stop_ids=()):
    assert len(results) == len(prompts) * params.n
    lengths = set()
    for k, r in enumerate(results):
        assert (r.prompt_index, r.sample_index) == divmod(k, params.n)
        toks = list(r.token_ids)
        lengths.add(len(toks))
        ref, ref_raw = reference_logprobs(model, prompts[r.prompt_index], toks, params.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=TOL, rtol=0)
        if params.greedy:
            assert toks == ref_raw.argmax(-1).tolist()
        if r.finish_reason == "stop":
            assert not stop_ids or (toks[-1] in stop_ids and not set(toks[:-1]) & set(stop_ids))
        else:
            assert len(toks) == params.max_new_tokens and not set(toks) & set(stop_ids)
    return lengths


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=STOPS),
    SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=4, stop_token_ids=STOPS),
    SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=9, n=2, seed=2, stop_token_ids=STOPS),
], ids=["greedy", "t1-n3", "top-p-n2"])
def test_refilled_rows_match_hf_forward(params):
    model = tiny_qwen3(seed=3)
    engine = EmbeddedEngine(model=model, max_batch=3)
    prefill_rows = []  # rows of each prefill forward (the only ones with logits_to_keep): the fill, the refills
    hook = model.register_forward_pre_hook(lambda m, args, kw: prefill_rows.append(kw["input_ids"].shape[0])
                                           if kw.get("logits_to_keep") == 1 else None, with_kwargs=True)
    results = engine.generate(PROMPTS, params)
    hook.remove()
    lengths = check_against_hf(model, results, PROMPTS, params, STOPS)
    assert len(lengths) > 1  # responses of different lengths: rows were freed and refilled at different steps
    # the n samples of a prompt filled together prefill it once (settings.prefill_once)
    assert sum(prefill_rows) < len(PROMPTS) * params.n if params.n > 1 else sum(prefill_rows) == len(PROMPTS)


def test_continuous_equals_static_greedy_and_is_seed_reproducible():
    model = tiny_qwen3(seed=5)
    static = EmbeddedEngine(model=model)
    cont = EmbeddedEngine(model=model, max_batch=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=STOPS)
    assert [r.token_ids for r in cont.generate(PROMPTS, greedy)] == [r.token_ids for r in static.generate(PROMPTS, greedy)]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=9, stop_token_ids=STOPS)
    first = cont.generate(PROMPTS, sampled)
    assert [r.token_ids for r in cont.generate(PROMPTS, sampled)] == [r.token_ids for r in first]


def test_sliding_window_moe_and_stop_strings():
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=MAX_POS, initializer_range=INIT_STD,
                      use_sliding_window=True, sliding_window=4, max_window_layers=1, eos_token_id=None,
                      pad_token_id=None, attn_implementation="sdpa")
    sliding = Qwen2ForCausalLM(cfg).eval()
    assert "sliding_attention" in sliding.config.layer_types
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=1, stop_token_ids=STOPS)
    check_against_hf(sliding, EmbeddedEngine(model=sliding, max_batch=3).generate(PROMPTS, params), PROMPTS, params,
                     STOPS)
    moe = tiny_qwen3_moe(seed=2)
    check_against_hf(moe, EmbeddedEngine(model=moe, max_batch=4).generate(PROMPTS, params), PROMPTS, params, STOPS)
    # stop strings: one host check per step; a sample stops at the token that completes "e"
    model = tiny_qwen3(seed=3)
    stop_params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3, stop=("e",))
    results = EmbeddedEngine(model=model, max_batch=3, tokenizer=CharTokenizer()).generate(PROMPTS, stop_params)
    check_against_hf(model, results, PROMPTS, stop_params)
    for r in results:
        text = CharTokenizer.decode(r.token_ids)
        assert ("e" in text) == (r.finish_reason == "stop")
        if r.finish_reason == "stop":
            assert "e" not in CharTokenizer.decode(r.token_ids[:-1])


def test_batch_ladder_a_new_batch_size_prepares_no_new_decode_shape_and_matches_hf():
    """Issue 40: with the batch ladder (on with CUDA graphs; forced here on CPU), rows are padded to the
    next rung, so a second and third batch size reuse the first call's decode state (on CUDA: its compiled
    step and graphs; counted by ``info()``), and rows past the largest rung go through continuous batching
    at that size. Padding changes no sample: each is checked against a full HF forward."""
    from ferrule.engine_settings import RolloutEngineSettings

    model = tiny_qwen3(seed=7)
    engine = EmbeddedEngine(model=model, settings=RolloutEngineSettings(pad_batches=True, batch_ladder=[4, 8]))
    plain = EmbeddedEngine(model=model)
    assert engine.info()["decode_shapes"] == 0 and engine.info()["batch_ladder"] == [4, 8]
    assert plain.info()["batch_ladder"] == []  # CPU default: no padding
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=STOPS)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3, stop_token_ids=STOPS)
    calls = [(PROMPTS[:3], greedy), (PROMPTS[:2], greedy), (PROMPTS[:4], greedy),   # 3, 2, 4 rows: rung 4
             (PROMPTS[:3], sampled),                                               # 6 rows: rung 8
             (PROMPTS[:1], greedy), (PROMPTS * 2, sampled)]                        # 1: rung 4; 24 rows: 8 + refills
    shapes = []
    for prompts, params in calls:
        results = engine.generate(prompts, params)
        check_against_hf(model, results, prompts, params, STOPS)
        if params.greedy:
            assert [r.token_ids for r in results] == [r.token_ids for r in plain.generate(prompts, params)]
        shapes.append(engine.info()["decode_shapes"])
    assert shapes == [1, 1, 1, 2, 2, 2]  # one decode state per rung, none for a new batch size after that
    assert engine.info()["distinct_shapes"] == [[4, 128], [8, 128]]
    assert engine.info()["graph_captures"] == 0  # CPU


def _tiny_qwen2(seed: int):
    """A tiny dense Qwen2 (q/k/v biases, GQA, full attention): a model the fast decode path covers."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=MAX_POS, initializer_range=INIT_STD,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_continuous_fast_step_matches_plain_continuous_path_and_hf_forward(monkeypatch, kind):
    """Issue 40, ``rollout_engine.continuous_fast``: continuous batching with each step through the fast path's
    decode forward (:class:`ferrule.rollout._fast_decode.FastContinuous`: ``decode_logits`` over fused weights,
    torch.compile'd with dynamo's eager backend on CPU, the same graphs and guards as on CUDA without inductor,
    one call per replay where CUDA replays a graph) gives the current continuous path's tokens and finish
    reasons and its logprobs within 1e-5, and each sample's logprobs equal a full HF forward over its own
    tokens, with rows refilled at different steps and several attended prefix lengths (``kv_bucket`` 4). The
    fast step must be the one that ran: ``info()["compiles"]`` counts its one compile (none on the CPU plain
    path), and the bucket's ``FastContinuous`` holds a step per attended length."""
    from ferrule.engine_settings import RolloutEngineSettings
    from ferrule.rollout import _fast_decode

    monkeypatch.setattr(_fast_decode, "BACKEND", "eager")
    monkeypatch.setattr(_fast_decode, "_COMPILED", {})
    torch._dynamo.reset()  # dynamo caches per code object: an earlier test's compile would serve this one
    model = _tiny_qwen2(seed=3) if kind == "qwen2" else tiny_qwen3(seed=3)
    plain = EmbeddedEngine(model=model, max_batch=3)
    fast = EmbeddedEngine(model=model, max_batch=3, settings=RolloutEngineSettings(kv_bucket=4, continuous_fast=True))
    assert not fast.fast_decode  # CPU: off unless forced, as the other CPU tests of the fast path force it
    fast.fast_decode = True
    fast._fuse_weights()  # what the constructor does when fast_decode is on (CUDA)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=STOPS),
                   SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4, stop_token_ids=STOPS,
                                  return_raw_logprobs=True)):
        got, want = fast.generate(PROMPTS, params), plain.generate(PROMPTS, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        for x, y in zip(got, want):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
            if params.return_raw_logprobs:
                torch.testing.assert_close(torch.tensor(x.raw_logprobs), torch.tensor(y.raw_logprobs), atol=1e-5,
                                           rtol=0)
        assert len(check_against_hf(model, got, PROMPTS, params, STOPS)) > 1  # rows refilled at different steps
    # one compile served both calls' cache lengths (decode_dynamic marked), every attended length and refill
    assert fast.info()["compiles"] == 1
    assert len(fast._states) == 2 and all(len(st.fast_continuous.graphs) > 1 for st in fast._states.values())
    assert plain.info()["compiles"] == 0 and not any(hasattr(st, "fast_continuous") for st in plain._states.values())


def test_continuous_fast_step_with_a_served_lora_adapter_matches_hf_peft(monkeypatch):
    """``continuous_fast`` with one served LoRA adapter: as on the static fast path, the steps decode on the
    merged copy (:class:`ferrule.rollout._lora_merge.MergedLora`) and the fill and refill prefills run on it too
    (PEFT's layers are not called); each sample's logprobs equal HF + PEFT's (unmerged) forward over its tokens."""
    import copy

    from test_rollout_lora import PARAMS, PROMPTS as LORA_PROMPTS, TOL as LORA_TOL, peft_reference
    from test_rollout_lora import reference_logprobs as peft_logprobs
    from test_rollout_lora import tiny_qwen3 as lora_qwen3

    from ferrule.engine_settings import RolloutEngineSettings
    from ferrule.rollout import _fast_decode

    monkeypatch.setattr(_fast_decode, "BACKEND", "eager")
    monkeypatch.setattr(_fast_decode, "_COMPILED", {})
    torch._dynamo.reset()
    base = lora_qwen3()
    engine = EmbeddedEngine(model=copy.deepcopy(base), max_batch=2,
                            settings=RolloutEngineSettings(kv_bucket=4, continuous_fast=True))
    engine.fast_decode = True
    engine._fuse_weights()  # what the constructor does when fast_decode is on (CUDA)
    ref, tensors, cfg = peft_reference(base, seed=1)
    engine.update_lora_adapter(tensors, cfg, version=1)
    peft_calls = []
    hooks = [m.register_forward_hook(lambda *a: peft_calls.append(1)) for m in engine._lora._wrapped.values()]
    results = engine.generate(LORA_PROMPTS, PARAMS)  # 3 prompts x n=2 = 6 rows through 2
    for h in hooks:
        h.remove()
    for r in results:
        want = peft_logprobs(ref, LORA_PROMPTS[r.prompt_index], r.token_ids, PARAMS.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, atol=LORA_TOL, rtol=0)
    assert not peft_calls and engine.info()["compiles"] == 1  # merged prefills; the fast step ran


def test_max_batch_validation():
    with pytest.raises(ValueError, match="max_batch"):
        EmbeddedEngine(model=tiny_qwen3(), max_batch=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled decode, CUDA graphs)")
@pytest.mark.parametrize("max_batch,continuous_fast", [(None, False), (3, False), (3, True)],
                         ids=["static", "continuous", "continuous-fast"])
def test_cuda_compiled_graph_decode_matches_hf_forward(max_batch, continuous_fast):
    """The CUDA fast path (torch.compile'd decode forward captured in a graph, fused sampler)
    against a full fp32 HF forward on the CPU, statically batched and with refilled rows (through
    the state's compiled HF forward, or with ``rollout_engine.continuous_fast`` through FastContinuous)."""
    from ferrule.engine_settings import RolloutEngineSettings

    cpu_model = tiny_qwen3(seed=6)
    engine = EmbeddedEngine(model=tiny_qwen3(seed=6).cuda(), max_batch=max_batch,
                            settings=RolloutEngineSettings(continuous_fast=continuous_fast))
    assert engine.cuda_graph and engine.compile_decode
    for params in (SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=STOPS),
                   SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=1, stop_token_ids=STOPS,
                                  return_raw_logprobs=True)):
        results = engine.generate(PROMPTS, params)
        assert len(results) == len(PROMPTS) * params.n
        for r in results:
            ref, ref_raw = reference_logprobs(cpu_model, PROMPTS[r.prompt_index], r.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
            if params.return_raw_logprobs:
                raw = ref_raw.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(r.raw_logprobs, dtype=torch.float64), raw, atol=1e-4, rtol=0)
            if params.greedy:
                assert list(r.token_ids) == ref_raw.argmax(-1).tolist()
    if continuous_fast:  # the fast step ran: its graphs, counted in info()
        assert all(st.fast_continuous.graphs for st in engine._states.values())
        assert engine.info()["graph_captures"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fused sampler)")
def test_fused_sampler_draws_what_multinomial_draws():
    """Same generator state -> same token as torch.multinomial (ATen's exponential-race draw), and the
    logprob of the eager sampler, on bf16 logits of a 151,936-entry vocabulary."""
    from ferrule.rollout._fast_sampling import FusedSampler
    from ferrule.rollout._sampling import sample_next

    logits = (torch.randn(64, 151936, device="cuda") * 3).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, max_new_tokens=1, seed=0)
    fused = FusedSampler(params, 64, 151936, torch.device("cuda"))
    g1 = torch.Generator(device="cuda").manual_seed(11)
    g2 = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(5):
        tok, lp, _ = fused(logits, g1)
        ref_tok, ref_lp, _ = sample_next(logits.float(), params, g2)
        assert (tok == ref_tok).float().mean().item() > 0.98  # differs only at last-bit ties of probs / noise
        same = tok == ref_tok
        torch.testing.assert_close(lp[same], ref_lp[same], atol=1e-5, rtol=0)


def test_a_plain_forward_after_the_engine_switched_attention_is_hf_sdpa():
    """On CUDA the engine switches its model to the decode attention for good; the service then scores
    prompt logprobs with a plain ``engine.model(ids)`` (no mask: transformers passes none for an unpadded
    causal batch). That forward must be HF's SDPA forward, not an error (found on an H100: every
    ``prompt_logprobs`` request of ``ferrule serve`` failed in opaque_sdpa)."""
    from ferrule.rollout._static_cache import use_opaque_sdpa

    model = tiny_qwen3(seed=3)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    assert use_opaque_sdpa(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=0, rtol=0)
    model.train()
    model.config.attention_dropout = 0.0
    out = model(ids).logits   # training-mode forward (autograd, dropout argument 0.0 in train mode)
    torch.testing.assert_close(out.detach(), ref, atol=1e-6, rtol=0)


def test_opaque_sdpa_equals_hf_sdpa_eager_and_compiled():
    """The decode attention the engine installs for compiled decoding computes what HF's SDPA
    attention computes (a boolean 4-D mask, GQA), eagerly, with autograd, and inside one
    ``torch.compile(fullgraph=True)`` graph (the custom op must not break it)."""
    from ferrule.rollout._static_cache import OPAQUE_SDPA, use_opaque_sdpa

    model = tiny_qwen3(seed=2)
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].repeat(3, 1, 1, 1)
    mask[1, :, :, :2] = False  # a left-padded row
    mask[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    assert use_opaque_sdpa(model) and model.config._attn_implementation == OPAQUE_SDPA
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    out.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():
        compiled = torch.compile(lambda i, m: model(i, attention_mask=m).logits, fullgraph=True)
        torch.testing.assert_close(compiled(ids, mask), ref, atol=1e-5, rtol=0)
