"""The run driver of :class:`ferrule.rl.loop.GRPOTrainer`: the step loop around the GRPO step.

:class:`RunDriver` owns what turns one GRPO step (``train_step``, in :mod:`ferrule.rl.loop`) into a
run: resume point, metrics logger, the initial weight sync, the stop signals (Ctrl-C = SIGINT, and
SIGTERM / SIGUSR1, which cluster schedulers send to preempt a job or before its time limit), checkpoints at the
interval, the final plot and releasing the run folder's lock. It holds the trainer (composition):
it reads the trainer's ``cfg``, ``roles``, ``run_dir``, ``ckpt_dir`` and calls its phase methods
(``setup``, ``_sync``, ``save_checkpoint``, ``_resume_point``, ``_evaluate``); the steps run on
the schedule of ``train.schedule`` (:mod:`ferrule.rl.schedules`), which calls ``train_step`` or
``produce`` / ``learn``. :meth:`ferrule.rl.loop.GRPOTrainer.run` is ``RunDriver(trainer).run()``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrule.rl.config_types import ConfigError
from ferrule.rl.stages import record
from ferrule.fs.util import remove_stale_temp_dirs
from ferrule.rl import distributed as rl_dist
from ferrule.rl.metrics import MetricsLogger, StepProgress
from ferrule.rl.schedules import make_schedule

if TYPE_CHECKING:
    from types import FrameType

    from ferrule.rl.loop import GRPOTrainer

__all__ = ["RunDriver", "RunResult", "StopSignal", "STOP_SIGNALS"]

#: The signals that stop a run like Ctrl-C: finish the current step, save a checkpoint, exit
#: ``128 + signal number`` (SIGINT 130, SIGTERM 143, SIGUSR1 138). SIGTERM is the preemption signal
#: of Slurm and Kubernetes (and torchrun's way of stopping its ranks); Slurm sends SIGUSR1 before a
#: job's time limit when asked (``#SBATCH --signal=USR1@120``).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))


class StopSignal(KeyboardInterrupt):
    """A second stop signal (or one before the loop started): abort at once without saving the step
    in progress. ``signum``: the signal; a ``KeyboardInterrupt`` so that ``finally`` blocks and
    Ctrl-C handlers treat it alike."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class RunResult:
    """What :meth:`GRPOTrainer.run` did.

    Attributes:
        run_dir: the run folder. start_step: completed steps when the run began (resume point).
        last_step: completed steps at exit. interrupted: stopped early (Ctrl-C or ``stop_after``).
        checkpoint: last checkpoint written (None if none). plot: reward-curve PNG (or None).
        metrics: the entries logged by this process (``metrics.jsonl`` has all of them).
        stop_signal: the signal that stopped the run (:data:`STOP_SIGNALS`), None otherwise.
    """

    run_dir: Path
    start_step: int
    last_step: int
    interrupted: bool
    checkpoint: Path | None
    plot: Path | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    stop_signal: int | None = None


