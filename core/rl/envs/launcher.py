"""The agentic rollout of ``ferrule train`` (``agent.environment`` set): what replaces the rollout and
score stages of a single-turn step, behind one seam in :meth:`ferrule.rl.loop.GRPOTrainer.train_step`.

- :class:`EnvironmentItems`: the environment's ``dataset(data.size, data.seed)`` as a prompt source,
  so the resumable :class:`~ferrule.rl.tasks.PromptSampler` picks the items of each step (a resumed
  run takes the same items as an uninterrupted one);
- :class:`AgentRollout`: builds the environment (its spec's factory with
  ``agent.environment_kwargs``) and the :class:`~ferrule.rl.envs.episodes.EpisodeRunner`, runs one
  step's episodes and turns them into training samples (one sequence per episode, loss mask 0 on
  environment tokens), rewards, metrics and logged samples.

Episodes never cross a checkpoint: every episode of step ``k`` ends inside step ``k`` (the runner
returns when all are done), so a checkpoint after step ``k`` holds no episode in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence
from ferrule.contract import registry
from ferrule.contract.specs import resolve_ref
from ferrule.rl.envs.bounded import one_line
from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner, episode_metrics
from ferrule.rl.tasks import Prompt

__all__ = ["EnvironmentItems", "AgentRollout", "AgentStep", "build_environment"]

#: The methods every environment object has (:class:`ferrule.rl.envs.Environment`; ``end`` is optional).
CONTRACT_METHODS = ("dataset", "reset", "step")


def _accepted(factory: Any, kwargs: dict[str, Any]) -> str:
    """``"; it accepts: a, b"`` when ``kwargs`` name parameters the factory's signature lacks, else ``""``."""
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return ""
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ""
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if all(k in names for k in kwargs):
        return ""
    return f"; it accepts: {', '.join(names) or 'no keyword arguments'}"


