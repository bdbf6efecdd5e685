"""``ferrule train CONFIG [key=value ...]``: run GRPO (see :mod:`ferrule.rl.loop`).

Mounted by ``ferrule.cli`` with ``app.command("train")(train_command)``.

Several ranks: ``ferrule train --nproc N CONFIG`` checks the config and the layout, then runs
``python -m torch.distributed.run --standalone --nproc-per-node N -m ferrule train CONFIG ...``
(the same arguments without ``--nproc``) and exits with the first failing rank's code (2 for a
user error, whose message it repeats last). ``torchrun ... -m ferrule train`` works directly too.

Exit codes: 0 done; 2 a user error (config: every problem listed; a resume that does not fit
the run; a bad path or checkpoint; a reward function refused at set-up (it raises on or mis-scores
the task's reference answers):
:data:`ferrule.user_errors.USER_ERRORS`); 130 stopped by Ctrl-C, 143 by SIGTERM, 138 by SIGUSR1 (after
saving a checkpoint when ``checkpoint.save_on_interrupt``; :data:`ferrule.rl.driver.STOP_SIGNALS`); 1 other errors.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ferrule import envs

if TYPE_CHECKING:
    from types import FrameType

    from rich.console import Console

    from ferrule.rl.config_schema import RLConfig
    from ferrule.rl.driver import RunResult
    from ferrule.rl.loop import GRPOTrainer


def resolve_config(config: Path | None, overrides: list[str], *, resume: bool = False,
                   run_dir: Path | None = None) -> RLConfig:
    """Load the config for the CLI: file (or ``RUN_DIR/config.yaml`` when resuming without one),
    overrides, ``--run-dir``, ``--resume``. Returns the validated ``RLConfig``.

    Raises:
        ConfigError: every problem at once.
    """
    from ferrule.rl.config_types import ConfigError
    from ferrule.fs.run_layout import CONFIG_FILE_NAME
    from ferrule.rl.config import load_config

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


#: printed by a bare ``ferrule train``
USAGE = ("ferrule train CONFIG [section.key=value ...]   e.g. ferrule train examples/configs/smollm2_arithmetic.yaml; "
         "continue a stopped or crashed run: ferrule train --resume --run-dir RUN_DIR; all options: "
         "ferrule train --help")


def _train(cfg: RLConfig, console: Console, *, resume: bool, check_weight_update_equal: bool,
           stop_after: int | None) -> RunResult | None:
    """Build the trainer and run it (None: a ``--resume`` of a run that is already complete); user
    errors exit 2 (printed, recorded), Ctrl-C exits 130; SIGTERM / SIGUSR1 before the loop starts (model
    loading) exit ``128 + signal`` at once (nothing to save yet); in the loop they stop it as Ctrl-C does
    (:data:`ferrule.rl.driver.STOP_SIGNALS`).
    """
    import signal
    import threading

    from ferrule.rl.driver import STOP_SIGNALS, StopSignal

    def before_the_loop(signum: int, frame: FrameType | None) -> None:  # the loop installs its own (finish the step, save)
        raise StopSignal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, before_the_loop) for s in STOP_SIGNALS if s != signal.SIGINT}
    try:
        return _run_trainer(cfg, console, resume=resume, check_weight_update_equal=check_weight_update_equal,
                            stop_after=stop_after)
    except StopSignal as exc:
        console.print(f"aborted by {signal.Signals(exc.signum).name}; the current step was not saved (the last "
                      "checkpoint stays valid)", markup=False, highlight=False)
        raise typer.Exit(128 + exc.signum) from None
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _run_trainer(cfg: RLConfig, console: Console, *, resume: bool, check_weight_update_equal: bool,
                 stop_after: int | None) -> RunResult | None:
    """The body of :func:`_train` (inside its signal handlers)."""
    from ferrule.user_errors import print_user_error, user_error_message
    from ferrule.rl.driver import StopSignal

    try:
        from ferrule.rl.loop import GRPOTrainer

        from ferrule.fs.run_layout import list_checkpoints

        trainer = GRPOTrainer(cfg, check_weight_update_equal=check_weight_update_equal, console=console)
        try:
            complete = resume and run_is_complete(trainer, list_checkpoints(trainer.ckpt_dir), console)
        except BaseException:
            trainer.close()  # the run folder's lock (and a folder the trainer created) go
            raise
        if complete:
            trainer.close()
            return
        result = trainer.run(stop_after=stop_after)
    except StopSignal:
        raise
    except KeyboardInterrupt:
        console.print("aborted by Ctrl-C; the current step was not saved (the last checkpoint stays valid)")
        raise typer.Exit(130) from None
    except BaseException as exc:  # noqa: BLE001 - user errors (ferrule.user_errors) exit 2, bugs keep a traceback
        message = user_error_message(exc)
        if message is None:
            raise
        print_user_error(message)
        _record_exit(2, message)
        raise typer.Exit(2) from None
    return result


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
    allow_model_change: Annotated[bool, typer.Option(
        "--allow-model-change", help="With --resume: continue even though the weights or tokenizer files of "
                                     "model.hf_dir changed since the checkpoint (checkpoint.allow_model_change).")] = False,
    nproc: Annotated[int, typer.Option(
        "--nproc", help="Ranks to launch on this machine through torchrun (one per GPU on CUDA); the config's "
                        "parallel: section sets tp/pp/ep and DP = nproc / (tp*pp).")] = 1,
) -> None:
    """Run GRPO-style RL: prompts -> rollout -> verifier rewards -> advantages -> policy loss -> optimizer step ->
    weight sync, with checkpoints, resume, metrics.jsonl and a reward-curve PNG in the run folder."""
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    t_start = time.monotonic()
    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars; the run has its own progress display
    console = Console(stderr=True, soft_wrap=True)
    _check_arguments(console, config, config_opt, nproc, bool(overrides or set_ or resume or run_dir))
    cfg = _load_checked(config if config is not None else config_opt,
                        [*(overrides or []), *(set_ or []),
                         *(["checkpoint.allow_model_change=true"] if allow_model_change else [])],
                        resume=resume, run_dir=run_dir, nproc=nproc)
    if nproc > 1:
        raise typer.Exit(launch_torchrun(nproc))
    result = _train(cfg, console, resume=resume, check_weight_update_equal=check_weight_update_equal,
                    stop_after=stop_after)
    if result is None:  # --resume of a run that is already complete: nothing to do
        return
    if envs.rank() != 0:  # the run summary comes from rank 0
        return
    _finish(result, console, wall_s=time.monotonic() - t_start, stop_after=stop_after)


def _check_arguments(console: Console, config: Path | None, config_opt: Path | None, nproc: int, other_args: bool) -> None:
    """Exit 2 (before anything loads) on: no arguments at all (prints the usage), CONFIG and --config
    together, ``--nproc`` below 1 or given inside a torchrun rank."""
    from ferrule.user_errors import print_user_error

    if config is None and config_opt is None and not other_args:
        console.print(f"usage: {USAGE}", markup=False, highlight=False)
        raise typer.Exit(2)
    if config is not None and config_opt is not None:
        console.print("error: give the config either as CONFIG or as --config, not both")
        raise typer.Exit(2)
    if nproc < 1 or (nproc > 1 and envs.under_torchrun()):
        print_user_error(f"--nproc {nproc}: " + ("expected >= 1" if nproc < 1 else "this process is already a "
                                                 "torchrun rank; drop --nproc (torchrun's --nproc-per-node sets it)"))
        raise typer.Exit(2)


def _load_checked(path: Path | None, overrides: list[str], *, resume: bool, run_dir: Path | None,
                  nproc: int) -> RLConfig:
    """:func:`resolve_config`, and for ``nproc > 1`` the layout checks that need only the model folder
    (before torchrun starts any rank). A user's mistake prints one line, is recorded, exits 2."""
    from ferrule.user_errors import print_user_error, user_error_message

    try:
        cfg = resolve_config(path, overrides, resume=resume, run_dir=run_dir)
        if nproc > 1:
            from ferrule.rl.config_types import ConfigError
            from ferrule.rl.distributed import check_layout
            from ferrule.rl.run_checks import model_folder_problems

            cfg.check_paths()
            hf_config, damaged = model_folder_problems(cfg.model.hf_dir)
            if damaged:
                raise ConfigError(damaged)
            check_layout(cfg, hf_config, nproc)
    except BaseException as exc:  # noqa: BLE001
        message = user_error_message(exc)
        if message is None:
            raise
        print_user_error(message)
        _record_exit(2, message)
        raise typer.Exit(2) from None
    return cfg


