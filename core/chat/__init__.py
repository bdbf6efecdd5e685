"""The chat format: chat-template rendering here (jinja templates registered by plugins -> text ->
token ids), the tool calls of a model turn in :mod:`ferrule.chat.tool_calls`.

The jinja environment is configured like Hugging Face's ``apply_chat_template``
(transformers ``utils/chat_template_utils.py``, checked against 5.24.0), so a template that
renders correctly here renders identically through ``tokenizer.apply_chat_template``:

- ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension;
- ``tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`` is plain
  ``json.dumps`` with those defaults: non-ASCII kept, dict insertion order kept, ``", "`` and
  ``": "`` separators, no HTML escaping (jinja's own ``tojson`` escapes ``<>&'`` and sorts keys);
- globals ``raise_exception(message)`` (raises), ``strftime_now(fmt)``, ``namespace``, ``dict``;
- the ``{% generation %}...{% endgeneration %}`` tag is accepted and renders its body (HF uses
  it to build assistant masks; spans are not tracked here);
- template variables, as ``apply_chat_template`` passes them: the tokenizer's named special
  tokens (``tokenizer.special_tokens_map``: ``bos_token``, ``eos_token``, ``pad_token``,
  ``unk_token``, ... as strings; HF-style Llama-3 / Mistral / DeepSeek-R1-Distill templates write
  ``{{ bos_token }}``), then ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and
  any extra keyword (e.g. ``enable_thinking``), an extra keyword overriding a special token of
  the same name. A template that uses a special-token variable needs the tokenizer
  (:class:`ChatTemplateError` otherwise: it would silently render an empty string);
- messages as transformers 5.24 normalizes them: keys whose value is ``None`` are dropped, and a
  message whose reasoning is given as ``thinking`` or ``reasoning`` also gets
  ``reasoning_content`` (and vice versa).

Messages are validated before rendering; errors name the offending message index.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ferrule.contract.specs import ChatTemplateSpec, resolve_ref

if TYPE_CHECKING:
    import jinja2

#: Roles a message may have (OpenAI / HF chat format).
KNOWN_ROLES = ("system", "user", "assistant", "tool")
#: Names under which a message's reasoning may arrive; the first one is what templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: The named special tokens of an HF tokenizer (``SPECIAL_TOKENS_ATTRIBUTES`` in transformers
#: ``tokenization_utils_base.py``); ``apply_chat_template`` passes those that are set.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """Malformed messages / tools, or a template that refused them (``raise_exception``)."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation.

    Attributes:
        text: the template output.
        token_ids: ``tokenizer.encode(text, add_special_tokens=False)``; special tokens written
            in the text (``<|im_start|>``, ...) become their single ids.
        template: the template name.
    """

    text: str
    token_ids: tuple[int, ...]
    template: str


# --------------------------------------------------------------------------------------------
# jinja environment (HF-compatible)
# --------------------------------------------------------------------------------------------


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter with Hugging Face semantics (``json.dumps`` with these defaults)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def make_environment() -> jinja2.Environment:
    """The shared sandboxed jinja environment (see the module docstring for its configuration)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders the body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) jinja source in :func:`make_environment`.

    Raises:
        ChatTemplateError: the source does not parse (line number in the message).
    """
    import jinja2

    try:
        return make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: line {exc.lineno}: {exc.message}") from exc


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    return f"of type {type(value).__name__}"


def _check_content(i: int, content: Any) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ChatTemplateError(
                    f"messages[{i}].content[{j}] is {part!r}; a content part is a dict with a string "
                    "'type' (e.g. {'type': 'text', 'text': '...'})."
                )
        return
    raise ChatTemplateError(
        f"messages[{i}].content is {_describe(content)}; expected a string or a list of content parts."
    )


def _check_tool_calls(i: int, calls: Any) -> None:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatTemplateError(f"messages[{i}].tool_calls is {_describe(calls)}; expected a list of tool calls.")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{where} is {_describe(call)}; expected a dict.")
        fn = call.get("function", call)
        if not isinstance(fn, Mapping):
            raise ChatTemplateError(f"{where}.function is {_describe(fn)}; expected a dict with name and arguments.")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{where} has no function name; write {{'function': {{'name': ..., 'arguments': {{...}}}}}}.")
        if "arguments" not in fn:
            raise ChatTemplateError(f"{where} ({fn['name']!r}) has no 'arguments'; pass a dict (or a JSON string).")
        if not isinstance(fn["arguments"], (Mapping, str)):
            raise ChatTemplateError(
                f"{where} ({fn['name']!r}).arguments is {_describe(fn['arguments'])}; expected a dict or a JSON string."
            )


def validate_messages(messages: Any, tools: Any = None) -> None:
    """Check a conversation before rendering.

    Rules: ``messages`` is a non-empty list of dicts; ``role`` is one of :data:`KNOWN_ROLES`;
    ``content`` is a string or a list of content parts (``{"type": ...}``), and may be missing
    or ``None`` only on an assistant message that has ``tool_calls``; ``tool_calls`` (assistant
    only) is a list of ``{"function": {"name": str, "arguments": dict | str}}`` (or the flat
    ``{"name", "arguments"}``); reasoning fields are strings; ``tools`` is a list of dicts.

    Raises:
        ChatTemplateError: the first problem found, naming ``messages[i]`` (or ``tools[i]``).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError(f"messages is {_describe(messages)}; expected a list of message dicts.")
    if not messages:
        raise ChatTemplateError("messages is empty; a conversation needs at least one message.")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{i}] is {_describe(msg)}; expected a dict with 'role' and 'content'.")
        role = msg.get("role")
        if role not in KNOWN_ROLES:
            what = "has no 'role'" if "role" not in msg else f"has unknown role {role!r}"
            raise ChatTemplateError(f"messages[{i}] {what}; expected one of {', '.join(KNOWN_ROLES)}.")
        calls = msg.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ChatTemplateError(f"messages[{i}] (role {role!r}) has tool_calls; only assistant messages call tools.")
        if calls is not None:
            _check_tool_calls(i, calls)
        content = msg.get("content")
        if content is None:
            if not calls:
                what = "has no 'content'" if "content" not in msg else "has content None"
                raise ChatTemplateError(
                    f"messages[{i}] (role {role!r}) {what}; give a string (\"\" for an empty turn). "
                    "Only an assistant message with tool_calls may omit it."
                )
        else:
            _check_content(i, content)
        for field in REASONING_FIELDS:
            value = msg.get(field)
            if value is not None and not isinstance(value, str):
                raise ChatTemplateError(f"messages[{i}].{field} is {_describe(value)}; expected a string.")
    if tools is not None:
        if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
            raise ChatTemplateError(f"tools is {_describe(tools)}; expected a list of JSON-schema dicts.")
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools[{i}] is {_describe(tool)}; expected a JSON-schema dict.")


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep-copied plain dicts without ``None`` values, reasoning aliased under every name
    (transformers 5.24 ``_normalize_chat_messages`` and ``_alias_reasoning_fields``)."""
    out = []
    for msg in messages:
        msg = copy.deepcopy({k: v for k, v in msg.items() if v is not None})
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def _resolve_spec(spec: ChatTemplateSpec | str) -> ChatTemplateSpec:
    if isinstance(spec, ChatTemplateSpec):
        return spec
    if isinstance(spec, str):
        from ferrule.contract import registry
        return registry.get_chat_template(spec)
    raise TypeError(f"spec is {_describe(spec)}; pass a ChatTemplateSpec or a registered template name.")


@functools.lru_cache(maxsize=64)
def _source(spec: ChatTemplateSpec) -> str:
    return spec.read_source()


@functools.lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """Names a template reads from its context (``jinja2.meta.find_undeclared_variables``)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(make_environment().parse(source)))


