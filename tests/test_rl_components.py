"""Engine-independent RL launcher pieces: config, tasks, rewards, advantages, metrics, plot.

References are independent of the code under test: Python's ``statistics`` module for GRPO
statistics, reasoning-gym's own dataset answers and ``score_answer`` for rewards, matplotlib's
``imread`` for the PNG, and the ``gguf`` package's own dequantizer for the SmolLM2 conversion.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ferrule.rl import advantages as adv_mod
from ferrule.rl.config import ConfigError, all_keys, config_from_dict, load_config
from ferrule.rl.config_checks import DOCS_BEGIN, DOCS_END, config_reference_markdown
from ferrule.rl.metrics import MetricsLogger, eta_seconds, format_duration, read_metrics, rollout_metrics
from ferrule.rl.rewards import RewardError, build_reward_fn, score_responses
from ferrule.rl.tasks import (JsonlSource, PromptFileError, PromptSampler, ReasoningGymSource,
                              extract_answer, resolve_system_prompt)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "configs"
SEED = 1234
GROUP = 4
N_GROUPS = 6
MINIMAL = {"model": {"hf_dir": "some/hf"}, "data": {"task": "basic_arithmetic"}}


# ---------------------------------------------------------------- config

def _problems(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(exc.value.problems)


@pytest.mark.parametrize("name", ["smollm2_arithmetic.yaml", "tiny_ci.yaml"])
def test_example_configs_load(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.data.task == "basic_arithmetic"
    assert cfg.rollout.n_samples_per_prompt >= 2 and cfg.rollout.temperature > 0


def test_unknown_keys_suggest_closest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {hf_dir: x}\ndata: {task: basic_arithmetic}\nrollout:\n  temprature: 0.7\n"
                    "rollot: {}\ntemperature: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["train.stepz=3"])
    text = _problems(exc)
    assert len(exc.value.problems) == 4
    assert "rollout.temprature: unknown key; did you mean 'rollout.temperature'?" in text
    assert "rollot: unknown section; did you mean 'rollout'?" in text
    assert "'rollout.temperature' or 'eval.temperature'" in text
    assert "train.stepz: unknown key; did you mean 'train.steps'?" in text
    assert str(path) in str(exc.value)


def test_type_errors_are_strict():
    raw = {**MINIMAL, "train": {"steps": 1.5, "seed": True}, "rollout": {"top_p": "high", "engine": "vllm"},
           "logging": {"progress": "yes"}}
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    text = _problems(exc)
    assert "train.steps: expected int, got float 1.5" in text
    assert "train.seed: expected int, got bool True" in text
    assert "rollout.top_p: expected float, got str 'high'" in text
    assert "rollout.engine: 'vllm' is not allowed; expected one of 'embedded', 'sglang'" in text
    assert "logging.progress: expected bool, got str 'yes'" in text
    # PyYAML reads 1e-6 (no dot) as a string; float keys accept it, ints widen to float.
    cfg = config_from_dict({**MINIMAL, "optimizer": {"lr": "1e-6", "clip_grad": 2}})
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.clip_grad == 2.0
    assert isinstance(cfg.optimizer.clip_grad, float)


def test_overrides_are_typed_and_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {hf_dir: x}\ndata: {task: basic_arithmetic, task_kwargs: {max_terms: 3}}\n"
                    "train: {steps: 10}\n")
    cfg = load_config(path, ["train.steps=7", "logging.progress=off", "optimizer.lr=3e-5",
                             "rollout.extra_stop_tokens=[<|im_end|>, '</s>']", "data.task_kwargs.max_digits=2",
                             "data.system_prompt=Be brief: answer=42"])
    assert cfg.train.steps == 7 and cfg.logging.progress is False and cfg.optimizer.lr == 3e-5
    assert cfg.rollout.extra_stop_tokens == ["<|im_end|>", "</s>"]
    assert cfg.data.task_kwargs == {"max_terms": 3, "max_digits": 2}
    assert cfg.data.system_prompt == "Be brief: answer=42"  # str keys take the text verbatim
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["train.steps=7.5", "logging.progress=maybe", "train.steps", "train.steps.x=1"])
    text = _problems(exc)
    assert "train.steps: expected int, got '7.5'" in text
    assert "logging.progress: expected a bool" in text
    assert "override 'train.steps': expected section.key=value" in text
    assert "train.steps is a int, not a mapping" in text


def test_contradictions_reported_together():
    raw = {**MINIMAL,
           "rollout": {"n_samples_per_prompt": 1, "max_new_tokens": 256},
           "train": {"micro_batch_tokens": 300, "prompts_per_step": 6, "optim_steps_per_rollout": 4},
           "checkpoint": {"interval": 0},
           "eval": {"interval": 5, "seed": 1},
           "data": {"task": "basic_arithmatic", "seed": 1, "prompt_template": "Q: {q}"},
           "algorithm": {"loss": "ppo2", "use_tis": True, "tis_cap": 0.5}}
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    text = _problems(exc)
    for expected in ["rollout.n_samples_per_prompt: GRPO needs >= 2 samples per prompt",
                     "train.micro_batch_tokens: 300 cannot hold the longest sequence",
                     "train.optim_steps_per_rollout: 4 does not divide train.prompts_per_step=6",
                     "checkpoint.interval: must be > 0 steps, got 0",
                     "eval.seed: equals data.seed=1",
                     "data.task: 'basic_arithmatic' is not a reasoning-gym dataset; did you mean 'basic_arithmetic'?",
                     "data.prompt_template: must contain the field {question}",
                     "algorithm.loss: 'ppo2' is not an RL policy loss; did you mean 'ppo'?",
                     "algorithm.tis_cap: must be >= 1"]:
        assert expected in text, expected
    with pytest.raises(ConfigError, match="temperature: 0 \\(greedy\\)"):
        config_from_dict({**MINIMAL, "rollout": {"temperature": 0.0}})
    with pytest.raises(ConfigError, match="set exactly one"):
        config_from_dict({"model": {"hf_dir": "x"}, "data": {"task": "gcd", "jsonl_path": "p.jsonl"}})


def test_system_prompt_preset_is_checked_against_reasoning_gym_only_when_used(monkeypatch):
    """An unknown preset is named with reasoning-gym's closest name; a run that uses no preset ("none", or a
    literal ``system_prompt``) does not import reasoning-gym to check it (~6 s of every ``ferrule train`` start)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from ferrule.rl import config_checks

    assert "direct" in SYSTEM_PROMPTS
    with pytest.raises(ConfigError, match="data.system_prompt_preset: 'drect' is unknown; did you mean 'direct'"):
        config_from_dict({**MINIMAL, "data": {**MINIMAL["data"], "system_prompt_preset": "drect"}})

    def refuse():
        raise AssertionError("reasoning-gym's presets were read")

    monkeypatch.setattr(config_checks, "_system_prompt_presets", refuse)
    config_from_dict({**MINIMAL, "data": {**MINIMAL["data"], "system_prompt_preset": "none"}})
    config_from_dict({**MINIMAL, "data": {**MINIMAL["data"], "system_prompt": "Answer briefly."}})


