"""``ferrule train`` end to end on CPU: a tiny random Qwen3 learns a verifier-rewarded task; resume.

The model is a random 2-layer Qwen3 (transformers config classes, in-tree Qwen plugin) with a
character-level tokenizer (``tokenizers`` WordLevel over single characters plus the ChatML
control tokens), so the whole vocabulary is ~50 ids and the policy starts near uniform. The task
is a JSONL file whose every prompt has the reference answer ``"7"``; the reward is the task's
verifier (exact match of the last number in the decoded response), never the loss. A random
policy emits a final "7" in about 3-6% of 4-token responses; GRPO has to raise that.

Independent checks: the rewards in ``samples.jsonl`` are recomputed here from the response
text with a regex (not with ferrule's extraction); the rollout engine's weights are verified
equal to the trained weights after every sync (``check_weight_update_equal``); the resumed run
is compared with an uninterrupted run of the same config, metric by metric, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# transformers' modeling code must be imported before ferrule's megatron CPU patches
from transformers import AutoConfig, GenerationMixin, PreTrainedTokenizerFast, Qwen3ForCausalLM  # noqa: F401
from inproc import run_ferrule  # noqa: E402

SEED = 0
STEPS = 30
WINDOW = 5            # steps averaged at the start and at the end
MIN_RISE = 0.3        # measured: 0.07 (steps 1-5) -> 0.61 (steps 26-30), 2 cores, 2026-11-30
RESUME_STEPS, STOP_AT = 6, 3
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz .,:?!\n")
WORDS = ["say", "digit", "reply", "answer", "number", "give", "write", "print"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
            rms_norm_eps=1e-6)
#: metrics that measure time (differ between runs by nature)
TIMING = re.compile(r"^(time.*|.*_per_s|memory_.*|mfu)$")  # timings, memory and mfu (from time) vary run to run


def _build_model(out: Path, **config) -> None:
    """The random tiny Qwen3 (``TINY``, with ``config`` over it) and its character-level tokenizer, saved at ``out``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    import torch

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(out)
    cfg = AutoConfig.for_model(model_type="qwen3", vocab_size=len(vocab), eos_token_id=vocab["<|im_end|>"],
                               pad_token_id=vocab["<|endoftext|>"], bos_token_id=None, **{**TINY, **config})
    torch.manual_seed(SEED)
    Qwen3ForCausalLM(cfg).float().save_pretrained(out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_e2e")
    _build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"{WORDS[i % 8]} {WORDS[(i // 8) % 8]} {i}", "answer": "7"}) + "\n")
    return root


def _overrides(assets: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={assets / 'task.jsonl'}",
            f"logging.run_dir={run_dir}", f"train.steps={steps}"]


#: the tiny GRPO config every RL test file shares; no reward-curve PNG (``logging.plot_at_end``): matplotlib's
#: drawing was 1.46 of a 3-step run's 2.74 s (cProfile), and only test_grpo_reward_rises_on_tiny_model reads it
CONFIG = """\
rollout: {temperature: 1.0, max_new_tokens: 4, n_samples_per_prompt: 8}
data: {system_prompt_preset: none, answer_extraction: last_number, max_prompt_tokens: 64}
reward: {function: task}
algorithm: {loss: ppo, use_tis: true, eps_clip: 0.2, eps_clip_high: 0.28}
optimizer: {lr: 1.0e-2, clip_grad: 1.0}
train: {prompts_per_step: 4, micro_batch_tokens: 1024, seed: 0}
checkpoint: {interval: 10, keep: 1}
eval: {interval: 0}
logging: {progress: false, log_samples: 32, plot_at_end: false}
"""


@pytest.fixture(scope="module")
def config_file(assets):
    path = assets / "tiny.yaml"
    path.write_text(CONFIG)
    return path


def _last_number(text: str) -> float | None:
    """The last number that does not continue a word ("ab7" is not a number), as a float."""
    nums = re.findall(r"(?<![A-Za-z0-9_.])-?[0-9]+(?:\.[0-9]+)?", text)
    return float(nums[-1]) if nums else None


