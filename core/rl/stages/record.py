"""Record stage: the step's metrics (``metrics.jsonl``, :mod:`ferrule.rl.metrics`) and its logged
samples (``samples.jsonl``).

Input: what the other stages returned (rewards, samples, advantages, the train outcome, the
sync stats, timings). Output: one flat metrics dict per step (docs/train.md lists every key)
and the first ``logging.log_samples`` samples as JSON-ready dicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from ferrule.megatron.flops import training_mfu
from ferrule.rl.advantages import zero_std_group_fraction
from ferrule.rl.checkpoints import atomic_write
from ferrule.rl.metrics import read_run_log, rollout_metrics
from ferrule.rl.rewards import reward_error_metrics

if TYPE_CHECKING:
    from ferrule.contract.specs import TowerSpec
    from ferrule.rl.tasks import Prompt
    from ferrule.rollout import GenerateResult
    import torch

    from ferrule.rl.batch import Sample
    from ferrule.rl.engines import PolicyTrainer
    from ferrule.rl.records import StepRecord
    from ferrule.rl.rewards import RewardResult
    from ferrule.rl.stages.advantages import Advantages
    from ferrule.rl.stages.train import TrainOutcome
    from ferrule.sync import SyncStats

__all__ = ["SAMPLES_FILE", "reset_peak_memory", "memory_metrics", "rollout_step_metrics", "train_step_metrics",
           "media_metrics", "version_metrics", "throughput_metrics", "sync_memory_metrics", "logged_samples",
           "append_samples",
           "truncate_samples", "NoLogger"]

SAMPLES_FILE = "samples.jsonl"


def reset_peak_memory() -> None:
    """Start the step's peak-memory window (CUDA; CPU reports the process peak RSS)."""
    from ferrule.megatron.device import get_backend

    get_backend().reset_peak_memory()


def memory_metrics() -> dict[str, int]:
    """This rank's memory after the step: CUDA allocated / step peak, or the host RSS / process peak (bytes)."""
    from ferrule.megatron.device import get_backend

    stats = get_backend().memory_stats()
    if "allocated" in stats:
        return {"memory_allocated_bytes": stats["allocated"], "memory_peak_bytes": stats["peak_allocated"]}
    return {"memory_allocated_bytes": stats["rss"], "memory_peak_bytes": stats["peak_rss"]}


def train_mfu(engine: PolicyTrainer, samples: Sequence[Sample], seconds: float, forward_only_too: bool) -> float | None:
    """Model FLOPs utilisation of the train phase (:func:`ferrule.megatron.flops.training_mfu`):
    forward_backward over every sample, plus forward_logprobs when it ran; None on CPU or where
    the count or the device's peak is unknown."""
    device = next(engine.model[0].parameters()).device
    lens = [s.num_tokens for s in samples]
    return training_mfu(engine.hf_config, lens, seconds, device, forward_only_seq_lens=lens if forward_only_too else ())


def rollout_step_metrics(rewards: Sequence[RewardResult], samples: Sequence[Sample], group_size: int) -> dict[str, Any]:
    """Reward, accuracy, length and truncation statistics of the step's rollout
    (:func:`ferrule.rl.metrics.rollout_metrics`), the mean task score and the reward-error counts."""
    metrics: dict[str, Any] = rollout_metrics(
        [r.reward for r in rewards], group_size=group_size, response_lengths=[len(s.response_ids) for s in samples],
        correct=[r.correct for r in rewards], format_ok=[r.format_ok for r in rewards],
        truncated=[s.truncated for s in samples])
    metrics["task_score_mean"] = float(np.mean([r.score if r.score is not None else 0.0 for r in rewards]))
    metrics.update(reward_error_metrics(rewards))
    return metrics


def train_step_metrics(outcome: TrainOutcome, rollout_lp: Sequence[torch.Tensor], advantages: Advantages,
                       group_size: int,
                       use_tis: bool) -> dict[str, Any]:
    """Loss, KL, clipping, entropy, train-vs-rollout logprob gap, grad norm, lr, advantage and (with
    ``use_tis``) truncated-IS statistics, and the skipped optimizer steps, of a
    :class:`~ferrule.rl.stages.train.TrainOutcome` (``advantages``: a
    :class:`~ferrule.rl.stages.advantages.Advantages`)."""
    import torch

    from ferrule.losses import finalize_metrics, sum_metrics

    lm = finalize_metrics(sum_metrics(outcome.sums))
    trainer_lp = outcome.trainer_logprobs
    have = [i for i, lp in enumerate(trainer_lp) if lp is not None]
    diff = torch.cat([(trainer_lp[i] - rollout_lp[i]).abs() for i in have]) if have else torch.zeros(1)
    metrics = {
        "loss": lm["loss:sum"] / len(outcome.sums),
        "kl": lm["ref_kl:mean"] if "ref_kl:mean" in lm else outcome.ppo_kl,
        "ppo_kl": outcome.ppo_kl,
        "clip_fraction": lm.get("clip_fraction:mean", 0.0),
        "ratio_mean": lm.get("ratio:mean"),
        "entropy": float(-torch.cat(list(rollout_lp)).mean()),
        "train_rollout_logprob_abs_diff": float(diff.mean()),
        "grad_norm": float(np.mean(outcome.grad_norms)),
        "lr": outcome.learning_rates[-1],
        "advantage_abs_mean": float(np.abs(advantages.values).mean()),
        "zero_std_group_fraction": zero_std_group_fraction(advantages.rewards, group_size,
                                                           sample_mask=advantages.trainable),
    }
    if advantages.penalties:  # algorithm.overlong=penalty
        metrics["overlong_penalty_mean"] = float(np.mean(advantages.penalties))
    if "entropy:mean" in lm:  # algorithm.entropy_coef > 0: the exact entropy the bonus used
        metrics["policy_entropy"] = lm["entropy:mean"]
    if use_tis:
        metrics["tis_weight_mean"] = lm.get("tis_weight:mean")
        metrics["tis_truncated_fraction"] = lm.get("tis_truncated_fraction:mean")
    if outcome.skipped:
        metrics["skipped_optim_steps"] = outcome.skipped
    return metrics


