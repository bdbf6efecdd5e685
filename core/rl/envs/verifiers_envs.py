"""``verifiers`` 0.4 (``verifiers.v1``) environments, unmodified, as ferrule environments.

Environment ``verifiers`` with ``environment_kwargs: {taskset: ID, ...}`` (module docstring of
:class:`VerifiersEnv` for the keys). verifiers inverts ferrule's loop: its ``Env.run_episode`` drives
the episode and its harness program (the built-in ``null`` chat loop, or any other) asks for each
model turn over OpenAI's chat-completions API, through verifiers' interception server, which hands
the call to a :class:`verifiers.v1.Client`. This adapter is that client, in-process, and turns the
inversion back into ferrule's ``reset`` / ``step``:

- ``reset(item, seed)`` starts the verifiers episode of the item's task (on one asyncio loop in a
  background thread, inside ``Env.serving()``) and waits for its first model call: the call's
  messages and tools are the initial observation;
- ``step(state, turn)`` answers the pending call with the model's turn (its text and the calls the
  family's tool parser read, as an OpenAI assistant message) and waits for what verifiers does next:
  another model call (its new messages, those after the model's turn, usually ``tool`` or
  ``user`` turns, are the observation) or the end of the episode (the reward: the sum of the
  episode's traces' rewards, verifiers' ``@vf.reward`` functions; numeric metrics go to ``info``).

So the token side is ferrule's own: the model's turns are the ids ferrule's engine sampled, with
their logprobs (loss mask 1), and verifiers' messages are rendered by the family's chat template
(loss mask 0); nothing is re-tokenised from verifiers' text. verifiers' ``Response.tokens`` is left
unset (its trace keeps messages, as for its eval client). A verifiers episode that fails (the harness
exits non-zero, a reward raises, the episode times out) raises in ``reset`` / ``step`` with the
episode's first error: ferrule ends that episode with ``agent.failure_reward`` and one line.

Limits of this adapter: one trainable policy per episode, one model call at a time (an env whose
agents call the model concurrently is refused); a harness that rewrites the conversation instead of
appending to it (compaction) is refused at the rewrite; the chat-completions dialect only (the
``null`` and ``bash`` harnesses; the Anthropic / Responses dialects are refused); ferrule's sampling
settings (``rollout.*``) apply, the env's ``sampling`` is ignored. verifiers pins ``openai<3`` and
pulls many packages: it lives in its own virtual environment (examples/verifiers/run.sh).

Importing this module imports neither torch nor verifiers.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ferrule.rl.envs.base import ModelTurn, Observation, StepResult

__all__ = ["VerifiersEnv"]


def _text(content: Any) -> str:
    """A chat message's content as text (verifiers' content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if isinstance(p, dict) and p.get("type") == "text":
            parts.append(str(p.get("text", "")))
        else:
            raise ValueError(f"message content part {str(p)[:60]!r} is not text; ferrule's verifiers adapter "
                             "handles text messages only")
    return "".join(parts)