def _comparable(entries):
    return [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in entries]


def _differences(a, b) -> list:
    """``(step, key, a's value, b's value)`` of each comparable metric that differs (a failure's message: pytest's
    own diff of two metric lists is cut before the differing keys)."""
    out = [("steps", len(a), len(b))] if len(a) != len(b) else []
    for x, y in zip(_comparable(a), _comparable(b)):
        out += [(x.get("step"), k, x.get(k), y.get(k)) for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]
    return out


@pytest.mark.timeout(240)
def test_grpo_reward_rises_on_tiny_model(assets, config_file, tmp_path):
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    run_dir = tmp_path / "run"
    # the one run here that draws the reward curve (CONFIG turns it off: half of a 3-step run's time)
    cfg = load_config(config_file, _overrides(assets, run_dir, STEPS) + ["logging.plot_at_end=true"])
    result = train(cfg, check_weight_update_equal=True)
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    rewards = [e["reward_mean"] for e in entries]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first + MIN_RISE, f"reward did not rise: first {WINDOW} steps {first:.3f}, last {last:.3f}: {rewards}"

    # the reward is the verifier's: recompute it from the logged response texts (responses with ',' or
    # '.' are skipped: "7,.6" is one number, 7.6, under the documented thousands-comma rule)
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * 32
    checked = 0
    for s in samples:
        if "," not in s["response"] and "." not in s["response"]:
            assert s["reward"] == (1.0 if _last_number(s["response"]) == 7.0 else 0.0), s
            checked += 1
    assert checked > 0.8 * len(samples)
    for e in entries:
        step_rewards = [s["reward"] for s in samples if s["step"] == e["step"]]
        assert e["reward_mean"] == pytest.approx(sum(step_rewards) / 32, abs=1e-12)
    # train and rollout engines agree on the sampled tokens' logprobs (same weights, fp32)
    assert max(e["train_rollout_logprob_abs_diff"] for e in entries) < 1e-4
    assert all(e["grad_norm"] >= 0 for e in entries)
    assert entries[-1]["weights_version"] == STEPS
    assert result.plot is not None and result.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "loop_state.json").is_file()
    assert len(list((run_dir / "checkpoints").iterdir())) == 1  # keep: 1


@pytest.fixture(scope="module")
def plain_run(assets, config_file, tmp_path_factory):
    """An uninterrupted synchronous run of ``RESUME_STEPS`` steps: ``(trainer, run folder)``."""
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer

    full = tmp_path_factory.mktemp("plain") / "full"
    plain = GRPOTrainer(load_config(config_file, _overrides(assets, full, RESUME_STEPS) + ["train.colocate=false"]))
    plain.run()
    return plain, full


