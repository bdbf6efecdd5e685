"""Sampling rules of the embedded engine against independent references.

- Truncation (top-k, top-p, min-p): HF transformers' ``TopKLogitsWarper``,
  ``TopPLogitsWarper`` and ``MinPLogitsWarper`` on ties, exact boundaries and random rows.
- Stop strings: the real Qwen2.5 tokenizer (built offline by ``ferrule.plugins.qwen``), whose
  byte-level vocabulary splits an emoji into several byte-fragment tokens; the reference for
  "which token completes the stop string" is a decode of the whole prefix, not a window.
- RNG: an unseeded ``generate`` leaves torch's global generator untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ferrule.rollout import SamplingParams
from ferrule.rollout._sampling import StopStringMatcher, truncate_logits
from ferrule.rollout.embedded import EmbeddedEngine

RANDOM_ROWS = 64
RANDOM_VOCAB = 50
SEED = 0


def kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


# ------------------------------------------------------------------------------------- top-p

# (probabilities, top_p): ties and prefixes whose mass equals top_p exactly
TOP_P_BOUNDARIES = [
    ([0.25, 0.25, 0.25, 0.25], 0.5),   # the issue's case: keep 2
    ([0.3, 0.1, 0.1, 0.5], 0.8),       # the issue's case: keep 2 (0.5 + 0.3)
    ([0.3, 0.1, 0.1, 0.5], 0.5),       # the top token alone reaches top_p
    ([0.5, 0.25, 0.25], 0.75),
    ([0.1] * 10, 0.3),
    ([0.2] * 5, 0.6),
    ([0.4, 0.3, 0.2, 0.1], 0.9),
    ([0.4, 0.3, 0.2, 0.1], 0.7),
    ([0.4, 0.3, 0.2, 0.1], 0.71),      # just past a boundary: one more token
    ([0.4, 0.3, 0.2, 0.1], 0.69),      # just before it
    ([0.5, 0.5], 0.5),
    ([0.9, 0.05, 0.05], 0.95),
]


@pytest.mark.parametrize("probs,top_p", TOP_P_BOUNDARIES)
def test_top_p_keeps_what_hf_keeps_on_ties_and_exact_boundaries(probs, top_p):
    logits = log_probs(probs)
    ours = kept(truncate_logits(logits.clone(), None, top_p))
    ref = kept(TopPLogitsWarper(top_p)(None, logits.clone()))
    assert int(ours.sum()) == int(ref.sum()), (probs, top_p, ours, ref)
    # a kept token is never less likely than a removed one (ties may be broken either way)
    p = torch.tensor(probs)
    if (~ours).any():
        assert p[ours[0]].min() >= p[~ours[0]].max()
    if len(set(probs)) == len(probs):  # no ties: the very same tokens
        assert torch.equal(ours, ref)


def test_top_p_issue_cases_keep_two():
    assert int(kept(truncate_logits(log_probs([0.25] * 4), None, 0.5)).sum()) == 2
    assert kept(truncate_logits(log_probs([0.3, 0.1, 0.1, 0.5]), None, 0.8)).tolist() == [[True, False, False, True]]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_equals_hf_on_random_rows(top_p):
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(RANDOM_ROWS, RANDOM_VOCAB, generator=g) * 3
    torch.testing.assert_close(kept(truncate_logits(logits.clone(), None, top_p)),
                               kept(TopPLogitsWarper(top_p)(None, logits.clone())), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- top-k

TOP_K_CASES = [
    ([1.0, 2.0, 2.0, 0.5], 2),     # tie at the k-th value, both kept by either rule
    ([1.0, 2.0, 2.0, 2.0], 2),     # three-way tie at k: all three kept (logit < kth is removed)
    ([3.0, 1.0, 1.0, 1.0, 0.0], 2),
    ([0.0, 0.0, 0.0, 0.0], 1),
    ([5.0, 4.0, 3.0], 3),          # k == vocab: nothing removed
    ([5.0, 4.0, 3.0, 2.0], 1),
]


@pytest.mark.parametrize("logits,k", TOP_K_CASES)
def test_top_k_keeps_exactly_what_hf_keeps_including_ties(logits, k):
    x = torch.tensor([logits])
    ours = kept(truncate_logits(x.clone(), k, 1.0))
    ref = kept(TopKLogitsWarper(k)(None, x.clone()))
    assert torch.equal(ours, ref), (logits, k, ours, ref)


def test_top_k_then_top_p_equal_hf_chain_on_random_rows():
    g = torch.Generator().manual_seed(SEED + 1)
    logits = (torch.randn(RANDOM_ROWS, RANDOM_VOCAB, generator=g) * 2).round()  # rounding makes ties
    for k, p in ((5, 0.9), (10, 0.5), (3, 0.99)):
        ref = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, logits.clone()))
        ours = truncate_logits(logits.clone(), k, p)
        assert torch.equal(kept(ours).sum(-1), kept(ref).sum(-1)), (k, p)


# ------------------------------------------------------------------------------------- min-p

MIN_P_CASES = [
    ([0.5, 0.25, 0.125, 0.125], 0.5),    # 0.25 == 0.5 * 0.5 exactly: kept (only p < threshold goes)
    ([0.4, 0.4, 0.1, 0.1], 0.3),
    ([0.25] * 4, 1.0),                   # all tied with the top: all kept
    ([0.7, 0.2, 0.1], 0.2),
]


@pytest.mark.parametrize("probs,min_p", MIN_P_CASES)
def test_min_p_keeps_exactly_what_hf_keeps(probs, min_p):
    logits = log_probs(probs)
    ours = kept(truncate_logits(logits.clone(), None, 1.0, min_p))
    ref = kept(MinPLogitsWarper(min_p)(None, logits.clone()))
    assert torch.equal(ours, ref), (probs, min_p, ours, ref)


def test_min_p_equals_hf_on_random_rows_and_is_validated():
    g = torch.Generator().manual_seed(SEED + 2)
    logits = torch.randn(RANDOM_ROWS, RANDOM_VOCAB, generator=g) * 3
    for mp in (0.05, 0.3, 0.9):
        assert torch.equal(kept(truncate_logits(logits.clone(), None, 1.0, mp)),
                           kept(MinPLogitsWarper(mp)(None, logits.clone())))
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


# ------------------------------------------------------------------------------------- stop strings


@pytest.fixture(scope="module")
def qwen_tok():
    from ferrule.plugins.qwen.tokenizer import load_qwen2_tokenizer

    return load_qwen2_tokenizer()


MELT = "\U0001FAE0"  # 🫠: 4 UTF-8 bytes, 3 byte-fragment tokens in Qwen2.5's vocabulary


def first_completion(tok, tokens: list[int], stop: str) -> int | None:
    """Reference: 1-based index of the first token after which the whole decoded prefix holds ``stop``."""
    for k in range(1, len(tokens) + 1):
        if stop in tok.decode(tokens[:k]):
            return k
    return None


def matcher_step(matcher: StopStringMatcher, tokens: list[int]) -> int | None:
    for k in range(1, len(tokens) + 1):
        if matcher.matches(tokens[:k]):
            return k
    return None


def byte_tokens(tok, raw: bytes) -> list[int]:
    """One token per byte (Qwen's byte-level vocabulary has all 256 single bytes)."""
    from ferrule.plugins.qwen.tokenizer import _spell

    return [tok.convert_tokens_to_ids(_spell(bytes([b]))) for b in raw]


def encode_bytes(tok, raw: bytes) -> list[int]:
    """Tokens of a byte run: the tokenizer's own encoding, or byte tokens for a cut character."""
    try:
        return tok.encode(raw.decode("utf-8"), add_special_tokens=False)
    except UnicodeDecodeError:
        return byte_tokens(tok, raw)


def test_emoji_stop_string_of_fifteen_fragment_tokens_matches(qwen_tok):
    ids = qwen_tok.encode(MELT, add_special_tokens=False)
    assert len(ids) == 3 and all(qwen_tok.decode([i]) == "\ufffd" for i in ids)
    stop = MELT * 5
    tokens = qwen_tok.encode("ok " + stop + " done", add_special_tokens=False)
    ref = first_completion(qwen_tok, tokens, stop)
    assert ref is not None
    assert matcher_step(StopStringMatcher([stop], qwen_tok.decode), tokens) == ref


STOPS = ["</answer>", MELT * 2, "é\n\n", " Answer:", "\u4f60\u597d"]


@pytest.mark.parametrize("stop", STOPS, ids=["tag", "emoji2", "accent-newlines", "space-word", "cjk"])
def test_stop_string_split_across_tokens_at_every_position(qwen_tok, stop):
    """The stop string is cut into two token runs at every byte position (also inside a
    character), preceded by text that ends in a multi-byte character and followed by more text."""
    matcher = StopStringMatcher([stop, "never-generated"], qwen_tok.decode)
    raw = stop.encode("utf-8")
    for prefix in ("x", "caf\u00e9 ", MELT):
        for cut in range(len(raw) + 1):
            pieces = encode_bytes(qwen_tok, raw[:cut]) + encode_bytes(qwen_tok, raw[cut:])
            tokens = qwen_tok.encode(prefix, add_special_tokens=False) + pieces + \
                qwen_tok.encode(" and more", add_special_tokens=False)
            assert qwen_tok.decode(tokens) == prefix + stop + " and more"
            ref = first_completion(qwen_tok, tokens, stop)
            assert matcher_step(matcher, tokens) == ref, (prefix, cut)


def test_stop_string_all_byte_tokens(qwen_tok):
    """Worst case: every byte of the stop string is its own token."""
    stop = MELT * 3
    tokens = qwen_tok.encode("a", add_special_tokens=False) + byte_tokens(qwen_tok, stop.encode('utf-8'))
    assert len(tokens) == 1 + 12
    assert matcher_step(StopStringMatcher([stop], qwen_tok.decode), tokens) == 13


def scripted_qwen2(cycle: list[int], vocab: int) -> Qwen2ForCausalLM:
    """A Qwen2 model whose greedy continuation of token ``cycle[i]`` is ``cycle[i + 1]``.

    The attention and MLP outputs are zero (``o_proj`` / ``down_proj`` = 0), so the final
    hidden state is the normalized embedding of the current token: embedding row ``cycle[i]``
    is the unit vector ``e_i`` and ``lm_head`` row ``cycle[i + 1]`` is ``10 * e_i``.
    """
    hidden = 8
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for i, t in enumerate(cycle):
            model.model.embed_tokens.weight[t, i] = 1.0
            model.lm_head.weight[cycle[(i + 1) % len(cycle)], i] = 10.0
    return model


def test_engine_stops_after_the_fifteenth_fragment_token(qwen_tok):
    ids = qwen_tok.encode(MELT, add_special_tokens=False)
    model = scripted_qwen2(ids, vocab=len(qwen_tok))
    engine = EmbeddedEngine(model=model, tokenizer=qwen_tok)
    prompt = [ids[-1]]  # the continuation starts with a whole emoji
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=9))[0]
    assert free.token_ids == tuple(ids * 3)  # the scripted model does what it should
    r = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=40, stop=(MELT * 5,)))[0]
    assert r.finish_reason == "stop"
    assert len(r.token_ids) == 15 and qwen_tok.decode(list(r.token_ids)) == MELT * 5


# ------------------------------------------------------------------------------------- RNG


def test_unseeded_generate_leaves_torch_global_rng_alone():
    torch.manual_seed(123)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")).eval()
    engine = EmbeddedEngine(model=model)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=4, n=2))
    assert len(out) == 2 and all(len(r.token_ids) == 4 for r in out)
    assert torch.equal(torch.rand(3), expected)
    # two unseeded calls still draw different samples (fresh entropy each call)
    draws = {engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=8))[0].token_ids
             for _ in range(4)}
    assert len(draws) > 1
    assert math.isfinite(sum(out[0].logprobs))
