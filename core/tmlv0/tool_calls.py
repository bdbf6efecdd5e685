"""TMLv0 tool invocations in a model turn (Inkling, Inkling-2; the parser of their ``register_tool_parsers``).

Reference: tml-renderers 0.2.1 (``tml_renderers.v0``), as rendered by ``templates/tmlv0.jinja``
(checked token for token against it by plugins/inkling/tests/test_inkling_chat_template.py). A model turn starts
after the generation prompt ``<|message_model|>``; each part is a message::

    <|content_text|>TEXT<|end_message|>
    <|message_model|>NAME<|content_invoke_tool_json|>{"name":NAME,"args":{...}}<|end_message|>

(the first part's ``<|message_model|>`` header is the generation prompt, so it is absent from the
sampled text), and the turn ends with ``<|content_model_end_sampling|>`` (removed before parsing).
"""

from __future__ import annotations

import re

from ferrule.chat.tool_calls import ParsedTurn, ToolCall, _call_of

__all__ = ["parse_tmlv0"]

_INVOKE = "<|content_invoke_tool_json|>"
_END = "<|end_message|>"
_HEADER = "<|message_model|>"
_PART = re.compile(r"<\|content_(?:text|thinking)\|>(.*?)(?:<\|end_message\|>|$)", re.S)


def parse_tmlv0(text: str) -> ParsedTurn:
    """Tool invocations of one TMLv0 model turn (decoded with special tokens kept).

    Returns:
        :class:`~ferrule.chat.tool_calls.ParsedTurn`: ``content`` joins the text parts; a call whose JSON
        is invalid, lacks ``name``/``args``, names another tool than its header, or is not closed by
        ``<|end_message|>`` is an entry of ``errors``. Never raises.
    """
    calls, errors, texts = [], [], []
    for k, part in enumerate(p for p in text.split(_HEADER) if p):
        if _INVOKE not in part:
            texts.extend(m.group(1) for m in _PART.finditer(part))
            continue
        header, _, rest = part.partition(_INVOKE)
        where = f"tool call {len(calls) + len(errors) + 1}"
        if _END not in rest:
            errors.append(f"{where} ({header.strip() or '?'}): not closed; end the JSON with <|end_message|>")
            continue
        payload = rest.split(_END, 1)[0]
        got = _call_of(payload, where, args_key="args")
        if isinstance(got, ToolCall) and header.strip() and got.name != header.strip():
            got = f"{where}: header names {header.strip()!r} but the JSON names {got.name!r}; write the same name"
        (calls if isinstance(got, ToolCall) else errors).append(got)
    return ParsedTurn("\n".join(t.strip() for t in texts).strip(), tuple(calls), tuple(errors))
