"""``ferrule chat-template ...``: list and render the chat templates plugins register.

Mounted by ``ferrule.cli`` as ``app.add_typer(chat_template_app, name="chat-template")``.

Input file of ``render``: a JSON object ``{"messages": [...], "tools": [...]}`` (``tools``
optional) or a bare JSON list of messages (OpenAI / HF chat format).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

chat_template_app = typer.Typer(help="List and render chat templates (text and token ids).", no_args_is_help=True)


@chat_template_app.callback()
def _chat_template() -> None:
    """List and render chat templates (text and token ids)."""


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def read_conversation(path: Path) -> tuple[list[Any], list[Any] | None]:
    """Read ``{"messages": [...], "tools": [...]}`` or a bare list of messages from ``path``.

    Raises:
        ValueError: unreadable file, invalid JSON or the wrong top-level shape (the message
            names the file and the expected shapes).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if isinstance(data, list):
        return data, None
    if isinstance(data, dict) and "messages" in data:
        unknown = sorted(set(data) - {"messages", "tools"})
        if unknown:
            raise ValueError(f"{path}: unknown top-level keys {unknown}; expected 'messages' and optionally 'tools'.")
        return data["messages"], data.get("tools")
    raise ValueError(f"{path}: expected a JSON object {{\"messages\": [...], \"tools\": [...]}} or a list of messages.")


def _parse_vars(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--var {item!r}: write NAME=JSON, e.g. --var enable_thinking=false.")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            # no silent fallback to a string: --var enable_thinking=False would be the truthy "False"
            raise ValueError(f"--var {item!r}: {raw!r} is not JSON; write true/false, a number, or a quoted "
                             f"string (e.g. --var {key}='\"text\"').") from None
    return out


def _pick_template(family: str | None, template: str | None) -> Any:
    from ferrule.contract import registry
    if (family is None) == (template is None):
        raise ValueError("give exactly one of --family FAMILY or --template NAME.")
    if template is not None:
        return registry.get_chat_template(template)
    specs = registry.chat_templates_for(family)
    if not specs:
        raise ValueError(f"family {family!r} registers no chat template; see `ferrule chat-template list`.")
    if len(specs) > 1:
        names = ", ".join(sorted(s.name for s in specs))
        raise ValueError(f"family {family!r} has several chat templates ({names}); choose one with --template.")
    return specs[0]


def _load_tokenizer(ref: str | None, spec: Any) -> Any:
    from ferrule.chat import tokenizer_for_template

    if ref is None:
        return tokenizer_for_template(spec)
    if Path(ref).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(ref, local_files_only=True)
    if ":" in ref:
        from ferrule.contract.specs import resolve_ref

        return resolve_ref(ref)()
    raise ValueError(f"--tokenizer {ref!r} is neither a directory nor a 'module:attr' loader reference.")


@chat_template_app.command("list")
def list_cmd() -> None:
    """List registered chat templates: name, family, stop tokens, resource."""
    from rich.console import Console
    from rich.table import Table

    from ferrule.contract import registry
    reg = registry.get_registry()
    table = Table(title="chat templates", title_justify="left")
    for col in ("name", "family", "stop tokens", "template", "description"):
        table.add_column(col, overflow="fold")
    for name in sorted(reg.chat_templates):
        s = reg.chat_templates[name]
        table.add_row(s.name, s.family, " ".join(s.stop_tokens), s.template, s.description or "-")
    Console().print(table)


@chat_template_app.command("render")
def render_cmd(
    file: Annotated[Path, typer.Argument(help="JSON: {\"messages\": [...], \"tools\": [...]} or a list of messages.")],
    family: Annotated[str | None, typer.Option("--family", help="Use the family's chat template (e.g. qwen2).")] = None,
    template: Annotated[str | None, typer.Option("--template", help="Use a template by name (e.g. qwen2_5).")] = None,
    generation_prompt: Annotated[bool, typer.Option("--generation-prompt/--no-generation-prompt",
                                                    help="End with an open assistant turn.")] = False,
    ids: Annotated[bool, typer.Option("--ids/--no-ids", help="Also tokenize and print the token ids.")] = True,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="HF tokenizer directory or 'module:attr' "
                                                  "zero-argument loader (default: the template plugin's tokenizer).")] = None,
    var: Annotated[list[str] | None, typer.Option("--var", help="Extra template variable NAME=JSON "
                                                  "(repeatable), e.g. --var enable_thinking=false.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object {template, text, token_ids, "
                                          "stop_token_ids} instead of the formatted view.")] = False,
) -> None:
    """Render FILE with a chat template; print the text and (with --ids) the token ids."""
    from rich.console import Console
    from rich.rule import Rule

    from ferrule.chat import (SPECIAL_TOKEN_NAMES, ChatTemplateError, encode_rendered, render_chat, stop_token_ids,
                              template_variables)

    try:
        spec = _pick_template(family, template)
        messages, tools = read_conversation(file)
        extra = _parse_vars(var or [])
        # the tokenizer's special tokens (bos_token, ...) are template variables, as in apply_chat_template
        needs_tok = ids or bool(template_variables(spec.read_source()) & set(SPECIAL_TOKEN_NAMES))
        tok = _load_tokenizer(tokenizer, spec) if needs_tok else None
        text = render_chat(spec, messages, tools=tools, add_generation_prompt=generation_prompt, tokenizer=tok,
                           **extra)
        token_ids: list[int] | None = None
        stops: tuple[int, ...] | None = None
        if ids:
            token_ids = encode_rendered(tok, text)
            stops = stop_token_ids(spec, tok)
    except (ChatTemplateError, ValueError, LookupError, ImportError, FileNotFoundError) as exc:
        _fail(str(exc))
        return
    except KeyError as exc:  # the registry's UnknownModelError (its str() is the plain message)
        _fail(str(exc))
        return

    console = Console()
    if as_json:
        payload = {"template": spec.name, "text": text, "token_ids": token_ids,
                   "stop_token_ids": list(stops) if stops is not None else None}
        typer.echo(json.dumps(payload, ensure_ascii=False))
        return
    console.print(Rule(f"{spec.name} (family {spec.family}): text, {len(text)} characters"))
    console.print(text, markup=False, highlight=False, soft_wrap=True, end="")
    if not text.endswith("\n"):
        console.print()
    if token_ids is not None:
        console.print(Rule(f"token ids: {len(token_ids)} (stop ids {list(stops or ())})"))
        console.print(" ".join(map(str, token_ids)), markup=False, highlight=False, soft_wrap=True)
