"""What a user of ``ferrule train`` sees: the final summary, the ETA, the reward-curve plot, and
the errors that must come before any model is loaded. References are computed here with numpy /
plain arithmetic from the same inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ferrule.rl.metrics import StepProgress, format_duration, run_summary, smoothed_step_time

STEPS = 12
WINDOW = 5


def _entries():
    rng = np.random.default_rng(0)
    out = [{"step": 0, "eval_accuracy": 0.25, "eval_reward_mean": 0.3}]
    for s in range(1, STEPS + 1):
        r = float(np.clip(0.2 + 0.05 * s + rng.normal(0, 0.1), 0, 1))
        e = {"step": s, "reward_mean": r, "accuracy": r / 2, "reward_group_std_mean": 0.45,
             "kl": 1e-3 * s, "clip_fraction": 0.01, "grad_norm": 1.0, "response_length_mean": 10.0}
        if s % 5 == 0:
            e.update(eval_accuracy=0.1 * s, eval_reward_mean=0.1 * s)
        out.append(e)
    return out


def test_run_summary_reports_last_window_mean_peak_last_eval_and_wall_time():
    entries = _entries()
    rewards = np.array([e["reward_mean"] for e in entries[1:]])
    text = run_summary(entries, wall_s=3723.0)
    assert f"reward_mean {rewards[-WINDOW:].mean():.3f} (mean of steps {STEPS - WINDOW + 1}-{STEPS})" in text
    assert f"accuracy {(rewards[-WINDOW:] / 2).mean():.3f}" in text
    assert f"peak reward_mean {rewards.max():.3f} at step {int(rewards.argmax()) + 1}" in text
    assert "last eval_accuracy 1.000 (step 10)" in text
    assert "wall time 1:02:03" in text


def test_eta_is_an_exponential_moving_average_of_recent_steps(monkeypatch):
    durations = [10.0, 10.0, 10.0, 100.0, 10.0]
    ref, alpha = durations[0], 0.3
    for d in durations[1:]:
        ref = alpha * d + (1 - alpha) * ref
    assert smoothed_step_time(durations) == pytest.approx(ref)

    clock = iter([0.0] + list(np.cumsum([5.0] + durations)))  # init; restart after a 5 s step-0 eval; steps
    monkeypatch.setattr("ferrule.rl.metrics.time.monotonic", lambda: next(clock))
    bar = StepProgress(20, enabled=False)
    bar.restart_clock()
    for step in range(1, len(durations) + 1):
        text = bar.update(step, {})
    assert text.endswith(f"eta {format_duration(ref * (20 - len(durations)))}")


def test_plot_title_counts_training_steps_band_stays_in_unit_interval_kl_has_legend_and_smoothed_line():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ferrule.rl.plot import SMOOTH_STEPS, build_figure

    entries = _entries()
    fig = build_figure(entries, "run")
    try:
        assert fig._suptitle.get_text() == f"run  ({STEPS} training steps)"  # step 0 is the initial eval
        reward_ax, _, _, kl_ax, _ = fig.axes[:5]
        band = [c for c in reward_ax.collections if c.get_label().startswith("+-")][0]
        verts = np.concatenate([p.vertices for p in band.get_paths()])
        assert verts[:, 1].min() >= 0.0 and verts[:, 1].max() <= 1.0
        rewards = np.array([e["reward_mean"] for e in entries[1:]])
        assert (rewards - 0.45).min() < 0 or (rewards + 0.45).max() > 1  # clipping was needed
        smooth = [ln for ln in reward_ax.lines if ln.get_label() == f"reward_mean ({SMOOTH_STEPS}-step mean)"][0]
        ref = [rewards[max(0, i - SMOOTH_STEPS + 1): i + 1].mean() for i in range(len(rewards))]
        np.testing.assert_allclose(smooth.get_ydata(), ref, rtol=1e-12)
        legend = kl_ax.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == ["kl", "clip_fraction (right axis)"]
    finally:
        plt.close(fig)


def test_negative_steps_give_one_message():
    from ferrule.rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config("examples/configs/smollm2_arithmetic.yaml", ["train.steps=-1"])
    assert info.value.problems == ["train.steps: must be >= 1, got -1"]


@pytest.fixture()
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 32}))
    return d


def _cfg(hf_dir, run_dir, *extra):
    from ferrule.rl.config import load_config

    return load_config(None, [f"model.hf_dir={hf_dir}", "data.task=basic_arithmetic",
                              f"logging.run_dir={run_dir}", *extra])


def test_errors_found_before_any_model_is_loaded(hf_dir, tmp_path):
    """GRPOTrainer(cfg) loads no model; these problems must surface there, together."""
    from ferrule.rl.config import ConfigError
    from ferrule.rl.loop import GRPOTrainer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(_cfg(hf_dir, run_dir, "model.family=lama", "data.chat_template=chatml9"))
    text = str(info.value)
    assert "logging.run_dir" in text and "--resume" in text and f"--run-dir {run_dir}" in text
    assert "model.family" in text and "'lama'" in text
    assert "data.chat_template" in text and "chatml9" in text
    GRPOTrainer(_cfg(hf_dir, run_dir, "checkpoint.resume=true"))  # resuming that folder is fine

    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt_neo_x9"}))
    with pytest.raises(ConfigError, match="model.hf_dir: .*gpt_neo_x9"):
        GRPOTrainer(_cfg(hf_dir, tmp_path / "fresh"))


def _tokenizer_json(n_tokens: int) -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(n_tokens)}, unk_token="t0")).to_str()


@pytest.mark.parametrize("damage, file, says", [
    ("truncated tokenizer.json", "tokenizer.json", "is not valid JSON at line 1"),
    ("config.json that is not JSON", "config.json", "is not valid JSON at line 1"),
    ("tokenizer ids beyond vocab_size", "tokenizer.json", "has token ids up to 39 but"),
])
def test_a_damaged_model_folder_is_one_line_naming_the_file_before_any_model_loads(hf_dir, tmp_path, damage, file,
                                                                                    says):
    """Issue 45.5: before, the first two were 214- and 89-line tracebacks, the third failed at the first rollout."""
    from typer.testing import CliRunner

    from ferrule.cli import app

    (hf_dir / "tokenizer.json").write_text(_tokenizer_json(32))
    if damage == "truncated tokenizer.json":
        text = (hf_dir / "tokenizer.json").read_text()
        (hf_dir / "tokenizer.json").write_text(text[: len(text) // 2])
    elif damage == "config.json that is not JSON":
        (hf_dir / "config.json").write_text("model_type: qwen3\nvocab_size: 32\n")
    else:
        (hf_dir / "tokenizer.json").write_text(_tokenizer_json(40))
    res = CliRunner().invoke(app, ["train", f"model.hf_dir={hf_dir}", "data.task=basic_arithmetic",
                                   f"logging.run_dir={tmp_path / 'run'}"])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(hf_dir / file) in errors[0] and says in errors[0], res.output
    assert "Traceback" not in res.output
    assert "copy it again from the model's source" in errors[0] or "the model's own tokenizer files" in errors[0]


def test_nonexistent_hf_path_says_does_not_exist(tmp_path):
    from ferrule.formats.safetensors_io import CheckpointError, SafetensorsReader
    from ferrule.rl.config import ConfigError

    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsReader(tmp_path / "nope")
    with pytest.raises(ConfigError, match="model.hf_dir: .* does not exist"):
        _cfg(tmp_path / "nope", tmp_path / "run").check_paths()
    from ferrule.rollout.embedded import EmbeddedEngine

    with pytest.raises(FileNotFoundError, match="does not exist"):
        EmbeddedEngine(hf_dir=tmp_path / "nope")


def test_only_known_harmless_megatron_warnings_are_silenced():
    import warnings

    from ferrule.megatron import KNOWN_HARMLESS_WARNINGS, silence_known_warnings

    def emitted(message, category, module):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            silence_known_warnings()
            warnings.warn_explicit(message, category, "x.py", 1, module=module)
        return len(rec)

    seen = {  # the texts megatron-core 0.16.1 prints (copied from a run's output)
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.": UserWarning,
        "Apex is not installed. Falling back to Torch Norm": UserWarning,
        "Warning: tp_group is None, using default tp group. Passing tp_group will be mandatory soon":
            DeprecationWarning,
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.": UserWarning,
    }
    assert len(KNOWN_HARMLESS_WARNINGS) >= len(seen)
    for message, category in seen.items():
        assert emitted(message, category, "megatron.core.optimizer") == 0, message
        assert emitted(message, category, "ferrule.rl.loop") == 1, message  # same text elsewhere: shown
    sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
    assert emitted(sharded, FutureWarning, "torch.distributed.checkpoint.planner_helpers") == 0
    assert emitted(sharded, FutureWarning, "ferrule.megatron.checkpoint") == 1
    collective = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                  "`torch.distributed.all_gather_single` instead.")
    assert emitted(collective, FutureWarning, "torch.distributed.c10d_logger") == 0
    assert emitted("`torch.distributed.broadcast` is deprecated.", FutureWarning, "torch.distributed.c10d_logger") == 1
    assert emitted("Transformer Engine and Apex are not installed", RuntimeWarning, "megatron.core") == 1
    assert emitted("some new megatron warning", UserWarning, "megatron.core.models") == 1
