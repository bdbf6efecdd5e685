"""``ferrule serve``'s OpenAI-compatible routes (``/oai/api/v1/chat/completions``, ``/completions``,
``/models``) driven by the real ``openai`` Python client, in process (uvicorn in a thread,
tests/serve_helpers.py).

The base is a tiny random Qwen2 with a byte-level tokenizer (256 byte tokens plus ChatML's
``<|im_end|>``, ``<|endoftext|>``, ``<|im_start|>``), so the qwen2 family's chat template and stop
tokens apply. Referee: HF transformers in float32 on the same weights (the base's, or the merged
sampler checkpoint's), greedy (``temperature=0``: logprobs are the untempered log-softmax), with the
prompt rendered by the tokenizer's own ``apply_chat_template`` over the family's template source.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
openai = pytest.importorskip("openai", reason="the openai client (dev extra) is not installed")
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
from serve_helpers import ALICE, BOB, MODEL_NAME, RunningServer, adam, sampler_weights, sdk_data  # noqa: E402

STOPS = ("<|im_end|>", "<|endoftext|>")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
STEPS = 6


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory):
    """A tiny random Qwen2 (vocab 264: 259 tokenizer ids + padding rows) with a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("oai_base") / "tiny-qwen2-chat"
    torch.manual_seed(3)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False, eos_token_id=256)).float().save_pretrained(out)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=STOPS[0], pad_token=STOPS[1],
                            additional_special_tokens=["<|im_start|>"]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def oai_server(chat_base, tmp_path_factory):
    srv = RunningServer(chat_base, tmp_path_factory.mktemp("oai_storage"))
    yield srv
    srv.stop()


def _client(srv, key=ALICE):
    return openai.OpenAI(base_url=srv.url + "/oai/api/v1", api_key=key, max_retries=0, timeout=120)


