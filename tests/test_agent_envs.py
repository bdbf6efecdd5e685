"""Agentic RL, host side (issue 42): the environment hook and contract, bounded environment calls,
per-family tool-call parsing, the in-tree environments and the sandboxed Python tool.

Independent references: tool calls are rendered by the family chat templates (Qwen's checked
against HF ``apply_chat_template``, TMLv0's against tml-renderers by their own tests) and parsed
back; the calculator is compared with Python's own arithmetic on the same expressions.
"""

from __future__ import annotations

import threading
import time

import pytest

from ferrule import hookimpl
from ferrule.contract import registry
from ferrule.contract.registry import DuplicateClaimError, Registry, UnknownModelError
from ferrule.rl.envs import ModelTurn, Observation, StepResult
from ferrule.rl.envs.base import check_observation, check_step_result
from ferrule.rl.envs.bounded import HungCalls, call_bounded, call_bounded_all
from ferrule.rl.envs.builtin import GuessNumber, ToolArithmetic, calculate
from ferrule.chat.tool_calls import ParsedTurn, ToolCall, parse_hermes

TIMEOUT_S = 0.3


class _EnvPlugin:
    @hookimpl
    def register_environments(self):
        from ferrule.contract.specs import EnvironmentSpec

        return [EnvironmentSpec(name="echo", factory="ferrule.rl.envs.builtin:GuessNumber")]


class _ParserPlugin:
    @hookimpl
    def register_tool_parsers(self):
        from ferrule.contract.specs import ToolParserSpec

        return [ToolParserSpec(family="*", parse="ferrule.chat.tool_calls:parse_hermes"),
                ToolParserSpec(family="demo", parse="ferrule.tmlv0.tool_calls:parse_tmlv0")]


def _registry_with(*objs) -> Registry:
    pm, _, _ = registry.get_plugin_manager(load_entrypoints=False)
    infos = []
    for name, dist, obj in objs:
        info, failure = registry.register_object(pm, obj, name=name, distribution=dist, version="1.0")
        assert failure is None, failure
        infos.append(info)
    return Registry.build(pm, infos, [])


def test_in_tree_environments_and_tool_parsers_come_through_the_hooks():
    names = [s.name for s in registry.list_environments()]
    assert names == ["guess_number", "textarena", "tool_arithmetic", "verifiers"]
    from ferrule.contract.specs import resolve_ref

    assert isinstance(resolve_ref(registry.get_environment("guess_number").factory)(), GuessNumber)
    assert registry.get_tool_parser("qwen3").parse == "ferrule.chat.tool_calls:parse_hermes"
    for family in ("inkling", "inkling2", "inkling2_text", "inkling2_loop"):  # every TMLv0 family
        assert registry.get_tool_parser(family).parse == "ferrule.tmlv0.tool_calls:parse_tmlv0"
    assert registry.get_tool_parser("no_such_family") is None
    with pytest.raises(UnknownModelError, match="'nope'.*registered: guess_number, textarena, tool_arithmetic, verifiers"):
        registry.get_environment("nope")


def test_environment_names_are_claimed_once():
    reg = _registry_with(("a", "d1", _EnvPlugin()))
    assert list(reg.environments) == ["echo"]
    with pytest.raises(DuplicateClaimError, match="environment 'echo'.*d1.*d2"):
        _registry_with(("a", "d1", _EnvPlugin()), ("b", "d2", _EnvPlugin()))


def test_register_tool_parsers_claims_a_family_once_and_star_is_the_default(monkeypatch):
    reg = _registry_with(("p", "d1", _ParserPlugin()))
    monkeypatch.setattr(registry, "get_registry", lambda: reg)
    assert registry.get_tool_parser("demo").parse.endswith("parse_tmlv0")
    assert registry.get_tool_parser("other").family == "*"
    with pytest.raises(DuplicateClaimError, match=r"tool-call parser for family '\*'.*d1.*d2"):
        _registry_with(("p", "d1", _ParserPlugin()), ("q", "d2", _ParserPlugin()))


