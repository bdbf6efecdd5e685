"""Token-in / token-out episodes: many multi-turn episodes driven against one rollout engine.

An episode is token ids from start to end:

- the **prompt**: the environment's initial observation rendered by the family's chat template
  (``add_generation_prompt=True``, ``tools=`` the observation's tools, ``data.chat_template_kwargs``);
- **model turns**: the ids the rollout engine sampled, exactly as sampled (never decoded and
  re-tokenised), with their rollout logprobs (the engine's untempered ``raw_logprobs`` when it
  returns them), loss mask 1;
- **environment turns**: the step's messages rendered by the same template and appended after
  the model's end-of-turn token (the *delta* of the rendered conversation, see
  :func:`environment_delta`), loss mask 0, logprob 0.

Each round sends the current ids of every live episode to the engine in one ``generate`` call
(``n=1`` each; the embedded engine batches them with continuous batching), then runs every live
episode's ``step`` at once, bounded by one deadline (:func:`ferrule.rl.envs.bounded.call_bounded_all`).
Limits per episode: ``agent.max_turns`` model turns, ``agent.max_episode_tokens`` tokens after the
prompt (model and environment), ``rollout.max_new_tokens`` per model turn. An episode that hits
one of the first two ends with ``truncated`` naming it; a turn that hits the per-turn limit still
goes to the environment (``ModelTurn.truncated``), closed by the template's end-of-turn token with
loss mask 0 (as a turn that a stop string or EOS ended). A failed ``reset`` or ``step`` ends the episode with
``agent.failure_reward`` and its ``error`` line.

The training sequence of an episode is ``prompt_ids + response_ids`` with ``loss_mask`` over
``response_ids`` (:class:`ferrule.rl.batch.Sample`); GRPO groups are the ``n`` episodes of one item.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ferrule.rl.envs.base import ModelTurn, check_observation, check_step_result
from ferrule.rl.envs.bounded import HungCalls, call_bounded_all
from ferrule.chat import render_chat_ids
from ferrule.rollout import GenerateRequest

__all__ = ["EpisodeLimits", "Episode", "EpisodeRunner", "environment_delta", "episode_seed"]


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits (``agent.*``, ``rollout.max_new_tokens``); see the module docstring.

    Attributes:
        max_turns: model turns. max_episode_tokens: tokens after the prompt (model + environment).
        max_turn_tokens: new tokens per model turn. step_timeout_s: seconds per ``reset`` / ``step``
        (one deadline per round). failure_reward: the reward of an episode whose environment failed.
        max_hung_env_calls: calls that timed out and may still run in the background before no further
        call starts (:class:`ferrule.rl.envs.bounded.HungCalls`).
    """

    max_turns: int = 8
    max_episode_tokens: int = 1024
    max_turn_tokens: int = 128
    step_timeout_s: float = 30.0
    failure_reward: float = 0.0
    max_hung_env_calls: int = 64


@dataclass
class Episode:
    """One episode's record.

    Attributes:
        group: the item's position in the step (GRPO group id); sample: its index in the group.
        item_index: the item's index in the environment's dataset.
        prompt_ids: ``[P]`` the rendered initial observation.
        response_ids: ``[R]`` every id after the prompt (model and environment turns).
        loss_mask: ``[R]`` 1 on model tokens, 0 on environment tokens.
        rollout_logprobs: ``[R]`` the engine's logprobs on model tokens, 0.0 on environment tokens.
        sampling_logprobs: ``[R]`` likewise, the logprobs of the distribution the tokens were drawn from
            (the tempered one); ``tempered``: whether they differ from ``rollout_logprobs`` (the engine
            returned raw logprobs: ``rollout.temperature`` != 1).
        messages: the conversation as messages (model turns decoded; for logging only).
        reward: sum of the step rewards (``failure_reward`` after an environment failure).
        turns / tool_calls / tool_errors: counts. turn_truncations: model turns that hit the
            per-turn token limit (the environment still gets them, ``ModelTurn.truncated``).
        truncated: ``""``, ``"turns"``, ``"episode_tokens"`` or ``"context"`` (the limit it hit). error: the
            failure line, or None.
        env_seconds: wall time of this episode's ``reset`` and ``step`` calls.
        info: the numeric ``info`` values of its steps, summed per key.
    """

    group: int
    sample: int
    item_index: int
    prompt_ids: tuple[int, ...] = ()
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    tempered: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    turns: int = 0
    turn_truncations: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: str = ""
    error: str | None = None
    env_seconds: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    done: bool = False
    state: Any = None
    stop_count: int = 0

    @property
    def ids(self) -> tuple[int, ...]:
        """The sequence so far: ``prompt_ids + response_ids``."""
        return tuple(self.prompt_ids) + tuple(self.response_ids)

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None = None,
               sampling_logprobs: Sequence[float] | None = None) -> None:
        """Append ``ids`` to ``response_ids``: model tokens with their untempered and sampling logprobs
        (mask 1), or, without logprobs, environment tokens (mask 0, logprobs 0.0)."""
        n, model = len(ids), logprobs is not None
        self.response_ids += ids
        self.loss_mask += [int(model)] * n
        self.rollout_logprobs += [float(x) for x in logprobs] if model else [0.0] * n
        self.sampling_logprobs += [float(x) for x in sampling_logprobs] if model else [0.0] * n