def _tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def _chat_prompt(base) -> list[int]:
    """The family's template (the qwen plugin's jinja source) rendered by HF's own apply_chat_template."""
    source = (REPO / "plugins" / "qwen" / "templates" / "qwen2_5.jinja").read_text()
    out = _tokenizer(base).apply_chat_template(MESSAGES, chat_template=source, add_generation_prompt=True,
                                               tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _hf_greedy(base, prompt, state=None, steps=STEPS, stops=()):
    """HF float32 greedy decode: tokens, their logprobs and each step's top-2 ``(id, logprob)``."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    toks, lps, top2, cur = [], [], [], list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(model(torch.tensor([cur])).logits[0, -1].double(), -1)
            t = int(lp.argmax())
            v, i = torch.topk(lp, 2)
            toks.append(t), lps.append(float(lp[t])), top2.append(list(zip(i.tolist(), v.tolist())))
            cur.append(t)
            if t in stops:
                break
    return toks, lps, top2


def _check_chat(resp, tok, ref_toks, ref_lps, ref_top2, stop_ids):
    choice = resp.choices[0]
    content_toks = ref_toks[:-1] if ref_toks[-1] in stop_ids else ref_toks
    assert choice.message.content == tok.decode(content_toks)
    assert choice.finish_reason == ("stop" if ref_toks[-1] in stop_ids else "length")
    got = choice.logprobs.content
    assert [e.token for e in got] == [tok.decode([t]) for t in content_toks]
    assert max(abs(e.logprob - r) for e, r in zip(got, ref_lps)) < 1e-5
    for e, alts in zip(got, ref_top2):
        assert [a.token for a in e.top_logprobs] == [tok.decode([i]) for i, _ in alts]
        assert max(abs(a.logprob - v) for a, (_, v) in zip(e.top_logprobs, alts)) < 1e-5
    assert resp.usage.completion_tokens == len(ref_toks)


def test_chat_completions_from_the_base_and_a_sampler_checkpoint(oai_server, chat_base):
    tok = _tokenizer(chat_base)
    stop_ids = {tok.convert_tokens_to_ids(s) for s in STOPS}
    prompt = _chat_prompt(chat_base)
    client = _client(oai_server)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    kw = dict(messages=MESSAGES, max_tokens=STEPS, temperature=0, logprobs=True, top_logprobs=2)
    base = client.chat.completions.create(model=MODEL_NAME, **kw)
    ref = _hf_greedy(chat_base, prompt, stops=stop_ids)
    assert base.usage.prompt_tokens == len(prompt) and base.model == MODEL_NAME
    _check_chat(base, tok, *ref, stop_ids)
    # Tinker's base IDs carry ':peft:<context>'; the context caps prompt + max_tokens
    same = client.chat.completions.create(model=f"{MODEL_NAME}:peft:128", **kw)
    assert same.choices[0].message.content == base.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="exceeds the context of 40 tokens"):
        client.chat.completions.create(model=f"{MODEL_NAME}:peft:40", **kw)
    # streaming: the same text, as server-sent events
    chunks = list(client.chat.completions.create(model=MODEL_NAME, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == base.choices[0].message.content

    # a sampler checkpoint of a trained LoRA client, by path and as '<base>;<path>'
    tc = oai_server.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    tc.forward_backward(sdk_data(seed=5), "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_weights_for_sampler("oai-1").result().path
    ref_cp = _hf_greedy(chat_base, prompt, sampler_weights(oai_server, path), stops=stop_ids)
    for model in (path, f"{MODEL_NAME};{path}"):
        resp = client.chat.completions.create(model=model, **kw)
        _check_chat(resp, tok, *ref_cp, stop_ids)
    assert max(abs(a - b) for a, b in zip(ref_cp[1], ref[1])) > 1e-3   # the checkpoint's weights, not the base's

    # tenants and keys: an unknown key is 401, another tenant's checkpoint 404 (as on the Tinker routes)
    with pytest.raises(openai.AuthenticationError):
        _client(oai_server, "tml-unknown-0009").chat.completions.create(model=MODEL_NAME, **kw)
    r = httpx.post(oai_server.url + "/oai/api/v1/chat/completions", json={"model": MODEL_NAME, **kw}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist for this API key"):
        _client(oai_server, BOB).chat.completions.create(model=path, **kw)
    with pytest.raises(openai.NotFoundError, match=f"serves '{MODEL_NAME}'"):
        client.chat.completions.create(model="Qwen/Qwen3-8B", **kw)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL_NAME, tools=[{"type": "function", "function": {"name": "f"}}],
                                       **kw)
    state = path.replace("sampler_weights/oai-1", "weights/s")
    tc.save_state("s").result()
    with pytest.raises(openai.BadRequestError, match="sampler_weights"):
        client.chat.completions.create(model=state, **kw)


def test_completions_logprobs_n_and_stop_strings(oai_server, chat_base):
    tok = _tokenizer(chat_base)
    client = _client(oai_server)
    prompt = tok.encode("The sky is")
    toks, lps, top2 = _hf_greedy(chat_base, prompt, stops={tok.eos_token_id})
    resp = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=STEPS, temperature=0,
                                     logprobs=2, n=2)
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.prompt_tokens == len(prompt)
    kept = toks[:-1] if toks[-1] == tok.eos_token_id else toks
    for c in resp.choices:   # greedy: both samples alike
        assert c.text == tok.decode(kept)
        assert c.logprobs.tokens == [tok.decode([t]) for t in kept]
        assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, lps)) < 1e-5
        assert [list(d) for d in c.logprobs.top_logprobs] == [[tok.decode([i]) for i, _ in a] for a in top2[:len(kept)]]
    # token ids as the prompt give the same; a stop string ends the text before it
    same = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=STEPS, temperature=0)
    assert same.choices[0].text == resp.choices[0].text and same.choices[0].logprobs is None
    text = resp.choices[0].text
    stop = next(ch for ch in text[1:] if ch.isascii() and ch.isprintable())
    cut = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=STEPS, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop, 1)] and cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="outside"):
        client.completions.create(model=MODEL_NAME, prompt=[5, 9999], max_tokens=2)
    # --max-memory: a request that does not fit in what is left is refused naming it; one that fits runs
    memory = oai_server.app.state.service.memory
    memory.limit = memory.held + memory.reserved + 1
    try:
        with pytest.raises(openai.BadRequestError, match=r"needs about .* left of the server's --max-memory"):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=STEPS, n=2)
    finally:
        memory.limit = None