def test_toml_yaml_and_dump_round_trip(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\nhf_dir = "x"\n[data]\ntask = "gcd"\n[data.task_kwargs]\n'
                                     'max_terms = 2\n[optimizer]\nlr = 2e-6\n')
    (tmp_path / "c.yaml").write_text("model: {hf_dir: x}\ndata: {task: gcd, task_kwargs: {max_terms: 2}}\n"
                                     "optimizer: {lr: 2.0e-6}\n")
    a, b = load_config(tmp_path / "c.toml"), load_config(tmp_path / "c.yaml")
    assert a == b and a.optimizer.lr == 2e-6
    written = a.dump(tmp_path / "run")
    assert written == tmp_path / "run" / "config.yaml"
    assert load_config(written) == a
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.yaml"]  # no temp file left


def test_check_paths_names_missing_inputs(tmp_path):
    cfg = config_from_dict({"model": {"hf_dir": str(tmp_path / "nope")},
                            "data": {"jsonl_path": str(tmp_path / "p.jsonl")}})
    with pytest.raises(ConfigError) as exc:
        cfg.check_paths()
    assert len(exc.value.problems) == 2 and "model.hf_dir" in exc.value.problems[0]


def test_rl_loss_names_exist_in_ferrule_losses():
    from ferrule.losses import LOSSES, get_loss
    from ferrule.rl.config import LOSS_NAMES

    assert set(LOSS_NAMES) == set(LOSSES) - {"cross_entropy"}  # every RL policy loss, no SFT loss
    for name in LOSS_NAMES:
        assert callable(get_loss(name))


