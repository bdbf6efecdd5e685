from vf_guess_number.taskset import GuessNumberEnv, GuessNumberTaskset

__all__ = ["GuessNumberTaskset", "GuessNumberEnv"]
