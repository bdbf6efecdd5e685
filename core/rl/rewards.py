"""Reward functions for RL: the task's verifier, exact match, or a user ``module:attr`` function.

:func:`build_reward_fn` turns a ``RewardConfig`` (plus the extraction mode and the prompt
source) into a callable ``reward_fn(response: str, prompt: Prompt) -> RewardResult``.

Builtins (``reward.function``):

- ``"task"``: extract the answer (:func:`ferrule.rl.tasks.extract_answer`) and score it with
  the prompt source's own verifier (reasoning-gym ``score_answer``; for JSONL, the dataset named
  by ``metadata.source_dataset`` or exact match).
- ``"exact_match"``: extract, then :func:`ferrule.rl.tasks.exact_match` against ``prompt.answer``.

**Reward mode** (``reward.mode``). The verifier returns a *task score*, which for many
reasoning-gym tasks gives partial credit (``basic_arithmetic`` scores the answer ``1`` to
``7 - 6 = ?`` with 0.5, a sign error; ``coin_flip`` scores matching digit prefixes).
``"task_score"`` uses that score as the reward; ``"exact"`` gives 1 only when the score is 1
(:data:`CORRECT_THRESHOLD`) and 0 otherwise. Either way ``RewardResult.score`` keeps the task
score and ``RewardResult.correct`` says whether it reached 1 (the ``accuracy`` metric), so both
are logged. Both modes add ``format_reward`` when an answer could be extracted
(``RewardResult.format_ok``).

**Set-up check** (:func:`check_reward_fn`, before any engine is built). Whether a reward
function is broken is a question for set-up, not for step 1 (a fresh policy's junk makes every
sample of reasoning-gym's ``prime_factorization`` raise): the function scores the reference
answers of the first :data:`SETUP_CHECK_PROMPTS` prompts that have one (rendered so that the
configured extraction gives them back, e.g. ``<answer>A</answer>``) and a few
:data:`MALFORMED_ANSWERS`. It is refused (:class:`RewardError`, one line naming the prompt) when
it raises on a reference answer, scores one below 1 (not ``correct``), or scores a malformed
string as correct on every checked prompt (it does not look at the answer). Raising on a
malformed string is allowed (such samples score ``reward.failure_reward``) and reported.
``reward.check_reference: false`` turns the check off for functions that do not score against
``prompt.answer``.

**Failures** (:func:`score_responses`). A verifier may raise on a malformed answer (reasoning-gym's
``prime_factorization`` raises ``ValueError`` on ``'7i.s'``, ``coin_flip`` ``OverflowError`` on
``'1e400'``, ``boxnet`` ``AttributeError`` on ``'[1, 2]'``). A policy's junk output must not stop a
run: such a sample gets ``reward.failure_reward`` (0 by default), ``correct=False``, and the
exception's type and message in ``RewardResult.error_type`` / ``error``. The loop counts them per
step (``reward_errors`` and ``reward_error_types`` in metrics.jsonl), prints the first few with
their sample, and prints a warning (:func:`reward_failure_warning`) for every step where at least
:data:`HIGH_ERROR_RATE` of the samples failed; the run goes on.

**Custom functions** (``"package.module:attr"``) have the signature::

    def my_reward(response: str, prompt: ferrule.rl.tasks.Prompt, **kwargs) -> float | RewardResult

``response`` is the decoded response text without special tokens; ``prompt`` carries
``messages``, ``answer`` (may be None), ``entry`` (the raw record) and ``id``; ``kwargs`` are
``reward.kwargs``. A returned number is the task score (``reward.mode`` applies, ``correct =
score >= 1``, ``format_ok`` from the configured extraction); a returned ``RewardResult`` is used
as given (its ``reward``; ``reward.mode`` does not apply). ``format_reward`` is added in both
cases. The function must be deterministic and thread-safe (it may be called from a worker
pool); an exception it raises is a failed sample (see above).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferrule.rl.tasks import Prompt, PromptSource, exact_match, extract_answer
from ferrule.contract.specs import resolve_ref

#: A score at or above this counts as "correct" (accuracy metric, and reward 1 in ``exact`` mode).
CORRECT_THRESHOLD = 1.0 - 1e-9
#: ``reward.mode`` values.
REWARD_MODES = ("task_score", "exact")
#: Fraction of a step's samples whose reward function raised from which the loop warns loudly.
HIGH_ERROR_RATE = 0.5
#: Prompts (with a reference answer) whose answers :func:`check_reward_fn` scores at set-up.
SETUP_CHECK_PROMPTS = 8
#: Answers no task should score as correct; :func:`check_reward_fn` scores them at set-up.
MALFORMED_ANSWERS = ("", "?", "7i.s", "1e400", "[1, 2]", "\x00\ufffd")


class RewardError(ValueError):
    """A reward function could not be built or returned an invalid value."""


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response.

    Attributes:
        reward: total scalar reward (the mode's value of the score + format reward), finite.
        correct: the verifier score reached 1 (counted in the ``accuracy`` metric).
        format_ok: an answer could be extracted.
        extracted: the extracted answer, or None.
        score: the task score before ``reward.mode`` and format reward (a custom
            ``RewardResult`` without one: its ``reward``); None when the function raised.
        error_type: the exception's class name when the reward function raised, else None.
        error: ``str(exception)`` when it raised, else None.
    """

    reward: float
    correct: bool
    format_ok: bool
    extracted: str | None = None
    score: float | None = None
    error_type: str | None = None
    error: str | None = None


