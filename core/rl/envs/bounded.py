"""Environment calls bounded in time: a slow, hanging or crashing call becomes a per-episode error.

Each call runs in a daemon thread that the caller waits on for at most ``timeout_s``. A call that
does not return in time is abandoned (Python cannot stop a thread: it keeps running in the
background until it returns, and never blocks interpreter exit); its episode ends with the error.
Environments that can block for long (a subprocess, a network service) should bound their own
work too (the sandboxed Python tool kills its subprocess, :mod:`ferrule.rl.envs.sandbox`).

Abandoned calls are bounded in number: a :class:`HungCalls` tracker (one per episode runner,
``agent.max_hung_env_calls``) holds the threads still running past their deadline, and once it holds its
limit, further calls are not started: each becomes an error that names the limit, so an environment that
hangs for good costs that many threads, not one per episode per step for the rest of the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["CallOutcome", "HungCalls", "call_bounded", "call_bounded_all", "one_line"]


def one_line(exc: BaseException, *, with_type: bool = True) -> str:
    """``"Type: message"`` (or the message alone) on one line, whitespace collapsed, cut at 300 characters."""
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if with_type else text


@dataclass(frozen=True)
class CallOutcome:
    """``value`` when the call returned in time, else ``error`` (one line); ``seconds``: wall time."""

    value: Any
    error: str | None
    seconds: float


class HungCalls:
    """The calls that timed out and still run in the background, at most ``limit`` of them.

    Args:
        limit: how many abandoned calls may run at once (>= 1); ``agent.max_hung_env_calls``.

    Raises:
        ValueError: ``limit < 1``.
    """

    def __init__(self, limit: int):
        if int(limit) < 1:
            raise ValueError(f"max_hung_env_calls must be >= 1, got {limit}")
        self.limit = int(limit)
        self._threads: list[threading.Thread] = []

    def running(self) -> int:
        """How many abandoned calls are still running (those that returned since are dropped)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        return len(self._threads)

    def add(self, thread: threading.Thread) -> None:
        self._threads.append(thread)


def call_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str,
                 check: Callable[[Any], Any] | None = None) -> CallOutcome:
    """Run ``fn(*args)`` in a daemon thread for at most ``timeout_s`` seconds.

    Args:
        fn / args: the call.
        timeout_s: seconds to wait (> 0).
        what: names the call in the error (``"environment 'x' step of episode 3"``).
        check: validates the returned value (raises on a malformed one), run in the same thread.

    Returns:
        :class:`CallOutcome`; ``error`` is ``"{what} timed out after {timeout_s} s"``,
        ``"{what} raised {Type}: {message}"`` or ``"{what} returned ...: {contract error}"``. Never raises
        (except KeyboardInterrupt / SystemExit in the waiting thread).
    """
    return call_bounded_all([(fn, args, what)], timeout_s=timeout_s, check=check)[0]


def call_bounded_all(calls: list[tuple[Callable[..., Any], tuple, str]], *, timeout_s: float,
                     check: Callable[[Any], Any] | None = None,
                     hung: HungCalls | None = None) -> list[CallOutcome]:
    """:func:`call_bounded` for several calls at once: all start together (one daemon thread each),
    and all share one deadline ``timeout_s`` seconds after the start, so ``k`` slow tool calls cost
    one timeout, not ``k``. Returns one :class:`CallOutcome` per call, in order.

    ``hung``: the tracker of abandoned calls (module docstring); the calls that time out join it, and
    while it holds its limit no call starts: each gets ``"{what} not started: N earlier calls that timed
    out are still running (agent.max_hung_env_calls = N) ..."`` (0 s)."""
    t0 = time.perf_counter()
    if hung is not None and hung.running() >= hung.limit:
        msg = (f"not started: {hung.running()} earlier environment calls that timed out are still running "
               f"(agent.max_hung_env_calls = {hung.limit}); the environment hangs: fix it, or raise "
               "agent.step_timeout_s if it is slow by design")
        return [CallOutcome(None, f"{what} {msg}", 0.0) for _fn, _args, what in calls]
    boxes: list[dict[str, Any]] = []
    threads = []
    for fn, args, what in calls:
        box: dict[str, Any] = {}

        def run(fn=fn, args=args, box=box) -> None:
            try:
                value = fn(*args)
                box["value"] = check(value) if check is not None else value
            except BaseException as exc:  # noqa: BLE001 -- the environment's failure is data for its episode
                box["exc"] = exc
            box["t"] = time.perf_counter()

        th = threading.Thread(target=run, name=f"ferrule-env: {what}"[:60], daemon=True)
        th.start()
        boxes.append(box)
        threads.append(th)
    out = []
    for (fn, args, what), th, box in zip(calls, threads, boxes):
        th.join(max(0.0, t0 + timeout_s - time.perf_counter()))
        if th.is_alive():
            if hung is not None:
                hung.add(th)
            out.append(CallOutcome(None, f"{what} timed out after {timeout_s:g} s (raise agent.step_timeout_s if "
                                         "the environment is slow by design)", time.perf_counter() - t0))
            continue
        dt = box["t"] - t0
        if "exc" in box:
            exc = box["exc"]
            from ferrule.rl.envs.base import EnvironmentContractError

            contract = isinstance(exc, EnvironmentContractError)
            kind = "returned a malformed result: " if contract else "raised "
            out.append(CallOutcome(None, f"{what} {kind}{one_line(exc, with_type=not contract)}", dt))
        else:
            out.append(CallOutcome(box.get("value"), None, dt))
    return out