def episode_seed(seed: int, step: int, item_index: int, sample: int) -> int:
    """The seed ``reset`` gets: ``sha256("ferrule-episode:{seed}:{step}:{item}:{sample}")`` mod 2**31."""
    h = hashlib.sha256(f"ferrule-episode:{seed}:{step}:{item_index}:{sample}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def environment_delta(render: Callable[..., tuple[int, ...]], messages: Sequence[Mapping[str, Any]],
                      new_messages: Sequence[Mapping[str, Any]], stop_ids: frozenset[int], tools: Any) -> tuple[int, ...]:
    """Token ids the chat template writes after the model's end-of-turn token for ``new_messages``.

    ``messages`` ends with the model's turn. Both ``messages`` and ``messages + new_messages``
    (with the generation prompt) are rendered; the delta is what follows the ``c``-th stop token
    of the longer rendering, ``c`` the number of stop tokens in the shorter one (the model turn's
    own end). So the template's separator after a turn (``"\\n"`` after ``<|im_end|>`` in ChatML)
    belongs to the environment turn, and the model's sampled ids are never re-rendered.

    Raises:
        ValueError: the shorter rendering has no stop token, or the longer one fewer of them.
    """
    base = render(list(messages), tools, False)
    full = render(list(messages) + list(new_messages), tools, True)
    count = sum(1 for t in base if t in stop_ids)
    if count == 0:
        raise ValueError("the chat template writes no stop token after an assistant turn; cannot place the "
                         "environment's turn after the model's")
    seen = 0
    for pos, tok in enumerate(full):
        if tok in stop_ids:
            seen += 1
            if seen == count:
                return tuple(full[pos + 1:])
    raise ValueError("the rendered conversation lost an assistant turn's stop token")


