"""The in-tree environments (registered through ``register_environments`` by :mod:`ferrule.rl.envs.plugin`).

- ``tool_arithmetic``: multi-step arithmetic the model should do through a tool: a
  ``calculator`` (a safe expression evaluator over ``+ - * / // % **`` and parentheses) or, with
  ``tool: python``, the sandboxed Python tool (:mod:`ferrule.rl.envs.sandbox`). The episode ends at
  the first turn without a tool call; reward 1 when its last number equals the answer (minus
  ``no_tool_penalty`` when no tool was used), else 0.
- ``guess_number``: guess an integer in ``[1, high]``; each wrong guess is answered "higher" or
  "lower"; reward 1 for the right number (minus ``turn_penalty`` per extra guess), 0 otherwise
  (the episode's turn limit ends it).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ferrule.rl.envs.base import ModelTurn, Observation, StepResult
from ferrule.rl.envs.sandbox import run_python

__all__ = ["ToolArithmetic", "GuessNumber", "calculate", "last_number"]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``"-12"``, ``"3.5"``), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression safely (numbers, ``+ - * / // % **``, unary minus, parentheses).

    Returns:
        the value as text (an integral value without ``.0``), or ``"error: ..."`` naming what is not
        allowed. Never raises.
    """
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large (at most 64)")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")

    if not isinstance(expression, str) or len(expression) > 500:
        return "error: pass {\"expression\": \"...\"} (a string of at most 500 characters)"
    try:
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. '12 * (3 + 4)'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
PYTHON_SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints (no network, limited time and memory).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


@dataclass
class _ArithmeticState:
    answer: float
    tool_calls: int = 0
    tool_errors: int = 0