@pytest.mark.parametrize("name,kwargs,expected", [
    ("no_module", {}, "agent.environment: environment 'no_module' (factory 'plugin_samples_nowhere:Env' of distribution "
                      "'envs-dist') does not import: ModuleNotFoundError: No module named 'plugin_samples_nowhere'; fix the "
                      "EnvironmentSpec's factory in that package, or reinstall it"),
    ("no_attr", {}, "agent.environment: environment 'no_attr' (factory 'plugin_samples:Nowhere' of distribution "
                    "'envs-dist') does not import: AttributeError: "),
    ("start_fails", {"n": 1}, "agent.environment: environment 'start_fails' (factory 'plugin_samples:StartFails' of "
                              "distribution 'envs-dist') failed to start: plugin_samples:StartFails(**{'n': 1}) raised "
                              "RuntimeError: word list file missing"),
    ("no_step", {}, "returned a NoStep object without reset, step; an environment has dataset(size, seed), "
                    "reset(item, seed) and step(state, turn)"),
    ("dataset_of", {}, "dataset(8, 1) raised OSError: cannot read words.txt"),
    ("dataset_of", {"items": 42}, "dataset(8, 1) returned int; expected a list of data.size items, each a dict"),
    ("dataset_of", {"items": []}, "dataset(8, 1) returned no items; expected a list"),
    ("dataset_of", {"items": [{"a": 1}, 7]}, "dataset(8, 1) returned an item of type int ('7'); each item is a dict"),
    ("guess", {"hihg": 4}, "agent.environment_kwargs: environment 'guess' refused {'hihg': 4}: "
                           "GuessNumber.__init__() got an unexpected keyword argument 'hihg'; "
                           "it accepts: high, turn_penalty, min_reward"),
    ("guess", {"high": 1}, "agent.environment_kwargs: environment 'guess' refused {'high': 1}: guess_number: high=1; "
                           "expected >= 2"),  # a value the factory refuses: no parameter list (the names are right)
])
def test_a_broken_environment_package_is_one_config_line_naming_it_before_any_model_loads(monkeypatch, name, kwargs,
                                                                                           expected):
    """What a user's first environment package gets wrong, each refused at set-up with one line naming the
    environment, its factory and distribution (each of these was a traceback, or blamed
    agent.environment_kwargs for a dataset that returned an int); the user-error table prints it without one."""
    from plugin_samples import BrokenEnvironmentsPlugin
    from ferrule.rl.config_types import ConfigError
    from ferrule.rl.envs.launcher import build_environment
    from ferrule.user_errors import user_error_message

    reg = _registry_with(("envs", "envs-dist", BrokenEnvironmentsPlugin()))
    monkeypatch.setattr(registry, "get_registry", lambda: reg)
    with pytest.raises(ConfigError) as err:
        build_environment(name, kwargs, 8, 1)
    assert len(err.value.problems) == 1 and expected in err.value.problems[0]
    assert "\n" not in user_error_message(err.value)
    env, items = build_environment("dataset_of", {"items": [{"a": 1}]}, 8, 1)  # the control: a working one
    assert items == [{"a": 1}] and env.items == items


def test_an_unknown_environment_names_the_plugins_that_failed_to_load(monkeypatch):
    """A package whose hook is misspelt registers nothing: the unknown-name error says which plugin failed
    and why, not only 'no plugin registers' (it did not before)."""
    from ferrule.contract.registry import LoadFailure

    pm, _, _ = registry.get_plugin_manager(load_entrypoints=False)
    fail = LoadFailure("wordguess", "0.1.0", "wordguess", "validate",
                       "PluginValidationError: unknown hook 'register_environment'", "")
    monkeypatch.setattr(registry, "get_registry", lambda: Registry.build(pm, [], [fail]))
    with pytest.raises(UnknownModelError, match=r"called 'wordguess'; registered: none\. Plugin 'wordguess' of "
                                                r"'wordguess' failed to load \(validate: PluginValidationError: "
                                                r"unknown hook 'register_environment'\)"):
        registry.get_environment("wordguess")


# ------------------------------------------------------------------ bounded calls

