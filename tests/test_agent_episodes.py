"""Agentic RL, token side (issue 42): multi-turn episodes on the embedded engine reach the train
engine unchanged, environment tokens get no gradient, and ``ferrule train`` runs the built-in
environments end to end (CI-sized).

The model is a random 2-layer Qwen3 with a character-level tokenizer (as tests/test_rl_e2e.py).
Independent references: the train engine's own forward (megatron) against the rollout engine's
(transformers) logprobs of the sampled tokens, within the tolerance of the single-turn weight-sync
test (1e-5); the ids the engine returned (recorded by a wrapper around ``generate``) against the
model segments of the episode; the parameter gradients of the same datum with the environment
positions' loss inputs replaced by other values (bit-identical) and, as the control, with one model
position's replaced (different).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from transformers import AutoConfig, GenerationMixin, PreTrainedTokenizerFast, Qwen3ForCausalLM  # noqa: F401

from ferrule.rl.envs import Observation, StepResult

SEED = 0
TOL = 1e-5  # tests/test_weight_sync.py: rollout vs train logprobs after a sync
ITEMS, GROUP, TURNS, TURN_TOKENS = 3, 2, 3, 6


def _build_model(out: Path) -> None:
    """test_rl_e2e's tiny Qwen3 and character tokenizer, with room for multi-turn episodes (tools make ~850-token prompts)."""
    from test_rl_e2e import _build_model as build

    build(out, max_position_embeddings=2048)


class CountEnv:
    """Say a number; the environment asks again ("again") until the second turn, which ends the episode
    with reward 1 when it contains a 7. Item 1's second step raises, item 2's never returns in time."""

    def dataset(self, size, seed):
        return [{"k": i} for i in range(size)]

    def reset(self, item, seed):
        return Observation([{"role": "user", "content": f"say {item['k']}"}], state={"k": item["k"]})

    def step(self, state, turn):
        if turn.index == 1 and state["k"] == 1:
            raise RuntimeError("scorer crashed")
        if turn.index == 1 and state["k"] == 2:
            import time
            time.sleep(30)
        if turn.index >= 1:
            return StepResult([], float("7" in turn.text), True, {"said_7": float("7" in turn.text)})
        return StepResult([{"role": "user", "content": "again"}], 0.0, False)