class ToolArithmetic:
    """Arithmetic through a tool (module docstring).

    Args:
        tool: ``"calculator"`` or ``"python"``.
        min_value / max_value: operand range (ints). terms: operands per question (>= 2).
        no_tool_penalty: subtracted from a correct answer given without any tool call.
        python_timeout_s / python_memory_mb: the Python tool's limits.
        system_prompt: the system message (None: a short default naming the tool and the format).
        demo: put one worked exchange before the question (user question, a tool call, the tool's
            reply, the final number), so a small model sees the format used once (SmolLM2-135M never
            wrote a tool call from the instructions alone).
    """

    def __init__(self, tool: str = "calculator", min_value: int = 10, max_value: int = 99, terms: int = 3,
                 no_tool_penalty: float = 0.5, python_timeout_s: float = 5.0, python_memory_mb: int = 256,
                 system_prompt: str | None = None, demo: bool = False) -> None:
        if tool not in ("calculator", "python"):
            raise ValueError(f"tool_arithmetic: tool={tool!r}; expected 'calculator' or 'python'")
        if terms < 2 or min_value > max_value:
            raise ValueError("tool_arithmetic: need terms >= 2 and min_value <= max_value")
        self.tool, self.lo, self.hi, self.terms = tool, int(min_value), int(max_value), int(terms)
        self.demo = bool(demo)
        self.no_tool_penalty, self.py_timeout, self.py_memory = float(no_tool_penalty), python_timeout_s, python_memory_mb
        arg = "expression" if tool == "calculator" else "code"
        self.system_prompt = system_prompt or (
            f"You can use the {tool} tool. To call it, write <tool_call>{{\"name\": \"{tool}\", \"arguments\": "
            f"{{\"{arg}\": ...}}}}</tool_call>. When you know the result, reply with the final number only.")

    def dataset(self, size: int, seed: int) -> Sequence[Mapping[str, Any]]:
        rng = random.Random(seed)
        items = []
        for _ in range(size):
            nums = [rng.randint(self.lo, self.hi) for _ in range(self.terms)]
            ops = [rng.choice("+-*") for _ in range(self.terms - 1)]
            expr = " ".join(str(nums[0]) if i == 0 else f"{ops[i - 1]} {nums[i]}" for i in range(self.terms))
            items.append({"question": f"What is {expr}?", "expression": expr, "answer": int(calculate(expr))})
        return items

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        demo = []
        if self.demo:
            args = {"expression": "7 * 8"} if self.tool == "calculator" else {"code": "print(7 * 8)"}
            call = json.dumps({"name": self.tool, "arguments": args})
            demo = [{"role": "user", "content": "What is 7 * 8?"},
                    {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                    {"role": "tool", "name": self.tool, "content": "56"},
                    {"role": "assistant", "content": "56"}]
        return Observation([{"role": "system", "content": self.system_prompt}, *demo,
                            {"role": "user", "content": str(item["question"])}],
                           tools=[CALCULATOR_SCHEMA if self.tool == "calculator" else PYTHON_SCHEMA],
                           state=_ArithmeticState(float(item["answer"])))

    def _run_tool(self, name: str, args: Mapping[str, Any]) -> str:
        if name != self.tool:
            return f"error: unknown tool {name!r}; the only tool is {self.tool!r}"
        if self.tool == "calculator":
            return calculate(args.get("expression"))  # type: ignore[arg-type]

        return run_python(args.get("code"), timeout_s=self.py_timeout, memory_mb=self.py_memory)  # type: ignore[arg-type]

    def step(self, state: _ArithmeticState, turn: ModelTurn) -> StepResult:
        p = turn.parsed
        if p.calls or p.errors:
            out = []
            for call in p.calls:
                state.tool_calls += 1
                result = self._run_tool(call.name, call.arguments)
                state.tool_errors += result.startswith("error")
                out.append({"role": "tool", "name": call.name, "content": result})
            for err in p.errors:
                state.tool_errors += 1
                out.append({"role": "tool", "name": self.tool, "content": f"error: {err}"})
            return StepResult(out, 0.0, False, {"tool_calls": len(p.calls), "tool_errors": len(p.errors)})
        got = last_number(p.content or turn.text)
        correct = got is not None and abs(got - state.answer) < 1e-6
        reward = (1.0 - (self.no_tool_penalty if state.tool_calls == 0 else 0.0)) if correct else 0.0
        return StepResult([], reward, True, {"correct": float(correct), "used_tool": float(state.tool_calls > 0)})


@dataclass
class _GuessState:
    secret: int
    guesses: int = 0


class GuessNumber:
    """Guess-the-number with higher/lower replies (module docstring).

    Args:
        high: the secret is in ``[1, high]``. turn_penalty: subtracted per guess after the first
            from the reward of a right guess (floored at ``min_reward``).
    """

    def __init__(self, high: int = 16, turn_penalty: float = 0.1, min_reward: float = 0.2) -> None:
        if high < 2:
            raise ValueError(f"guess_number: high={high}; expected >= 2")
        self.high, self.turn_penalty, self.min_reward = int(high), float(turn_penalty), float(min_reward)

    def dataset(self, size: int, seed: int) -> Sequence[Mapping[str, Any]]:
        rng = random.Random(seed)
        return [{"secret": rng.randint(1, self.high)} for _ in range(size)]

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        prompt = (f"I picked a whole number from 1 to {self.high}. Guess it: reply with one number. "
                  "I will tell you whether my number is higher or lower.")
        return Observation([{"role": "user", "content": prompt}], state=_GuessState(int(item["secret"])))

    def step(self, state: _GuessState, turn: ModelTurn) -> StepResult:
        guess = last_number(turn.text)
        if guess is None or not guess.is_integer():
            return StepResult([{"role": "user", "content": f"Reply with one whole number from 1 to {self.high}."}],
                              0.0, False, {"invalid": 1.0})
        state.guesses += 1
        g = int(guess)
        if g == state.secret:
            reward = max(self.min_reward, 1.0 - self.turn_penalty * (state.guesses - 1))
            return StepResult([], reward, True, {"invalid": 0.0, "solved": 1.0, "guesses": float(state.guesses)})
        hint = "higher" if state.secret > g else "lower"
        return StepResult([{"role": "user", "content": f"{g} is wrong: my number is {hint}."}], 0.0, False,
                          {"invalid": 0.0})
