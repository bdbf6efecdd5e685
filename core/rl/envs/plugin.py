"""ferrule's in-tree environments, registered through the same hook an outside package implements
(entry point ``environments`` of the ``ferrule`` group). No import but the specs at call time."""

from __future__ import annotations

from ferrule import hookimpl


@hookimpl
def register_environments():
    from ferrule.contract.specs import EnvironmentSpec

    b = "ferrule.rl.envs.builtin"
    return [EnvironmentSpec(name="tool_arithmetic", factory=f"{b}:ToolArithmetic",
                            description="arithmetic through a calculator or a sandboxed Python tool"),
            EnvironmentSpec(name="guess_number", factory=f"{b}:GuessNumber",
                            description="guess an integer with higher/lower replies (multi-turn)"),
            EnvironmentSpec(name="textarena", factory="ferrule.rl.envs.textarena_games:TextArenaGame",
                            description="a single-player textarena 0.7 game, unmodified (extra: agents)"),
            EnvironmentSpec(name="verifiers", factory="ferrule.rl.envs.verifiers_envs:VerifiersEnv",
                            description="a verifiers 0.4 environment, unmodified (verifiers in its own venv: "
                                        "examples/verifiers/run.sh)")]
