"""Reward semantics and reward-function failures against reasoning-gym's real verifiers.

References: reasoning-gym 0.1.25's ``score_answer`` of each dataset, called directly, for the
score (``basic_arithmetic`` half-credits a sign error) and for the exceptions junk answers raise
(``prime_factorization`` -> ``ValueError`` on ``'7i.s'``, ``coin_flip`` -> ``OverflowError`` on
``'1e400'``, ``boxnet`` -> ``AttributeError`` on ``'[1, 2]'``).
"""

from __future__ import annotations

import textwrap

import pytest

from ferrule.rl.rewards import (HIGH_ERROR_RATE, RewardError, build_reward_fn, check_reward_fn, reward_error_metrics,
                                reward_failure_warning, score_responses)
from ferrule.rl.tasks import ReasoningGymSource

ARITH_KW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}

# (task, junk answer, exception class reasoning-gym raises)
RAISING = [("prime_factorization", "7i.s", ValueError), ("coin_flip", "1e400", OverflowError),
           ("boxnet", "[1, 2]", AttributeError)]


@pytest.mark.parametrize("task,junk,exc", RAISING, ids=[t for t, _, _ in RAISING])
def test_a_verifier_that_raises_scores_the_failure_reward_and_is_counted(task, junk, exc):
    src = ReasoningGymSource(task, 4, 1)
    with pytest.raises(exc):  # the real verifier raises on this junk
        src.dataset.score_answer(junk, src[0].entry)
    fn = build_reward_fn("task", source=src, extraction="full")
    good = f"{src[1].answer}" if task != "boxnet" else "[]"
    prompts = [src[0], src[1], src[2]]
    results = score_responses(fn, [junk, good, junk], prompts, failure_reward=-0.5)
    assert [r.error_type for r in results] == [exc.__name__, None, exc.__name__]
    assert results[0].reward == -0.5 and not results[0].correct and results[0].score is None
    assert results[1].reward == pytest.approx(src.dataset.score_answer(good, src[1].entry))
    assert reward_error_metrics(results) == {"reward_errors": 2, "reward_error_types": {exc.__name__: 2}}
    # 2 of 3 failed: a warning (the run goes on); every sample failing is a warning too, never an error
    assert reward_failure_warning(results, [junk, good, junk], prompts, "step 1").startswith(
        f"WARNING step 1: the reward function raised on 2 of 3 samples (67%)")
    assert reward_failure_warning(results[1:2], [good], prompts[1:2], "step 2") is None
    every = score_responses(fn, [junk, junk], prompts[:2])
    assert exc.__name__ in reward_failure_warning(every, [junk, junk], prompts[:2], "step 4")


def test_failure_reward_defaults_to_zero_and_keyboard_interrupt_propagates():
    src = ReasoningGymSource("prime_factorization", 2, 1)
    fn = build_reward_fn("task", source=src, extraction="full")
    assert score_responses(fn, ["7i.s"], [src[0]])[0].reward == 0.0

    def interrupted(response, prompt):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_responses(interrupted, ["x"], [src[0]])
    assert reward_error_metrics(score_responses(fn, [src[0].answer], [src[0]])) == {"reward_errors": 0}


def test_reward_mode_task_score_keeps_partial_credit_exact_does_not():
    src = ReasoningGymSource("basic_arithmetic", 200, 1, ARITH_KW)
    p = next(src[i] for i in range(len(src)) if src[i].answer == "1")
    response = "2 + -1 = -1"  # a sign error
    score = src.dataset.score_answer("-1", p.entry)
    assert score == 0.5  # reasoning-gym's partial credit
    task_score = build_reward_fn("task", source=src, extraction="last_number", mode="task_score")(response, p)
    exact = build_reward_fn("task", source=src, extraction="last_number", mode="exact")(response, p)
    assert (task_score.reward, task_score.score, task_score.correct) == (0.5, 0.5, False)
    assert (exact.reward, exact.score, exact.correct) == (0.0, 0.5, False)
    right = build_reward_fn("task", source=src, extraction="last_number", mode="exact", format_reward=0.25)(
        "2 + -1 = 1", p)
    assert (right.reward, right.score, right.correct) == (1.25, 1.0, True)
    with pytest.raises(ValueError, match="unknown reward mode"):
        build_reward_fn("task", source=src, mode="binary")


