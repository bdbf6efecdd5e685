"""Inkling's TMLv0 chat template and tokenizer against tml-renderers, Inkling's reference chat format.

References (independent of ferrule's jinja template and tokenizer build):
- ``tests/data/tmlv0_golden.jsonl``: 18 conversations rendered by tml-renderers' ``v0.Renderer``
  (``tests/make_tmlv0_golden.py`` regenerates it and documents the input mapping);
- tml-renderers live: the same renderer run now (completion and SFT paths, the effort line over a
  sweep of values, its parser on our generation prompt), and its ``O200kBaseChatTokenizer``;
- transformers: ``InklingConfig``'s placeholder ids and its chat-template environment.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
from tml_renderers import chat, tokenizers, v0

from ferrule.chat import ChatTemplateError, encode_rendered, render_chat, stop_token_ids
from ferrule.tmlv0 import tokenizer as inkling_tok

HERE = Path(__file__).resolve().parents[3] / "tests"  # make_tmlv0_golden.py and its data
N_GOLDEN = 18
RANDOM_STRINGS = 300
RANDOM_SEED = 0
#: thinking efforts swept against tml-renderers: every thousandth, halves of thousandths (both roundings
#: are half-to-even), and random values
_EFFORT_RNG = random.Random(RANDOM_SEED)
EFFORT_SWEEP = sorted({k / 1000 for k in range(1001)} | {(k + 0.5) / 1000 for k in range(1000)}
                      | {_EFFORT_RNG.random() for _ in range(300)} | {1e-9, 0.3349, 0.9995})


def _generator():
    spec = importlib.util.spec_from_file_location("make_tmlv0_golden", HERE / "make_tmlv0_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def _golden() -> list[dict]:
    rows = [json.loads(line) for line in GEN.GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == N_GOLDEN
    return rows


def _render(row: dict) -> str:
    return render_chat("tmlv0", row["messages"], tools=row["tools"], add_generation_prompt=row["add_generation_prompt"],
                       thinking_effort=row["thinking_effort"])


@pytest.fixture(scope="module")
def tok():
    return inkling_tok.load_tmlv0_tokenizer()


@pytest.fixture(scope="module")
def ref_tok():
    return tokenizers.O200kBaseChatTokenizer()


# ------------------------------------------------------------------------------------------
# golden renderings
# ------------------------------------------------------------------------------------------


def test_golden_covers_every_feature():
    rows = _golden()
    text = "".join(r["text"] for r in rows)
    for marker in ("<|message_system|>", "<|message_tool|>", "Thinking effort level: 0<", "Thinking effort level: 1<",
                   "<|content_thinking|>", "<|content_invoke_tool_json|>", "tool_declare<|content_xml|>",
                   "<|content_model_end_sampling|>", "<|content_image|>", "<|content_audio_input|>", "🤖"):
        assert marker in text, marker
    assert {r["add_generation_prompt"] for r in rows} == {True, False}
    assert None in {r["thinking_effort"] for r in rows}
    assert [m["kind"] for r in rows for m in r["media"]] == ["image", "audio"]


@pytest.mark.parametrize("index", range(N_GOLDEN))
def test_golden_text_and_ids(index, tok):
    row = _golden()[index]
    text = _render(row)
    assert text == row["text"], row["name"]
    assert encode_rendered(tok, text) == row["token_ids"], row["name"]


@pytest.mark.parametrize("index", range(N_GOLDEN))
def test_matches_tml_renderers_live(index, tok):
    row = _golden()[index]
    expected, media = GEN.reference(row["messages"], row["tools"], row["add_generation_prompt"], row["thinking_effort"])
    assert encode_rendered(tok, _render(row)) == expected, row["name"]
    assert media == row["media"], row["name"]  # the golden file is what tml-renderers gives today


def test_golden_file_is_reproducible(capsys):
    """`python tests/make_tmlv0_golden.py --check`: the stored file is byte-identical to a fresh rendering."""
    assert GEN.main(["--check"]) == 0, capsys.readouterr().out


def _native_with_effort(messages: list, effort: float | None) -> list:
    """tinker-cookbook's SFT input: native messages, a ThinkingEffort before the first non-system one."""
    native = [m for oa in chat.OpenAIMessage.from_oss_messages(messages) for m in oa.to_messages()]
    if effort is not None:
        at = next((i for i, m in enumerate(native) if m.author.kind != chat.AuthorKind.System), len(native))
        native.insert(at, chat.Message(content=chat.ThinkingEffort(round(effort * 1000)),
                                       author=chat.Author(chat.AuthorKind.System)))
    return native


def test_conversation_matches_tml_sft_rendering(tok):
    """A conversation that ends with the model's turn renders as render_for_sft's input tokens."""
    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    rows = [r for r in _golden() if r["messages"][-1]["role"] == "assistant" and not r["add_generation_prompt"]
            and not r["media"]]
    assert len(rows) >= 2
    for row in rows:
        for effort in (row["thinking_effort"], 0.42):
            native = _native_with_effort(GEN.to_tml_messages(row["messages"], row["tools"]), effort)
            (example,) = renderer.render_for_sft(native)
            expected = [int(t) for span in example.input_token_spans for t in span.span.tokens]
            text = render_chat("tmlv0", row["messages"], tools=row["tools"], thinking_effort=effort)
            assert encode_rendered(tok, text) == expected, (row["name"], effort)