class RunDriver:
    """The run around the GRPO step (module docstring), composed with (not mixed into) a trainer.

    Args:
        trainer: the :class:`~ferrule.rl.loop.GRPOTrainer` whose stages it runs; the stop request
            (``_stop_requested``, ``_stop_signal``) lives on the trainer, which the distributed
            metrics gather also reads.
    """

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        """A :data:`STOP_SIGNALS` handler: the first asks for a stop at the end of the step, a second aborts."""
        if self.trainer._stop_requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise StopSignal(signum)
        self.trainer._stop_requested = True
        self.trainer._stop_signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.trainer._log(f"\n{name}: finishing the current step, then saving a checkpoint and exiting "
                          f"({'press Ctrl-C' if signum == signal.SIGINT else 'a second ' + name} again to abort "
                          "without saving)")

    def run(self, *, stop_after: int | None = None) -> RunResult:
        """Run (or resume) the loop up to ``train.steps``; then :meth:`close` (also on an error).

        Args:
            stop_after: stop once this many steps are complete, as if Ctrl-C had been pressed
                (checkpoint saved when enabled); for tests and time-boxed runs.

        Returns:
            :class:`RunResult`.
        """
        try:
            return self._run(stop_after)
        finally:
            self.trainer.close()

    def _open_logger(self, start: int) -> MetricsLogger | record.NoLogger:
        """The metrics logger (global rank 0; resumes ``metrics.jsonl`` at ``start``), which also
        trims ``samples.jsonl`` to ``start`` and writes the resolved config; a no-op logger elsewhere."""
        cfg = self.trainer.cfg
        if not self.trainer.roles.is_driver:
            return record.NoLogger()
        try:
            logger = MetricsLogger(self.trainer.run_dir, resume_step=start if cfg.checkpoint.resume else None,
                                   tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                   wandb_project=cfg.logging.wandb_project, config=cfg.to_dict())
        except FileExistsError as exc:
            raise ConfigError([f"logging.run_dir: {exc}"]) from None
        record.truncate_samples(self.trainer.run_dir, start)
        cfg.dump(self.trainer.run_dir)
        return logger

    def _stop_agreed(self) -> bool:
        """Whether a stop was requested on any rank (one all-gather when distributed, so every rank
        stops at the same step)."""
        if not self.trainer.roles.distributed:
            return self.trainer._stop_requested

        self.trainer._stop_requested = any(rl_dist.all_gather_objects(self.trainer._stop_requested))
        return self.trainer._stop_requested

    def _remove_stale_temp_dirs(self) -> None:
        """Delete the hidden temporary folders that killed or failed saves left in the checkpoint folder
        (:func:`ferrule.fs.util.remove_stale_temp_dirs`) and say so; the driver only."""
        if not self.trainer.roles.is_driver:
            return
        removed = remove_stale_temp_dirs(self.trainer.ckpt_dir)
        if removed:
            self.trainer._log(f"removed {len(removed)} temporary folder(s) of interrupted checkpoint saves "
                              f"({sum(b for _, b in removed) / 1e6:.1f} MB): "
                              + ", ".join(str(p) for p, _ in removed))

    def _run(self, stop_after: int | None) -> RunResult:
        import threading

        cfg = self.trainer.cfg
        if cfg.checkpoint.enabled or cfg.checkpoint.resume:  # the files as this run reads them (before setup)
            from ferrule.rl.model_identity import model_files

            self.trainer.model_files = model_files(cfg.model.hf_dir)
        self.trainer.setup()
        self.trainer.run_dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temp_dirs()
        start = self.trainer._resume_point() if cfg.checkpoint.resume else 0
        logger = self._open_logger(start)
        t_sync = self.trainer._sync()  # the rollout engine serves exactly the train engine's weights from step 1 on
        verified = " (verified equal)" if self.trainer.check_equal else ""
        self.trainer._log(f"initial weight sync {t_sync:.2f} s{verified}; steps {start + 1}..{cfg.train.steps}, "
                          f"run dir {self.trainer.run_dir}")
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            old_handlers = {s: signal.signal(s, self._on_stop_signal) for s in STOP_SIGNALS}
        try:
            step, ckpt, interrupted, logged = self._steps(start, stop_after, logger)
        finally:
            for s, old in old_handlers.items():
                signal.signal(s, old)
        plot = None
        if cfg.logging.plot_at_end and step > 0 and self.trainer.roles.is_driver:
            from ferrule.rl.plot import plot_run

            plot = plot_run(self.trainer.run_dir)
        if interrupted:
            self.trainer._log(f"stopped after step {step}" + (
                f" (checkpoint {ckpt}); continue with: ferrule train --resume --run-dir {self.trainer.run_dir}"
                if ckpt else ""))
        return RunResult(run_dir=self.trainer.run_dir, start_step=start, last_step=step, interrupted=interrupted,
                         checkpoint=ckpt, plot=plot, metrics=logged,
                         stop_signal=getattr(self.trainer, "_stop_signal", None) if interrupted else None)

    def _steps(self, start: int, stop_after: int | None, logger: MetricsLogger | record.NoLogger) -> tuple[int, Path | None, bool, list]:
        """Steps ``start + 1 ..`` with logging, samples, checkpoints and the stop request;
        returns ``(last step, last checkpoint, interrupted, logged entries)``."""
        cfg, driver = self.trainer.cfg, self.trainer.roles.is_driver
        logged: list[dict[str, Any]] = []
        ckpt, step = None, start

        with logger, StepProgress(cfg.train.steps, start, enabled=cfg.logging.progress and driver,
                                  console=self.trainer.console) as bar, make_schedule(self.trainer, start) as schedule:
            if start == 0 and self.trainer.eval_source is not None and driver:
                self.trainer._rollout_phase()
                logged.append(logger.log(0, self.trainer._evaluate(0)))
                self.trainer._log_eval(0, logged[-1])
                bar.restart_clock()
            while step < cfg.train.steps:
                step += 1
                metrics, samples = schedule.step(step)
                logged.append(logger.log(step, metrics))
                if "eval_accuracy" in metrics:
                    self.trainer._log_eval(step, metrics)
                if samples and driver:
                    record.append_samples(self.trainer.run_dir, samples)
                bar.update(step, metrics)
                t = self.trainer
                requested = t._stop_at_step_end if t.roles.distributed else t._stop_requested
                stop = requested or (stop_after is not None and step >= stop_after)
                last = step == cfg.train.steps
                if cfg.checkpoint.enabled and (step % cfg.checkpoint.interval == 0 or last or
                                               (stop and cfg.checkpoint.save_on_interrupt)):
                    ckpt = self.trainer.save_checkpoint(step)
                    stop = stop or self._stop_agreed()  # a signal during the save: this checkpoint is the stop's
                if stop and not last:
                    return step, ckpt, True, logged
        return step, ckpt, False, logged