def test_custom_numeric_reward_follows_the_mode_and_raising_custom_is_counted(tmp_path, monkeypatch):
    (tmp_path / "rw_mode.py").write_text(textwrap.dedent("""
        def half(response, prompt):
            return 0.5
        def picky(response, prompt):
            if "junk" in response:
                raise KeyError(response)
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    src = ReasoningGymSource("gcd", 2, 1)
    assert build_reward_fn("rw_mode:half", mode="exact")("r", src[0]).reward == 0.0
    assert build_reward_fn("rw_mode:half", mode="task_score")("r", src[0]).reward == 0.5
    res = score_responses(build_reward_fn("rw_mode:picky"), ["ok", "junk"], [src[0], src[1]])
    assert [(r.reward, r.error_type) for r in res] == [(1.0, None), (0.0, "KeyError")]


def test_reward_config_keys():
    from ferrule.rl.config import ConfigError, load_config

    base = ["model.hf_dir=x", "data.task=basic_arithmetic"]
    cfg = load_config(None, base + ["reward.mode=exact", "reward.failure_reward=-1"])
    assert (cfg.reward.mode, cfg.reward.failure_reward) == ("exact", -1.0)
    assert load_config(None, base).reward.mode == "task_score"
    with pytest.raises(ConfigError, match="reward.mode: 'binary' is not allowed"):
        load_config(None, base + ["reward.mode=binary"])
    with pytest.raises(ConfigError, match="reward.failure_reward: expected a finite float, got inf"):
        load_config(None, base + ["reward.failure_reward=inf"])


REWARD_CHECK_MODULE = textwrap.dedent("""
    def broken(response, prompt):
        raise TypeError("this reward function is broken")
    def never(response, prompt):
        return 0.0
    def always(response, prompt):
        return 1.0
""")


def test_setup_check_passes_a_verifier_that_only_raises_on_junk_and_names_what_it_raises():
    """prime_factorization's real verifier scores its reference answers 1 and raises on junk (allowed)."""
    src = ReasoningGymSource("prime_factorization", 16, 1)
    for extraction in ("answer_tag", "full", "last_line"):
        fn = build_reward_fn("task", source=src, extraction=extraction)
        found = check_reward_fn(fn, src, extraction=extraction)
        assert found.checked == tuple(src[i].id for i in range(8))
        assert dict(found.raises_on_malformed)["7i.s"].startswith("ValueError: invalid literal for int()")
    for i in range(8):  # independent: the verifier itself gives the references full score
        assert src.dataset.score_answer(src[i].answer, src[i].entry) == 1.0


def test_setup_check_refuses_a_function_that_raises_on_or_mis_scores_the_reference(tmp_path, monkeypatch):
    (tmp_path / "rw_check.py").write_text(REWARD_CHECK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    src = ReasoningGymSource("prime_factorization", 16, 1)
    p0 = src[0]
    with pytest.raises(RewardError, match=rf"'rw_check:broken' raised TypeError: this reward function is broken on "
                                          rf"the reference answer '{p0.answer}' of prompt {p0.id}"):
        check_reward_fn(build_reward_fn("rw_check:broken"), src, extraction="full", function="rw_check:broken")
    with pytest.raises(RewardError, match=rf"scores the reference answer '{p0.answer}' of prompt {p0.id} .*0.0, not "
                                          "correct.*reward.check_reference=false"):
        check_reward_fn(build_reward_fn("rw_check:never"), src, extraction="full", function="rw_check:never")
    with pytest.raises(RewardError, match="scores the malformed answer '' as correct on all 8 checked prompts"):
        check_reward_fn(build_reward_fn("rw_check:always"), src, extraction="full", function="rw_check:always")
    # the task's verifier under an extraction that cannot give the answer back (last_number of "2 × 3")
    fn = build_reward_fn("task", source=src, extraction="last_number")
    bad = next(src[i] for i in range(8) if "×" in src[i].answer)
    with pytest.raises(RewardError, match=r"data.answer_extraction='last_number' extracted"):
        check_reward_fn(fn, src, extraction="last_number")
    assert src.dataset.score_answer(bad.answer.split(" ")[-1], bad.entry) < 1.0  # the verifier agrees


def test_setup_check_does_not_count_junk_that_extracts_to_the_reference():
    """last_number takes "7" out of the malformed "7i.s": on prompts whose answer is 7 that scores 1 rightly."""
    from ferrule.rl.tasks import JsonlSource

    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n" for i in range(4)))
        src = JsonlSource(path)
        fn = build_reward_fn("task", source=src, extraction="last_number")
        assert fn("7i.s", src[0]).correct  # the junk really scores correct here
        assert check_reward_fn(fn, src, extraction="last_number").checked == tuple(src[i].id for i in range(4))