def test_docs_config_reference_is_current():
    text = (REPO / "docs" / "train.md").read_text()
    block = text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0]
    assert DOCS_BEGIN + block + DOCS_END == config_reference_markdown(), \
        "docs/train.md is stale: run `python -m ferrule.rl.config_checks docs/train.md`"
    for key in all_keys():
        assert f"| `{key}` |" in block, key


# ---------------------------------------------------------------- advantages

def _reference_grpo(rewards, ids, std_norm, eps):
    out = [0.0] * len(rewards)
    for g in set(ids):
        members = [i for i, x in enumerate(ids) if x == g]
        vals = [rewards[i] for i in members]
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals)
        for i in members:
            out[i] = (rewards[i] - mean) / (std + eps) if std_norm else rewards[i] - mean
    return out


@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_advantages_match_reference(std_norm):
    rng = np.random.default_rng(SEED)
    rewards = rng.integers(0, 3, size=GROUP * N_GROUPS).astype(float) / 2
    rewards[:GROUP] = 1.0  # one zero-variance group
    contiguous = adv_mod.grpo_advantages(rewards, group_size=GROUP, std_normalization=std_norm, eps=1e-6)
    ids = [i // GROUP for i in range(len(rewards))]
    np.testing.assert_allclose(contiguous, _reference_grpo(list(rewards), ids, std_norm, 1e-6), rtol=1e-12)
    assert np.all(contiguous[:GROUP] == 0.0)
    perm = rng.permutation(len(rewards))  # interleaved groups via group_ids
    shuffled = adv_mod.grpo_advantages(rewards[perm], group_ids=np.array(ids)[perm], std_normalization=std_norm)
    np.testing.assert_allclose(shuffled, contiguous[perm], rtol=1e-12)
    with pytest.raises(ValueError, match="exactly one"):
        adv_mod.grpo_advantages(rewards)


def test_grpo_rejects_singleton_groups_and_nan():
    with pytest.raises(ValueError, match="std normalization needs >= 2"):
        adv_mod.grpo_advantages([1.0, 0.0], group_size=1)
    assert adv_mod.grpo_advantages([1.0, 0.0], group_size=1, std_normalization=False).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="non-finite"):
        adv_mod.grpo_advantages([1.0, float("nan")], group_size=2)


def test_grpo_sample_mask_leaves_untrainable_samples_out_of_the_baseline():
    """A sample with no trainable token gets 0 and does not move its group's mean / std."""
    rewards = [1.0, 0.0, 0.0, 5.0,   # sample 3: empty response (masked), its reward must not count
               0.3, 0.9, 0.9, 0.9,   # only sample 4 remains: no baseline, all 0
               0.2, 0.4, 0.8, 1.0]   # unmasked group
    mask = [1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1]
    eps = 1e-6
    expected = [0.0] * 12
    for members in ([0, 1, 2], [8, 9, 10, 11]):
        vals = [rewards[i] for i in members]
        mean, std = statistics.fmean(vals), statistics.stdev(vals)
        for i in members:
            expected[i] = (rewards[i] - mean) / (std + eps)
    assert expected[0] == pytest.approx(0.6666667 / 0.5773513, rel=1e-6)  # the hand value: (1 - 1/3) / sqrt(1/3)
    got = adv_mod.grpo_advantages(rewards, group_size=4, eps=eps, sample_mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    drgrpo = adv_mod.grpo_advantages(rewards, group_size=4, std_normalization=False,
                                     sample_mask=np.array(mask, dtype=bool))
    np.testing.assert_allclose(drgrpo[:4], [2 / 3, -1 / 3, -1 / 3, 0.0], rtol=1e-12)
    assert drgrpo[4:8].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="sample_mask shape"):
        adv_mod.grpo_advantages(rewards, group_size=4, sample_mask=mask[:-1])
    with pytest.raises(ValueError, match="bool or 0/1"):
        adv_mod.grpo_advantages(rewards, group_size=4, sample_mask=[0.5] * 12)