def _turn(text: str, calls=(), errors=()) -> ModelTurn:
    return ModelTurn(text=text, parsed=ParsedTurn(text, tuple(calls), tuple(errors)), token_ids=(1,),
                     truncated=False, index=0)


def test_a_crashing_hanging_or_malformed_step_is_an_error_line_not_an_exception():
    def crash(_state, _turn):
        raise RuntimeError("tool backend down")

    def hang(_state, _turn):
        time.sleep(30)

    def malformed(_state, _turn):
        return StepResult([], reward=float("nan"), done=True)

    out = call_bounded(crash, None, None, timeout_s=TIMEOUT_S, what="step 2", check=check_step_result)
    assert out.value is None and out.error == "step 2 raised RuntimeError: tool backend down"
    t0 = time.perf_counter()
    out = call_bounded(hang, None, None, timeout_s=TIMEOUT_S, what="step 3", check=check_step_result)
    assert time.perf_counter() - t0 < 5 * TIMEOUT_S
    assert out.error.startswith("step 3 timed out after 0.3 s")
    out = call_bounded(malformed, None, None, timeout_s=TIMEOUT_S, what="step 4", check=check_step_result)
    assert out.error == "step 4 returned a malformed result: step returned reward nan; expected a finite number"
    out = call_bounded(lambda s, t: {"reward": 1}, None, None, timeout_s=TIMEOUT_S, what="s", check=check_step_result)
    assert "step returned dict; expected ferrule.rl.envs.StepResult" in out.error
    out = call_bounded(lambda: Observation([]), timeout_s=TIMEOUT_S, what="reset", check=check_observation)
    assert out.error == "reset returned a malformed result: reset returned no messages; the episode needs a prompt"
    ok = call_bounded(lambda s, t: StepResult([], 1.0, True), None, None, timeout_s=TIMEOUT_S, what="s",
                      check=check_step_result)
    assert ok.error is None and ok.value.reward == 1.0


def test_calls_that_hang_for_good_are_bounded_in_number_then_refused_until_they_return():
    release = threading.Event()

    def hang(_state, _turn):
        release.wait(60)
        return StepResult([], 1.0, True)

    hung = HungCalls(limit=3)
    calls = [(hang, (None, None), f"step of episode {i}") for i in range(2)]
    first = call_bounded_all(calls, timeout_s=0.1, check=check_step_result, hung=hung)
    assert [o.error.split(" timed out")[0] for o in first] == ["step of episode 0", "step of episode 1"]
    assert hung.running() == 2  # both still run in the background
    second = call_bounded_all(calls, timeout_s=0.1, check=check_step_result, hung=hung)
    assert all("timed out" in o.error for o in second) and hung.running() == 4  # started under the limit
    before = threading.active_count()
    refused = call_bounded_all(calls, timeout_s=0.1, check=check_step_result, hung=hung)
    assert threading.active_count() == before  # no thread started
    assert refused[1].error == ("step of episode 1 not started: 4 earlier environment calls that timed out are "
                                "still running (agent.max_hung_env_calls = 3); the environment hangs: fix it, "
                                "or raise agent.step_timeout_s if it is slow by design")
    release.set()  # the hung calls return: calls start again
    deadline = time.perf_counter() + 10
    while hung.running() and time.perf_counter() < deadline:
        time.sleep(0.01)
    ok = call_bounded_all(calls, timeout_s=5, check=check_step_result, hung=hung)
    assert [o.error for o in ok] == [None, None] and ok[0].value.reward == 1.0
    with pytest.raises(ValueError, match="max_hung_env_calls must be >= 1, got 0"):
        HungCalls(0)


# ------------------------------------------------------------------ tool-call parsers

CALLS = [ToolCall("calculator", {"expression": "12 * (3 + 4)"}), ToolCall("lookup", {"key": "a", "n": [1, 2]})]