def _finish(result: RunResult, console: Console, *, wall_s: float, stop_after: int | None) -> None:
    """Print the run summary (rank 0); exit ``128 + signal`` after a stop signal, 130 after Ctrl-C."""
    from ferrule.rl.metrics import METRICS_FILE, read_metrics, run_summary

    summary = (f"run {result.run_dir}: steps {result.start_step} -> {result.last_step}; "
               + run_summary(read_metrics(result.run_dir / METRICS_FILE), wall_s=wall_s))
    if result.plot:
        summary += f"; reward curve {result.plot}"
    console.print(summary, highlight=False, markup=False)
    if result.stop_signal is not None:
        raise typer.Exit(128 + result.stop_signal)
    if result.interrupted and stop_after is None:
        raise typer.Exit(130)


def run_is_complete(trainer: GRPOTrainer, found: list[tuple[int, Path]], console: Console) -> bool:
    """``--resume`` before anything loads: True (and says so) when the run already reached
    ``train.steps``; False when there is something to continue.

    A run folder that holds a run (``config.yaml`` or ``metrics.jsonl``) but no complete checkpoint
    (it died before its first ``checkpoint.interval``) continues too: the loop restarts it at step
    0 and says so (:meth:`ferrule.rl.loop.GRPOTrainer._resume_point`).

    Raises:
        ConfigError: the folder holds no run at all (a typo in ``--run-dir`` must not start over).
    """
    from ferrule.rl.config_types import ConfigError
    from ferrule.fs.run_layout import CONFIG_FILE_NAME
    from ferrule.rl.metrics import METRICS_FILE, read_metrics

    run_dir, steps = trainer.run_dir, trainer.cfg.train.steps
    if not found and not ((run_dir / CONFIG_FILE_NAME).is_file() or (run_dir / METRICS_FILE).is_file()):
        raise ConfigError([f"--resume: {run_dir} holds no run (no {CONFIG_FILE_NAME}, {METRICS_FILE} or checkpoint "
                           f"in {trainer.ckpt_dir}); check --run-dir, or drop --resume to start a new run"])
    if found:
        done, where = found[-1][0], f"its latest checkpoint is step {found[-1][0]}"
    elif not trainer.cfg.checkpoint.enabled and (logged := read_metrics(run_dir / METRICS_FILE)):
        done, where = int(logged[-1].get("step", 0)), f"{METRICS_FILE} reaches step {logged[-1].get('step')}"
    else:
        return False
    if done < steps:
        return False
    if envs.rank() == 0:
        console.print(f"run {run_dir} is complete: {where} of train.steps={steps}; nothing to do (to train on, "
                      f"raise it: ferrule train --resume --run-dir {run_dir} train.steps={steps + done})",
                      markup=False, highlight=False)
    return True


