"""Guess an integer in [1, high] with higher/lower replies: a verifiers 0.4 (`verifiers.v1`) environment,
written the way `vf init` scaffolds one (a taskset, a task with a `@vf.reward`) plus an `Env` whose
`run()` plays the user turn by turn (the pattern of verifiers' own TextArena taskset). Nothing in it
knows about ferrule."""

import random
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "Guess my number. Answer with one integer only."


def _guess(text: str | None) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


class GuessNumberData(vf.TaskData):
    """One row: the secret number and the range."""

    answer: int
    high: int


class GuessNumberTask(vf.Task[GuessNumberData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        """1 if the last guess is the number, less 0.25 per extra guess (at least 0.25); else 0."""
        guesses = [_guess(m.content) for m in trace.branches[-1].messages
                   if m.role == "assistant"] if trace.branches else []
        if not guesses or guesses[-1] != self.data.answer:
            return 0.0
        return max(0.25, 1.0 - 0.25 * (len(guesses) - 1))


class GuessNumberConfig(vf.TasksetConfig):
    num_tasks: int = 16
    """How many tasks to build."""
    high: int = 4
    """The number lies in [1, high]."""
    seed: int = 0


class GuessNumberEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 3


class GuessNumberEnv(vf.Env[GuessNumberEnvConfig]):
    """The user's side: a wrong guess gets "N is wrong: my number is higher/lower." as the next user turn."""

    async def run(self, task, agents):
        guesses = 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                guesses += 1
                guess = _guess(segment.last_reply)
                if guess == task.data.answer or guesses >= self.config.max_guesses:
                    break
                hint = ("not a number: answer with one integer" if guess is None else
                        f"{guess} is wrong: my number is {'higher' if guess < task.data.answer else 'lower'}.")
                segment = await interaction.turn(hint)
        interaction.trace.record_metric("guesses", float(guesses))


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self) -> list[GuessNumberTask]:
        rng = random.Random(self.config.seed)
        return [GuessNumberTask(GuessNumberData(name=f"guess#{i}", answer=rng.randint(1, self.config.high),
                                                high=self.config.high,
                                                prompt=f"I am thinking of an integer from 1 to {self.config.high}. "
                                                       "What is it?",
                                                system_prompt=SYSTEM_PROMPT),
                                self.config.task)
                for i in range(self.config.num_tasks)]
