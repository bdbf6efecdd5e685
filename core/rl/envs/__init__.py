"""Agentic RL: multi-turn environments as plugins, token-in / token-out episodes.

- :mod:`ferrule.rl.envs.base`: the environment contract (``dataset`` / ``reset`` / ``step``).
- :mod:`ferrule.rl.envs.bounded`: each environment call bounded in time; failures are per episode.
- :mod:`ferrule.rl.envs.builtin`: the in-tree environments (``tool_arithmetic``, ``guess_number``).
- :mod:`ferrule.rl.envs.sandbox`: the sandboxed Python tool.
- :mod:`ferrule.rl.envs.plugin`: their registration (``register_environments``).

docs/agents.md describes how to write an environment package.
"""

from ferrule.rl.envs.base import (EnvironmentContractError, Environment, ModelTurn, Observation,  # noqa: F401
                                  StepResult)

__all__ = ["Environment", "EnvironmentContractError", "ModelTurn", "Observation", "StepResult"]
