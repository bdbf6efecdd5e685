"""Per-step RL metrics: JSONL log (resumable), summary helpers, progress bar, optional TB/W&B.

``RUN_DIR/metrics.jsonl`` holds one JSON object per step: ``{"step": int, "time": unix seconds,
<metric>: float | null, ...}`` with the names in :data:`METRICS` (others are allowed).
Non-finite values are written as ``null`` (strict JSON) and their names listed under
``"nonfinite"``. Steps strictly increase. On resume (:class:`MetricsLogger` with
``resume_step=k``) the entries with ``step > k`` (written after the checkpoint the run resumes
from) are removed (all of them for ``k = 0``: a run restarted before its first checkpoint), so
the file equals that of an uninterrupted run once it catches up. A torn last line is dropped on
resume; any other damaged line, or steps that do not strictly increase, is refused naming the
line (:class:`RunLogError`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ferrule.fs.util import apply_default_mode

METRICS_FILE = "metrics.jsonl"
#: TensorBoard event folder in the run folder (``logging.tensorboard``).
TENSORBOARD_DIR = "tensorboard"
#: The W&B run id of a run folder (``logging.wandb``); W&B's own files go to ``RUN_DIR/wandb/``.
WANDB_ID_FILE = "wandb_run_id"

#: Standard metric names -> (unit, description). The loop should log these names.
METRICS: dict[str, tuple[str, str]] = {
    "reward_mean": ("reward", "mean reward over all samples of the step (per reward.mode, + format reward)"),
    "reward_std": ("reward", "std of the reward over all samples of the step"),
    "reward_group_std_mean": ("reward", "mean over groups of the within-group reward std (GRPO signal; 0 "
                                        "means no learning signal)"),
    "accuracy": ("fraction", "fraction of samples whose verifier score reached 1 (the mean reward of "
                             "reward.mode=exact)"),
    "task_score_mean": ("score", "mean task score before reward.mode and format reward (partial credit "
                                 "included; failed samples count 0)"),
    "reward_errors": ("samples", "samples whose reward function raised (scored reward.failure_reward)"),
    "reward_error_types": ("", "{exception type: count} of those samples (only when > 0)"),
    "eval_reward_errors": ("samples", "held-out samples whose reward function raised (eval steps only)"),
    "format_rate": ("fraction", "fraction of samples whose answer could be extracted"),
    "response_length_mean": ("tokens", "mean response length"),
    "response_length_max": ("tokens", "longest response"),
    "truncated_fraction": ("fraction", "fraction of samples stopped by max_new_tokens"),
    "loss": ("", "policy loss (weighted sum over the step's tokens)"),
    "kl": ("nats/token", "token-mean KL estimate to the reference policy (or old policy if none)"),
    "clip_fraction": ("fraction", "fraction of response tokens whose PPO ratio was clipped"),
    "entropy": ("nats/token", "token-mean policy entropy"),
    "train_rollout_logprob_abs_diff": ("nats/token", "mean |train logprob - rollout logprob|"),
    "grad_norm": ("L2 norm", "global gradient norm before clipping"),
    "lr": ("1/step", "learning rate used at this step"),
    "time_rollout_s": ("s", "generation time"),
    "time_train_s": ("s", "forward_backward + optim_step time"),
    "time_sync_s": ("s", "weight-sync time to the rollout engine"),
    "sync_bytes": ("bytes", "bytes sent to the rollout engine by the step's sync (the adapter only with lora.rank > 0)"),
    "sync_device_memory_delta_bytes": ("bytes", "CUDA bytes allocated after the sync minus before it (GPU only; 0 "
                                                "when the export leaves nothing behind)"),
    "time_step_s": ("s", "wall time of the whole step"),
    "memory_allocated_bytes": ("bytes", "rank 0's memory after the step: CUDA bytes allocated by tensors on a GPU, the "
                                        "process RSS on CPU"),
    "memory_peak_bytes": ("bytes", "rank 0's peak: CUDA bytes allocated at most during the step (counter reset at "
                                   "each step start), the process's peak RSS since it started on CPU"),
    "rollout_tokens_per_s": ("tokens/s", "generated tokens per second of rollout time"),
    "train_tokens_per_s": ("tokens/s", "prompt+response tokens per second of train time"),
    "mfu": ("fraction", "model FLOPs utilisation of the train time (PaLM model FLOPs / peak bf16; null on CPU)"),
    "tokens_per_s": ("tokens/s", "generated tokens per second of step wall time"),
    "eval_accuracy": ("fraction", "accuracy on the held-out prompts (eval steps only)"),
    "eval_reward_mean": ("reward", "mean reward on the held-out prompts (eval steps only)"),
    "ppo_kl": ("nats/token", "token-mean k3 KL(current || behaviour) seen by each mini-batch before its update"),
    "ratio_mean": ("", "mean PPO ratio exp(logp - old logp)"),
    "zero_std_group_fraction": ("fraction", "groups whose samples all got the same reward (advantage 0)"),
    "advantage_abs_mean": ("", "mean absolute advantage"),
    "tis_weight_mean": ("", "mean truncated importance-sampling weight (use_tis)"),
    "tis_truncated_fraction": ("fraction", "fraction of tokens whose IS weight was capped at tis_cap"),
    "skipped_optim_steps": ("steps", "optimizer steps skipped for a non-finite gradient norm (only when > 0)"),
    "weights_version": ("", "optimizer steps applied = the weight version the rollout engine holds"),
    "epoch": ("", "pass over the prompt source the step's prompts came from"),
    "time_eval_s": ("s", "evaluation time (eval steps only)"),
}


def rollout_metrics(rewards: Sequence[float], *, group_size: int, response_lengths: Sequence[int],
                    correct: Sequence[bool] | None = None, format_ok: Sequence[bool] | None = None,
                    truncated: Sequence[bool] | None = None) -> dict[str, float]:
    """Reward/length summary of one rollout batch (contiguous groups of ``group_size``).

    ``reward_std`` is the population std over all samples; ``reward_group_std_mean`` averages
    the population std within each group.

    Raises:
        ValueError: empty batch or length mismatch.
    """
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if n == 0 or n % group_size:
        raise ValueError(f"{n} rewards do not form groups of {group_size}")
    if len(response_lengths) != n:
        raise ValueError(f"{len(response_lengths)} response lengths for {n} rewards")
    lengths = np.asarray(response_lengths, dtype=np.float64)
    out = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "reward_group_std_mean": float(r.reshape(-1, group_size).std(axis=1).mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
    }
    for name, flags in (("accuracy", correct), ("format_rate", format_ok), ("truncated_fraction", truncated)):
        if flags is not None:
            if len(flags) != n:
                raise ValueError(f"{len(flags)} {name} flags for {n} rewards")
            out[name] = float(np.mean(np.asarray(flags, dtype=np.float64)))
    return out


class RunLogError(ValueError):
    """A line of a run log (``metrics.jsonl``, ``samples.jsonl``) that cannot be read back; the
    message names the file and the line and says what to do."""


def read_run_log(path: str | os.PathLike[str], *, order: str | None = None) -> list[dict[str, Any]]:
    """Entries of a JSONL run log: one JSON object with an integer ``"step"`` per line.

    A torn last line (a crash or a full disk mid-write: not JSON, or not UTF-8) is ignored; every
    other line must be an object with an int ``step``. ``order`` checks the steps: ``"increasing"``
    (strictly: ``metrics.jsonl``), ``"nondecreasing"`` (``samples.jsonl``, several per step), None.

    Raises:
        RunLogError: a corrupt line before the last, a line that is not an object with an int
            ``step``, or steps out of ``order`` (``PATH:LINE`` and the fix in the message).
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out: list[dict[str, Any]] = []
    prev: tuple[int, int] | None = None  # (step, line) of the previous entry
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if i == len(lines):  # torn by a crash mid-write: the run resumes without it
                break
            raise RunLogError(f"{path}:{i}: corrupt line {raw[:80]!r} (not JSON); delete or repair that line, or "
                              "start a new logging.run_dir") from None
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise RunLogError(f"{path}:{i}: expected a JSON object with an integer \"step\", got {raw[:80]!r}; "
                              "delete or repair that line, or start a new logging.run_dir")
        if order and prev is not None and (step < prev[0] or (order == "increasing" and step == prev[0])):
            raise RunLogError(f"{path}:{i}: step {step} is not after step {prev[0]} of line {prev[1]}: the log holds "
                              "steps twice or out of order (two trainers on one run folder?); keep one run's lines, or "
                              "start a new logging.run_dir")
        prev = (step, i)
        out.append(entry)
    return out


