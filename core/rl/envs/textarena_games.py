"""TextArena (``textarena`` 0.7, optional extra ``agents``) single-player games as ferrule environments.

Environment ``textarena`` with ``environment_kwargs: {env_id: GuessTheNumber-v0, ...}``: the game
runs unmodified; this adapter only translates between its API and the contract of
:mod:`ferrule.rl.envs.base`:

- ``dataset(size, seed)``: ``size`` game seeds (``{"env_id", "game_seed"}``);
- ``reset``: ``textarena.make(env_id)`` (its ``-raw`` variant when registered: observations as
  ``(sender, text, type)`` tuples instead of a wrapper's re-rendered full history, since the chat
  template already keeps the history), ``reset(num_players=1, seed=game_seed)``; the game's prompt
  is the user message;
- ``step``: the model turn's text (special tokens skipped) is the action
  (``env.step(action=...)``); the game's new messages (those not sent by the player) are the next
  user message; when the game is done, ``env.close()``'s reward for player 0 is the episode's
  reward (``info``: ``invalid_move``, ``turn_count`` from the game's info).

Multi-player games need an opponent policy and are refused (``num_players`` must be 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ferrule.rl.envs.base import ModelTurn, Observation, StepResult

__all__ = ["TextArenaGame"]

PLAYER = 0


def _text_of(obs: Any) -> str:
    """The messages of a textarena observation that the player did not send, one per line."""
    if isinstance(obs, str):
        return obs
    return "\n".join(str(msg) for sender, msg, *_ in obs if sender != PLAYER).strip()


@dataclass
class _GameState:
    env: Any


class TextArenaGame:
    """A textarena game (module docstring).

    Args:
        env_id: a textarena environment id (``textarena.envs.registration.ENV_REGISTRY``).
        num_players: must be 1.

    Raises:
        ValueError: textarena is not installed (names the extra), the id is unknown (names a few
            known ones), or ``num_players != 1``.
    """

    def __init__(self, env_id: str = "GuessTheNumber-v0", num_players: int = 1) -> None:
        try:
            import textarena  # noqa: F401
            from textarena.envs.registration import ENV_REGISTRY
        except ImportError:
            raise ValueError("environment 'textarena' needs the textarena package: pip install 'ferrule[agents]' "
                             "(textarena 0.7)") from None
        if num_players != 1:
            raise ValueError(f"num_players={num_players}: only single-player textarena games are supported "
                             "(a multi-player game needs an opponent policy)")
        if env_id not in ENV_REGISTRY:
            import difflib

            near = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=3)
            raise ValueError(f"env_id={env_id!r} is no textarena environment; did you mean {near}?")
        self.env_id = env_id + "-raw" if not env_id.endswith("-raw") and env_id + "-raw" in ENV_REGISTRY else env_id

    def dataset(self, size: int, seed: int) -> Sequence[Mapping[str, Any]]:
        return [{"env_id": self.env_id, "game_seed": seed * 1_000_003 + i} for i in range(size)]

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        import textarena as ta

        env = ta.make(str(item["env_id"]))
        env.reset(num_players=1, seed=int(item["game_seed"]))
        _, obs = env.get_observation()
        return Observation([{"role": "user", "content": _text_of(obs)}], state=_GameState(env))

    def step(self, state: _GameState, turn: ModelTurn) -> StepResult:
        done, _ = state.env.step(action=turn.text)
        if done:
            rewards, game_info = state.env.close()
            info = (game_info or {}).get(PLAYER, {})
            return StepResult([], float((rewards or {}).get(PLAYER, 0.0)), True,
                              {"invalid_move": float(bool(info.get("invalid_move"))),
                               "turn_count": float(info.get("turn_count", 0))})
        _, obs = state.env.get_observation()
        return StepResult([{"role": "user", "content": _text_of(obs) or "(no reply)"}], 0.0, False)