RewardFn = Callable[[str, Prompt], RewardResult]


def _check_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward function {name} returned {type(value).__name__} {value!r}; expected a "
                          "float or a RewardResult")
    if not math.isfinite(value):
        raise RewardError(f"reward function {name} returned a non-finite reward {value!r}")
    return float(value)


def load_custom_reward(ref: str) -> Callable[..., Any]:
    """Import ``"module:attr"`` and check it accepts ``(response, prompt, **kwargs)``.

    Raises:
        RewardError: malformed reference, import failure, not callable, or a signature that
            cannot take two positional arguments.
    """
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise RewardError(f"reward function {ref!r}: expected 'package.module:attr'")
    try:
        fn = resolve_ref(ref)
    except (ImportError, AttributeError) as exc:
        raise RewardError(f"cannot load reward function {ref!r}: {exc}") from exc
    if not callable(fn):
        raise RewardError(f"reward function {ref!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind("response", None)
    except TypeError as exc:
        raise RewardError(f"reward function {ref!r} must accept (response: str, prompt: Prompt, **kwargs): "
                          f"{exc}") from None
    except ValueError:  # builtins without a signature: accept
        pass
    return fn


def apply_mode(score: float, mode: str) -> float:
    """The reward of a task score: the score itself (``"task_score"``) or 1/0 (``"exact"``).

    Raises:
        ValueError: unknown mode.
    """
    if mode == "task_score":
        return score
    if mode == "exact":
        return 1.0 if score >= CORRECT_THRESHOLD else 0.0
    raise ValueError(f"unknown reward mode {mode!r}; use one of {list(REWARD_MODES)}")


def build_reward_fn(function: str = "task", *, source: PromptSource | None = None,
                    extraction: str = "answer_tag", format_reward: float = 0.0,
                    kwargs: dict[str, Any] | None = None, mode: str = "task_score") -> RewardFn:
    """Build ``reward_fn(response, prompt) -> RewardResult``.

    Args:
        function: ``"task"``, ``"exact_match"`` or ``"module:attr"`` (``reward.function``).
        source: the prompt source (its ``score`` is the ``"task"`` verifier).
        extraction: answer extraction mode (``data.answer_extraction``).
        format_reward: added when an answer was extracted (``reward.format_reward``).
        kwargs: passed to a custom function (``reward.kwargs``).
        mode: ``"task_score"`` or ``"exact"`` (``reward.mode``, module docstring).

    Raises:
        RewardError: ``"task"`` without a source, or a bad custom function (see
            :func:`load_custom_reward`).
        ValueError: unknown extraction or reward mode.
    """
    extract_answer("", extraction)  # validates the mode early (ValueError)
    apply_mode(0.0, mode)
    if function == "task":
        if source is None:
            raise RewardError("reward.function='task' needs the prompt source (its verifier)")

        def score(ans: str | None, prompt: Prompt) -> float:
            return source.score(ans, prompt)
    elif function == "exact_match":
        def score(ans: str | None, prompt: Prompt) -> float:
            if prompt.answer is None:
                raise RewardError(f"prompt {prompt.id}: exact_match needs a reference 'answer'")
            return exact_match(ans, prompt.answer)
    else:
        custom = load_custom_reward(function)
        extra = dict(kwargs or {})

        def reward_custom(response: str, prompt: Prompt) -> RewardResult:
            out = custom(response, prompt, **extra)
            if isinstance(out, RewardResult):
                _check_number(out.reward, function)
                return RewardResult(out.reward + format_reward * out.format_ok, out.correct, out.format_ok,
                                    out.extracted, score=out.reward if out.score is None else out.score)
            value = _check_number(out, function)
            ans = extract_answer(response, extraction)
            fmt = ans is not None
            return RewardResult(apply_mode(value, mode) + format_reward * fmt, value >= CORRECT_THRESHOLD, fmt, ans,
                                score=value)

        return reward_custom

    def reward_builtin(response: str, prompt: Prompt) -> RewardResult:
        ans = extract_answer(response, extraction)
        value = _check_number(score(ans, prompt), function)
        fmt = ans is not None
        return RewardResult(apply_mode(value, mode) + format_reward * fmt, value >= CORRECT_THRESHOLD, fmt, ans,
                            score=value)

    return reward_builtin


def build_reward_fn_from_config(cfg: Any, source: PromptSource) -> RewardFn:
    """:func:`build_reward_fn` from an ``RLConfig`` (``cfg.reward`` and ``cfg.data``)."""
    return build_reward_fn(cfg.reward.function, source=source, extraction=cfg.data.answer_extraction,
                           format_reward=cfg.reward.format_reward, kwargs=cfg.reward.kwargs, mode=cfg.reward.mode)


def score_responses(reward_fn: RewardFn, responses: Sequence[str], prompts: Sequence[Prompt], *,
                    failure_reward: float = 0.0) -> list[RewardResult]:
    """Rewards of a rollout batch; ``prompts[i]`` is the prompt of ``responses[i]``.

    An ``Exception`` raised by ``reward_fn`` for one sample does not propagate: that sample
    gets ``RewardResult(failure_reward, correct=False, format_ok=False, error_type=..., error=...)``
    (module docstring). ``KeyboardInterrupt`` / ``SystemExit`` still propagate.

    Raises:
        ValueError: length mismatch.
    """
    if len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses but {len(prompts)} prompts")
    out = []
    for r, p in zip(responses, prompts):
        try:
            out.append(reward_fn(r, p))
        except Exception as exc:  # a verifier that chokes on junk output: score the sample, keep the run
            out.append(RewardResult(float(failure_reward), False, False, None, score=None,
                                    error_type=type(exc).__name__, error=str(exc)))
    return out


def reward_error_metrics(results: Sequence[RewardResult], prefix: str = "") -> dict[str, Any]:
    """``{prefix+"reward_errors": count}`` plus ``{prefix+"reward_error_types": {type: count}}``
    when any sample failed (the type counts are sorted by name)."""
    types: dict[str, int] = {}
    for r in results:
        if r.error_type is not None:
            types[r.error_type] = types.get(r.error_type, 0) + 1
    out: dict[str, Any] = {f"{prefix}reward_errors": sum(types.values())}
    if types:
        out[f"{prefix}reward_error_types"] = dict(sorted(types.items()))
    return out


def describe_failure(result: RewardResult, response: str, prompt: Prompt, limit: int = 200) -> str:
    """One line naming a failed sample: prompt id, exception, and the (shortened) response."""
    text = response if len(response) <= limit else response[:limit] + "..."
    return f"prompt {prompt.id}: {result.error_type}: {result.error} (response {text!r})"


def reward_failure_warning(results: Sequence[RewardResult], responses: Sequence[str], prompts: Sequence[Prompt],
                           where: str, threshold: float = HIGH_ERROR_RATE) -> str | None:
    """A one-line warning when at least ``threshold`` of the samples' reward functions raised, else None.

    The run goes on either way (those samples scored ``reward.failure_reward``); a function that
    is broken outright is refused at set-up by :func:`check_reward_fn`.
    """
    failed = [i for i, r in enumerate(results) if r.error_type is not None]
    if not results or len(failed) < threshold * len(results):
        return None
    first = failed[0]
    return (f"WARNING {where}: the reward function raised on {len(failed)} of {len(results)} samples "
            f"({len(failed) / len(results):.0%}), all scored reward.failure_reward; first: "
            f"{describe_failure(results[first], responses[first], prompts[first])}. Check reward.function and "
            "data.answer_extraction if this persists after the first steps.")


def reference_response(answer: str, extraction: str) -> str:
    """A response from which ``extract_answer(response, extraction)`` gives back ``answer``
    (``<answer>A</answer>`` for ``answer_tag``, the answer itself for the other modes)."""
    return f"<answer>{answer}</answer>" if extraction == "answer_tag" else str(answer)


@dataclass(frozen=True)
class RewardCheck:
    """What :func:`check_reward_fn` found.

    Attributes:
        checked: prompt ids whose reference answer scored correct.
        raises_on_malformed: ``(malformed answer, "ExcType: message")`` of the malformed
            strings the function raised on (allowed: those samples score ``failure_reward``).
    """

    checked: tuple[str, ...]
    raises_on_malformed: tuple[tuple[str, str], ...]


def check_reward_fn(reward_fn: RewardFn, source: PromptSource, *, extraction: str, function: str = "task",
                    max_prompts: int = SETUP_CHECK_PROMPTS) -> RewardCheck:
    """Score the source's reference answers and :data:`MALFORMED_ANSWERS` before training (module docstring).

    Args:
        reward_fn: from :func:`build_reward_fn`.
        source: the prompt source; the first ``max_prompts`` prompts with an ``answer`` are used.
        extraction: ``data.answer_extraction`` (how the reference response is written).
        function: ``reward.function``, for the messages.

    Returns:
        :class:`RewardCheck` (no prompt with an answer: nothing checked).

    Raises:
        RewardError: the function raises on a reference answer, scores it not correct, or
            scores a malformed answer correct on every checked prompt; the message names the
            prompt, the answer, what came back, and the fix.
    """
    prompts = []
    for i in range(len(source)):
        if len(prompts) >= max_prompts:
            break
        if source[i].answer is not None:
            prompts.append(source[i])
    fix = ("fix reward.function / data.answer_extraction, or set reward.check_reference=false if the function "
           "does not score against prompt.answer")
    for p in prompts:
        response = reference_response(p.answer, extraction)
        try:
            result = reward_fn(response, p)
        except Exception as exc:
            raise RewardError(f"reward function {function!r} raised {type(exc).__name__}: {exc} on the reference "
                              f"answer {p.answer!r} of prompt {p.id} (response {response!r}); it would fail "
                              f"every sample: {fix}") from None
        if not result.correct:
            raise RewardError(f"reward function {function!r} scores the reference answer {p.answer!r} of prompt "
                              f"{p.id} (response {response!r}) {result.score!r}, not correct (>= 1; "
                              f"data.answer_extraction={extraction!r} extracted {result.extracted!r}): {fix}")
    raised: dict[str, str] = {}
    for junk in MALFORMED_ANSWERS:
        # junk that extracts to the reference answer (last_number of "7i.s" is "7") is no junk for that prompt
        got = extract_answer(reference_response(junk, extraction), extraction)
        others = [p for p in prompts if got != extract_answer(reference_response(p.answer, extraction), extraction)]
        correct_on = 0
        for p in others:
            try:
                correct_on += reward_fn(reference_response(junk, extraction), p).correct
            except Exception as exc:
                raised.setdefault(junk, f"{type(exc).__name__}: {exc}")
        if others and correct_on == len(others):
            raise RewardError(f"reward function {function!r} scores the malformed answer {junk!r} as correct on "
                              f"all {len(others)} checked prompts, so it does not look at the answer: {fix}")
    return RewardCheck(tuple(p.id for p in prompts), tuple(raised.items()))