def _plain(message: Mapping[str, Any]) -> dict[str, Any]:
    """A verifiers wire message as a chat-template message (text content)."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_call_id", "name")}
    out["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"].get("arguments") or "{}")}}
                             for c in message["tool_calls"]]
    return out


@dataclass
class _Episode:
    """One verifiers episode seen from ferrule: the calls it makes and how it ended."""

    key: str
    events: "queue.Queue[tuple]" = field(default_factory=queue.Queue)
    pending: Any = None  # the asyncio future of the model call waiting for ferrule's turn
    seen: list = field(default_factory=list)  # the conversation ferrule has (wire messages)
    future: Any = None  # concurrent.futures.Future of the episode coroutine
    turns: int = 0
    in_call: bool = False  # a model call of this episode is in progress (set on the loop)
    result: Any = None  # verifiers' Episode, once over


class VerifiersEnv:
    """A verifiers 0.4 environment (module docstring).

    Args:
        taskset: the verifiers taskset id (an importable package exporting a ``vf.Taskset``, e.g.
            ``vf_guess_number``), ``--env.taskset.id`` in verifiers' CLI.
        taskset_kwargs: the taskset's config fields (``--env.taskset.*``).
        env: a verifiers env id to pair with the taskset (``--env.id``); empty: the taskset's own
            ``Env``, else ``SingleAgentEnv``.
        env_kwargs: other env config fields (``--env.*``, e.g. ``{max_guesses: 3}``).
        harness: the harness of every agent seat (``"null"``: verifiers' plain chat loop; quote it in
            YAML, where a bare ``null`` is None). None: verifiers' default (the taskset's bundled
            harness, else ``bash``, which runs the model's shell commands on this host).
        runtime: the runtime of every seat (``subprocess``: on this host, no container; verifiers'
            default is the remote ``prime`` sandbox).
        turn_timeout_s: how long a model call waits for ferrule's turn before it fails (bounds a
            verifiers episode that ferrule stopped driving, e.g. after ``agent.max_turns``).
        model: the model name verifiers records.

    Raises:
        ValueError: verifiers is not installed (names the version and the script), or verifiers refuses
            the config (its message).
    """

    def __init__(self, taskset: str, taskset_kwargs: Mapping[str, Any] | None = None, env: str = "",
                 env_kwargs: Mapping[str, Any] | None = None, harness: str | None = "null", runtime: str = "subprocess",
                 turn_timeout_s: float = 300.0, model: str = "ferrule-policy") -> None:
        try:
            import verifiers.v1 as vf
        except ImportError:
            raise ValueError("environment 'verifiers' needs verifiers 0.4 (pip install 'verifiers==0.4.0'; it pins "
                             "openai<3, so install it in its own virtual environment: examples/verifiers/run.sh)") from None
        self.vf, self.turn_timeout_s, self.model = vf, float(turn_timeout_s), model
        raw: dict[str, Any] = {"taskset": {"id": taskset, **dict(taskset_kwargs or {})}, **dict(env_kwargs or {}),
                               "interception": {"type": "server"}}
        if env:
            raw["id"] = env
        try:
            cls = vf.env_config_type(taskset, env)
            roles = [n for n, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
            for role in roles:
                seat = dict(raw.get(role) or {})
                if harness is not None:
                    seat.setdefault("harness", {"id": harness})
                seat.setdefault("runtime", {"type": runtime})
                raw[role] = seat
            self.config = vf.resolve_env_config(raw)
            self.env = vf.load_environment(self.config)
        except (ImportError, TypeError, AttributeError) as exc:
            raise ValueError(f"verifiers refused taskset={taskset!r} env={env!r}: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 -- pydantic's ValidationError and verifiers' own errors: a config mistake
            raise ValueError(f"verifiers refused taskset={taskset!r} env={env!r}: {' '.join(str(exc).split())[:400]}") from None
        self._tasks: list[Any] | None = None
        self._episodes: dict[str, _Episode] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ the serving loop
    def _start(self) -> asyncio.AbstractEventLoop:
        """The background loop with the env's serving resources (interception server, tools) up, and
        this adapter's client in the server's client cache. Started once, on the first episode."""
        with self._lock:
            if self._loop is not None:
                return self._loop
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ferrule-verifiers", daemon=True).start()
            from contextlib import AsyncExitStack

            stack = AsyncExitStack()

            async def up() -> None:
                await stack.enter_async_context(self.env.serving())
                server = getattr(self.env, "_interception", None)
                if server is None or not isinstance(getattr(server, "clients", None), dict):
                    raise RuntimeError("verifiers' interception server has no client cache (verifiers 0.4.0 has "
                                       "Env._interception.clients); this adapter needs verifiers 0.4")
                server.clients[self._client_config().model_dump_json()] = _make_client(self)

            asyncio.run_coroutine_threadsafe(up(), loop).result(timeout=120)

            def down() -> None:
                try:
                    asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=10)
                except Exception:  # noqa: BLE001 -- best effort at interpreter exit
                    pass

            atexit.register(down)
            self._loop = loop
            return loop

    def _client_config(self) -> Any:
        # a train-type client config: the interception server then asks the client for a whole
        # response (get_response) also for streamed requests, instead of relaying provider bytes
        return self.vf.TrainClientConfig(base_url="http://ferrule.invalid/in-process", api_key_var="FERRULE_UNUSED")

    # ------------------------------------------------------------------ ferrule's contract
    def _task_list(self) -> list[Any]:
        if self._tasks is None:
            ts = self.env.taskset
            self._tasks = list(ts if ts.bounded else ts.take(4096))
            if not self._tasks:
                raise ValueError(f"verifiers taskset {self.config.taskset.id!r} has no tasks")
        return self._tasks

    def dataset(self, size: int, seed: int) -> Sequence[Mapping[str, Any]]:
        """``size`` items ``{"task": k}``, cycling over the taskset's tasks in an order shuffled by ``seed``
        (an infinite taskset: its first 4096 tasks)."""
        import random

        n = len(self._task_list())
        order = list(range(n))
        random.Random(seed).shuffle(order)
        return [{"task": order[i % n]} for i in range(size)]

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        """Start the verifiers episode of the item's task; its first model call is the observation.
        ``seed`` is not used: a verifiers task carries its own data (seeds included, as in verifiers'
        TextArena taskset); the episode's randomness is the model's sampling."""
        loop = self._start()
        task = self._task_list()[int(item["task"])]
        ep = _Episode(key=f"{self.model}#{next(self._ids)}")
        with self._lock:
            self._episodes[ep.key] = ep
        ctx = self.vf.ModelContext(model=ep.key, client=self._client_config())
        ep.future = asyncio.run_coroutine_threadsafe(self.env.run_episode(task, ctx), loop)
        ep.future.add_done_callback(lambda f: ep.events.put(("done", f)))
        messages, tools = self._next_call(ep)
        if messages is None:
            raise RuntimeError(f"the verifiers episode of task {task.data.idx} ended before its first model call "
                               f"(reward {tools:g})")
        ep.seen = messages
        return Observation([_plain(m) for m in messages], tools=tools or None, state=ep)

    def step(self, state: _Episode, turn: ModelTurn) -> StepResult:
        ep = state
        assistant = self._answer(ep, turn)
        messages, tools = self._next_call(ep)
        if messages is None:  # the episode is over
            return StepResult([], float(tools), True, dict(self._info(ep)))
        prefix = ep.seen + [assistant]
        if len(messages) <= len(prefix) or [m.get("role") for m in messages[:len(prefix)]] != [m.get("role") for m in prefix]:
            raise RuntimeError("the verifiers harness sent a conversation that does not extend the previous one "
                               "(compaction or a rewrite); a token-in/token-out episode cannot follow it")
        ep.seen = messages
        return StepResult([_plain(m) for m in messages[len(prefix):]], 0.0, False)

    def end(self, state: Any) -> None:
        """Stop a verifiers episode that ferrule stopped driving (a limit ended it first)."""
        ep = state if isinstance(state, _Episode) else None
        if ep is None:
            return
        with self._lock:
            self._episodes.pop(ep.key, None)
        if ep.future is not None and not ep.future.done():
            ep.future.cancel()

    # ------------------------------------------------------------------ the two sides
    def _answer(self, ep: _Episode, turn: ModelTurn) -> dict[str, Any]:
        """Resolve the pending model call with ``turn``; returns the assistant message verifiers gets."""
        message, finish = self.assistant_message(turn)
        fut, ep.pending = ep.pending, None
        if fut is None:
            raise RuntimeError("no verifiers model call is waiting for this turn")
        self._loop.call_soon_threadsafe(_resolve, fut, (message, finish))
        ep.turns += 1
        from verifiers.v1.dialects.chat import message_to_wire

        return message_to_wire(message)

    def assistant_message(self, turn: ModelTurn) -> tuple[Any, str]:
        """``(verifiers.v1.AssistantMessage, finish_reason)`` of a model turn: the calls the family's tool
        parser read become OpenAI ``tool_calls`` (ids ``call_{turn}_{k}``, arguments as JSON text) with
        the text outside them as content; a turn without calls is its text. A malformed call is not a
        call: verifiers' harness sees the turn's text (and usually ends the exchange)."""
        vf = self.vf
        calls = [vf.ToolCall(id=f"call_{turn.index}_{k}", name=c.name, arguments=json.dumps(c.arguments))
                 for k, c in enumerate(turn.parsed.calls)]
        content = turn.parsed.content if calls else turn.text
        finish = "tool_calls" if calls else ("length" if turn.truncated else "stop")
        return vf.AssistantMessage(content=content, tool_calls=calls or None), finish

    def _next_call(self, ep: _Episode) -> tuple[list | None, Any]:
        """Wait for the episode's next model call ``(messages, tools)`` or its end ``(None, reward)``."""
        kind, *rest = ep.events.get(timeout=self.turn_timeout_s)
        if kind == "call":
            messages, tools, fut = rest
            ep.pending = fut
            return messages, tools
        (f,) = rest
        with self._lock:
            self._episodes.pop(ep.key, None)
        if f.cancelled():
            raise RuntimeError("the verifiers episode was cancelled")
        exc = f.exception()
        if exc is not None:
            raise RuntimeError(f"the verifiers episode raised {type(exc).__name__}: {exc}")
        episode = f.result()
        ep.result = episode
        if episode.errors:
            err = episode.errors[0]
            raise RuntimeError(f"the verifiers episode failed: {err.type}: {' '.join(str(err.message).split())[:300]}")
        for t in episode.traces:
            if not t.ok:
                e = t.errors[0] if getattr(t, "errors", None) else None
                raise RuntimeError("the verifiers episode's run failed"
                                   + (f": {e.type}: {' '.join(str(e.message).split())[:300]}" if e else ""))
        return None, float(sum(t.reward for t in episode.traces))

    def _info(self, ep: _Episode) -> dict[str, float]:
        episode = ep.result
        out: dict[str, float] = {}
        for t in getattr(episode, "traces", []):
            for k, v in (t.metrics or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0.0) + float(v)
            for k, r in (t.rewards or {}).items():
                if r is not None:
                    out[f"reward_{k}"] = out.get(f"reward_{k}", 0.0) + float(r.value)
        return out

    async def _model_call(self, dialect: Any, body: dict, turn: Any) -> Any:
        """The client side (on the loop): hand the call to ferrule, wait for the turn, build the Response."""
        from verifiers.v1.dialects import ChatDialect

        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(f"ferrule's verifiers adapter speaks the chat-completions dialect only, not "
                                      f"{type(dialect).__name__} (use the null or bash harness)")
        key = body.get("model")
        with self._lock:
            ep = self._episodes.get(key)
        if ep is None:
            raise RuntimeError(f"no ferrule episode for model {key!r} (the episode ended)")
        if ep.in_call:
            raise RuntimeError("the verifiers env called the model twice at once; ferrule's adapter runs one "
                               "model call per episode at a time")
        ep.in_call = True
        try:
            return await self._one_call(ep, key, dialect, body, turn)
        finally:
            ep.in_call = False

    async def _one_call(self, ep: _Episode, key: str, dialect: Any, body: dict, turn: Any) -> Any:
        from verifiers.v1.clients.train import serialize_completion, tool_to_wire
        from verifiers.v1.dialects.chat import message_to_wire

        vf = self.vf
        if turn is not None:
            prompt, tools = turn.prompt, turn.tools
        else:
            request = dialect.parse_request(body)
            prompt, tools = request.messages, request.tools
        fut = asyncio.get_running_loop().create_future()
        ep.events.put(("call", [message_to_wire(m) for m in prompt],
                       [tool_to_wire(t) for t in tools] if tools else None, fut))
        message, finish = await asyncio.wait_for(fut, timeout=self.turn_timeout_s)
        response = vf.Response(id=f"ferrule-{key}-{ep.turns}", created=0, model=key, message=message,
                               finish_reason=finish, usage=None)
        response.raw = serialize_completion(response, key)
        return response


def _resolve(fut: Any, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _make_client(adapter: VerifiersEnv) -> Any:
    """A ``verifiers.v1.Client`` whose ``get_response`` is the adapter's model side."""
    vf = adapter.vf

    class FerruleClient(vf.Client):
        async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
            return await adapter._model_call(dialect, body, turn)

    return FerruleClient()