def _assistant_turn(template: str, tokenizer, calls, content: str = "") -> str:
    """The text of an assistant turn with ``calls``, as the family's template renders it after the
    generation prompt (the model's side of the conversation), stop token removed."""
    from ferrule.chat import render_chat
    from ferrule.chat.tool_calls import openai_tool_calls

    user = [{"role": "user", "content": "hi"}]
    prefix = render_chat(template, user, add_generation_prompt=True, tokenizer=tokenizer)
    full = render_chat(template, user + [{"role": "assistant", "content": content,
                                          "tool_calls": openai_tool_calls(tuple(calls))}], tokenizer=tokenizer)
    assert full.startswith(prefix)
    return full[len(prefix):]


def test_hermes_parser_reads_what_the_qwen_template_writes_and_reports_malformed_calls():
    turn = _assistant_turn("qwen2_5", None, CALLS, content="Let me compute.").split("<|im_end|>")[0]
    assert turn.count("<tool_call>") == 2
    parsed = parse_hermes(turn)
    assert parsed == ParsedTurn("Let me compute.", tuple(CALLS), ())
    bad = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call> ok '
                       '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": [1]}</tool_call>'
                       '<tool_call>{"name": "calculator"')
    assert bad.calls == () and bad.content == "ok"
    assert [e.split(":")[0] for e in bad.errors] == ["tool call 1", "tool call 2", "tool call 3 (x)", "tool call 4"]
    assert "not valid JSON" in bad.errors[0] and "string \"name\"" in bad.errors[1]
    assert "must be a JSON object" in bad.errors[2] and "not closed" in bad.errors[3]


def test_tmlv0_parser_reads_what_the_tmlv0_template_writes_and_reports_malformed_calls():
    from ferrule.tmlv0.tool_calls import parse_tmlv0

    turn = _assistant_turn("tmlv0", None, CALLS, content="Let me compute.")
    turn = turn.removesuffix("<|content_model_end_sampling|>")
    assert turn.count("<|content_invoke_tool_json|>") == 2
    assert parse_tmlv0(turn) == ParsedTurn("Let me compute.", tuple(CALLS), ())
    bad = parse_tmlv0('<|content_text|>hm<|end_message|><|message_model|>calculator<|content_invoke_tool_json|>'
                      '{"name":"calculator","args":{"expression":<|end_message|>'
                      '<|message_model|>a<|content_invoke_tool_json|>{"name":"b","args":{}}<|end_message|>'
                      '<|message_model|>calculator<|content_invoke_tool_json|>{"name":"calculator"')
    assert bad.calls == () and bad.content == "hm" and len(bad.errors) == 3
    assert "not valid JSON" in bad.errors[0] and "header names 'a' but the JSON names 'b'" in bad.errors[1]
    assert "not closed" in bad.errors[2]


# ------------------------------------------------------------------ in-tree environments

def test_calculator_matches_python_arithmetic_and_refuses_anything_else():
    for expr in ("12 * (3 + 4)", "7 - 10 * 3", "2 ** 10 // 3", "-5 % 3", "1 / 8"):
        want = eval(expr)  # noqa: S307 -- the reference
        assert float(calculate(expr)) == pytest.approx(want, rel=1e-6)
    assert calculate("__import__('os')").startswith("error: Call is not allowed")
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("2 ** 1000").startswith("error: exponent too large")
    assert calculate(None).startswith("error: pass")