class Recorder:
    """A rollout engine wrapper that keeps every sampled id sequence (the reference for 'never re-tokenised')."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, []

    def generate(self, requests, params):
        out = self.engine.generate(requests, params)
        self.sampled += [tuple(r.token_ids) for r in out]
        return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_tiny") / "model"
    _build_model(out)
    return out


@pytest.fixture(scope="module")
def episodes(hf_dir):
    from ferrule.contract import registry
    from ferrule.chat import stop_token_ids
    from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.chat.tool_calls import parse_hermes
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    template = registry.get_chat_template("qwen3")
    stops = stop_token_ids(template, tokenizer)
    engine = Recorder(EmbeddedEngine(hf_dir=hf_dir))
    runner = EpisodeRunner(CountEnv(), "count", template, tokenizer, parse_hermes, stops,
                           EpisodeLimits(max_turns=TURNS, max_episode_tokens=200, max_turn_tokens=TURN_TOKENS,
                                         step_timeout_s=1.0, failure_reward=-1.0))
    params = SamplingParams(temperature=1.0, max_new_tokens=TURN_TOKENS, stop_token_ids=stops,
                            return_raw_logprobs=True)
    eps = runner.run(engine, [(i, {"k": i}) for i in range(ITEMS)], GROUP, params, seed=SEED, step=1)
    return eps, engine.sampled, tokenizer, stops


def test_tempered_episodes_keep_the_sampling_logprobs_beside_the_untempered(episodes, hf_dir):
    """At temperature 0.7 an episode's model tokens carry the engine's untempered logprobs
    (``rollout_logprobs``) and the tempered ones they were drawn from (``sampling_logprobs``): HF's
    ``log_softmax(logits)`` and ``log_softmax(logits / 0.7)`` of the same ids; environment tokens 0.0."""
    from transformers import AutoModelForCausalLM

    from ferrule.chat.tool_calls import parse_hermes
    from ferrule.rl.envs.episodes import EpisodeLimits, EpisodeRunner
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.contract import registry

    _, _, tokenizer, stops = episodes
    runner = EpisodeRunner(CountEnv(), "count", registry.get_chat_template("qwen3"), tokenizer, parse_hermes, stops,
                           EpisodeLimits(max_turns=TURNS, max_episode_tokens=200, max_turn_tokens=TURN_TOKENS,
                                         step_timeout_s=1.0))
    params = SamplingParams(temperature=0.7, max_new_tokens=TURN_TOKENS, stop_token_ids=stops,
                            return_raw_logprobs=True)
    eps = runner.run(EmbeddedEngine(hf_dir=hf_dir), [(0, {"k": 0}), (1, {"k": 1})], 1, params, seed=SEED, step=1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    checked = 0
    for e in eps:
        assert e.tempered and len(e.sampling_logprobs) == len(e.rollout_logprobs) == len(e.response_ids)
        ids = torch.tensor([list(e.prompt_ids) + list(e.response_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(e.prompt_ids) - 1:-1].double()
        target = ids[0, len(e.prompt_ids):].unsqueeze(1)
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        for got, temp in ((e.rollout_logprobs, 1.0), (e.sampling_logprobs, 0.7)):
            want = torch.log_softmax(logits / temp, -1).gather(1, target)[:, 0]
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64)[mask], want[mask], atol=TOL, rtol=0)
            assert all(x == 0.0 for x, m in zip(got, e.loss_mask) if m == 0)
        checked += int(mask.sum())
    assert checked >= 2 and any(0 in e.loss_mask for e in eps)


def _samples(eps):
    from ferrule.rl.batch import Sample

    return [Sample(group=e.group, prompt_ids=tuple(e.prompt_ids), response_ids=tuple(e.response_ids),
                   rollout_logprobs=tuple(e.rollout_logprobs), truncated=bool(e.truncated),
                   loss_mask=tuple(e.loss_mask)) for e in eps]


def _segments(mask):
    """``[(start, stop, value)]`` runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def test_episodes_keep_the_sampled_ids_mask_environment_turns_and_report_failures(episodes):
    eps, sampled, tokenizer, stops = episodes
    assert [(e.group, e.sample) for e in eps] == [(g, j) for g in range(ITEMS) for j in range(GROUP)]
    model_segments = []
    for e in eps:
        assert len(e.response_ids) == len(e.loss_mask) == len(e.rollout_logprobs)
        for a, b, m in _segments(e.loss_mask):
            if m == 1:
                model_segments.append(tuple(e.response_ids[a:b]))
            else:
                assert all(lp == 0.0 for lp in e.rollout_logprobs[a:b])
                text = tokenizer.decode(e.response_ids[a:b], skip_special_tokens=False)
                # the environment's turn as ChatML writes it after the model's <|im_end|> (which the
                # runner adds, masked, after a turn cut by the per-turn limit)
                closed = e.response_ids[a - 1] in stops
                env_text = text.removeprefix("" if closed else "<|im_end|>")
                if b == len(e.response_ids) and not env_text:
                    continue  # the last turn, closed: no environment turn after it
                assert env_text == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", text
    # every model segment is exactly a sequence the engine sampled (cut only by a turn-token limit)
    assert sorted(model_segments) == sorted(sampled)
    ok, crashed, hung = ([e for e in eps if e.item_index == k] for k in range(3))
    for e in ok:  # two turns, one environment turn between them; reward 1 iff the second says 7
        assert e.error is None and e.turns == 2 and e.reward == float("7" in e.messages[-1]["content"])
    # the run went on: each failed episode has its own error line and failure_reward
    for e in crashed:
        assert e.reward == -1.0 and e.error == ("environment 'count' step 2 of item 1 (episode "
                                                f"{e.sample}) raised RuntimeError: scorer crashed")
    for e in hung:
        assert e.reward == -1.0 and e.error.startswith(f"environment 'count' step 2 of item 2 (episode {e.sample}) "
                                                       "timed out after 1 s")
    from ferrule.rl.envs.episodes import episode_metrics

    m = episode_metrics(eps)
    assert m["agent/env_errors"] == 2 * GROUP and m["agent/turns"] == 2.0
    assert m["agent/turn_truncations"] == pytest.approx(sum(e.turn_truncations for e in eps) / len(eps))