class EpisodeRunner:
    """Runs the episodes of one step (module docstring).

    Args:
        env: the environment object (:class:`ferrule.rl.envs.Environment`); name: its name (messages).
        template / tokenizer: the chat template spec and the checkpoint's tokenizer.
        parse: the family's tool parser (``text -> ParsedTurn``).
        stop_ids: the template's stop token ids (a model turn ends with one).
        limits: :class:`EpisodeLimits`. chat_template_kwargs: ``data.chat_template_kwargs``.
        max_prompt_tokens: longest accepted initial observation (longer: the episode fails).
        max_context: the model's context (``max_position_embeddings``), or None: an episode whose
            sequence plus one full turn would not fit ends before the turn, and one whose environment
            reply would not fit ends without it (``truncated="context"``); an initial observation
            that leaves no room for one turn fails the episode. A failed ``reset`` leaves
            ``prompt_ids`` empty, so nothing of a refused observation reaches training.
    """

    def __init__(self, env: Any, name: str, template: Any, tokenizer: Any, parse: Callable[[str], Any],
                 stop_ids: Sequence[int], limits: EpisodeLimits, chat_template_kwargs: Mapping[str, Any] | None = None,
                 max_prompt_tokens: int = 4096, max_context: int | None = None) -> None:
        self.env, self.name, self.template, self.tokenizer, self.parse = env, name, template, tokenizer, parse
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.end_id = int(stop_ids[0]) if stop_ids else None
        self.limits, self.kwargs = limits, dict(chat_template_kwargs or {})
        self.hung = HungCalls(limits.max_hung_env_calls)  # this environment's abandoned calls
        self.kwargs.pop("tools", None)
        self.max_prompt_tokens, self.max_context = max_prompt_tokens, max_context

    # -------------------------------------------------------------- rendering
    def _render(self, messages: list, tools: Any, generation_prompt: bool) -> tuple[int, ...]:
        return render_chat_ids(self.template, self.tokenizer, messages, tools=tools,
                               add_generation_prompt=generation_prompt, **self.kwargs).token_ids

    def _what(self, ep: Episode, call: str) -> str:
        """Names a call in an episode's error line: ``"environment 'x' step 2 of item 7 (episode 0)"``."""
        return f"environment {self.name!r} {call} of item {ep.item_index} (episode {ep.sample})"

    def _fail(self, ep: Episode, error: str) -> None:
        ep.error, ep.reward, ep.done = error, self.limits.failure_reward, True

    # -------------------------------------------------------------- one step's episodes
    def run(self, engine: Any, items: Sequence[tuple[int, Mapping[str, Any]]], n: int, params: Any, *,
            seed: int, step: int) -> list[Episode]:
        """``n`` episodes per ``(item_index, item)``, group-major; returns when all are done.

        Args:
            engine: a rollout engine (``generate(requests, params)``, :mod:`ferrule.rollout`).
            params: :class:`~ferrule.rollout.SamplingParams` of a model turn (``n`` is forced to 1,
                ``max_new_tokens`` to ``limits.max_turn_tokens``, the seed varies per round).
            seed / step: ``train.seed`` and the step (episode seeds and round seeds derive from them).
        """
        import dataclasses

        eps = [Episode(group=g, sample=j, item_index=idx) for g, (idx, _) in enumerate(items) for j in range(n)]
        self._reset_all(eps, [items[e.group][1] for e in eps], seed, step)
        base_seed = params.seed if params.seed is not None else seed
        rnd = 0
        while True:
            live = [e for e in eps if not e.done]
            if not live:
                self._end_all(eps)
                return eps
            p = dataclasses.replace(params, n=1, max_new_tokens=self.limits.max_turn_tokens,
                                    seed=episode_seed(base_seed, step, -1, rnd))
            if self.max_context is not None:
                for e in live:
                    if len(e.prompt_ids) + len(e.response_ids) + self.limits.max_turn_tokens > self.max_context:
                        e.truncated, e.done = "context", True
                live = [e for e in live if not e.done]
                if not live:
                    continue
            self._model_turns(engine, live, p)
            self._env_steps([e for e in live if not e.done])
            rnd += 1

    def _reset_all(self, eps: list[Episode], items: list, seed: int, step: int) -> None:
        calls = [(self.env.reset, (item, episode_seed(seed, step, e.item_index, e.sample)), self._what(e, "reset"))
                 for e, item in zip(eps, items)]
        for e, out in zip(eps, call_bounded_all(calls, timeout_s=self.limits.step_timeout_s, hung=self.hung, check=check_observation)):
            e.env_seconds += out.seconds
            if out.error:
                self._fail(e, out.error)
                continue
            obs = out.value
            e.messages, e.tools, e.state = list(obs.messages), obs.tools, obs.state
            try:
                e.prompt_ids = self._render(e.messages, e.tools, True)
            except Exception as exc:  # noqa: BLE001 -- a message the template refuses is the environment's error
                self._fail(e, f"{self._what(e, 'reset')}: its observation does not render: {exc}")
                continue
            room = self.max_context - self.limits.max_turn_tokens if self.max_context is not None else None
            if len(e.prompt_ids) > self.max_prompt_tokens:
                self._fail(e, f"{self._what(e, 'reset')}: the observation renders to {len(e.prompt_ids)} tokens > "
                              f"data.max_prompt_tokens={self.max_prompt_tokens}")
            elif room is not None and len(e.prompt_ids) > room:
                self._fail(e, f"{self._what(e, 'reset')}: the observation renders to "
                              f"{len(e.prompt_ids)} tokens, which leaves no room in the model's context "
                              f"({self.max_context} tokens) for a turn of rollout.max_new_tokens="
                              f"{self.limits.max_turn_tokens}")
            if e.error is not None:  # nothing of a refused observation is trained on (it may not fit the model)
                e.prompt_ids = ()

    def _end_all(self, eps: list[Episode]) -> None:
        """The environment's optional ``end(state)`` for every episode that has a state, once the step's
        episodes are over (any way: done, a limit, an error), bounded like ``step``. It releases what an
        episode holds (verifiers' adapter stops a verifiers episode that a limit cut short); the episode
        is already scored, so its failures change nothing and are dropped."""
        end = getattr(self.env, "end", None)
        if not callable(end):
            return
        calls = [(end, (e.state,), self._what(e, "end")) for e in eps if e.state is not None]
        if calls:
            call_bounded_all(calls, timeout_s=self.limits.step_timeout_s, hung=self.hung)

    def _model_turns(self, engine: Any, live: list[Episode], params: Any) -> None:
        results = engine.generate([GenerateRequest(e.ids, request_id=f"{e.group}:{e.sample}") for e in live], params)
        for e, r in zip(live, results):
            lps = r.raw_logprobs if r.raw_logprobs is not None else r.logprobs
            ids, lps = list(r.token_ids), list(lps)
            room = self.limits.max_episode_tokens - len(e.response_ids)
            cut = len(ids) > room
            ids, lps = ids[:room], lps[:room]
            e.tempered |= r.raw_logprobs is not None
            e.extend(ids, lps, list(r.logprobs)[:room])
            e.turns += 1
            ended = bool(ids) and ids[-1] in self.stop_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": text})
            if cut:
                e.truncated, e.done = "episode_tokens", True
                continue
            turn_cut = r.finish_reason == "length" and not ended
            e.turn_truncations += turn_cut
            e._turn = ModelTurn(text=text, parsed=self.parse(self.tokenizer.decode(
                ids[:-1] if ended else ids, skip_special_tokens=False)), token_ids=tuple(ids),
                truncated=turn_cut, index=e.turns - 1)  # type: ignore[attr-defined]
            e.tool_calls += len(e._turn.parsed.calls)  # type: ignore[attr-defined]
            e.tool_errors += len(e._turn.parsed.errors)  # type: ignore[attr-defined]
            if not ended and self.end_id is not None:  # the turn limit, a stop string or EOS ended it: close the turn
                e.extend([self.end_id])

    def _env_steps(self, live: list[Episode]) -> None:
        calls = [(self.env.step, (e.state, e._turn), self._what(e, f"step {e.turns}"))  # type: ignore[attr-defined]
                 for e in live]
        outs = call_bounded_all(calls, timeout_s=self.limits.step_timeout_s, hung=self.hung, check=check_step_result)
        for e, out in zip(live, outs):
            e.env_seconds += out.seconds
            if out.error:
                self._fail(e, out.error)
                continue
            res = out.value
            e.reward += float(res.reward)
            for k, v in res.info.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    e.info[k] = e.info.get(k, 0.0) + float(v)
            if res.done:
                e.done = True
                continue
            try:
                delta = environment_delta(self._render, e.messages, res.messages, self.stop_ids, e.tools)
            except Exception as exc:  # noqa: BLE001 -- the environment's messages do not render
                self._fail(e, f"{self._what(e, f'step {e.turns}')}: its messages do not render: {exc}")
                continue
            e.messages.extend(res.messages)
            if len(e.response_ids) + len(delta) >= self.limits.max_episode_tokens:
                e.truncated, e.done = "episode_tokens", True
                continue
            if self.max_context is not None and len(e.prompt_ids) + len(e.response_ids) + len(delta) > self.max_context:
                e.truncated, e.done = "context", True  # the reply would not fit the model: it is not appended
                continue
            e.extend(list(delta))
            if e.turns >= self.limits.max_turns:
                e.truncated, e.done = "turns", True