def test_tool_arithmetic_runs_calls_answers_errors_and_scores_the_final_answer():
    env = ToolArithmetic(min_value=2, max_value=9, terms=3)
    items = env.dataset(4, seed=3)
    assert items == env.dataset(4, seed=3) and all(float(calculate(i["expression"])) == i["answer"] for i in items)
    obs = env.reset(items[0], seed=0)
    assert obs.tools[0]["function"]["name"] == "calculator" and obs.messages[-1]["content"] == items[0]["question"]
    res = env.step(obs.state, _turn("", calls=[ToolCall("calculator", {"expression": items[0]["expression"]}),
                                               ToolCall("python", {})], errors=["tool call 3: not valid JSON"]))
    assert not res.done and res.reward == 0
    assert [m["content"] for m in res.messages] == [str(items[0]["answer"]), "error: unknown tool 'python'; the only "
                                                    "tool is 'calculator'", "error: tool call 3: not valid JSON"]
    assert all(m["role"] == "tool" for m in res.messages)
    done = env.step(obs.state, _turn(f"The answer is {items[0]['answer']}."))
    assert done.done and done.reward == 1.0 and done.info == {"correct": 1.0, "used_tool": 1.0}
    fresh = env.reset(items[0], seed=0)
    assert env.step(fresh.state, _turn(str(items[0]["answer"]))).reward == 0.5  # right, but no tool used
    assert env.step(env.reset(items[0], 0).state, _turn("no idea")).reward == 0.0
    # demo=True: one worked exchange before the question, whose call the Hermes parser reads back and whose
    # tool reply is the calculator's own answer
    for tool in ("calculator", "python"):
        demo = ToolArithmetic(tool=tool, demo=True).reset(items[0], seed=0).messages
        assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant", "user"]
        parsed = parse_hermes(demo[2]["content"])
        assert not parsed.errors and [c.name for c in parsed.calls] == [tool]
        assert demo[3]["content"] == demo[4]["content"] == "56" == calculate("7 * 8")


def test_guess_number_answers_higher_lower_and_rewards_the_right_guess():
    env = GuessNumber(high=16)
    obs = env.reset({"secret": 11}, seed=0)
    replies = [env.step(obs.state, _turn(t)) for t in ("8", "maybe?", "13", "11")]
    assert [r.messages[0]["content"] if r.messages else None for r in replies] == [
        "8 is wrong: my number is higher.", "Reply with one whole number from 1 to 16.",
        "13 is wrong: my number is lower.", None]
    assert [r.done for r in replies] == [False, False, False, True]
    assert replies[-1].reward == pytest.approx(0.8)  # third guess: 1 - 2 * 0.1


def test_python_tool_prints_and_stops_at_its_time_memory_and_network_limits():
    from ferrule.rl.envs.sandbox import run_python

    assert run_python("print(sum(range(10)))") == "45"
    assert run_python("while True: pass", timeout_s=0.5) == "error: timed out after 0.5 s"
    assert run_python("x = bytearray(512 << 20)", memory_mb=128) == "error: memory limit (128 MiB) exceeded"
    assert "network access is disabled" in run_python("import socket; socket.create_connection(('1.1.1.1', 80))")
    assert run_python("1/0") == "error: ZeroDivisionError: division by zero"


def test_a_textarena_game_runs_unmodified_through_the_adapter():
    ta = pytest.importorskip("textarena", reason="textarena is the optional extra 'agents' (pip install 'ferrule[agents]')")
    from ferrule.rl.envs.textarena_games import TextArenaGame

    env = TextArenaGame("GuessTheNumber-v0")
    (item,) = env.dataset(1, seed=5)
    obs = env.reset(item, seed=0)
    ref = ta.make("GuessTheNumber-v0-raw")  # the reference: the game played directly, same seed, same moves
    ref.reset(num_players=1, seed=item["game_seed"])
    _, ref_obs = ref.get_observation()
    assert obs.messages == [{"role": "user", "content": ref_obs[0][1]}] and "Guess The Number" in ref_obs[0][1]
    target = ref.state.game_state["game_number"]
    moves = ["no idea", f"[{target % 20 + 1}]", f"I guess [{target}]"]
    for k, move in enumerate(moves):
        res = env.step(obs.state, _turn(move))
        done, _ = ref.step(action=move)
        assert res.done == done
        if done:
            rewards, _ = ref.close()
            assert res.reward == rewards[0] == 1 and res.info == {"invalid_move": 0.0, "turn_count": 2.0}
            break
        _, ref_obs = ref.get_observation()
        assert res.messages == [{"role": "user", "content": "\n".join(m for s, m, _ in ref_obs if s != 0)}]
        assert ("invalid move" in res.messages[0]["content"]) == (k == 0)
    assert k == len(moves) - 1
    with pytest.raises(ValueError, match="no textarena environment; did you mean"):
        TextArenaGame("GuessTheNumbr-v0")