@pytest.mark.gpu  # also on CPU; on a CUDA machine it resumes a CUDA run
@pytest.mark.timeout(240)
def test_resume_equals_uninterrupted_run(assets, config_file, plain_run, tmp_path):
    """Also colocation (issue 24): the split run is colocated (train offloaded while the rollout
    engine generates, rollout asleep while training; its checkpoints are taken while offloaded),
    the full run is not; metrics, samples and final weights agree bit for bit."""
    import torch

    from ferrule.rl.config import ConfigError, load_config
    from ferrule.rl.loop import GRPOTrainer, train
    from ferrule.rl.metrics import read_metrics

    plain, full = plain_run
    split = tmp_path / "split"
    colocate = ["train.colocate=true"]
    assert plain.colocation is None
    first = train(load_config(config_file, _overrides(assets, split, RESUME_STEPS) + colocate), stop_after=STOP_AT)
    assert first.interrupted and first.last_step == STOP_AT
    assert first.checkpoint == split / "checkpoints" / f"step_{STOP_AT:06d}"
    assert len(read_metrics(split / "metrics.jsonl")) == STOP_AT

    # a changed data/algorithm setting is refused on resume
    with pytest.raises(ConfigError, match="algorithm.eps_clip"):
        GRPOTrainer(load_config(config_file, _overrides(assets, split, RESUME_STEPS) +
                                ["checkpoint.resume=true", "algorithm.eps_clip=0.1"])).run()
    resumed = GRPOTrainer(load_config(config_file, _overrides(assets, split, RESUME_STEPS) + colocate
                                      + ["checkpoint.resume=true"]))
    second = resumed.run()
    assert second.start_step == STOP_AT and second.last_step == RESUME_STEPS and not second.interrupted
    assert resumed.colocation is not None and resumed.engine.offloaded and resumed.rollout.asleep  # step ended

    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert _comparable(a) == _comparable(b), _differences(a, b)  # bit-identical: rewards, losses, grad norms, ...
    assert all(e["time_offload_s"] > 0 and e["time_onload_s"] > 0 and e["time_sleep_s"] > 0 for e in b)
    assert all("memory_train_peak_bytes" in e and "memory_rollout_peak_bytes" in e for e in a + b)
    resumed.engine.onload()
    ref = dict(plain.engine.export_hf_state())
    got = dict(resumed.engine.export_hf_state())
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)  # final weights
    assert (full / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
    assert len({e["reward_mean"] for e in a}) > 1  # the compared runs are not trivially constant


@pytest.mark.timeout(240)
def test_cli_ctrl_c_saves_and_resumes(assets, config_file, tmp_path):
    """``ferrule train`` in a subprocess: SIGINT -> checkpoint + exit 130; ``--resume --run-dir`` finishes."""
    run_dir = tmp_path / "cli"
    launcher = "import typer; from ferrule.cli.train import train_command; typer.run(train_command)"
    env = dict(os.environ, FERRULE_PLUGINS="qwen,inkling")
    cmd = [sys.executable, "-c", launcher, str(config_file), *_overrides(assets, run_dir, 10_000),
           "--set", "checkpoint.interval=1000"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Ctrl-C" in out
    done = len(metrics.read_text().splitlines())
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == [f"step_{done:06d}"], out

    res = run_ferrule(["train", "--resume", "--run-dir", run_dir, "--set", f"train.steps={done + 2}"], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == list(range(1, done + 3))
    assert f"resumed from {ckpts[0]}" in res.stderr

    bad = run_ferrule(["train", config_file, "rollout.temprature=2"], env=env)
    assert bad.returncode == 2
    assert "did you mean 'rollout.temperature'" in bad.stderr


@pytest.mark.timeout(120)
def test_kl_reference_and_minibatches(assets, config_file, tmp_path):
    """``kl_coef > 0`` loads the frozen reference (the initial checkpoint): its KL starts at ~0 (HF and
    megatron forwards of the same weights) and grows as the policy moves; with two optimizer steps per
    rollout the second mini-batch sees a moved policy (``ppo_kl`` > 0, ratio != 1)."""
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train

    steps = 3
    common = ["checkpoint.enabled=false", "logging.plot_at_end=false"]
    cfg = load_config(config_file, _overrides(assets, tmp_path / "kl", steps) + ["algorithm.kl_coef=0.05"] + common)
    entries = train(cfg).metrics
    assert len(entries) == steps
    assert entries[0]["kl"] < 1e-6                      # reference == initial weights
    assert entries[-1]["kl"] > 1e-4                      # the policy moved away from it
    assert all(e["ppo_kl"] == 0 for e in entries)        # one mini-batch: behaviour == current policy

    cfg = load_config(config_file, _overrides(assets, tmp_path / "mb", 2) + ["train.optim_steps_per_rollout=2"] + common)
    entries = train(cfg).metrics
    assert all(e["ppo_kl"] > 0 and e["ratio_mean"] != 1.0 for e in entries)  # mini-batch 2 ran on updated weights
    assert entries[-1]["weights_version"] == 4


@pytest.mark.timeout(240)
def test_resume_with_more_steps_replans_the_decay_and_a_shrunk_data_set_is_a_cli_error(assets, config_file, tmp_path):
    """Issue 9: cosine decay over ``train.steps=4``, resumed with ``train.steps=6``: steps 5-6 use the
    schedule re-planned over 6 steps (the checkpoint's horizon gave lr 0.0), by the cosine formula.
    Then the task file shrinks: ``ferrule train --resume`` prints one error line and exits 2."""
    import math

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    lr, run_dir = 1e-2, tmp_path / "cosine"
    task = tmp_path / "task.jsonl"
    task.write_text((assets / "task.jsonl").read_text())
    overrides = [f"model.hf_dir={assets / 'model'}", f"data.jsonl_path={task}", f"logging.run_dir={run_dir}",
                 "optimizer.lr_decay_style=cosine", "logging.plot_at_end=false"]
    train(load_config(config_file, overrides + ["train.steps=4"]))
    second = train(load_config(config_file, overrides + ["train.steps=6", "checkpoint.resume=true"]))
    assert second.start_step == 4 and second.last_step == 6
    lrs = [e["lr"] for e in read_metrics(run_dir / "metrics.jsonl")]
    # step s trains at lr(s - 1): cosine from lr to min_lr 0 over the decay horizon, no warmup
    assert lrs[:4] == pytest.approx([lr * (1 + math.cos(math.pi * n / 4)) / 2 for n in range(4)], rel=1e-12)
    assert lrs[4:] == pytest.approx([lr * (1 + math.cos(math.pi * n / 6)) / 2 for n in (4, 5)], rel=1e-12)

    task.write_text("".join(task.read_text().splitlines(keepends=True)[:40]))  # 64 -> 40 prompts
    res = run_ferrule(["train", "--resume", "--run-dir", run_dir, "train.steps=8"],
                      env=dict(os.environ, FERRULE_PLUGINS="qwen,inkling"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "num_prompts=64" in errors[0] and "num_prompts=40" in errors[0], res.stderr[-2000:]
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 6  # nothing was trained or truncated


REWARD_MODULE = '''
def picky(response, prompt):
    """1 for a final 7; raises like a strict verifier on responses holding a letter a-m."""
    bad = [c for c in response if c in "abcdefghijklm"]
    if bad:
        raise ValueError(f"cannot parse {bad[0]!r}")
    return 1.0 if response.strip().endswith("7") else 0.0


def broken(response, prompt):
    raise TypeError("this reward function is broken")
'''


@pytest.mark.timeout(180)
def test_reward_function_failures_are_scored_counted_and_a_broken_function_stops(assets, config_file, tmp_path,
                                                                                  monkeypatch):
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics
    from ferrule.rl.rewards import RewardError

    (tmp_path / "e2e_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["checkpoint.enabled=false", "logging.plot_at_end=false", "reward.failure_reward=-1"]
    run_dir = tmp_path / "picky"
    result = train(load_config(config_file, _overrides(assets, run_dir, 2) + common +
                               ["reward.function=e2e_rewards:picky"]))
    assert result.last_step == 2
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    for e in read_metrics(run_dir / "metrics.jsonl"):
        step = [s for s in samples if s["step"] == e["step"]]
        failed = [s for s in step if any(c in "abcdefghijklm" for c in s["response"])]  # independent of ferrule
        assert 0 < len(failed) < len(step)
        assert e["reward_errors"] == len(failed) and e["reward_error_types"] == {"ValueError": len(failed)}
        assert all(s["reward"] == -1.0 and s["reward_error"].startswith("ValueError: cannot parse") for s in failed)
        assert all("reward_error" not in s for s in step if s not in failed)

    # a function that raises on the task's reference answer is refused at set-up, before any engine is built
    with pytest.raises(RewardError, match="'e2e_rewards:broken' raised TypeError: this reward function is broken on "
                                          "the reference answer '7' of prompt"):
        train(load_config(config_file, _overrides(assets, tmp_path / "broken", 2) + common +
                          ["reward.function=e2e_rewards:broken"]))
    assert not (tmp_path / "broken").exists()


@pytest.mark.timeout(240)
def test_a_verifier_raising_on_every_junk_sample_of_a_fresh_policy_does_not_stop_the_run(assets, config_file,
                                                                                           tmp_path):
    """reasoning-gym's prime_factorization verifier calls int() on every factor: a fresh policy's junk makes
    every sample raise at step 1 (train.seed 4). The set-up check passes (the references score 1), the run goes on,
    every failure is counted and a step where half or more failed prints a warning."""
    import io

    from rich.console import Console

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics
    from ferrule.rl.tasks import ReasoningGymSource

    run_dir = tmp_path / "primes"
    out = io.StringIO()
    overrides = [f"model.hf_dir={assets / 'model'}", "data.task=prime_factorization", "data.size=16",
                 "data.answer_extraction=full", "data.max_prompt_tokens=256", "train.micro_batch_tokens=4096",
                 f"logging.run_dir={run_dir}", "train.steps=2", "checkpoint.enabled=false",
                 "logging.plot_at_end=false", "reward.failure_reward=-1",
                 "train.seed=4", "rollout.max_new_tokens=8"]  # measured: every sample of step 1 raises
    result = train(load_config(config_file, overrides), console=Console(file=out, width=400))
    assert result.last_step == 2
    src = ReasoningGymSource("prime_factorization", 16, 1)
    entries = {p.id: p.entry for p in (src[i] for i in range(16))}
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64
    log = out.getvalue()
    assert "reward check: the reference answers of 8 prompts score correct" in log
    for e in read_metrics(run_dir / "metrics.jsonl"):
        step = [s for s in samples if s["step"] == e["step"]]
        failed = []
        for s in step:  # independent of ferrule: the real verifier on the stripped response
            try:
                src.dataset.score_answer(s["response"].strip() or None, entries[s["prompt_id"]])
            except ValueError:
                failed.append(s)
        assert len(failed) >= len(step) // 2, "the fixture should make most samples raise"
        if e["step"] == 1:
            assert len(failed) == len(step) == 32, "the fixture should make every sample of step 1 raise"
        assert e["reward_errors"] == len(failed) and e["reward_error_types"] == {"ValueError": len(failed)}
        assert all(s["reward"] == -1.0 for s in failed)
        assert f"WARNING step {e['step']}: the reward function raised on {len(failed)} of 32 samples" in log


@pytest.mark.timeout(300)
def test_export_of_a_training_checkpoint_is_a_complete_hf_folder(assets, config_file, tmp_path):
    """``ferrule export RUN_DIR OUT`` (latest step by default) gives a folder transformers loads with the
    trained weights, the source's generation config (two EOS ids) and its tokenizer."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from ferrule.rl.config import load_config
    from ferrule.converters.export import ExportError, find_run_checkpoint
    from ferrule.megatron.parallel import destroy_distributed
    from ferrule.rl.loop import GRPOTrainer

    src = tmp_path / "model"
    shutil.copytree(assets / "model", src)
    gen = GenerationConfig.from_pretrained(src)
    gen.eos_token_id = [3, 1]  # <|im_end|>, <|endoftext|>: two EOS ids, as Qwen2.5-Instruct has
    gen.save_pretrained(src)
    run_dir = tmp_path / "run"
    cfg = load_config(config_file, _overrides(assets, run_dir, 2) + [
        f"model.hf_dir={src}", "checkpoint.interval=1", "checkpoint.keep=0", "logging.plot_at_end=false"])
    trainer = GRPOTrainer(cfg, check_weight_update_equal=True)  # the rollout engine holds exactly the trained weights
    trainer.run()
    trained = {k: v.clone() for k, v in trainer.rollout.get_hf_state_dict().items()}
    # `ferrule export` runs without a process group (a process of its own): the trainer's goes first, or the
    # conversion would run in a spawned rank (converters/workers.py), an interpreter start
    del trainer
    destroy_distributed()
    hf_files = sorted(p.name for p in (run_dir / "checkpoints" / "step_000002" / "engine" / "hf").iterdir())
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(hf_files)

    assert find_run_checkpoint(run_dir)[0] == 2 and find_run_checkpoint(run_dir, 1)[0] == 1
    with pytest.raises(ExportError, match=r"no checkpoint of step 7 .*steps \[1, 2\]"):
        find_run_checkpoint(run_dir, 7)
    with pytest.raises(ExportError, match="does not exist"):
        find_run_checkpoint(tmp_path / "nope")

    out = tmp_path / "exported"
    env = dict(os.environ, FERRULE_PLUGINS="qwen,inkling")
    res = run_ferrule(["export", run_dir, out], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "exported step 2" in res.stderr

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == [3, 1]
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(src).to_dict()
    tok, ref_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    assert tok("say 7\n").input_ids == ref_tok("say 7\n").input_ids and tok.eos_token == ref_tok.eos_token
    exported = load_file(out / "model.safetensors")
    assert set(exported) <= set(trained)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
    original = load_file(src / "model.safetensors")
    assert any(not torch.equal(original[k], exported[k]) for k in exported)  # training moved the weights

    again = run_ferrule(["export", run_dir, out], env=env)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.timeout(240)
def test_async_schedule_at_staleness_0_equals_sync_and_one_step_off_trains_one_version_behind(
        assets, config_file, plain_run, tmp_path):
    """train.schedule=async with max_staleness 0 (the rollout thread waits for every sync) gives the
    synchronous run's metrics, samples and final weights bit for bit; one_step_off trains step k on
    the rollout of the weights after step k-2 (staleness 1 from step 2 on), records the versions and
    the waits, and its checkpoint holds the sampler position of the trained step."""
    import torch

    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rl.metrics import read_metrics

    plain, full = plain_run
    zero = GRPOTrainer(load_config(config_file, _overrides(assets, tmp_path / "a0", RESUME_STEPS) +
                                   ["train.schedule=async", "train.max_staleness=0"]))
    zero.run()
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(tmp_path / "a0" / "metrics.jsonl")
    assert _comparable(a) == _comparable(b)
    assert all(e["staleness_max"] == 0 and e["staleness_histogram"] == {"0": 32} for e in a)
    ref, got = dict(plain.engine.export_hf_state()), dict(zero.engine.export_hf_state())
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert (full / "samples.jsonl").read_text() == (tmp_path / "a0" / "samples.jsonl").read_text()

    off = GRPOTrainer(load_config(config_file, _overrides(assets, tmp_path / "off", RESUME_STEPS) +
                                  ["train.schedule=one_step_off", "checkpoint.interval=3", "checkpoint.keep=0"]))
    off.run()
    c = read_metrics(tmp_path / "off" / "metrics.jsonl")
    assert [e["staleness_max"] for e in c] == [0] + [1] * (RESUME_STEPS - 1)
    assert [e["rollout_weights_version"] for e in c] == [0] + list(range(RESUME_STEPS - 1))
    assert all(e["weight_versions_per_batch"] == 1 and e["stale_dropped_samples"] == 0 for e in c)
    assert all(e["time_trainer_wait_s"] >= 0 and e["time_rollout_wait_s"] >= 0 for e in c)
    assert _comparable(c[:1]) == _comparable(a[:1])  # step 1 is the synchronous one
    # step 1 is on policy; later steps train on samples of the previous weights: the trainer's old
    # logprobs move away from the rollout's (what TIS corrects: weights != 1)
    assert c[0]["train_rollout_logprob_abs_diff"] < 1e-4
    assert all(e["train_rollout_logprob_abs_diff"] > 1e-4 and e["tis_weight_mean"] != 1.0 for e in c[1:])
    # step 3's checkpoint: the thread had drawn step 4's prompts (and maybe step 5's) by then
    state = json.loads((tmp_path / "off" / "checkpoints" / "step_000003" / "loop_state.json").read_text())
    assert state["sampler"]["served"] == 3 * 4
