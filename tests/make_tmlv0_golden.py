"""Regenerate tests/data/tmlv0_golden.jsonl: TMLv0 renderings of CONVERSATIONS by tml-renderers.

Run from the repository root (needs tml-renderers, a dev dependency)::

    python tests/make_tmlv0_golden.py            # rewrite the golden file
    python tests/make_tmlv0_golden.py --check    # exit 1 if the file differs from a fresh rendering

Each line holds one conversation in ferrule's input form (``messages``, ``tools``,
``add_generation_prompt``, ``thinking_effort``) and what tml-renderers produces for it:

- ``token_ids``: ``v0.Renderer(O200kBaseChatTokenizer()).render_for_completion`` (or
  ``render_for_completion_with_effort`` when ``thinking_effort`` is not None) over
  ``chat.OpenAIMessage.from_oss_messages(...)``, with each image / audio token span replaced by one
  placeholder id (:data:`IMAGE_PLACEHOLDER_ID`, :data:`AUDIO_PLACEHOLDER_ID`: the ids the towers
  expand), and ``<|message_model|>`` appended when ``add_generation_prompt`` is true
  (tml-renderers leaves that header for the model to sample; its parser accepts it either way);
- ``text``: those tokens spelled out (special tokens as ``<|name|>``, text runs decoded);
- ``media``: for each image / audio span, its kind and the token count tml-renderers gives it.

How ferrule's input maps onto tml-renderers' OpenAI dicts (:func:`to_tml_messages`): a message's
``reasoning_content`` becomes a leading ``{"type": "thinking"}`` part (tml-renderers ignores the
field), and ``tools`` become a ``tool_declare`` message (compact JSON, as tinker-cookbook's
``create_conversation_prefix_with_tools`` writes it) before the first non-system message.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import struct
import sys
import wave
import zlib
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "data" / "tmlv0_golden.jsonl"
IMAGE_PLACEHOLDER_ID = 200054  # <|unused_200054|>, transformers InklingConfig.image_token_id
AUDIO_PLACEHOLDER_ID = 200053  # <|unused_200053|>, transformers InklingConfig.audio_token_id
MESSAGE_MODEL_ID = 200001  # <|message_model|>


def _png(width: int, height: int) -> bytes:
    """A deterministic RGB PNG (stdlib only)."""
    rows = b"".join(b"\x00" + bytes((x * 7 + y * 3 + c * 50) % 256 for x in range(width) for c in range(3))
                    for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def _wav(seconds: float, rate: int = 16000, hz: float = 440.0) -> bytes:
    """A deterministic 16-bit mono sine WAV (stdlib only)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * hz * i / rate)))
                               for i in range(int(seconds * rate))))
    return out.getvalue()


IMAGE_URL = "data:image/png;base64," + base64.b64encode(_png(64, 48)).decode()
AUDIO_B64 = base64.b64encode(_wav(0.2)).decode()


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                  "city": {"type": "string", "description": "City name, e.g. Zürich"}}}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
                   "required": ["a", "b"]}}}
NOW_TOOL = {"type": "function", "function": {"name": "now", "parameters": {}}}

#: (name, messages, tools, add_generation_prompt, thinking_effort)
CONVERSATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, bool, float | None]] = [
    ("single_user_default_effort", [{"role": "user", "content": "What is 2 + 2?"}], None, True, 0.9),
    ("system_user_no_effort", [{"role": "system", "content": "Answer tersely."},
                               {"role": "user", "content": "Name a prime."}], None, True, None),
    ("multi_turn", [{"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Tell me a joke."}], None, True, 0.5),
    ("effort_zero", [{"role": "user", "content": "Quick: capital of France?"}], None, True, 0.0),
    ("effort_one", [{"role": "user", "content": "Prove there are infinitely many primes."}], None, True, 1.0),
    # 0.3349 -> 335 thousandths -> 0.34 (half to even on thousandths); 0.125 -> 0.12; 0.0145 -> 0.01
    ("effort_rounding", [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2"},
                         {"role": "user", "content": "x"}], None, True, 0.3349),
    ("effort_half_even", [{"role": "user", "content": "y"}], None, False, 0.125),
    ("reasoning_field_sft", [{"role": "user", "content": "Is 91 prime?"},
                             {"role": "assistant", "reasoning_content": "91 = 7 * 13.", "content": "No: 91 = 7 x 13."}],
     None, False, None),
    ("thinking_parts", [{"role": "user", "content": "Sum 1..10?"},
                        {"role": "assistant", "content": [{"type": "thinking", "thinking": "10*11/2 = 55"},
                                                          {"type": "text", "text": "55"}]},
                        {"role": "user", "content": "And 1..100?"}], None, True, 0.7),
    ("tool_call_and_result", [{"role": "system", "content": "Use tools when useful."},
                              {"role": "user", "content": "Weather in Zürich?"},
                              {"role": "assistant", "content": "",
                               "tool_calls": [_call("call_1", "get_weather", {"unit": "c", "city": "Zürich"})]},
                              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                               "content": "{\"temp\": 21, \"sky\": \"clear\"}"}],
     [WEATHER_TOOL], True, 0.9),
    ("parallel_calls_nested_args", [{"role": "user", "content": "Add 3+4 and 10+20, then tell me the time."},
                                    {"role": "assistant", "content": "Sure, computing.",
                                     "reasoning_content": "Two adds and a clock.",
                                     "tool_calls": [_call("c1", "add", {"b": 4, "a": 3}),
                                                    _call("c2", "add", {"a": 10, "b": 20,
                                                                        "meta": {"z": [1, 2.5, None, True], "y": "ü中<>&'"}}),
                                                    _call("c3", "now", {})]},
                                    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "7"},
                                    {"role": "tool", "tool_call_id": "c2", "name": "add", "content": "30"},
                                    {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "12:00"},
                                                                                      {"type": "text", "text": "UTC"}]},
                                    {"role": "assistant", "content": "7, 30, and it is 12:00 UTC."}],
     [ADD_TOOL, NOW_TOOL], False, None),
    ("tool_call_only_content_none", [{"role": "user", "content": "Time?"},
                                     {"role": "assistant", "content": None, "tool_calls": [_call("t", "now", {})]},
                                     {"role": "tool", "content": "09:30"}],
     [NOW_TOOL], True, None),
    ("image_part", [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                 {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}],
     None, True, 0.9),
    ("audio_part", [{"role": "system", "content": "Transcribe audio."},
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": AUDIO_B64, "format": "wav"}},
                                                 {"type": "text", "text": "What do you hear?"}]}],
     None, True, 0.5),
    ("empty_contents", [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                        {"role": "assistant", "content": ""}, {"role": "user", "content": []},
                        {"role": "assistant", "content": []}, {"role": "user", "content": [{"type": "text", "text": ""}]}],
     None, False, None),
    ("unicode", [{"role": "user", "content": "中文测试，你好世界。Ünïcödé ñ — emojis 🤖🚀 👩‍👩‍👧 Привет мир مرحبا שלום"},
                 {"role": "assistant", "content": "こんにちは 세계 ∑∫√∞ ≤ ≥ “quotes” cafe\u0301 a\u00a0b\tc\r\nd"},
                 {"role": "user", "content": "  leading and trailing spaces  \n\n"}], None, True, 0.25),
    ("consecutive_assistant_and_mid_system", [{"role": "user", "content": "Two answers please."},
                                              {"role": "assistant", "content": "First."},
                                              {"role": "assistant", "content": "Second."},
                                              {"role": "system", "content": "Now be brief."},
                                              {"role": "user", "content": "Ok"}], None, False, 0.9),
    ("only_system_with_tools", [{"role": "system", "content": "Setup only."}], [WEATHER_TOOL], False, 0.6),
]