def test_effort_line_matches_tml_renderers(tok):
    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    oa = chat.OpenAIMessage.from_oss_messages(convo)
    for effort in EFFORT_SWEEP:
        spans, _ = renderer.render_for_completion_with_effort(oa, effort)
        expected = [int(t) for span in spans for t in span.span.tokens]
        assert encode_rendered(tok, render_chat("tmlv0", convo, thinking_effort=effort)) == expected, effort
    # the default is tinker-cookbook's DEFAULT_EFFORT (0.9); None leaves the line out
    spans, _ = renderer.render_for_completion_with_effort(oa, 0.9)
    assert encode_rendered(tok, render_chat("tmlv0", convo)) == [int(t) for s in spans for t in s.span.tokens]
    spans, _ = renderer.render_for_completion(oa)
    assert encode_rendered(tok, render_chat("tmlv0", convo, thinking_effort=None)) == [
        int(t) for s in spans for t in s.span.tokens]


def test_generation_prompt_is_parsed_by_tml_renderers(tok, ref_tok):
    """Our prompt ends with <|message_model|>; tml-renderers' parser reads prompt header + sample as one message."""
    renderer = v0.Renderer(ref_tok)
    convo = [{"role": "user", "content": "Hi"}]
    _, parser = renderer.render_for_completion(chat.OpenAIMessage.from_oss_messages(convo))
    prompt = encode_rendered(tok, render_chat("tmlv0", convo, add_generation_prompt=True, thinking_effort=None))
    header = prompt[-1:]
    assert header == [ref_tok.encode_special("message_model")]
    sample = tok.encode("<|content_text|>Hello there<|end_message|><|content_model_end_sampling|>", add_special_tokens=False)
    parsed = parser.parse_tokens(header + sample)
    assert [type(m.content).__name__ for m in parsed] == ["Text", "ModelEndSampling"]
    assert parsed[0].author.kind == chat.AuthorKind.Model and parsed[0].content.text == "Hello there"
    assert stop_token_ids("tmlv0", tok) == tuple(renderer.stop())


def test_template_renders_identically_in_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    from ferrule.contract import registry
    source = registry.get_chat_template("tmlv0").read_source()
    for row in _golden():
        expected, _ = render_jinja_template([row["messages"]], tools=row["tools"], chat_template=source,
                                            add_generation_prompt=row["add_generation_prompt"],
                                            thinking_effort=row["thinking_effort"])
        assert expected[0] == row["text"], row["name"]


def test_registered_for_inkling():
    from ferrule.contract import registry
    assert [s.name for s in registry.chat_templates_for("inkling")] == ["tmlv0"]
    assert registry.get_chat_template("tmlv0").stop_tokens == ("<|content_model_end_sampling|>",)
    assert "chat_template" not in registry.get_registry().missing_parts("inkling")


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("effort", [1.5, -0.1, "high", True, math.nan, math.inf])
def test_bad_effort_is_refused(effort):
    with pytest.raises(ChatTemplateError, match="thinking_effort must be a number in \\[0, 1\\]"):
        render_chat("tmlv0", [{"role": "user", "content": "x"}], thinking_effort=effort)


