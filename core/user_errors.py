"""What counts as a user's mistake, and how a command prints it: one ``error:`` line, exit code 2.

A *user error* is bad input: a config, a path, a checkpoint or a plugin that does not fit. A
command prints it as ``error: <message>`` on stderr (no traceback) and exits with code 2. Anything
else is a bug in ferrule or a dependency and keeps its traceback (exit code 1).

The list is one table, :data:`USER_ERRORS`, of ``"module:attr"`` exception classes. A class is
looked up only when its module is already imported (an exception of that class cannot exist
otherwise), so the table costs no torch / megatron import and this module imports no ferrule
layer: it sits in the foundation, so every command can use it wherever it lives (the ``ferrule``
app's own commands in :mod:`ferrule.cli`, ``ferrule convert`` / ``check`` / ``export`` in
:mod:`ferrule.converters`, plugins' commands). Some of the classes derive from ``BaseException``,
not ``Exception`` (torch's ``CheckpointException``), which is why every command routes errors
through :func:`user_error_message` instead of ``except Exception``. Its old paths
``ferrule.cli.errors`` and ``ferrule.cli_errors`` resolve here (:mod:`ferrule.compat`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["USER_ERRORS", "user_error_message", "exit_on_user_errors", "print_user_error"]

#: Exception classes that mean "the input is wrong" (message is what the user must read).
USER_ERRORS: tuple[str, ...] = (
    "ferrule.rl.config_types:ConfigError",                # train config: every problem listed
    "ferrule.contract.registry:PluginError",                       # unknown model_type, broken / incomplete plugin
    "ferrule.contract.specs:SpecError",                            # a plugin's spec is malformed
    "ferrule.mapping:MappingError",                       # checkpoint keys / shapes do not fit the table
    "ferrule.config_translation:ConfigTranslationError",  # HF config.json cannot be translated
    "ferrule.chat:ChatTemplateError",
    "ferrule.megatron.parallel:ParallelLayoutError",
    "ferrule.megatron.checkpoint:CheckpointMismatchError",
    "ferrule.rl.tasks:PromptFileError",
    "ferrule.fs.util:DiskFullError",                        # a save that does not fit: the folder and sizes
    "ferrule.formats.safetensors_io:CheckpointError",              # missing / truncated / refused checkpoint files
    "ferrule.rl.rewards:RewardError",                     # a reward function refused at set-up (raises on a reference answer)
    "ferrule.rl.envs.base:EnvironmentFailedError",        # every episode of agent.max_failed_steps steps failed
    "ferrule.rl.metrics:RunLogError",                     # a damaged metrics.jsonl / samples.jsonl line
    "ferrule.fs.locks:LockedError",                          # a run folder / output another process holds
    "ferrule.converters.checkpoint:ConversionError",
    "ferrule.fs.run_layout:RunCheckpointError",              # a run folder without (that) checkpoint
    "ferrule.lora.peft_format:AdapterFormatError",         # a PEFT adapter that does not fit the model
    "ferrule.lora.appliers:LoraTargetError",              # LoRA target_modules that name nothing / part of a fused module
    # dist_checkpointing errors that reach the CLI without going through load_sharded
    "torch.distributed.checkpoint.api:CheckpointException",   # a BaseException
    "megatron.core.dist_checkpointing.core:CheckpointingException",
    # paths given on the command line
    "builtins:FileNotFoundError",
    "builtins:FileExistsError",
    "builtins:NotADirectoryError",
    "builtins:IsADirectoryError",
    "builtins:PermissionError",
)


def _resolve(ref: str) -> type[BaseException] | None:
    module, _, attr = ref.partition(":")
    mod = sys.modules.get(module)
    cls = getattr(mod, attr, None) if mod is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def user_error_message(exc: BaseException) -> str | None:
    """The message to print for ``exc`` if it is a user error (:data:`USER_ERRORS`), else None.

    ferrule's own errors print their message as is (a ``ConfigError`` with one problem on one
    line, with several as its list); built-in path errors are prefixed with their type; torch's
    ``CheckpointException`` is reduced to its first rank's cause on one line.
    """
    for ref in USER_ERRORS:
        cls = _resolve(ref)
        if cls is None or not isinstance(exc, cls):
            continue
        if ref.startswith("builtins:"):
            return f"{type(exc).__name__}: {exc}"
        if ref.startswith("torch."):
            failures = getattr(exc, "failures", None) or {}
            rank = min(failures) if failures else None
            cause = failures[rank][0] if rank is not None else exc
            return _one_line(f"checkpoint cannot be loaded into this model (rank {rank}): "
                             f"{type(cause).__name__}: {cause}")
        if ref.startswith("megatron."):
            return _one_line(f"checkpoint cannot be loaded into this model: {exc}")
        problems = getattr(exc, "problems", None)  # ConfigError: one problem fits on one line
        if isinstance(problems, list) and len(problems) == 1:
            where = f" in {exc.origin}" if getattr(exc, "origin", None) else ""
            return f"config error{where}: {problems[0]}"
        return str(exc)
    return None


def print_user_error(message: str) -> None:
    """Print ``error: message`` on stderr (plain text: no rich markup or highlighting)."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"error: {message}", markup=False, highlight=False)


@contextmanager
def exit_on_user_errors() -> Iterator[None]:
    """Run a command body: a user error becomes ``error: ...`` on stderr and exit code 2
    (``typer.Exit(2)``); any other exception propagates unchanged (traceback, exit 1)."""
    import typer

    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        message = user_error_message(exc)
        if message is None:
            raise
        print_user_error(message)
        raise typer.Exit(2) from None
