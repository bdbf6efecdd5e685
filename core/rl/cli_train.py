"""``ferrule train CONFIG [key=value ...]``: run GRPO (see :mod:`ferrule.rl.loop`).

Mounted by ``ferrule.cli`` with ``app.command("train")(train_command)``.

Exit codes: 0 done; 2 a user error (config: every problem listed; a resume that does not fit
the run; a bad path or checkpoint; a reward function that raised on every sample of a step:
:data:`ferrule.cli_errors.USER_ERRORS`); 130 stopped by Ctrl-C (after saving a checkpoint when
``checkpoint.save_on_interrupt``); 1 other errors.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer


def resolve_config(config: Path | None, overrides: list[str], *, resume: bool = False,
                   run_dir: Path | None = None):
    """Load the config for the CLI: file (or ``RUN_DIR/config.yaml`` when resuming without one),
    overrides, ``--run-dir``, ``--resume``. Returns the validated ``RLConfig``.

    Raises:
        ConfigError: every problem at once.
    """
    from ferrule.rl.config import CONFIG_FILE_NAME, ConfigError, load_config

    items = list(overrides)
    if config is not None and "=" in str(config) and not Path(config).exists():
        items.insert(0, str(config))  # `ferrule train key=value` without a file
        config = None
    if run_dir is not None:
        items.append(f"logging.run_dir={run_dir}")
    if resume:
        items.append("checkpoint.resume=true")
        if config is None:
            if run_dir is None:
                raise ConfigError(["--resume without CONFIG needs --run-dir RUN_DIR (its config.yaml is reloaded)"])
            config = Path(run_dir) / CONFIG_FILE_NAME
    return load_config(config, items)


def train_command(
    config: Annotated[Path | None, typer.Argument(
        help="YAML/TOML config (e.g. examples/configs/smollm2_arithmetic.yaml). With --resume it may be "
             "omitted: RUN_DIR/config.yaml is used.", show_default=False)] = None,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Overrides section.key=value (e.g. train.steps=20 rollout.temperature=0.8).", show_default=False)] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="An override section.key=value (repeatable; same as a trailing argument).")] = None,
    config_opt: Annotated[Path | None, typer.Option("--config", "-c", help="Config file (alternative to CONFIG).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint of the run folder "
                                                          "(data order, RNG and optimizer state included).")] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run folder (overrides logging.run_dir).")] = None,
    check_weight_update_equal: Annotated[bool, typer.Option(
        "--check-weight-update-equal",
        help="After every weight sync verify that the rollout engine holds exactly the trained weights.")] = False,
    stop_after: Annotated[int | None, typer.Option(
        "--stop-after", help="Stop (with a checkpoint) once this many steps are complete, as Ctrl-C would.")] = None,
) -> None:
    """Run GRPO-style RL: prompts -> rollout -> verifier rewards -> advantages -> policy loss -> optimizer step ->
    weight sync, with checkpoints, resume, metrics.jsonl and a reward-curve PNG in the run folder."""
    from rich.console import Console

    from ferrule.cli_errors import print_user_error, user_error_message
    from ferrule.rl.config import ConfigError

    t_start = time.monotonic()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars; the run has its own progress display
    console = Console(stderr=True, soft_wrap=True)
    if config is not None and config_opt is not None:
        console.print("error: give the config either as CONFIG or as --config, not both")
        raise typer.Exit(2)
    try:
        cfg = resolve_config(config if config is not None else config_opt, [*(overrides or []), *(set_ or [])],
                             resume=resume, run_dir=run_dir)
        from ferrule.rl.loop import GRPOTrainer

        from ferrule.rl.checkpoints import list_checkpoints

        trainer = GRPOTrainer(cfg, check_weight_update_equal=check_weight_update_equal, console=console)
        if resume and not list_checkpoints(trainer.ckpt_dir):
            # an explicit --resume must not silently start over (a typo in --run-dir would)
            raise ConfigError([f"--resume: no complete checkpoint in {trainer.ckpt_dir}; check --run-dir, or drop "
                               "--resume to start a new run"])
        result = trainer.run(stop_after=stop_after)
    except KeyboardInterrupt:
        console.print("aborted by Ctrl-C; the current step was not saved (the last checkpoint stays valid)")
        raise typer.Exit(130) from None
    except BaseException as exc:  # noqa: BLE001 - user errors (ferrule.cli_errors) exit 2, bugs keep a traceback
        message = user_error_message(exc)
        if message is None:
            raise
        print_user_error(message)
        raise typer.Exit(2) from None
    from ferrule.rl.metrics import METRICS_FILE, read_metrics, run_summary

    summary = (f"run {result.run_dir}: steps {result.start_step} -> {result.last_step}; "
               + run_summary(read_metrics(result.run_dir / METRICS_FILE), wall_s=time.monotonic() - t_start))
    if result.plot:
        summary += f"; reward curve {result.plot}"
    console.print(summary, highlight=False, markup=False)
    if result.interrupted and stop_after is None:
        raise typer.Exit(130)