def read_metrics(path: str | os.PathLike[str], *, check_order: bool = False) -> list[dict[str, Any]]:
    """Entries of a metrics.jsonl (:func:`read_run_log`). A torn last line (crash mid-write) is ignored.

    Raises:
        RunLogError: a corrupt or non-object line before the last (names the line number); with
            ``check_order``, steps that do not strictly increase.
    """
    return read_run_log(path, order="increasing" if check_order else None)


def _clean(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, bad = {}, []
    for k, v in metrics.items():
        if hasattr(v, "item") and callable(v.item):  # numpy / torch scalars
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(k)
            v = None
        out[k] = v
    return out, bad


class MetricsLogger:
    """Append-only per-step metrics writer for a run folder.

    Args:
        run_dir: the run folder (created if missing).
        resume_step: None for a fresh run (an existing non-empty metrics.jsonl is an error
            unless ``overwrite``); an int ``k`` to resume after step ``k`` (entries with
            ``step > k`` are dropped, atomically).
        overwrite: start a fresh file even if one exists.
        tensorboard / wandb: also log every numeric metric there (``add_scalar(name, value, step)``
            into ``RUN_DIR/tensorboard/``; ``wandb.log(metrics, step=step)`` into a W&B run whose
            files go to ``RUN_DIR/wandb/`` and whose id is kept in ``RUN_DIR/wandb_run_id``, so a
            resume continues it; ``WANDB_MODE=offline`` keeps it on disk). On resume TensorBoard
            purges the events after ``resume_step`` (``purge_step``); W&B ignores steps it already
            has. The packages come with the ``metrics`` extra (``RuntimeError`` with the pip
            command when one is missing).
        wandb_project, config: W&B project name and the run config dict.

    Raises:
        FileExistsError: fresh run into a folder that already has metrics.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, resume_step: int | None = None,
                 overwrite: bool = False, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "ferrule", config: Mapping[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        existing = read_metrics(self.path, check_order=resume_step is not None)
        if resume_step is None:
            if existing and not overwrite:
                raise FileExistsError(f"{self.path} already has {len(existing)} entries; resume the run "
                                      "(--resume, i.e. checkpoint.resume=true) or choose a new logging.run_dir")
            kept: list[dict[str, Any]] = []
        else:
            # resuming at step 0 (no checkpoint yet) is the run from its start: its eval at step 0 runs again
            kept = [e for e in existing if e["step"] <= resume_step] if resume_step > 0 else []
        self._rewrite(kept)
        self.last_step = kept[-1]["step"] if kept else None
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("logging.tensorboard=true needs the tensorboard package: "
                                   "`pip install 'ferrule[metrics]'` (or tensorboard), or set "
                                   "logging.tensorboard=false") from exc
            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=(
                (resume_step + 1 if resume_step > 0 else 0) if resume_step is not None else None))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as exc:
                raise RuntimeError("logging.wandb=true needs the wandb package: `pip install 'ferrule[metrics]'` "
                                   "(or wandb), or set logging.wandb=false") from exc
            self._wandb = wandb_mod.init(project=wandb_project, dir=str(self.run_dir), config=dict(config or {}),
                                         id=self._wandb_run_id(resume_step is not None),
                                         resume="allow")

    def _wandb_run_id(self, resuming: bool) -> str:
        """The W&B run id of this run folder (:data:`WANDB_ID_FILE`): kept on resume, so a resumed run
        continues one W&B run; a fresh run gets a new one."""
        path = self.run_dir / WANDB_ID_FILE
        if resuming and path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]  # W&B ids: letters, digits, - and _
        path.write_text(run_id + "\n")
        return run_id

    def _rewrite(self, entries: list[dict[str, Any]]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix=".metrics.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            for e in entries:
                f.write(json.dumps(e, allow_nan=False) + "\n")
        apply_default_mode(tmp)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one entry for ``step``; return the written dict.

        Raises:
            ValueError: ``step`` is not greater than the last logged step.
        """
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"metrics step {step} is not after the last logged step {self.last_step}")
        clean, bad = _clean(metrics)
        entry = {"step": int(step), "time": round(time.time(), 3), **clean}
        if bad:
            entry["nonfinite"] = bad
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, allow_nan=False) + "\n")
            f.flush()
        self.last_step = step
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        return entry

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def eta_seconds(elapsed_s: float, steps_done: int, steps_left: int) -> float | None:
    """Remaining time estimate: mean step time so far x steps left (None before the first step)."""
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * max(steps_left, 0)