def episode_metrics(eps: Sequence[Episode]) -> dict[str, float]:
    """Per-step means over episodes: ``agent/turns``, ``agent/tool_calls``, ``agent/tool_errors``,
    ``agent/env_errors`` (count), ``agent/truncated_{turns,episode_tokens,context}`` (fractions of episodes),
    ``agent/turn_truncations`` (per episode: turns cut by the per-turn limit),
    ``agent/env_time_s`` (sum of environment wall time), ``agent/model_tokens``, ``agent/env_tokens``,
    and ``env/<key>`` (the mean of each summed ``info`` key)."""
    import numpy as np

    m = {"agent/turns": float(np.mean([e.turns for e in eps])),
         "agent/tool_calls": float(np.mean([e.tool_calls for e in eps])),
         "agent/tool_errors": float(np.mean([e.tool_errors for e in eps])),
         "agent/env_errors": float(sum(e.error is not None for e in eps)),
         "agent/env_time_s": float(sum(e.env_seconds for e in eps)),
         "agent/model_tokens": float(np.mean([sum(e.loss_mask) for e in eps])),
         "agent/env_tokens": float(np.mean([len(e.loss_mask) - sum(e.loss_mask) for e in eps]))}
    for why in ("turns", "episode_tokens", "context"):
        m[f"agent/truncated_{why}"] = float(np.mean([e.truncated == why for e in eps]))
    m["agent/turn_truncations"] = float(np.mean([e.turn_truncations for e in eps]))
    keys = sorted({k for e in eps for k in e.info})
    for k in keys:
        m[f"env/{k}"] = float(np.mean([e.info.get(k, 0.0) for e in eps]))
    return m