def test_an_episode_that_would_outgrow_the_model_context_ends_before_the_turn():
    from ferrule.chat import stop_token_ids, tokenizer_for_template
    from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner
    from ferrule.rollout import GenerateResult, SamplingParams

    tokenizer = tokenizer_for_template("qwen2_5")
    stops = stop_token_ids("qwen2_5", tokenizer)
    turn = tuple(tokenizer.encode("5", add_special_tokens=False)) + (stops[0],)
    seen = []

    class Engine:  # answers "5<|im_end|>" to everything, records the request lengths
        def generate(self, requests, params):
            seen.extend(len(r.prompt_token_ids) for r in requests)
            return [GenerateResult(turn, (-0.5,) * len(turn), "stop", i, 0) for i in range(len(requests))]

    runner = EpisodeRunner(GuessNumber(high=16), "guess_number", "qwen2_5", tokenizer, parse_hermes, stops,
                           EpisodeLimits(max_turns=50, max_episode_tokens=10_000, max_turn_tokens=8), max_context=200)
    (ep,) = runner.run(Engine(), [(0, {"secret": 11})], 1, SamplingParams(), seed=0, step=1)
    assert ep.truncated == "context" and ep.error is None and 2 <= ep.turns < 50
    # every request left room for a full turn, and the trained sequence fits (the last reply, 20 tokens, would
    # have made it 204: it ends the episode without being appended)
    assert max(seen) + 8 <= 200 and len(ep.prompt_ids) + len(ep.response_ids) <= 200
    assert ep.messages[-1] == {"role": "user", "content": "5 is wrong: my number is higher."}


def test_end_is_called_once_per_episode_however_it_ended_and_its_failure_changes_nothing():
    """The optional ``end(state)`` (verifiers' adapter stops a verifiers episode with it): once per episode
    that has a state, after the step's episodes are over, whether the episode ended by ``done``, by
    ``agent.max_turns`` or by a crashing step; an ``end`` that raises leaves the episodes as they were."""
    from ferrule.chat import stop_token_ids, tokenizer_for_template
    from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner
    from ferrule.rollout import GenerateResult, SamplingParams

    tokenizer = tokenizer_for_template("qwen2_5")
    stops = stop_token_ids("qwen2_5", tokenizer)
    turn = tuple(tokenizer.encode("5", add_special_tokens=False)) + (stops[0],)

    class Engine:
        def generate(self, requests, params):
            return [GenerateResult(turn, (-0.5,) * len(turn), "stop", i, 0) for i in range(len(requests))]

    class Ending(GuessNumber):  # item 0: guessed at once; item 1: never (max_turns); item 2: its step crashes
        def __init__(self, fail_end):
            super().__init__(high=16)
            self.ended, self.fail_end = [], fail_end

        def step(self, state, turn):
            if state.secret == 3:
                raise RuntimeError("scorer crashed")
            return super().step(state, turn)

        def end(self, state):
            self.ended.append(state.secret)
            if self.fail_end:
                raise RuntimeError("end failed")

    results = []
    for fail_end in (False, True):
        env = Ending(fail_end)
        runner = EpisodeRunner(env, "guess_number", "qwen2_5", tokenizer, parse_hermes, stops,
                               EpisodeLimits(max_turns=2, max_episode_tokens=1000, max_turn_tokens=8,
                                             step_timeout_s=5.0))
        eps = runner.run(Engine(), [(0, {"secret": 5}), (1, {"secret": 11}), (2, {"secret": 3})], 1, SamplingParams(),
                         seed=0, step=1)
        assert [(e.reward, e.truncated, e.error is None) for e in eps] == [(1.0, "", True), (0.0, "turns", True),
                                                                           (0.0, "", False)]
        assert sorted(env.ended) == [3, 5, 11]
        results.append([(e.response_ids, e.reward, e.error) for e in eps])
    assert results[0] == results[1]