@pytest.mark.parametrize(
    ("messages", "tools", "pattern"),
    [
        ([{"role": "user", "content": "x"},
          {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}]}],
         None, r"messages\[1\]\.tool_calls\[0\] \(add\): TMLv0 renders arguments as a dict"),
        ([{"role": "user", "content": [{"type": "video", "url": "v.mp4"}]}], None,
         r"messages\[0\]: content part type \"video\" is not rendered by TMLv0"),
        ([{"role": "user", "content": [{"type": "text"}]}], None, r"messages\[0\]: a text part needs a string 'text'"),
        ([{"role": "user", "content": "x"}], [{"name": "add", "parameters": {}}], r"tools\[0\] has no 'function'"),
    ],
)
def test_malformed_input_names_the_offender(messages, tools, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        render_chat("tmlv0", messages, tools=tools)


# ------------------------------------------------------------------------------------------
# tokenizer vs tml-renderers' O200kBaseChatTokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tok, ref_tok):
    from transformers import InklingConfig

    assert len(tok) == 200058
    for token_id, content in inkling_tok.TMLV0_SPECIAL_TOKENS:
        assert content == f"<|{ref_tok.decode_special(token_id)}|>"
        assert tok.convert_tokens_to_ids(content) == token_id
        assert tok.decode([token_id]) == content
    assert ref_tok.decode_special(inkling_tok.O200K_BPE_VOCAB_SIZE - 1) is None
    assert ref_tok.decode_special(200058) is None
    assert (tok.bos_token, tok.eos_token) == (f"<|{ref_tok.bos_token}|>", f"<|{ref_tok.eos_token}|>")
    cfg = InklingConfig()  # the placeholders the template writes are the ids the HF model scatters into
    ids = tok.convert_tokens_to_ids([inkling_tok.IMAGE_PLACEHOLDER, inkling_tok.AUDIO_PLACEHOLDER,
                                     "<|content_image|>", "<|content_audio_input|>"])
    assert ids == [cfg.image_token_id, cfg.audio_token_id, cfg.image_bos_token_id, cfg.audio_bos_token_id]


FIXED_STRINGS = [
    "Hello world! 12345 + 678 = ?",
    "  def f(x):\n\treturn x**2  # comment\n\n",
    "中文测试，你好世界。Ünïcödé ñ — emojis 🤖🚀 👩‍👩‍👧",
    "The quick brown fox's 3.14159 don't  I'LL   spaces\r\n\r\nend",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם こんにちは 세계",
    '{"name":"get_weather","args":{"city":"Tokyo","unit":"c"}}',
    "cafe\u0301 n\u0303 ｆｕｌｌｗｉｄｔｈ１２３ ∑∫√∞ ≤ ≥ ‘quotes’ “double”",
    "a\u00a0b\u2003c\u200bd\tx\x0by\x0cz /path/to//file.txt\n/",
    "x" * 300 + " " + "1234567890" * 20,
]


def _random_strings() -> list[str]:
    rng = random.Random(RANDOM_SEED)
    ranges = [(0x20, 0x7E), (0x20, 0x7E), (0xC0, 0x17F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
              (0x600, 0x6FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF),
              (0x2000, 0x206F)]
    out = []
    for _ in range(RANDOM_STRINGS):
        chars = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.15:
                chars.append(rng.choice(" \n\t\r'/0123456789"))
            else:
                lo, hi = rng.choice(ranges)
                chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def test_tokenizer_matches_tml_encode_ordinary(tok, ref_tok):
    for text in FIXED_STRINGS + _random_strings():
        expected = ref_tok.encode_ordinary(text)
        assert tok.encode(text, add_special_tokens=False) == expected, repr(text)
        assert tok.decode(expected) == text, repr(text)


def test_wrong_vocabulary_file_is_rejected(tmp_path, monkeypatch):
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(b"IQ== 0\n")
    with pytest.raises(ValueError, match="sha256"):
        inkling_tok.build_tmlv0_tokenizer(bad)
    monkeypatch.setenv("FERRULE_O200K_TIKTOKEN", str(tmp_path / "missing.tiktoken"))
    with pytest.raises(FileNotFoundError, match="FERRULE_O200K_TIKTOKEN"):
        inkling_tok.find_o200k_tiktoken()
    with pytest.raises(KeyError, match="no TMLv0 tokenizer for template 'qwen3'"):
        inkling_tok.load_chat_tokenizer("qwen3")


# ------------------------------------------------------------------------------------------
# CLI: ferrule chat-template render --family inkling
# ------------------------------------------------------------------------------------------


def test_cli_render_reproduces_golden(tmp_path, tok):
    from typer.testing import CliRunner

    from ferrule.cli import app

    runner = CliRunner()
    rows = {r["name"]: r for r in _golden()}
    for name in ("tool_call_and_result", "image_part", "system_user_no_effort", "reasoning_field_sft"):
        row = rows[name]
        path = tmp_path / f"{name}.json"
        payload = {"messages": row["messages"], **({"tools": row["tools"]} if row["tools"] else {})}
        path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
        flag = "--generation-prompt" if row["add_generation_prompt"] else "--no-generation-prompt"
        effort = json.dumps(row["thinking_effort"])
        result = runner.invoke(app, ["chat-template", "render", str(path), "--family", "inkling", flag,
                                     "--var", f"thinking_effort={effort}", "--json"])
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert (out["template"], out["text"], out["token_ids"]) == ("tmlv0", row["text"], row["token_ids"]), name
        assert out["stop_token_ids"] == [200006]
    # formatted view, default effort (0.9) and no --var
    row = rows["single_user_default_effort"]
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(row["messages"]), encoding="utf-8")
    result = runner.invoke(app, ["chat-template", "render", str(path), "--family", "inkling", "--generation-prompt"])
    assert result.exit_code == 0, result.output
    assert row["text"] in result.output and " ".join(map(str, row["token_ids"])) in result.output


def test_cli_user_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from ferrule.cli import app

    runner = CliRunner()
    path = tmp_path / "calls.json"
    path.write_text(json.dumps([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]}]))
    result = runner.invoke(app, ["chat-template", "render", str(path), "--family", "inkling", "--no-ids"])
    assert result.exit_code == 2
    assert "TMLv0 renders arguments as a dict" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["chat-template", "render", str(path), "--family", "inkling", "--no-ids",
                                 "--var", "thinking_effort=2"])
    assert result.exit_code == 2 and "thinking_effort must be a number in [0, 1]" in result.output