#: set by :func:`launch_torchrun` for its ranks: a rank that stops on a user error writes
#: ``rank<R>.json`` (``{"rank", "code", "message"}``) there, so the launcher can exit with its code
EXIT_DIR_ENV = "FERRULE_TRAIN_EXIT_DIR"


def _record_exit(code: int, message: str) -> None:
    folder = envs.get(EXIT_DIR_ENV)
    if folder:
        rank = envs.rank()
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "code": code, "message": message}))


def _argv_without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch_torchrun(nproc: int, argv: list[str] | None = None) -> int:
    """Run ``ferrule train`` on ``nproc`` local ranks through torchrun; returns the exit code.

    ``argv``: the CLI arguments after the program name (default ``sys.argv[1:]``), ``--nproc``
    removed. 0 when every rank finished; a rank's recorded user-error code (2, its message
    printed last) when one stopped on a user error; torchrun's own code otherwise (1: a rank
    raised, its traceback is in the output above; 130: Ctrl-C).
    """
    import subprocess
    import tempfile

    from ferrule.user_errors import print_user_error

    args = _argv_without_nproc(list(sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="ferrule-train-exit-") as exit_dir:
        env = envs.child_env(**{EXIT_DIR_ENV: exit_dir})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "ferrule", *args]
        try:
            code = subprocess.run(cmd, env=env).returncode
        except KeyboardInterrupt:
            return 130
        if code == 0:
            return 0
        records = sorted((json.loads(p.read_text()) for p in Path(exit_dir).glob("rank*.json")),
                         key=lambda r: r["rank"])
        if records:
            print_user_error(f"rank {records[0]['rank']}: {records[0]['message']}")
            return int(records[0]["code"])
        return code