def build_environment(name: str, kwargs: dict[str, Any], size: int, seed: int) -> tuple[Any, list[dict]]:
    """The environment object ``factory(**kwargs)`` of the registered environment ``name`` and its
    ``dataset(size, seed)`` items, checked before any model is loaded.

    Every failure is a one-line :class:`~ferrule.rl.config.ConfigError` that names the environment, the
    factory reference and the distribution that registered it (a broken environment package is the
    user's input, not a ferrule crash): the factory does not import; it refuses ``kwargs`` (``TypeError`` /
    ``ValueError``: ``agent.environment_kwargs``, with the parameters it accepts) or raises anything else;
    the object lacks ``dataset`` / ``reset`` / ``step``; ``dataset`` raises, or returns no items or items
    that are not dicts.

    Raises:
        ferrule.contract.registry.UnknownModelError: ``name`` is not registered.
        ferrule.rl.config.ConfigError: as above.
    """
    from ferrule.rl.config_types import ConfigError

    spec = registry.get_environment(name)
    dist = registry.get_registry().owners.get(("environment", name), "?")
    where = f"environment {name!r} (factory {spec.factory!r} of distribution {dist!r})"
    try:
        factory = resolve_ref(spec.factory)
    except Exception as exc:  # noqa: BLE001 -- an import of the package's module: anything can fail there
        raise ConfigError([f"agent.environment: {where} does not import: {one_line(exc)}; fix the "
                           "EnvironmentSpec's factory in that package, or reinstall it"]) from None
    try:
        env = factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"agent.environment_kwargs: environment {name!r} refused {kwargs}: "
                           f"{one_line(exc, with_type=False)}{_accepted(factory, kwargs)}"]) from None
    except Exception as exc:  # noqa: BLE001 -- the package's constructor failed: one line, not a traceback
        raise ConfigError([f"agent.environment: {where} failed to start: {spec.factory}(**{kwargs}) raised "
                           f"{one_line(exc)}"]) from None
    missing = [m for m in CONTRACT_METHODS if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError([f"agent.environment: {where} returned a {type(env).__name__} object without "
                           f"{', '.join(missing)}; an environment has dataset(size, seed), reset(item, seed) and "
                           "step(state, turn) (ferrule.rl.envs.Environment, docs/agents.md)"])
    call = f"dataset({size}, {seed})"
    try:
        items = env.dataset(size, seed)
    except Exception as exc:  # noqa: BLE001 -- the package's dataset failed: one line, not a traceback
        raise ConfigError([f"agent.environment: {where} {call} raised {one_line(exc)}"]) from None
    try:
        items = list(items)
    except TypeError:
        raise ConfigError([f"agent.environment: {where} {call} returned {type(items).__name__}; expected a list "
                           "of data.size items, each a dict"]) from None
    if not items:
        raise ConfigError([f"agent.environment: {where} {call} returned no items; expected a list of data.size "
                           "items, each a dict"])
    bad = next((i for i in items if not isinstance(i, dict)), None)
    if bad is not None:
        raise ConfigError([f"agent.environment: {where} {call} returned an item of type {type(bad).__name__} "
                           f"({str(bad)[:60]!r}); each item is a dict (it reaches reset as `item`)"])
    return env, items


class EnvironmentItems:
    """The environment's items as a prompt source (``len``, ``[i]``, ``name``) of
    :class:`~ferrule.rl.tasks.Prompt` records (``entry`` = the item, no messages, no answer)."""

    def __init__(self, name: str, items: Sequence[Any]) -> None:
        self.name = f"environment {name}"
        self._prompts = [Prompt(index=i, messages=(), answer=None, entry=dict(it), id=f"{name}:{i}")
                         for i, it in enumerate(items)]

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Any:
        return self._prompts[i]


@dataclass
class AgentStep:
    """One step's agentic rollout: ``samples`` / ``rewards`` (one per episode, group-major),
    ``prompt_ids`` (per item: the first episode's prompt), ``metrics`` (``agent/*``, ``env/*``),
    ``logged`` (``samples.jsonl`` entries), ``episodes`` (the records)."""

    samples: list[Any]
    rewards: list[Any]
    prompt_ids: list[tuple[int, ...]]
    metrics: dict[str, float]
    logged: list[dict[str, Any]]
    episodes: list[Any]

    def model_token_logprobs(self, rollout_lp: Sequence[Any], trainer_lp: Sequence[Any]) -> tuple[list, list]:
        """``rollout_lp`` / ``trainer_lp`` (per sample ``[R]`` tensors, trainer entries may be None) cut to
        the model's tokens (loss mask 1), for the logprob metrics (entropy, train-vs-rollout gap)."""
        import torch

        keep = [torch.as_tensor(s.mask) > 0 for s in self.samples]
        return ([lp[k] for lp, k in zip(rollout_lp, keep)],
                [lp[k] if lp is not None else None for lp, k in zip(trainer_lp, keep)])


class AgentRollout:
    """Environment + episode runner of a run (module docstring).

    Raises:
        ferrule.contract.registry.UnknownModelError: ``agent.environment`` is not registered.
        ferrule.rl.config.ConfigError: (one line each, :func:`build_environment`) the factory does not
            import, refuses ``agent.environment_kwargs`` or raises, the object lacks a contract method,
            or its ``dataset`` raises or is empty / malformed.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg, ag = cfg, cfg.agent
        self.env, items = build_environment(ag.environment, ag.environment_kwargs, cfg.data.size, cfg.data.seed)
        self.source = EnvironmentItems(ag.environment, items)
        self.runner = None
        self.failed_steps: list[int] = []  # the latest consecutive steps whose every episode failed

    def _check_failed_streak(self, step: int, eps: Sequence[Any], failed: Sequence[Any]) -> None:
        """Count the steps in a row whose every episode failed; at ``agent.max_failed_steps`` of them raise
        :class:`~ferrule.rl.envs.base.EnvironmentFailedError` (before the step trains)."""
        from ferrule.rl.envs.base import EnvironmentFailedError

        limit = self.cfg.agent.max_failed_steps
        self.failed_steps = self.failed_steps + [step] if eps and len(failed) == len(eps) else []
        if limit and len(self.failed_steps) >= limit:
            steps = self.failed_steps
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            raise EnvironmentFailedError(
                f"agent.environment {self.cfg.agent.environment!r}: every episode of {span} ended by an environment "
                f"error (agent.max_failed_steps = {limit}); the last: {failed[-1].error}. Fix the environment and "
                "resume the run (ferrule train ... --resume), or raise agent.max_failed_steps")

    def bind(self, family: str, template: Any, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        """Make the episode runner once the template, tokenizer and stop ids exist (the driver's setup)."""
        from ferrule.contract.specs import resolve_ref
        from ferrule.chat.tool_calls import parse_hermes

        ag = self.cfg.agent
        spec = registry.get_tool_parser(family)
        parse = resolve_ref(spec.parse) if spec is not None else parse_hermes
        limits = EpisodeLimits(max_turns=ag.max_turns, max_episode_tokens=ag.max_episode_tokens,
                               max_turn_tokens=self.cfg.rollout.max_new_tokens, step_timeout_s=ag.step_timeout_s,
                               failure_reward=ag.failure_reward, max_hung_env_calls=ag.max_hung_env_calls)
        import json
        from pathlib import Path

        hf = json.loads((Path(self.cfg.model.hf_dir) / "config.json").read_text())
        context = (hf.get("text_config") or hf).get("max_position_embeddings")
        self.runner = EpisodeRunner(self.env, ag.environment, template, tokenizer, parse, stop_ids, limits,
                                    self.cfg.data.chat_template_kwargs, self.cfg.data.max_prompt_tokens,
                                    max_context=int(context) if context else None)

    def run_step(self, engine: Any, prompts: Sequence[Any], params: Any, step: int, log: Any) -> AgentStep:
        """Run the step's episodes (``rollout.n_samples_per_prompt`` per prompt) and build the samples."""
        from ferrule.rl.batch import Sample
        from ferrule.rl.rewards import RewardResult

        n = self.cfg.rollout.n_samples_per_prompt
        eps = self.runner.run(engine, [(p.index, p.entry) for p in prompts], n, params, seed=self.cfg.train.seed,
                              step=step)
        samples, rewards = [], []
        end = self.runner.end_id if self.runner.end_id is not None else 0
        for e in eps:
            if e.response_ids:
                samples.append(Sample(group=e.group, prompt_ids=tuple(e.prompt_ids), response_ids=tuple(e.response_ids),
                                      rollout_logprobs=tuple(e.rollout_logprobs), truncated=bool(e.truncated),
                                      loss_mask=tuple(e.loss_mask),
                                      sampling_logprobs=tuple(e.sampling_logprobs) if e.tempered else None))
            else:  # the environment failed before the model's first turn: one masked token, nothing to train
                samples.append(Sample(group=e.group, prompt_ids=tuple(e.prompt_ids) or (end,), response_ids=(end,),
                                      rollout_logprobs=(0.0,), truncated=False, loss_mask=(0,)))
            rewards.append(RewardResult(reward=float(e.reward), correct=e.reward > 0, format_ok=e.error is None,
                                        score=float(e.reward), error_type="EnvironmentError" if e.error else None,
                                        error=e.error))
        failed = [e for e in eps if e.error]
        for e in failed[:3]:
            log(f"step {step}: {e.error}")  # names the environment, the call, the item and the episode
        if len(failed) > 3:
            log(f"step {step}: {len(failed)} episodes ended by environment errors (agent/env_errors)")
        self._check_failed_streak(step, eps, failed)
        prompt_ids = [samples[g * n].prompt_ids for g in range(len(prompts))]
        logged = [{"step": step, "prompt_id": prompts[e.group].id, "sample": e.sample, "messages": e.messages,
                   "reward": e.reward, "turns": e.turns, "truncated": e.truncated, **({"error": e.error} if e.error else {})}
                  for e in eps[:self.cfg.logging.log_samples]]
        return AgentStep(samples, rewards, prompt_ids, episode_metrics(eps), logged, eps)
