"""Score stage: decoded responses -> rewards (:mod:`ferrule.rl.rewards`).

Input: the reward function, the response texts and each one's prompt. Output: one
:class:`~ferrule.rl.rewards.RewardResult` per response. A sample whose reward function raises
scores ``reward.failure_reward`` and is counted; the first few failures of a run are printed,
with a warning for a step where many failed. A broken reward function is refused before the
first step (:func:`check_reward_functions`: it must score the task's reference answers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence
from ferrule.rl.rewards import check_reward_fn, describe_failure, reward_failure_warning, score_responses

if TYPE_CHECKING:
    from ferrule.rl.config_schema import RLConfig
    from ferrule.rl.tasks import PromptSource
    from ferrule.rl.rewards import RewardFn, RewardResult
    from ferrule.rl.tasks import Prompt

__all__ = ["Scorer", "MAX_SHOWN_REWARD_FAILURES", "check_reward_functions"]

#: Reward-function failures printed per run (every one is counted in the metrics).
MAX_SHOWN_REWARD_FAILURES = 5


class Scorer:
    """Scores responses and prints the first :data:`MAX_SHOWN_REWARD_FAILURES` failures of a run.

    Args:
        failure_reward: the reward of a sample whose reward function raised (``reward.failure_reward``).
        log: prints one line (the driver's console).
    """

    def __init__(self, failure_reward: float, log: Callable[[str], None],
                 max_shown: int = MAX_SHOWN_REWARD_FAILURES) -> None:
        self.failure_reward, self.log, self.max_shown = failure_reward, log, max_shown
        self.shown = 0

    def __call__(self, reward_fn: RewardFn, texts: Sequence[str], prompts: Sequence[Prompt],
                 where: str) -> list[RewardResult]:
        """Rewards of ``texts`` (``texts[i]`` answers ``prompts[i]``); ``where`` names the step in messages
        (and in the warning for a step where many failed, :func:`ferrule.rl.rewards.reward_failure_warning`)."""
        rewards = score_responses(reward_fn, texts, prompts, failure_reward=self.failure_reward)
        warning = reward_failure_warning(rewards, texts, prompts, where)
        if warning:
            self.log(warning)
        for r, text, prompt in zip(rewards, texts, prompts):
            if r.error_type is not None and self.shown < self.max_shown:
                self.shown += 1
                self.log(f"{where}: reward function failed, sample scored {self.failure_reward} "
                         f"({self.shown}/{self.max_shown} shown; all are counted in "
                         f"reward_errors): {describe_failure(r, text, prompt)}")
        return rewards


def check_reward_functions(cfg: RLConfig, pairs: Sequence[tuple[RewardFn | None, PromptSource]], log: Callable[[str], None]) -> None:
    """:func:`ferrule.rl.rewards.check_reward_fn` on each ``(reward_fn, prompt source)`` of ``pairs``
    (train first, then eval; a None function is skipped); prints what the train check found.

    Raises:
        ferrule.rl.rewards.RewardError: a reward function that does not score the reference answers.
    """
    for i, (fn, source) in enumerate(pairs):
        if fn is None:
            continue
        found = check_reward_fn(fn, source, extraction=cfg.data.answer_extraction, function=cfg.reward.function)
        if i == 0 and found.checked:
            log(f"reward check: the reference answers of {len(found.checked)} prompts score correct"
                + "".join(f"; raises on the malformed answer {junk!r} ({err}), such samples score "
                          f"{cfg.reward.failure_reward}" for junk, err in found.raises_on_malformed[:2]))