def test_train_engine_logprobs_equal_rollout_logprobs_and_environment_tokens_get_no_gradient(episodes, hf_dir):
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rl.advantages import token_weights
    from ferrule.rl.batch import build_datums, response_slice, sequence_datum

    eps, _, _, _ = episodes
    samples = _samples(eps)
    engine = TrainEngine.from_hf(hf_dir)
    lps = engine.forward_logprobs([sequence_datum(s) for s in samples])
    checked = 0
    for s, lp in zip(samples, lps):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        got = response_slice(lp, s)[mask].double()
        want = torch.tensor(s.rollout_logprobs, dtype=torch.float64)[mask]
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        checked += int(mask.sum())
    assert checked >= ITEMS * GROUP

    # gradients: environment positions contribute nothing (their loss inputs do not matter)
    s = next(x for x in samples if 0 in x.loss_mask)
    w = token_weights([len(s.response_ids)], loss_masks=[s.mask])
    (datum,) = build_datums([s], weights=w, advantages=[1.0], behaviour_logprobs=[torch.tensor(s.rollout_logprobs)],
                            use_tis=True)
    offset = len(datum.loss_fn_inputs["weights"]) - len(s.response_ids)  # the P - 1 prompt positions
    env_pos = [offset + i for i, m in enumerate(s.loss_mask) if m == 0]
    model_pos = offset + s.loss_mask.index(1)
    assert float(datum.loss_fn_inputs["weights"][env_pos].abs().sum()) == 0.0

    def grads(d):
        engine.zero_grad()
        engine.forward_backward([d], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "tis_cap": 2.0})
        return {n: p.main_grad.detach().clone() for n, p in engine.model[0].module.named_parameters()}

    def perturbed(positions):
        from ferrule.megatron.batching import Datum

        inputs = {k: v.clone() for k, v in datum.loss_fn_inputs.items()}
        for key in ("advantages", "logprobs", "rollout_logprobs"):
            inputs[key][positions] = torch.linspace(-3.0, 3.0, len(positions))
        return Datum(datum.model_input, inputs, datum.media)

    base = grads(datum)
    assert any(float(g.abs().sum()) > 0 for g in base.values())
    for name, g in grads(perturbed(env_pos)).items():
        torch.testing.assert_close(g, base[name], atol=0, rtol=0, msg=f"{name}: environment tokens got gradient")
    control = grads(perturbed([model_pos]))
    assert any(not torch.equal(control[n], base[n]) for n in base), "a model position's inputs must matter"


CONFIGS = [pytest.param("smollm2_tool_arithmetic.yaml", [], id="tool_arithmetic"),
           pytest.param("smollm2_guess_number.yaml", [], id="guess_number"),
           # TIS against the tempered sampling distribution (the default tis_behaviour) at temperature 0.8
           pytest.param("smollm2_guess_number.yaml", ["algorithm.use_tis=true", "rollout.temperature=0.8"],
                        id="guess_number_tis_sampled"),
           # a textarena game, unmodified, through the same launcher (the optional extra 'agents')
           pytest.param("smollm2_guess_number.yaml", ["agent.environment=textarena",
                                                      "agent.environment_kwargs={env_id: GuessTheNumber-v0}"],
                        id="textarena")]


def _guess_number_config(hf_dir, run_dir, *extra):
    """guess_number over [1, 2] for 2 steps: the tiny model's random digits win now and then, so groups
    have reward spread and the policy moves (the resume test needs that)."""
    from ferrule.rl.config import load_config

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "examples" / "configs" / "smollm2_guess_number.yaml",
                       [f"model.hf_dir={hf_dir}", f"logging.run_dir={run_dir}", "train.steps=2",
                        "agent.environment_kwargs={high: 2}", "train.prompts_per_step=2",
                        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "rollout.temperature=1.0",
                        "agent.max_turns=2", "optimizer.lr=1e-3", "logging.plot_at_end=false",
                        "checkpoint.interval=100", "train.micro_batch_tokens=4096", "data.max_prompt_tokens=1536",
                        "logging.log_samples=4", *extra])


@pytest.fixture(scope="module")
def guess_number_run(hf_dir, tmp_path_factory):
    """An uninterrupted 2-step guess_number run: ``(trainer, run folder)`` (the example test's
    guess_number case and the resume test's reference)."""
    from ferrule.rl.loop import GRPOTrainer

    run_dir = tmp_path_factory.mktemp("guess") / "full"
    trainer = GRPOTrainer(_guess_number_config(hf_dir, run_dir))
    trainer.run()
    return trainer, run_dir


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config,extra", CONFIGS)
def test_example_configs_train_two_steps_on_the_tiny_model(config, extra, hf_dir, tmp_path, request):
    if "agent.environment=textarena" in extra:
        pytest.importorskip("textarena", reason="textarena is the optional extra 'agents' (pip install 'ferrule[agents]')")
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    root = Path(__file__).resolve().parents[1]
    if config == "smollm2_guess_number.yaml" and not extra:  # the run the resume test compares against
        run_dir = request.getfixturevalue("guess_number_run")[1]
    else:
        run_dir = tmp_path / "run"
        train(load_config(root / "examples" / "configs" / config,
                          [f"model.hf_dir={hf_dir}", f"logging.run_dir={run_dir}", "train.steps=2",
                           "train.prompts_per_step=1", "algorithm.use_tis=false", "rollout.n_samples_per_prompt=2",
                           "rollout.max_new_tokens=8", "agent.max_turns=2", "logging.plot_at_end=false",
                           "checkpoint.enabled=false", "train.micro_batch_tokens=4096", "data.max_prompt_tokens=1536",
                           *extra]))
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2]
    for e in entries:
        assert 1.0 <= e["agent/turns"] <= 2.0 and e["agent/env_errors"] == 0
        assert e["agent/model_tokens"] > 0 and e["agent/env_tokens"] >= 0
        assert abs(e["train_rollout_logprob_abs_diff"]) < 1e-4
        if "rollout.temperature=0.8" in extra:  # weights pi / pi_T of tokens drawn at T=0.8, not ~1
            assert abs(e["tis_weight_mean"] - 1.0) > 1e-3
    logged = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert logged and all(x["messages"][-1]["role"] in ("assistant", "user", "tool") for x in logged)