def test_an_observation_or_reply_that_does_not_fit_the_model_fails_or_ends_its_episode_and_nothing_of_it_is_trained():
    """What reaches training from an environment whose texts are too long: an initial observation longer than
    ``data.max_prompt_tokens`` (item 0) or leaving no room in the context for one turn (item 1) fails its
    episode with one line and contributes no ids (its prompt was once trained on anyway, and a run on the
    tiny model crashed in the train engine on 'datum 0: 5019 tokens exceed max_position_embeddings 2048');
    a reply that would pass the context (item 2) ends the episode (``truncated="context"``) without it.
    Reference: the model's context and the limits, counted by hand."""
    from types import SimpleNamespace

    from ferrule.chat import stop_token_ids, tokenizer_for_template
    from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner
    from ferrule.rl.envs.launcher import AgentRollout
    from ferrule.rollout import GenerateResult, SamplingParams

    context, prompt_cap, turn_tokens = 300, 600, 8  # the bare prompt: ~60 tokens (system + user)
    tokenizer = tokenizer_for_template("qwen2_5")
    stops = stop_token_ids("qwen2_5", tokenizer)
    turn = tuple(tokenizer.encode("5", add_special_tokens=False)) + (stops[0],)
    words = lambda n: " ".join(["word"] * n)  # noqa: E731 -- " word" is one token of the Qwen tokenizer

    class Engine:
        def generate(self, requests, params):
            return [GenerateResult(turn, (-0.5,) * len(turn), "stop", i, 0) for i in range(len(requests))]

    class Verbose(GuessNumber):
        def reset(self, item, seed):
            obs = super().reset(item, seed)
            obs.messages[-1]["content"] += " " + words(item["pad"])
            return obs

        def step(self, state, turn):
            res = super().step(state, turn)
            return StepResult([{"role": "user", "content": words(400)}], 0.0, False) if not res.done else res

    runner = EpisodeRunner(Verbose(high=16), "verbose", "qwen2_5", tokenizer, parse_hermes, stops,
                           EpisodeLimits(max_turns=4, max_episode_tokens=10_000, max_turn_tokens=turn_tokens),
                           max_prompt_tokens=prompt_cap, max_context=context)
    rollout = AgentRollout.__new__(AgentRollout)  # the launcher's sample building, without a model or config file
    rollout.cfg = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=1), train=SimpleNamespace(seed=0),
                                  logging=SimpleNamespace(log_samples=0),
                                  agent=SimpleNamespace(environment="verbose", max_failed_steps=3))
    rollout.runner, rollout.failed_steps = runner, []
    prompts = [SimpleNamespace(index=i, entry={"secret": 11, "pad": pad}, id=f"v:{i}")
               for i, pad in enumerate((800, 260, 10))]
    lines = []
    out = rollout.run_step(Engine(), prompts, SamplingParams(), step=1, log=lines.append)
    e0, e1, e2 = out.episodes
    assert "renders to" in e0.error and f"> data.max_prompt_tokens={prompt_cap}" in e0.error
    assert f"leaves no room in the model's context ({context} tokens)" in e1.error
    assert e2.error is None and e2.truncated == "context" and e2.turns == 1
    for s in out.samples:  # every training sequence fits the model
        assert len(s.prompt_ids) + len(s.response_ids) <= context
    assert [len(s.prompt_ids) + len(s.response_ids) for s in out.samples[:2]] == [2, 2]  # one masked id each way
    assert [s.loss_mask for s in out.samples[:2]] == [(0,), (0,)]
    assert [r.error is not None for r in out.rewards] == [True, True, False]
    # the printed lines: one per failed episode, naming the environment, the call, the item and the episode once
    assert lines == [f"step 1: environment 'verbose' reset of item 0 (episode 0): the observation renders to "
                     f"{lines[0].split('renders to ')[1].split()[0]} tokens > data.max_prompt_tokens={prompt_cap}",
                     f"step 1: environment 'verbose' reset of item 1 (episode 0): the observation renders to "
                     f"{lines[1].split('renders to ')[1].split()[0]} tokens, which leaves no room in the model's "
                     f"context ({context} tokens) for a turn of rollout.max_new_tokens={turn_tokens}"]
