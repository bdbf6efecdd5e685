"""Tool calls in model turns: the parsed record and the default (Hermes / Qwen) parser.

A family's parser (``register_tool_parsers``, :class:`ferrule.contract.specs.ToolParserSpec`) turns one
model turn, decoded with its special tokens kept and its stop token removed, into a
:class:`ParsedTurn`: the free text, the well-formed calls and one message per malformed call.
A malformed call is data the environment answers (an observation the model can learn from),
never an exception.

:func:`parse_hermes` reads the format Qwen 2.5 / 3's chat templates write and declare in their
system prompt (Hermes function calling, ``tokenizer_config.json`` of Qwen2.5-*-Instruct)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

Importing this module imports no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ParsedTurn", "parse_hermes", "openai_tool_calls"]

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: ``name`` and its JSON-object ``arguments`` (a dict)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn read by a tool parser.

    Attributes:
        content: the turn's text outside tool calls (stripped).
        calls: the well-formed calls, in order.
        errors: one line per malformed call (what was wrong, what is expected), in order; an
            environment sends them back to the model as the observation.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


def _call_of(payload: str, where: str, args_key: str = "arguments") -> ToolCall | str:
    """A :class:`ToolCall` from JSON text ``{"name": ..., args_key: {...}}``, else an error line."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        return f"{where}: not valid JSON ({exc.msg} at character {exc.pos}); write {{\"name\": ..., \"{args_key}\": {{...}}}}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"{where}: expected a JSON object with a string \"name\"; got {payload.strip()[:80]!r}"
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return f"{where} ({obj['name']}): \"{args_key}\" must be a JSON object; got {type(args).__name__}"
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> ParsedTurn:
    """Tool calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5 / 3).

    Args:
        text: one model turn, decoded with special tokens kept, the stop token removed.

    Returns:
        :class:`ParsedTurn`; an unterminated ``<tool_call>``, invalid JSON or a missing ``name``
        is an entry of ``errors``. Never raises.
    """
    calls, errors = [], []
    for k, m in enumerate(_HERMES.finditer(text)):
        where = f"tool call {k + 1}"
        if not m.group(2):
            errors.append(f"{where}: <tool_call> is not closed; end it with </tool_call>")
            continue
        got = _call_of(m.group(1), where)
        (calls if isinstance(got, ToolCall) else errors).append(got)
    return ParsedTurn(_HERMES.sub("", text).strip(), tuple(calls), tuple(errors))


def openai_tool_calls(calls: tuple[ToolCall, ...], prefix: str = "call") -> list[dict[str, Any]]:
    """``calls`` as OpenAI / HF chat ``tool_calls`` entries (arguments as a dict, as the chat
    templates take them), ids ``{prefix}_{k}``."""
    return [{"id": f"{prefix}_{k}", "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for k, c in enumerate(calls)]