def test_all_equal_non_binary_groups_count_as_zero_std():
    """Equal float64 rewards do not sum exactly (``[0.1] * 3`` has std 1.7e-17): such groups still
    carry no signal, get advantage exactly 0 and count in ``zero_std_group_fraction``."""
    rewards = [0.1] * 3 + [0.35] * 3 + [0.7] * 3 + [0.1, 0.35, 0.7]
    assert np.asarray(rewards[:3]).std(ddof=1) > 0  # the round-off this test is about
    adv = adv_mod.grpo_advantages(rewards, group_size=3)
    assert adv[:9].tolist() == [0.0] * 9
    mean, std = statistics.fmean([0.1, 0.35, 0.7]), statistics.stdev([0.1, 0.35, 0.7])
    np.testing.assert_allclose(adv[9:], [(v - mean) / (std + 1e-6) for v in (0.1, 0.35, 0.7)], rtol=1e-12)
    assert adv_mod.zero_std_group_fraction(rewards, 3) == 0.75
    assert adv_mod.zero_std_group_fraction([1e6, 1e6 * (1 + 1e-15), 1.0, 2.0], 2) == 0.5  # scale-relative
    # a masked sample leaves a group with one reward: no comparison, so it counts as zero-std
    assert adv_mod.zero_std_group_fraction([0.0, 1.0, 0.0, 1.0], 2, sample_mask=[1, 0, 1, 1]) == 0.5


