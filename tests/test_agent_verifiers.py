"""verifiers 0.4 environments through ferrule's adapter (issue 42; ``ferrule.rl.envs.verifiers_envs``).

verifiers pins ``openai<3`` and is not in ferrule's test environment: these tests run in the virtual
environment that examples/verifiers/run.sh makes (``$FERRULE_VF_VENV/bin/python -m pytest -n 0
tests/test_agent_verifiers.py``) and skip elsewhere, except the one that checks the refusal without it (run everywhere, verifiers hidden).
The environment is examples/verifiers/vf_guess_number under verifiers' own ``null`` harness (its chat
program, a uv script, in the ``subprocess`` runtime: the first run fetches its packages from PyPI).

Independent reference: verifiers' own record of the episode (the ``Episode`` its ``run_episode``
returns: the trace's conversation, its ``@vf.reward`` scores and metrics) and the taskset's task data,
against what ferrule's side saw (observations, reward, info).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from ferrule.rl.envs import ModelTurn
from ferrule.chat.tool_calls import parse_hermes

HAVE_VF = importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec("vf_guess_number") is not None


def _turn(text: str, index: int) -> ModelTurn:
    return ModelTurn(text=text, parsed=parse_hermes(text), token_ids=(1, 2), truncated=False, index=index)


def test_without_verifiers_the_environment_names_the_package_and_the_script(monkeypatch):
    from ferrule.rl.envs.verifiers_envs import VerifiersEnv

    # verifiers made unimportable (None in sys.modules), so the refusal is checked in every environment
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ValueError, match=r"needs verifiers 0\.4 .*examples/verifiers/run\.sh"):
        VerifiersEnv(taskset="vf_guess_number")


@pytest.fixture(scope="module")
def env():
    if not HAVE_VF:
        pytest.skip("verifiers 0.4 / the example taskset are not installed here (verifiers pins openai<3); these "
                    "tests run in the venv examples/verifiers/run.sh makes")
    from ferrule.rl.envs.verifiers_envs import VerifiersEnv

    return VerifiersEnv(taskset="vf_guess_number", taskset_kwargs={"num_tasks": 4, "high": 4},
                        env_kwargs={"max_guesses": 3})


@pytest.mark.timeout(600)
def test_a_verifiers_episode_runs_unmodified_and_matches_verifiers_own_record(env):
    """Two wrong guesses (one not a number), then the right one: ferrule's observations are the env's own
    prompts and replies, the reward and metrics are those verifiers recorded, and verifiers' trace holds
    exactly the conversation ferrule saw."""
    items = env.dataset(3, seed=0)
    assert len(items) == 3 and len({i["task"] for i in items}) == 3
    task = env._task_list()[items[0]["task"]]
    answer = task.data.answer
    obs = env.reset(items[0], seed=0)
    assert obs.messages == [{"role": "system", "content": task.data.system_prompt},
                            {"role": "user", "content": task.data.prompt}] and obs.tools is None
    wrong = answer % 4 + 1
    seen = list(obs.messages)
    for k, text in enumerate([f"Is it {wrong}?", "no idea", str(answer)]):
        res = env.step(obs.state, _turn(text, k))
        seen.append({"role": "assistant", "content": text})
        if k == 0:
            hint = "higher" if wrong < answer else "lower"
            assert res.messages == [{"role": "user", "content": f"{wrong} is wrong: my number is {hint}."}]
        if k == 1:
            assert res.messages == [{"role": "user", "content": "not a number: answer with one integer"}]
        assert res.done == (k == 2)
        seen += res.messages
    assert res.reward == 0.5 and res.info == {"guesses": 3.0, "reward_solved": 0.5}
    (trace,) = obs.state.result.traces
    assert trace.reward == res.reward and trace.metrics["guesses"] == 3.0
    recorded = [{"role": m.role, "content": m.content} for m in trace.branches[-1].messages]
    assert recorded == seen


@pytest.mark.timeout(600)
def test_a_failing_verifiers_episode_is_an_error_and_end_stops_a_cut_episode(env):
    """A model turn that would never finish (ferrule stopped driving: ``end``) cancels verifiers' episode;
    a dead episode's next ``step`` raises one line (ferrule turns it into the episode's error)."""
    items = env.dataset(2, seed=1)
    obs = env.reset(items[1], seed=0)
    ep = obs.state
    env.end(ep)
    assert ep.future.cancelled() or ep.future.done()
    with pytest.raises(RuntimeError, match="no verifiers model call is waiting|cancelled|failed"):
        env.step(ep, _turn("1", 0))


def test_tool_calls_reach_the_harness_as_openai_tool_calls(env):
    """A Qwen-style ``<tool_call>`` turn becomes the chat.completion the harness's OpenAI SDK reads: the
    same tool name and arguments (the openai package's own parser as the reference), finish reason
    ``tool_calls``; a plain turn is its text."""
    import openai.types.chat as oai
    from verifiers.v1 import Response
    from verifiers.v1.clients.train import serialize_completion

    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": [3, "x"]}}\n</tool_call>'
    message, finish = env.assistant_message(_turn(text, 4))
    raw = serialize_completion(Response(id="r", created=0, model="m", message=message, finish_reason=finish), "m")
    got = oai.ChatCompletion.model_validate(raw).choices[0]
    (call,) = got.message.tool_calls
    assert got.finish_reason == "tool_calls" and got.message.content == "Let me add."
    assert call.id == "call_4_0" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": [3, "x"]}
    message, finish = env.assistant_message(_turn("just 7", 0))
    assert finish == "stop" and message.content == "just 7" and message.tool_calls is None
