"""The ``ferrule`` command line (typer + rich): the ``ferrule`` app, ``ferrule plugins`` and :func:`main`.

Every other command is mounted by ``"module:attr"`` name: ``chat-template`` (:mod:`.chat`), ``lora``
(:mod:`.lora`), ``train`` (:mod:`.train`), ``plot`` (:mod:`.plot`), ``serve`` (:mod:`.serve`) are
modules of this package; ``convert``, ``check`` (:mod:`ferrule.converters.commands`) and ``export``
(:mod:`ferrule.converters.export`) live with the converters they drive, so the core imports nothing
of the converters; plugins add theirs (``register_commands``). :mod:`ferrule.user_errors` turns
library errors into one-line user errors. Each command imports its heavy dependencies (torch,
megatron, transformers) inside the command body, so ``ferrule --help`` and ``ferrule plugins``
stay fast and torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

import ferrule
from ferrule import envs

app = typer.Typer(
    name="ferrule",
    help="Model-support framework for LLM reinforcement learning: model-family plugins, HF <-> Megatron "
    "checkpoint conversion, chat templates and GRPO training on Megatron-Core.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)
console = Console()

#: (command name, "module:attr" of a typer app) mounted as sub-command groups.
_SUBAPPS: tuple[tuple[str, str, str], ...] = (
    ("convert", "ferrule.converters.commands:convert_app", "Convert checkpoints between HF safetensors and Megatron torch_dist."),
    ("chat-template", "ferrule.cli.chat:chat_template_app", "List and render chat templates (text and token ids)."),
    ("lora", "ferrule.cli.lora:app", "Export a LoRA checkpoint's adapter as HF PEFT, or import a PEFT adapter."),
)
#: (command name, "module:attr" of a plain function) registered as single commands.
_COMMANDS: tuple[tuple[str, str], ...] = (
    ("train", "ferrule.cli.train:train_command"),
    ("plot", "ferrule.cli.plot:plot_command"),
    ("check", "ferrule.converters.commands:check_command"),
    ("export", "ferrule.converters.export:export_command"),
    ("serve", "ferrule.cli.serve:serve_command"),
)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"ferrule {ferrule.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                 callback=_version_callback, is_eager=True),
) -> None:
    """ferrule command line."""


@app.command("plugins")
def plugins_cmd(
    show_traceback: bool = typer.Option(False, "--traceback", help="Print full tracebacks of load failures."),
    check: bool = typer.Option(False, "--check", help="Build-check each family's TINY_HF_CONFIG as transformers "
                                                      "parses it (imports transformers and torch: slower)."),
) -> None:
    """List plugin distributions, their families and status, environments, implemented hooks and load failures.

    Each complete family runs its cheap build check (references resolve, TINY_HF_CONFIG translates, the
    default build knows its options; no torch; --check: as transformers parses the config): a family that
    fails it is shown as broken.

    Honours FERRULE_PLUGINS (allow-list of entry points) and FERRULE_STRICT_PLUGINS=1
    (a broken plugin is fatal instead of reported).
    """
    console = Console()  # at call time: the terminal width now, not when ferrule.cli was first imported
    from ferrule.contract import registry
    from ferrule.contract.specs import FamilyStatus

    reg = registry.get_registry()

    t = Table(title="ferrule plugins", title_justify="left")
    for col in ("distribution", "version", "entry point", "families", "hooks"):
        t.add_column(col)
    for p in reg.plugins:
        fams = sorted(f for f, plugin in reg.family_plugin.items() if plugin == p.name)
        t.add_row(p.distribution, p.version, p.name, ", ".join(fams) or "-", ", ".join(h.removeprefix("register_") for h in p.hooks) or "-")
    console.print(t)

    from ferrule.conformance.build import family_build_check

    f = Table(title="families", title_justify="left")
    for col in ("family", "model_types", "status", "reason", "missing parts"):
        f.add_column(col, overflow="fold")
    style = {"validated": "green", "structural": "yellow", "unstable": "red"}
    for spec in registry.list_families():
        missing = reg.missing_parts(spec.name)
        status = f"[{style[spec.status.value]}]{spec.status.value}[/]"
        reason = spec.reason or "-"
        if missing and spec.status is not FamilyStatus.STRUCTURAL:
            # a family that cannot be used is never listed as validated (see the load failures below)
            status = "[red]incomplete[/]"
            reason = f"declared {spec.status.value} but lacks {', '.join(missing)}: unusable until the load failure is fixed"
        elif not missing:
            # the cheap build check (ferrule.conformance.build): a family that cannot build is never listed healthy
            verdict, detail = family_build_check(spec.name, parse=check)
            if verdict == "broken":
                status = "[red]broken[/]"
                reason = f"declared {spec.status.value} but its build check fails: {detail}"
            elif verdict == "deprecated":
                reason = f"{spec.reason + '; ' if spec.reason else ''}builds with a deprecation warning: {detail}"
        f.add_row(spec.name, ", ".join(spec.model_types), status, reason, ", ".join(missing) or "-")
    console.print(f)
    _print_environments(console, reg)

    if reg.failures:
        e = Table(title="load failures", title_justify="left", style="red")
        for col in ("distribution", "version", "entry point", "stage", "error"):
            e.add_column(col, overflow="fold")
        for fl in reg.failures:
            e.add_row(fl.distribution, fl.version, fl.entry_point, fl.stage, fl.error)
        console.print(e)
        if show_traceback:
            for fl in reg.failures:
                console.rule(f"{fl.entry_point} ({fl.distribution})")
                console.print(fl.traceback, markup=False, highlight=False)
    else:
        console.print("load failures: none")
    if envs.get(registry.ALLOW_ENV):
        console.print(f"(allow-list {registry.ALLOW_ENV}={envs.get(registry.ALLOW_ENV)})")


def _print_environments(console: Console, reg: Any) -> None:
    """The ``environments`` table of ``ferrule plugins``: each registered environment (``agent.environment``),
    its distribution, description and factory; a factory that does not import is shown as broken (red,
    with the error), the same check ``ferrule train`` makes before it loads a model."""
    from ferrule.contract.specs import resolve_ref

    t = Table(title="environments (agent.environment)", title_justify="left")
    for col in ("environment", "distribution", "description", "factory"):
        t.add_column(col, overflow="fold")
    for name in sorted(reg.environments):
        spec = reg.environments[name]
        try:
            resolve_ref(spec.factory)
            factory = spec.factory
        except Exception as exc:  # noqa: BLE001 -- a package's module may fail in any way: report it, go on
            factory = f"[red]broken[/]: {spec.factory} does not import ({type(exc).__name__}: {exc})"
        t.add_row(name, reg.owners.get(("environment", name), "?"), spec.description or "-", factory)
    if reg.environments:
        console.print(t)
    else:
        console.print("environments: none")


#: Errors met while mounting plugin commands; :func:`main` reports them (one line, exit 2).
_MOUNT_ERRORS: list[Exception] = []


def _mount() -> None:
    for name, ref, help_text in _SUBAPPS:
        module, _, attr = ref.partition(":")
        app.add_typer(getattr(importlib.import_module(module), attr), name=name, help=help_text)
    for name, ref in _COMMANDS:
        module, _, attr = ref.partition(":")
        app.command(name)(getattr(importlib.import_module(module), attr))
    _mount_plugin_commands()


def _mount_plugin_commands(target: typer.Typer | None = None, errors: list[Exception] | None = None) -> None:
    """Mount the sub-commands plugins declare with ``register_commands`` (e.g. ``ferrule assets``
    from the ferrule-llama example). A command module that fails to import is recorded as a
    load failure (``ferrule plugins`` shows it; fatal with ``FERRULE_STRICT_PLUGINS=1``)."""
    from ferrule.contract import registry
    from ferrule.contract.specs import resolve_ref

    target = app if target is None else target
    errors = _MOUNT_ERRORS if errors is None else errors
    builtin = {"plugins"} | {n for n, _, _ in _SUBAPPS} | {n for n, _ in _COMMANDS}
    try:
        reg = registry.get_registry()
        for spec in registry.list_commands():
            if spec.name in builtin:
                raise registry.PluginLoadError(
                    f"plugin command {spec.name!r} ({spec.app}) would shadow the built-in `ferrule {spec.name}`; "
                    "rename it in the plugin's register_commands.")
            try:
                obj = resolve_ref(spec.app)
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the CLI
                if registry.strict_plugins():
                    raise registry.PluginLoadError(f"plugin command {spec.name!r}: cannot import {spec.app}: "
                                                   f"{type(exc).__name__}: {exc}") from exc
                import traceback

                reg.failures.append(registry.LoadFailure(reg.owners.get(("CLI command", spec.name), "?"), "",
                                                         spec.name, "register_commands",
                                                         f"{type(exc).__name__}: {exc}", traceback.format_exc()))
                continue
            if isinstance(obj, typer.Typer):
                target.add_typer(obj, name=spec.name, help=spec.help or None)
            else:
                target.command(spec.name, help=spec.help or None)(obj)
    except registry.PluginError as exc:
        errors.append(exc)


_mount()


def main() -> None:
    """Console-script entry point.

    User errors that a command did not handle itself (a plugin problem, a bad path, a checkpoint
    that does not fit; the table is :data:`ferrule.user_errors.USER_ERRORS`) print one message and
    exit with code 2, not a traceback; other exceptions keep their traceback.
    """
    from ferrule.user_errors import print_user_error, user_error_message

    if _MOUNT_ERRORS:
        console.print(f"[red]error:[/red] {_MOUNT_ERRORS[0]}", highlight=False)
        raise SystemExit(2)
    try:
        app()
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        message = user_error_message(exc)
        if message is None:
            raise
        print_user_error(message)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