def test_token_weights_give_split_invariant_means():
    rng = np.random.default_rng(SEED)
    lengths = [int(n) for n in rng.integers(0, 20, size=GROUP * N_GROUPS)]
    lengths[3] = 0
    losses = [rng.normal(size=n) for n in lengths]
    flat = np.concatenate(losses)
    w = adv_mod.token_weights(lengths, mode="token_mean")
    assert sum(x.sum() for x in w) == pytest.approx(1.0, abs=1e-12)
    # Any split into micro-batches: the sum of per-micro-batch weighted sums is the global token mean.
    for cuts in ([5], [1, 2, 17], list(range(1, len(lengths)))):
        parts = np.split(np.arange(len(lengths)), cuts)
        total = sum(sum(float(w[i] @ losses[i]) for i in part) for part in parts)
        assert total == pytest.approx(flat.mean(), rel=1e-12)
    ws = adv_mod.token_weights(lengths, mode="sample_mean")
    expected = statistics.fmean(float(x.mean()) for x in losses if len(x))
    assert sum(float(a @ b) for a, b in zip(ws, losses)) == pytest.approx(expected, rel=1e-12)
    wc = adv_mod.token_weights(lengths, mode="constant", max_new_tokens=20)
    assert sum(float(a @ b) for a, b in zip(wc, losses)) == pytest.approx(flat.sum() / (len(lengths) * 20))
    masks = [np.r_[np.ones(n // 2), np.zeros(n - n // 2)] for n in lengths]
    wm = adv_mod.token_weights(lengths, loss_masks=masks)
    kept = np.concatenate([x[: n // 2] for x, n in zip(losses, lengths)])
    assert sum(float(a @ b) for a, b in zip(wm, losses)) == pytest.approx(kept.mean(), rel=1e-12)
    pa = adv_mod.per_token_advantages(np.arange(len(lengths), dtype=float), lengths)
    assert [len(x) for x in pa] == lengths and all(np.all(x == i) for i, x in enumerate(pa))
    with pytest.raises(ValueError, match="loss mask shape"):
        adv_mod.token_weights([2], loss_masks=[[1.0]])


# ---------------------------------------------------------------- tasks and rewards

def test_reasoning_gym_source_is_deterministic_and_verifier_rewards():
    kw = {"max_terms": 2, "max_digits": 1}
    a = ReasoningGymSource("basic_arithmetic", 16, 7, kw, resolve_system_prompt("direct"))
    b = ReasoningGymSource("basic_arithmetic", 16, 7, kw, resolve_system_prompt("direct"))
    c = ReasoningGymSource("basic_arithmetic", 16, 8, kw)
    assert [a[i].question for i in range(16)] == [b[i].question for i in range(16)]
    assert [a[i].question for i in range(16)] != [c[i].question for i in range(16)]
    from reasoning_gym.utils import SYSTEM_PROMPTS
    assert a[0].messages[0] == {"role": "system", "content": SYSTEM_PROMPTS["direct"]}
    assert a[0].messages[1]["content"] == a[0].question
    reward = build_reward_fn("task", source=a, format_reward=0.25)
    for i in range(4):
        p = a[i]
        good = reward(f"Let me think. <answer>{p.answer}</answer>", p)
        wrong = reward(f"<answer>{int(p.answer) + 1}</answer>", p)
        bare = reward(p.answer, p)  # right number, but not in the requested tags
        assert (good.reward, good.correct, good.format_ok, good.extracted) == (1.25, True, True, p.answer)
        assert wrong.reward == 0.25 and not wrong.correct
        assert (bare.reward, bare.format_ok) == (0.0, False)
    countdown = ReasoningGymSource("countdown", 4, 3)
    p = countdown[0]
    r = build_reward_fn("task", source=countdown)
    assert r(f"<answer>{p.answer}</answer>", p).correct
    assert not r("<answer>1 + 1</answer>", p).correct
    assert r("<answer>1 + 1</answer>", p).reward == pytest.approx(
        countdown.dataset.score_answer("1 + 1", p.entry))


def test_extract_answer_modes():
    text = "first <answer> 3 </answer> then\n<answer>-1,234.5</answer>\n  so 7 \n\n"
    assert extract_answer(text, "answer_tag") == "-1,234.5"
    assert extract_answer(text, "last_number") == "7"
    assert extract_answer("4 - 1 = -3, total 1,000.", "last_number") == "1000"
    assert extract_answer(text, "last_line") == "so 7"
    assert extract_answer(" x ", "full") == "x"
    assert extract_answer("no tags", "answer_tag") is None and extract_answer("", "last_line") is None
    with pytest.raises(ValueError, match="unknown answer extraction mode"):
        extract_answer("x", "boxed")


def test_prompt_sampler_epochs_and_exact_resume():
    src = ReasoningGymSource("gcd", 10, 1)
    s = PromptSampler(src, seed=SEED)
    first = s.next_indices(10)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    second = s.next_indices(10)
    assert sorted(second) == list(range(10)) and second != first
    a = PromptSampler(src, seed=SEED)
    batches = [a.next_indices(4) for _ in range(6)]  # crosses epoch boundaries
    b = PromptSampler(src, seed=SEED)
    b.next_indices(4), b.next_indices(4)
    state = json.loads(json.dumps(b.state_dict()))  # survives a JSON round trip
    c = PromptSampler(src, seed=SEED)
    c.load_state_dict(state)
    assert [c.next_indices(4) for _ in range(4)] == batches[2:]
    assert PromptSampler(src, seed=SEED, shuffle=False).next_indices(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="seed=1234 but this run has seed=5"):
        PromptSampler(src, seed=5).load_state_dict(state)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_source_and_line_numbered_errors(tmp_path):
    good = _write(tmp_path / "ok.jsonl", [
        json.dumps({"prompt": "What is 2+2?", "answer": 4, "id": "a"}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                    "answer": "hello"}),
        json.dumps({"prompt": "Sum", "answer": "1000",
                    "metadata": {"source_dataset": "chain_sum"}}),
    ])
    src = JsonlSource(good, system_prompt="SYS", prompt_template="Q: {question}")
    assert len(src) == 3 and src[0].id == "a" and src[0].answer == "4"
    assert src[0].messages == ({"role": "system", "content": "SYS"}, {"role": "user", "content": "Q: What is 2+2?"})
    assert src[1].messages[0]["content"] == "S"  # messages records are used as is
    reward = build_reward_fn("task", source=src)
    assert reward("<answer>4.0</answer>", src[0]).correct  # exact match compares numbers
    assert not reward("<answer>5</answer>", src[0]).correct
    from reasoning_gym import get_score_answer_fn
    rg = get_score_answer_fn("chain_sum")("+01,000.00", {"answer": "1000"})
    assert rg == 1.0 and reward("<answer>+01,000.00</answer>", src[2]).reward == rg
    cases = {
        '{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": 2,}': "bad.jsonl:2: invalid JSON",
        '{"prompt": "x"}': "bad.jsonl:1: missing 'answer'",
        '{"prompt": "x", "answer": "1", "solution": "s"}': "unknown field(s) ['solution']",
        '{"prompt": "x", "messages": [], "answer": "1"}': "exactly one of 'prompt'",
        '{"messages": [{"role": "bot", "content": "x"}], "answer": "1"}': "'messages' must be",
        '{"prompt": "x", "answer": [1]}': "'answer' must be a string or a number",
        '[1, 2]': "expected a JSON object",
    }
    for content, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(content + "\n")
        with pytest.raises(PromptFileError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            JsonlSource(tmp_path / "bad.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    assert JsonlSource(tmp_path / "bad.jsonl", require_answer=False)[0].answer is None
    with pytest.raises(PromptFileError, match="does not exist"):
        JsonlSource(tmp_path / "missing.jsonl")


def test_custom_reward_functions(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        from ferrule.rl.rewards import RewardResult
        def short(response, prompt, *, target=3):
            return 1.0 if len(response.split()) <= target else 0.0
        def rich(response, prompt):
            return RewardResult(0.5, False, True, "x")
        def bad_type(response, prompt):
            return "1"
        def no_args():
            return 1.0
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    src = ReasoningGymSource("gcd", 2, 1)
    fn = build_reward_fn("my_rewards:short", source=src, kwargs={"target": 2}, format_reward=0.5,
                         extraction="last_number")
    results = score_responses(fn, ["a 12", "one two three"], [src[0], src[1]])
    assert [(r.reward, r.correct, r.format_ok) for r in results] == [(1.5, True, True), (0.0, False, False)]
    assert build_reward_fn("my_rewards:rich")("r", src[0]).reward == 0.5
    with pytest.raises(RewardError, match="returned str"):
        build_reward_fn("my_rewards:bad_type")("r", src[0])
    with pytest.raises(RewardError, match="must accept"):
        build_reward_fn("my_rewards:no_args")
    with pytest.raises(RewardError, match="not callable"):
        build_reward_fn("my_rewards:NOT_CALLABLE")
    with pytest.raises(RewardError, match="cannot load"):
        build_reward_fn("my_rewards:missing")
    with pytest.raises(RewardError, match="needs the prompt source"):
        build_reward_fn("task")
    with pytest.raises(ValueError, match="2 responses but 1 prompts"):
        score_responses(fn, ["a", "b"], [src[0]])


# ---------------------------------------------------------------- metrics and plot

def test_rollout_metrics_match_reference():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.25]
    m = rollout_metrics(rewards, group_size=4, response_lengths=[3, 5, 7, 9, 1, 1, 2, 2],
                        correct=[r == 1.0 for r in rewards], truncated=[False] * 7 + [True])
    assert m["reward_mean"] == pytest.approx(statistics.fmean(rewards))
    assert m["reward_std"] == pytest.approx(statistics.pstdev(rewards))
    assert m["reward_group_std_mean"] == pytest.approx(
        (statistics.pstdev(rewards[:4]) + statistics.pstdev(rewards[4:])) / 2)
    assert (m["accuracy"], m["truncated_fraction"], m["response_length_max"]) == (3 / 8, 1 / 8, 9.0)
    assert "format_rate" not in m
    assert eta_seconds(30.0, 3, 7) == 70.0 and eta_seconds(1.0, 0, 5) is None
    assert (format_duration(3723), format_duration(75), format_duration(None)) == ("1:02:03", "1:15", "?")


def test_metrics_jsonl_resume_truncates_later_steps(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 6):
            log.log(step, {"reward_mean": step / 10, "kl": float("nan") if step == 2 else 0.0})
    entries = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5]
    assert entries[1]["kl"] is None and entries[1]["nonfinite"] == ["kl"]
    with pytest.raises(FileExistsError, match="already has 5 entries"):
        MetricsLogger(tmp_path)
    log = MetricsLogger(tmp_path, resume_step=3)
    assert [e["step"] for e in read_metrics(log.path)] == [1, 2, 3]
    with pytest.raises(ValueError, match="not after the last logged step 3"):
        log.log(3, {"reward_mean": 0.0})
    log.log(4, {"reward_mean": np.float32(0.5)})
    assert read_metrics(log.path)[-1]["reward_mean"] == 0.5
    with open(log.path, "a") as f:
        f.write('{"step": 5, "rew')  # torn last line (crash mid-write) is ignored
    assert [e["step"] for e in read_metrics(log.path)] == [1, 2, 3, 4]
    lines = log.path.read_text().splitlines()
    log.path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2: corrupt"):
        read_metrics(log.path)
    assert MetricsLogger(tmp_path / "fresh", overwrite=True).last_step is None


def test_plot_run_writes_a_decodable_png(tmp_path):
    import matplotlib.pyplot as plt

    from ferrule.rl.plot import plot_run

    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path)
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 13):
            log.log(step, {"reward_mean": step / 12, "reward_group_std_mean": 0.1, "accuracy": step / 24,
                           "response_length_mean": 40 - step, "kl": 0.01 * step, "clip_fraction": 0.02,
                           "grad_norm": 1.0 / step, **({"eval_accuracy": 0.5} if step % 4 == 0 else {})})
    out = plot_run(tmp_path)
    assert out == tmp_path / "reward_curve.png" and out.stat().st_size > 20_000
    image = plt.imread(out)
    assert image.shape == (1300, 800, 4)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "reward_curve.png"]
    import typer
    from typer.testing import CliRunner

    from ferrule.cli.plot import plot_command

    app = typer.Typer()
    app.command("plot")(plot_command)
    app.command("other")(lambda: None)  # two commands, as in the real `ferrule` app
    result = CliRunner().invoke(app, ["plot", str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 0 and result.output.strip() == str(tmp_path / "x.png")
    assert plt.imread(tmp_path / "x.png").shape == image.shape
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "metrics.jsonl does not exist" in result.output


def test_plot_comparison_draws_each_run_on_shared_panels(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import typer
    from typer.testing import CliRunner

    from ferrule.cli.plot import plot_command
    from ferrule.rl.plot import COMPARE_PANELS, SMOOTH_STEPS, build_comparison_figure, plot_comparison

    rewards = {"a": [0.1 * (s % 5) for s in range(1, 13)], "b": [1.0 - 0.05 * s for s in range(1, 13)]}
    runs = {}
    for name, rs in rewards.items():
        with MetricsLogger(tmp_path / name) as log:
            log.log(0, {"eval_accuracy": 0.25})
            for step, r in enumerate(rs, 1):
                log.log(step, {"reward_mean": r, "accuracy": r / 2, "response_length_mean": 30 - step,
                               **({"entropy": 0.5 * step} if name == "a" else {}),
                               "time_step_s": 1.0 + step, "memory_peak_bytes": 3 * 2**30 if name == "a" else 2**30})
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    fig = build_comparison_figure(runs, "t")
    try:
        axes = {key: ax for ax, (key, *_) in zip(fig.axes, COMPARE_PANELS)}
        for name, rs in rewards.items():
            line = next(l for l in axes["reward_mean"].lines if l.get_label() == name)
            # trailing mean, computed independently: mean of the last SMOOTH_STEPS values (fewer at the start)
            want = [np.mean(rs[max(0, i - SMOOTH_STEPS + 1): i + 1]) for i in range(len(rs))]
            np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
            np.testing.assert_array_equal(line.get_xdata(), range(1, 13))
        mem = {l.get_label(): l.get_ydata() for l in axes["memory_peak_bytes"].lines}
        assert list(mem["a"]) == [3.0] * 12 and list(mem["b"]) == [1.0] * 12  # GiB
        assert axes["time_step_s"].get_yscale() == "log"
        ent = {l.get_label(): list(l.get_ydata()) for l in axes["entropy"].lines}
        assert ent == {"a": [0.5 * s for s in range(1, 13)]}  # raw values; run b logged none
        assert any(l.get_label() == "a: eval_accuracy" for l in axes["accuracy"].lines)
    finally:
        plt.close(fig)
    out = plot_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp.png", labels=["full", "lora"])
    assert plt.imread(out)[..., :3].std() > 0.05
    with pytest.raises(ValueError, match="two or more"):
        plot_comparison([tmp_path / "a"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="labels must differ"):
        plot_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "x.png", labels=["x", "x"])
    app = typer.Typer()
    app.command("plot")(plot_command)
    app.command("other")(lambda: None)
    ok = CliRunner().invoke(app, ["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "c.png"),
                                  "-l", "full", "-l", "lora"])
    assert ok.exit_code == 0 and (tmp_path / "c.png").is_file(), ok.output
    bad = CliRunner().invoke(app, ["plot", str(tmp_path / "a"), str(tmp_path / "b")])
    assert bad.exit_code == 2 and "needs --out" in bad.output
