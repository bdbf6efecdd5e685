"""The chat-template context equals what ``tokenizer.apply_chat_template`` passes.

Reference: transformers' ``apply_chat_template`` (5.24) on the real Qwen2.5 tokenizer (built
offline by ``ferrule.plugins.qwen``) with named special tokens set, for templates that use each
context variable: ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``,
``add_generation_prompt``, ``tools``, ``documents``, an extra keyword (``enable_thinking``), and
messages whose ``None`` values transformers drops. Templates are written in the shapes of
Llama-3, Mistral and DeepSeek-R1-Distill templates (BOS written by the template).
"""

from __future__ import annotations

import copy

import pytest

from ferrule.chat import ChatTemplateError, render_chat, render_chat_ids
from ferrule.contract.specs import ChatTemplateSpec

BOS = "<|endoftext|>"
UNK = "<|fim_pad|>"

TEMPLATES = {
    # Llama-3 shape: BOS, header-wrapped turns, generation prompt
    "llama3_like": (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}"),
    # Mistral shape: BOS once, [INST] user turns, EOS after every assistant turn
    "mistral_like": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    # DeepSeek-R1-Distill shape: BOS + system, then user / assistant markers, think opener when prompting
    "r1_distill_like": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
        "{% elif m['role'] == 'user' %}<|User|>{{ m['content'] }}{% elif m['role'] == 'assistant' %}"
        "<|Assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"),
    # every other context variable
    "context_probe": (
        "{% for m in messages %}[{{ m.role }}|{{ 'content' in m }}|{{ m.content is none }}]{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}"
        "|tools={{ tools | tojson }}|documents={{ documents | tojson }}|gen={{ add_generation_prompt }}"
        "|think={{ enable_thinking }}|pad={{ pad_token }}|unk={{ unk_token }}|sep={{ sep_token }}|"),
}

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOL_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}]


@pytest.fixture(scope="module")
def tokenizer():
    from ferrule.plugins.qwen.tokenizer import load_qwen2_tokenizer

    tok = copy.deepcopy(load_qwen2_tokenizer())  # the loader's instance is shared: never mutate it
    tok.bos_token = BOS
    tok.unk_token = UNK
    return tok


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    import sys

    root = tmp_path_factory.mktemp("tplpkg")
    pkg = root / "ctx_templates"
    (pkg / "templates").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, source in TEMPLATES.items():
        (pkg / "templates" / f"{name}.jinja").write_text(source)
    sys.path.insert(0, str(root))
    yield {name: ChatTemplateSpec(name=name, family="qwen2", template=f"ctx_templates:templates/{name}.jinja",
                                  stop_tokens=("<|im_end|>",)) for name in TEMPLATES}
    sys.path.remove(str(root))


CASES = [
    ("llama3_like", MESSAGES, {}, True),
    ("llama3_like", MESSAGES, {}, False),
    ("mistral_like", MESSAGES[1:3], {}, False),
    ("r1_distill_like", MESSAGES, {}, True),
    ("context_probe", TOOL_MESSAGES, {"tools": TOOLS, "documents": DOCUMENTS, "enable_thinking": False}, True),
    ("context_probe", MESSAGES, {"enable_thinking": True, "pad_token": "override"}, False),
]


@pytest.mark.parametrize("name,messages,kwargs,gen", CASES)
def test_text_and_ids_equal_apply_chat_template(tokenizer, specs, name, messages, kwargs, gen):
    ref_text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False,
                                             add_generation_prompt=gen, **copy.deepcopy(kwargs))
    ref_ids = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=True, return_dict=False,
                                            add_generation_prompt=gen, **copy.deepcopy(kwargs))
    kw = copy.deepcopy(kwargs)
    tools = kw.pop("tools", None)
    text = render_chat(specs[name], messages, tools=tools, add_generation_prompt=gen, tokenizer=tokenizer, **kw)
    assert text == ref_text
    rendered = render_chat_ids(specs[name], tokenizer, messages, tools=tools, add_generation_prompt=gen, **kw)
    assert list(rendered.token_ids) == list(ref_ids)
    if name != "context_probe":
        assert rendered.token_ids[0] == tokenizer.convert_tokens_to_ids(BOS)


def test_template_reading_bos_without_tokenizer_is_an_error(specs):
    with pytest.raises(ChatTemplateError, match="bos_token.*tokenizer="):
        render_chat(specs["llama3_like"], MESSAGES)
    # given explicitly, no tokenizer is needed
    assert render_chat(specs["llama3_like"], MESSAGES[:1], bos_token="<s>").startswith("<s><|im_start|>system")


def test_qwen3_enable_thinking_from_the_train_config(tokenizer):
    """data.chat_template_kwargs reaches the template as apply_chat_template's kwargs."""
    from ferrule.contract import registry
    from ferrule.plugins.qwen.tokenizer import load_qwen3_tokenizer
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import prompt_token_ids

    cfg = load_config(None, ["model.hf_dir=x", "data.task=basic_arithmetic",
                             "data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    spec = registry.get_chat_template("qwen3")
    tok = load_qwen3_tokenizer()
    msgs = MESSAGES[:2]
    for kwargs in ({"enable_thinking": False}, {}):
        ref = tok.apply_chat_template(msgs, chat_template=spec.read_source(), tokenize=True, return_dict=False,
                                      add_generation_prompt=True, **kwargs)
        assert list(prompt_token_ids(spec, tok, msgs, kwargs)) == list(ref)
    off = tok.decode(list(prompt_token_ids(spec, tok, msgs, cfg.data.chat_template_kwargs)))
    assert off.endswith("<think>\n\n</think>\n\n")


def test_reserved_chat_template_kwargs_are_config_errors():
    from ferrule.rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.chat_template_kwargs"):
        load_config(None, ["model.hf_dir=x", "data.task=basic_arithmetic",
                           "data.chat_template_kwargs={add_generation_prompt: false}"])