def to_tml_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """ferrule's input -> tml-renderers' OpenAI dicts (see the module docstring)."""
    out = []
    for msg in messages:
        msg = dict(msg)
        reasoning = msg.pop("reasoning_content", None)
        if reasoning is not None:
            content = msg.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            msg["content"] = [{"type": "thinking", "thinking": reasoning}, *parts]
        out.append(msg)
    if tools:
        at = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
        out.insert(at, {"role": "tool_declare", "content": json.dumps(tools, separators=(",", ":"))})
    return out


def reference(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
              thinking_effort: float | None) -> tuple[list[int], list[dict[str, Any]]]:
    """Token ids (media spans -> one placeholder each) and media spans, from tml-renderers."""
    from tml_renderers import chat, tokenizers, v0

    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    oa = chat.OpenAIMessage.from_oss_messages(to_tml_messages(messages, tools))
    if thinking_effort is None:
        spans, _ = renderer.render_for_completion(oa)
    else:
        spans, _ = renderer.render_for_completion_with_effort(oa, thinking_effort)
    ids: list[int] = []
    media: list[dict[str, Any]] = []
    for wrapped in spans:
        span = wrapped.span
        if isinstance(span, chat.EncodedTextTokenSpan):
            ids.extend(int(t) for t in span.tokens)
        elif isinstance(span, chat.ImageAssetPointerTokenSpan):
            ids.append(IMAGE_PLACEHOLDER_ID)
            media.append({"kind": "image", "num_tokens": int(span.num_tokens), "width": int(span.width),
                          "height": int(span.height)})
        elif isinstance(span, chat.DmelTokenSpan):
            ids.append(AUDIO_PLACEHOLDER_ID)
            media.append({"kind": "audio", "num_tokens": int(span.token_count())})
        else:
            raise TypeError(f"unexpected tml-renderers span {type(span).__name__}")
    if add_generation_prompt:
        ids.append(MESSAGE_MODEL_ID)
    return ids, media


def spell(ids: list[int]) -> str:
    """Token ids as text: special tokens as ``<|name|>``, runs of ordinary tokens decoded together."""
    from tml_renderers import tokenizers

    tok = tokenizers.O200kBaseChatTokenizer()
    out: list[str] = []
    run: list[int] = []
    for token_id in ids:
        name = tok.decode_special(token_id)
        if name is None:
            run.append(token_id)
            continue
        if run:
            out.append(tok.decode_strict(run))
            run = []
        out.append(f"<|{name}|>")
    if run:
        out.append(tok.decode_strict(run))
    return "".join(out)


def golden_rows() -> list[dict[str, Any]]:
    rows = []
    for name, messages, tools, gen, effort in CONVERSATIONS:
        ids, media = reference(messages, tools, gen, effort)
        rows.append({"name": name, "messages": messages, "tools": tools, "add_generation_prompt": gen,
                     "thinking_effort": effort, "text": spell(ids), "token_ids": ids, "media": media})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored file instead of writing it")
    args = parser.parse_args(argv)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in golden_rows())
    if args.check:
        same = GOLDEN.is_file() and GOLDEN.read_text(encoding="utf-8") == text
        print(f"{GOLDEN}: {'up to date' if same else 'DIFFERS from a fresh rendering'}")
        return 0 if same else 1
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    tmp = GOLDEN.with_suffix(".jsonl.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(GOLDEN)
    print(f"wrote {len(CONVERSATIONS)} conversations to {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
