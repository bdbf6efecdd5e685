"""Reward functions for RL: the task's verifier, exact match, or a user ``module:attr`` function.

:func:`build_reward_fn` turns a ``RewardConfig`` (plus the extraction mode and the prompt
source) into a callable ``reward_fn(response: str, prompt: Prompt) -> RewardResult``.

Builtins (``reward.function``):

- ``"task"``: extract the answer (:func:`ferrule.rl.tasks.extract_answer`) and score it with
  the prompt source's own verifier (reasoning-gym ``score_answer``; for JSONL, the dataset named
  by ``metadata.source_dataset`` or exact match).
- ``"exact_match"``: extract, then :func:`ferrule.rl.tasks.exact_match` against ``prompt.answer``.

Both add ``format_reward`` when an answer could be extracted (``RewardResult.format_ok``).

**Custom functions** (``"package.module:attr"``) have the signature::

    def my_reward(response: str, prompt: ferrule.rl.tasks.Prompt, **kwargs) -> float | RewardResult

``response`` is the decoded response text without special tokens; ``prompt`` carries
``messages``, ``answer`` (may be None), ``entry`` (the raw record) and ``id``; ``kwargs`` are
``reward.kwargs``. Returning a number means ``correct = reward >= 1`` and ``format_ok`` from the
configured extraction; ``format_reward`` is added in both cases. The function must be
deterministic and thread-safe (it may be called from a worker pool).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferrule.rl.tasks import Prompt, PromptSource, exact_match, extract_answer

#: A score at or above this counts as "correct" (accuracy metric).
CORRECT_THRESHOLD = 1.0 - 1e-9


class RewardError(ValueError):
    """A reward function could not be built or returned an invalid value."""


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response.

    Attributes:
        reward: total scalar reward (verifier score + format reward), finite.
        correct: the verifier score reached 1 (counted in the ``accuracy`` metric).
        format_ok: an answer could be extracted.
        extracted: the extracted answer, or None.
    """

    reward: float
    correct: bool
    format_ok: bool
    extracted: str | None = None


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
    from ferrule.specs import resolve_ref

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


def build_reward_fn(function: str = "task", *, source: PromptSource | None = None,
                    extraction: str = "answer_tag", format_reward: float = 0.0,
                    kwargs: dict[str, Any] | None = None) -> RewardFn:
    """Build ``reward_fn(response, prompt) -> RewardResult``.

    Args:
        function: ``"task"``, ``"exact_match"`` or ``"module:attr"`` (``reward.function``).
        source: the prompt source (its ``score`` is the ``"task"`` verifier).
        extraction: answer extraction mode (``data.answer_extraction``).
        format_reward: added when an answer was extracted (``reward.format_reward``).
        kwargs: passed to a custom function (``reward.kwargs``).

    Raises:
        RewardError: ``"task"`` without a source, or a bad custom function (see
            :func:`load_custom_reward`).
    """
    extract_answer("", extraction)  # validates the mode early (ValueError)
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
                                    out.extracted)
            value = _check_number(out, function)
            ans = extract_answer(response, extraction)
            fmt = ans is not None
            return RewardResult(value + format_reward * fmt, value >= CORRECT_THRESHOLD, fmt, ans)

        return reward_custom

    def reward_builtin(response: str, prompt: Prompt) -> RewardResult:
        ans = extract_answer(response, extraction)
        value = _check_number(score(ans, prompt), function)
        fmt = ans is not None
        return RewardResult(value + format_reward * fmt, value >= CORRECT_THRESHOLD, fmt, ans)

    return reward_builtin


def build_reward_fn_from_config(cfg: Any, source: PromptSource) -> RewardFn:
    """:func:`build_reward_fn` from an ``RLConfig`` (``cfg.reward`` and ``cfg.data``)."""
    return build_reward_fn(cfg.reward.function, source=source, extraction=cfg.data.answer_extraction,
                           format_reward=cfg.reward.format_reward, kwargs=cfg.reward.kwargs)


def score_responses(reward_fn: RewardFn, responses: Sequence[str], prompts: Sequence[Prompt]) -> list[RewardResult]:
    """Rewards of a rollout batch; ``prompts[i]`` is the prompt of ``responses[i]``.

    Raises:
        ValueError: length mismatch.
    """
    if len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses but {len(prompts)} prompts")
    return [reward_fn(r, p) for r, p in zip(responses, prompts)]