def special_tokens_of(tokenizer: Any) -> dict[str, str]:
    """``tokenizer.special_tokens_map`` (HF: the named special tokens that are set, as strings),
    or the :data:`SPECIAL_TOKEN_NAMES` attributes that are not None for other tokenizers."""
    if tokenizer is None:
        return {}
    named = getattr(tokenizer, "special_tokens_map", None)
    if isinstance(named, Mapping):
        return {k: str(v) for k, v in named.items() if k in SPECIAL_TOKEN_NAMES and v is not None}
    return {k: str(getattr(tokenizer, k)) for k in SPECIAL_TOKEN_NAMES if getattr(tokenizer, k, None) is not None}


def render_chat(
    spec: ChatTemplateSpec | str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    tokenizer: Any = None,
    **kwargs: Any,
) -> str:
    """Render a conversation with a registered chat template.

    Args:
        spec: the template spec, or a template name looked up with
            ``ferrule.contract.registry.get_chat_template``.
        messages: OpenAI / HF chat messages (see :func:`validate_messages`); not modified.
        tools: JSON-schema tool declarations (``{"type": "function", "function": {...}}``).
        add_generation_prompt: end with the template's open assistant turn.
        tokenizer: the HF tokenizer whose named special tokens (``bos_token``, ``eos_token``,
            ...) the template sees, as ``apply_chat_template`` passes them. Required when the
            template reads one of them and ``kwargs`` does not give it.
        **kwargs: extra template variables (e.g. ``enable_thinking=False`` for Qwen3,
            ``documents=[...]``); they override special tokens of the same name.

    Returns:
        The rendered text, identical to ``tokenizer.apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **kwargs)`` with the same template.

    Raises:
        ChatTemplateError: malformed messages/tools (naming ``messages[i]``), a template that
            does not parse, a template that calls ``raise_exception``, or one that reads a
            special token (``{{ bos_token }}``) while no tokenizer was given.
        UnknownModelError: ``spec`` is a name no plugin registered.
    """
    import jinja2

    spec = _resolve_spec(spec)
    validate_messages(messages, tools)
    source = _source(spec)
    template = compile_template(source)
    special = special_tokens_of(tokenizer)
    wanted = sorted((template_variables(source) & set(SPECIAL_TOKEN_NAMES)) - set(special) - set(kwargs))
    if wanted and tokenizer is None:
        raise ChatTemplateError(f"chat template {spec.name!r} writes {', '.join(wanted)}, which come from the "
                                "tokenizer; pass tokenizer= (as tokenizer.apply_chat_template does) or give "
                                "them as keyword arguments.")
    variables = {**special, "documents": None, **kwargs}
    try:
        return template.render(
            messages=_template_messages(messages),
            tools=copy.deepcopy(list(tools)) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template {spec.name!r}: {exc}") from exc


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat text: ``tokenizer.encode(text, add_special_tokens=False)``.

    The template already wrote every control token, so no BOS/EOS is added; control tokens in
    the text (also ones a user typed) are matched as added tokens, as HF does by default.
    """
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_ids(
    spec: ChatTemplateSpec | str,
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> RenderedChat:
    """:func:`render_chat` (with ``tokenizer``'s special tokens) followed by :func:`encode_rendered`.
    The ids equal ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=...,
    **kwargs)`` with the same template. Raises what those raise."""
    spec = _resolve_spec(spec)
    text = render_chat(spec, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       tokenizer=tokenizer, **kwargs)
    return RenderedChat(text=text, token_ids=tuple(encode_rendered(tokenizer, text)), template=spec.name)


def stop_token_ids(spec: ChatTemplateSpec | str, tokenizer: Any) -> tuple[int, ...]:
    """Ids of the template's stop tokens in ``tokenizer`` (for rollout ``stop_token_ids``).

    Raises:
        ChatTemplateError: a stop token is not a single token of ``tokenizer``.
    """
    spec = _resolve_spec(spec)
    ids = []
    for token in spec.stop_tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ChatTemplateError(
                f"stop token {token!r} of template {spec.name!r} encodes to {encoded}, not one id; "
                "the tokenizer does not match the template."
            )
        ids.append(encoded[0])
    return tuple(ids)


def tokenizer_for_template(spec: ChatTemplateSpec | str) -> Any:
    """The tokenizer that goes with a template, found through the plugin that ships it.

    Lookup: ``spec.tokenizer`` (a ``"module:attr"`` zero-argument loader) when the spec has
    such a field; otherwise the convention ``<template package>.tokenizer.load_chat_tokenizer(name)``
    (e.g. ``ferrule.plugins.qwen.tokenizer.load_chat_tokenizer("qwen2_5")``).

    Raises:
        LookupError: the plugin provides no tokenizer; pass one explicitly (``--tokenizer``).
    """
    spec = _resolve_spec(spec)
    ref = getattr(spec, "tokenizer", None)
    if ref:
        return resolve_ref(ref)()
    package = spec.template.partition(":")[0]
    try:
        module = importlib.import_module(f"{package}.tokenizer")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.tokenizer":
            raise
        module = None
    loader = getattr(module, "load_chat_tokenizer", None)
    if loader is None:
        raise LookupError(
            f"template {spec.name!r} (package {package}) names no tokenizer: {package}.tokenizer has no "
            "load_chat_tokenizer(name). Pass a tokenizer explicitly (CLI: --tokenizer DIR or module:attr)."
        )
    return loader(spec.name)
