"""The environment contract of agentic RL: what ``ferrule train`` asks of a multi-turn environment.

An environment package registers an :class:`~ferrule.contract.specs.EnvironmentSpec` through the
``register_environments`` hook; its ``factory(**agent.environment_kwargs)`` returns one object
that follows :class:`Environment` and serves every episode of a run (episode state lives in the
``state`` it returns from ``reset``, so one object can serve many episodes at once, from several
threads). The launcher (:mod:`ferrule.rl.envs.episodes`) drives it, gymnasium-style:

1. ``dataset(size, seed)`` once: the run's items (JSON-like dicts); GRPO groups are episodes of
   one item.
2. ``reset(item, seed)`` per episode: the initial observation (chat messages, the tools to
   declare, the episode's state).
3. ``step(state, turn)`` after each model turn: the next observation (messages appended to the
   conversation, usually ``tool`` or ``user`` turns), the reward of the step, whether the episode
   is over, and info (numbers are averaged into the step's metrics as ``env/<key>``).

4. ``end(state)``, optional: once per episode that has a state, after all the step's episodes are
   over (by ``done``, a limit or an error), bounded like ``step``; it releases what the episode
   holds (the verifiers adapter stops a verifiers episode that a limit cut short). Its failures
   are dropped: the episode is already scored.

The episode's reward is the sum of its step rewards. Each ``reset`` / ``step`` call is bounded by
``agent.step_timeout_s`` (:mod:`ferrule.rl.envs.bounded`): a call that raises, hangs or returns
something malformed ends that episode with ``agent.failure_reward`` and a one-line error in the
episode's record; the run goes on.

Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from ferrule.chat.tool_calls import ParsedTurn

__all__ = ["Observation", "StepResult", "ModelTurn", "Environment", "EnvironmentContractError",
           "EnvironmentFailedError", "check_observation", "check_step_result"]


class EnvironmentContractError(ValueError):
    """An environment returned something the contract does not allow (the message names what)."""


class EnvironmentFailedError(RuntimeError):
    """Every episode of ``agent.max_failed_steps`` consecutive steps ended by an environment error: the
    run stops (a user error: ``ferrule train`` prints it on one line, exit code 2) instead of training
    on batches that carry no signal. The message names the environment, the steps, the limit and the
    last error; the run's last checkpoint stays, to resume from once the environment is fixed."""


@dataclass
class Observation:
    """What ``reset`` returns.

    Attributes:
        messages: the conversation so far (OpenAI / HF chat messages: ``{"role", "content"}``),
            rendered with the family's chat template and ``add_generation_prompt=True``.
        tools: JSON-schema tool declarations (``{"type": "function", "function": {...}}``) the
            template declares, or None.
        state: the episode's own state, passed back to every ``step`` (any object).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    state: Any = None


@dataclass
class StepResult:
    """What ``step`` returns.

    Attributes:
        messages: the environment's next turn(s), appended after the model's turn (``tool`` or
            ``user`` messages; empty when ``done``). Rendered through the chat template; their
            tokens get loss mask 0.
        reward: this step's reward (float); the episode's reward is the sum.
        done: the episode is over.
        info: per-step facts; numeric values are averaged over the step's episodes into the
            metrics as ``env/<key>``.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelTurn:
    """One model turn, as the environment sees it.

    Attributes:
        text: the turn decoded without special tokens (what a user would read).
        parsed: the family's tool parser's reading (:mod:`ferrule.chat.tool_calls`), from the turn
            decoded with special tokens kept and its stop token removed.
        token_ids: the sampled ids ``[T]`` (stop token included), exactly as generated.
        truncated: the turn hit ``rollout.max_new_tokens`` without a stop token.
        index: 0-based turn number in the episode.
    """

    text: str
    parsed: ParsedTurn
    token_ids: tuple[int, ...]
    truncated: bool
    index: int


@runtime_checkable
class Environment(Protocol):
    """The object an :class:`~ferrule.contract.specs.EnvironmentSpec` factory returns (module docstring)."""

    def dataset(self, size: int, seed: int) -> Sequence[Mapping[str, Any]]:
        """``size`` items (JSON-like dicts), deterministic in ``seed``."""

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        """The initial observation of an episode on ``item``; ``seed`` is the episode's own."""

    def step(self, state: Any, turn: ModelTurn) -> StepResult:
        """React to the model's turn (``state`` is ``Observation.state`` of this episode)."""


def _check_messages(messages: Any, what: str) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise EnvironmentContractError(f"{what}.messages must be a list of chat messages "
                                       f"({{'role': ..., 'content': ...}}); got {str(messages)[:80]!r}")


def check_observation(obs: Any) -> Observation:
    """``obs`` if it is a well-formed :class:`Observation` with at least one message.

    Raises:
        EnvironmentContractError: naming what is wrong.
    """
    if not isinstance(obs, Observation):
        raise EnvironmentContractError(f"reset returned {type(obs).__name__}; expected ferrule.rl.envs.Observation")
    _check_messages(obs.messages, "Observation")
    if not obs.messages:
        raise EnvironmentContractError("reset returned no messages; the episode needs a prompt")
    return obs


def check_step_result(res: Any) -> StepResult:
    """``res`` if it is a well-formed :class:`StepResult` (a finite float reward; messages unless done).

    Raises:
        EnvironmentContractError: naming what is wrong.
    """
    import math

    if not isinstance(res, StepResult):
        raise EnvironmentContractError(f"step returned {type(res).__name__}; expected ferrule.rl.envs.StepResult")
    _check_messages(res.messages, "StepResult")
    if isinstance(res.reward, bool) or not isinstance(res.reward, (int, float)) or not math.isfinite(res.reward):
        raise EnvironmentContractError(f"step returned reward {res.reward!r}; expected a finite number")
    if not res.done and not res.messages:
        raise EnvironmentContractError("step returned no messages and done=False; the model would have "
                                       "nothing to answer (return done=True or an observation)")
    if not isinstance(res.info, dict):
        raise EnvironmentContractError(f"step returned info of type {type(res.info).__name__}; expected a dict")
    return res