#: Weight of the newest step duration in the ETA's exponential moving average: the ETA follows a
#: lasting change of speed (other jobs on the machine) within a few steps without jumping on one
#: slow step (an evaluation, a checkpoint save).
ETA_SMOOTHING = 0.3


def smoothed_step_time(durations: Sequence[float], alpha: float = ETA_SMOOTHING) -> float | None:
    """Exponential moving average of step durations (seconds): ``m_1 = d_1``,
    ``m_k = alpha * d_k + (1 - alpha) * m_{k-1}``; None for no steps."""
    mean = None
    for d in durations:
        mean = d if mean is None else alpha * d + (1 - alpha) * mean
    return mean


def run_summary(entries: Sequence[Mapping[str, Any]], wall_s: float | None = None, window: int = 5) -> str:
    """One-paragraph summary of a run's metrics.jsonl entries (step 0 = the initial evaluation).

    Reports the mean ``reward_mean`` and ``accuracy`` of the last ``window`` steps (one step's
    value is noisy), the peak ``reward_mean`` and its step, the last ``eval_accuracy`` and its
    step, and the wall time.
    """
    def num(e: Mapping[str, Any], key: str) -> float | None:
        v = e.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    train = [e for e in entries if e.get("step", 0) > 0 and num(e, "reward_mean") is not None]
    parts = []
    if train:
        tail = train[-window:]
        span = f"steps {tail[0]['step']}-{tail[-1]['step']}" if len(tail) > 1 else f"step {tail[0]['step']}"
        parts.append(f"reward_mean {np.mean([num(e, 'reward_mean') for e in tail]):.3f} (mean of {span})")
        acc = [num(e, "accuracy") for e in tail if num(e, "accuracy") is not None]
        if acc:
            parts.append(f"accuracy {np.mean(acc):.3f}")
        peak = max(train, key=lambda e: num(e, "reward_mean"))
        parts.append(f"peak reward_mean {num(peak, 'reward_mean'):.3f} at step {peak['step']}")
    evals = [e for e in entries if num(e, "eval_accuracy") is not None]
    if evals:
        parts.append(f"last eval_accuracy {num(evals[-1], 'eval_accuracy'):.3f} (step {evals[-1]['step']})")
    if wall_s is not None:
        parts.append(f"wall time {format_duration(wall_s)}")
    return ", ".join(parts) if parts else "no steps logged"