def version_metrics(rec: StepRecord) -> dict[str, Any]:
    """Weight versions and staleness of a :class:`~ferrule.rl.records.StepRecord`: the rollout's
    ``rollout_weights_version`` (optimizer steps), ``weight_versions_per_batch`` (distinct versions among
    its samples), ``staleness_mean`` / ``staleness_max`` (train steps), ``staleness_histogram``
    (``{"k": samples}``) and ``stale_dropped_samples``."""
    batch = rec.batch
    versions = {r.weights_version if r.weights_version is not None else batch.weight_version
                for r in batch.results} or {batch.weight_version}
    hist: dict[str, int] = {}
    for s in sorted(rec.staleness):
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"rollout_weights_version": batch.weight_version, "weight_versions_per_batch": len(versions),
            "staleness_mean": float(np.mean(rec.staleness)) if rec.staleness else 0.0,
            "staleness_max": max(rec.staleness, default=0), "staleness_histogram": hist,
            "stale_dropped_samples": rec.stale_dropped}


def media_metrics(towers: Sequence[TowerSpec], media: Sequence[dict | None]) -> dict[str, int]:
    """Per tower modality: the media parts and placeholder tokens of the step's prompts (each
    prompt's ``n`` samples share them)."""
    from ferrule.media import media_token_counts

    out = {}
    per_prompt = [m or {} for m in media]
    for t in towers:
        out[f"media_{t.modality}_parts"] = sum(len(m.get(t.modality, ())) for m in per_prompt)
        out[f"media_{t.modality}_tokens"] = sum(media_token_counts(m, {t.modality: t}).get(t.modality, 0)
                                                for m in per_prompt)
    return out


def throughput_metrics(samples: Sequence[Sample], *, t_rollout: float, t_train: float,
                       t_sync: float) -> dict[str, float]:
    """Phase times (s) and tokens per second of rollout (generated tokens) and train (sequence tokens)."""
    gen_tokens = sum(len(s.response_ids) for s in samples)
    seq_tokens = sum(s.num_tokens + 1 for s in samples)
    return {"time_rollout_s": t_rollout, "time_train_s": t_train, "time_sync_s": t_sync,
            "rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
            "train_tokens_per_s": seq_tokens / max(t_train, 1e-9)}


def sync_memory_metrics(stats: SyncStats) -> dict[str, int]:
    """The device-memory change across the sync's export (a leaking export shows up here first)."""
    if stats.device_memory_after is None:
        return {}
    return {"sync_device_memory_delta_bytes": stats.device_memory_after - stats.device_memory_before}


def logged_samples(step: int, prompts: Sequence[Prompt], results: Sequence[GenerateResult], texts: Sequence[str],
                   rewards: Sequence[RewardResult], advantages: Sequence[float] | np.ndarray, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` samples of the step as ``samples.jsonl`` entries."""
    return [{"step": step, "prompt_id": prompts[r.prompt_index].id, "sample": r.sample_index,
             "response": texts[i], "answer": prompts[r.prompt_index].answer, "extracted": rewards[i].extracted,
             "reward": rewards[i].reward, "score": rewards[i].score, "correct": rewards[i].correct,
             "advantage": float(advantages[i]),
             **({"reward_error": f"{rewards[i].error_type}: {rewards[i].error}"} if rewards[i].error_type else {})}
            for i, r in enumerate(results[:limit])]


def append_samples(run_dir: Path, samples: Sequence[dict[str, Any]]) -> None:
    """Append ``samples`` to ``RUN_DIR/samples.jsonl``."""
    with open(Path(run_dir) / SAMPLES_FILE, "a") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)


def truncate_samples(run_dir: Path, step: int) -> None:
    """Drop the ``samples.jsonl`` entries after ``step`` (a resume from ``step`` logs them again); atomic.

    A torn last line (a crash or a full disk mid-write) is dropped too.

    Raises:
        ferrule.rl.metrics.RunLogError: any other damaged line, or steps that decrease (file and line named).
    """
    path = Path(run_dir) / SAMPLES_FILE
    if path.exists():
        keep = [e for e in read_run_log(path, order="nondecreasing") if e["step"] <= step]
        atomic_write(path, "".join(json.dumps(e) + "\n" for e in keep))


class NoLogger:
    """The metrics logger of ranks other than 0: returns the entry, writes nothing."""

    def __enter__(self) -> "NoLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"step": step, **metrics}
