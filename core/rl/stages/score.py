"""Score stage: decoded responses -> rewards (:mod:`ferrule.rl.rewards`).

Input: the reward function, the response texts and each one's prompt. Output: one
:class:`~ferrule.rl.rewards.RewardResult` per response. A sample whose reward function raises
scores ``reward.failure_reward`` and is counted; the first few failures of a run are printed;
a step where every sample failed raises :class:`~ferrule.rl.rewards.RewardError`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["Scorer", "MAX_SHOWN_REWARD_FAILURES"]

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

    def __call__(self, reward_fn: Any, texts: Sequence[str], prompts: Sequence[Any], where: str) -> list[Any]:
        """Rewards of ``texts`` (``texts[i]`` answers ``prompts[i]``); ``where`` names the step in messages.

        Raises:
            ferrule.rl.rewards.RewardError: every sample's reward function raised.
        """
        from ferrule.rl.rewards import check_reward_failures, describe_failure, score_responses

        rewards = score_responses(reward_fn, texts, prompts, failure_reward=self.failure_reward)
        check_reward_failures(rewards, texts, prompts, where)
        for r, text, prompt in zip(rewards, texts, prompts):
            if r.error_type is not None and self.shown < self.max_shown:
                self.shown += 1
                self.log(f"{where}: reward function failed, sample scored {self.failure_reward} "
                         f"({self.shown}/{self.max_shown} shown; all are counted in "
                         f"reward_errors): {describe_failure(r, text, prompt)}")
        return rewards