@pytest.mark.timeout(240)
def test_a_run_whose_every_episode_fails_stops_after_agent_max_failed_steps(hf_dir, tmp_path, monkeypatch):
    """An environment whose every step raises: each step logs its episodes' errors, and after
    agent.max_failed_steps such steps in a row ``ferrule train`` stops with one error line naming the
    environment, the steps, the limit and the last failure (exit code 2, no traceback), before the
    failing step trains; the steps before it are in metrics.jsonl. 0 never stops."""
    from inproc import run_ferrule

    from ferrule.rl.envs import launcher
    from ferrule.rl.envs.builtin import GuessNumber

    class ScorerDown(GuessNumber):
        def step(self, state, turn):
            raise RuntimeError("scorer down")

    real = launcher.build_environment

    def build(name, kwargs, size, seed):
        _, items = real(name, kwargs, size, seed)
        return ScorerDown(**kwargs), items

    monkeypatch.setattr(launcher, "build_environment", build)
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2_guess_number.yaml"
    common = [f"model.hf_dir={hf_dir}", "train.steps=4", "train.prompts_per_step=1", "rollout.n_samples_per_prompt=2",
              "rollout.max_new_tokens=4", "agent.max_turns=2", "logging.plot_at_end=false", "logging.progress=false",
              "checkpoint.enabled=false", "data.max_prompt_tokens=1536"]
    out = run_ferrule(["train", config, *common, f"logging.run_dir={tmp_path / 'a'}", "agent.max_failed_steps=2"])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: agent.environment 'guess_number': every episode of steps 1-2 ended by an "
                           "environment error (agent.max_failed_steps = 2); the last: environment 'guess_number' "
                           "step 1 of item "), last
    assert "raised RuntimeError: scorer down. Fix the environment and resume" in last
    assert [e["step"] for e in _read(tmp_path / "a" / "metrics.jsonl")] == [1]  # step 2 did not train
    never = run_ferrule(["train", config, *common, f"logging.run_dir={tmp_path / 'b'}", "agent.max_failed_steps=0",
                         "train.steps=3"])
    assert never.returncode == 0, never.stderr[-2000:]
    assert [e["agent/env_errors"] for e in _read(tmp_path / "b" / "metrics.jsonl")] == [2.0] * 3


def _read(path):
    from ferrule.rl.metrics import read_metrics

    return read_metrics(path)


TIMING = __import__("re").compile(r"^(time.*|.*_per_s|.*time_s|memory_.*|mfu)$")  # wall-clock, memory: vary run to run


@pytest.mark.timeout(240)
def test_agentic_resume_equals_uninterrupted_run(hf_dir, guess_number_run, tmp_path):
    """A multi-turn run stopped after step 1 (checkpoint written at the boundary; every episode of a step
    ends inside it) and resumed equals the uninterrupted 2-step run bit for bit: every non-timing metric
    (agent/* and env/* included), samples.jsonl, and the final weights."""
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rl.metrics import read_metrics

    plain, full = guess_number_run
    split = tmp_path / "split"
    first = GRPOTrainer(_guess_number_config(hf_dir, split)).run(stop_after=1)
    assert first.interrupted and first.last_step == 1
    assert first.checkpoint == split / "checkpoints" / "step_000001"
    resumed = GRPOTrainer(_guess_number_config(hf_dir, split, "checkpoint.resume=true"))
    second = resumed.run()
    assert second.start_step == 1 and second.last_step == 2 and not second.interrupted

    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    strip = lambda entries: [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in entries]  # noqa: E731
    assert [e["step"] for e in b] == [1, 2]
    assert strip(a) == strip(b)
    assert (full / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
    ref, got = dict(plain.engine.export_hf_state()), dict(resumed.engine.export_hf_state())
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    # the compared runs are not trivially constant: some episodes won, so the policy got a gradient
    assert any(e["reward_group_std_mean"] > 0 and e["grad_norm"] > 0 for e in a), a