def format_duration(seconds: float | None) -> str:
    """``"1:02:03"`` / ``"2:03"`` / ``"?"``."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepProgress:
    """Rich progress bar over RL steps with ETA and the latest reward/accuracy.

    ``with StepProgress(total_steps, start_step) as bar: bar.update(step, metrics)``. The ETA is
    the :func:`smoothed_step_time` of the steps run in this process (a resumed run does not count
    restored steps) times the steps left; :meth:`restart_clock` excludes work before the first
    step (the step-0 evaluation). Without a TTY it prints one plain line per step instead;
    ``enabled=False`` prints nothing.
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, console: Any = None):
        from rich.console import Console

        self.total, self.start = total_steps, start_step
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._last = time.monotonic()
        self._step_time: float | None = None
        self._progress = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.enabled and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def restart_clock(self) -> None:
        """Start timing the next step now (work done since the last update is not a step)."""
        self._last = time.monotonic()

    def update(self, step: int, metrics: Mapping[str, Any]) -> str:
        """Advance to ``step`` (1-based, completed steps) and show a summary; return the text."""
        now = time.monotonic()
        self._step_time = smoothed_step_time([now - self._last] if self._step_time is None else
                                             [self._step_time, now - self._last])
        self._last = now
        eta = self._step_time * max(self.total - step, 0)
        parts = [f"step {step}/{self.total}"]
        for key, label in (("reward_mean", "reward"), ("accuracy", "acc"), ("response_length_mean", "len"),
                           ("kl", "kl")):
            v = metrics.get(key)
            if isinstance(v, (int, float)):
                parts.append(f"{label} {v:.3g}")
        parts.append(f"eta {format_duration(eta)}")
        text = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=text)
        elif self.enabled:
            self.console.print(text, markup=False, highlight=False)
        return text

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
