"""Each stage of the GRPO step on its own (ferrule.rl.stages), with fake engines: what goes in,
what comes out, checked against numbers computed here by hand (hashlib, numpy)."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrule.rl.config import ConfigError, config_from_dict
from ferrule.rl.distributed import RankRoles
from ferrule.rollout import GenerateResult
from ferrule.rl.stages import advantages, checkpoint, record, rollout, score, sync, train

ONE_PROCESS = RankRoles(0, 1, (0,))
SEED, STEP, N = 3, 4, 2


def _cfg(*overrides: str):
    return config_from_dict({}, list(overrides), validate=False)


def _shard_seed(index: int) -> int:
    salt = "rollout" if index == 0 else f"rollout.{index}"
    return int.from_bytes(hashlib.sha256(f"ferrule-{salt}:{SEED}:{STEP}".encode()).digest()[:8], "big") % 2**63


class _Engine:
    """Records generate calls; returns ``n`` one-token samples per request."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params):
        self.calls.append((requests, params))
        return [GenerateResult(token_ids=(9,), logprobs=(-0.5,), finish_reason="stop", prompt_index=i,
                               sample_index=j, request_id=r.request_id)
                for i, r in enumerate(requests) for j in range(params.n)]


def _prompt(i, answer="a"):
    return SimpleNamespace(id=f"p{i}", index=i, answer=answer, messages=({"role": "user", "content": str(i)},),
                           media_dir="")


# ------------------------------------------------------------------ rollout

def test_rollout_runs_seeded_shards_and_numbers_results_by_prompt():
    cfg = _cfg(f"train.seed={SEED}", f"rollout.n_samples_per_prompt={N}")
    params = rollout.sampling_params(cfg, (7,), (), n=N, temperature=1.0, max_new_tokens=5, seed=None)
    engine, prompts = _Engine(), [_prompt(i) for i in range(5)]
    ids = [(1, i) for i in range(5)]
    media = {"p3": {"vision": ["img"]}}
    out = rollout.generate_rollouts(ONE_PROCESS, engine, params, seed=SEED, prompts_per_shard=2, step=STEP,
                                    prompts=prompts, prompt_ids=ids, media=lambda p: media.get(p.id))
    assert [[r.prompt_token_ids for r in reqs] for reqs, _ in engine.calls] == [ids[0:2], ids[2:4], ids[4:5]]
    assert [p.seed for _, p in engine.calls] == [_shard_seed(k) for k in range(3)]
    assert [r.media for r in engine.calls[1][0]] == [None, {"vision": ["img"]}]
    assert [(r.prompt_index, r.sample_index) for r in out] == [(i, j) for i in range(5) for j in range(N)]


def test_greedy_sampling_drops_top_p_and_top_k():
    cfg = _cfg("rollout.top_p=0.9", "rollout.top_k=20")
    greedy = rollout.sampling_params(cfg, (7, 8), ("</s>",), n=1, temperature=0.0, max_new_tokens=3, seed=11)
    assert (greedy.top_p, greedy.top_k, greedy.stop_token_ids, greedy.stop, greedy.seed) == (1.0, -1, (7, 8),
                                                                                             ("</s>",), 11)
    sampled = rollout.sampling_params(cfg, (), (), n=1, temperature=0.7, max_new_tokens=3, seed=None)
    assert (sampled.top_p, sampled.top_k) == (0.9, 20)


def test_prompt_renderer_caches_and_refuses_long_prompts(monkeypatch):
    rendered = []
    monkeypatch.setattr(rollout, "prompt_token_ids", lambda t, tok, m, kw: rendered.append(m) or (1, 2, 3))
    r = rollout.PromptRenderer(None, None, (), {}, _cfg("data.max_prompt_tokens=3").data)
    assert r.ids(_prompt(0), "train") == r.ids(_prompt(0), "train") == (1, 2, 3)
    assert len(rendered) == 1
    short = rollout.PromptRenderer(None, None, (), {}, _cfg("data.max_prompt_tokens=2").data)
    with pytest.raises(ConfigError, match="data.max_prompt_tokens: prompt 'p0' renders to 3 tokens > 2"):
        short.ids(_prompt(0), "train")


# ------------------------------------------------------------------ score

def test_scorer_gives_failures_the_failure_reward_and_shows_the_first_few():
    from ferrule.rl.rewards import RewardResult

    def fn(text, prompt):
        if text == "bad":
            raise ZeroDivisionError("no")
        return RewardResult(1.0, True, True, text)

    lines = []
    scorer = score.Scorer(0.25, lines.append, max_shown=1)
    out = scorer(fn, ["ok", "bad", "bad"], [_prompt(0), _prompt(1), _prompt(2)], "step 1")
    assert [r.reward for r in out] == [1.0, 0.25, 0.25]
    assert [r.error_type for r in out] == [None, "ZeroDivisionError", "ZeroDivisionError"]
    shown = [ln for ln in lines if not ln.startswith("WARNING")]
    assert len(shown) == 1 and shown[0].startswith("step 1: reward function failed, sample scored 0.25 (1/1 shown")
    lines.clear()
    assert [r.reward for r in scorer(fn, ["bad", "bad"], [_prompt(0), _prompt(1)], "step 2")] == [0.25, 0.25]
    assert len(lines) == 1 and lines[0].startswith("WARNING step 2: the reward function raised on 2 of 2 samples")


# ------------------------------------------------------------------ advantages

def test_samples_take_raw_logprobs_and_advantages_normalize_each_group():
    results = [GenerateResult((5, 6), (-1.0, -2.0), "length", 0, 0, raw_logprobs=(-0.1, -0.2)),
               GenerateResult((5,), (-3.0,), "stop", 0, 1),
               GenerateResult((7,), (-4.0,), "stop", 1, 0),
               GenerateResult((8,), (-5.0,), "stop", 1, 1),
               GenerateResult((9,), (-6.0,), "stop", 1, 2)]
    samples = advantages.build_samples([(1, 2), (3,)], results, [None, {"audio": [0]}])
    assert [(s.group, s.prompt_ids, s.response_ids, s.rollout_logprobs, s.truncated) for s in samples[:2]] == [
        (0, (1, 2), (5, 6), (-0.1, -0.2), True), (0, (1, 2), (5,), (-3.0,), False)]
    assert samples[2].media == {"audio": [0]} and samples[0].media is None
    # tempered sampling (raw logprobs returned): the logprobs the tokens were drawn from stay beside
    assert samples[0].sampling_logprobs == (-1.0, -2.0) and samples[1].sampling_logprobs is None
    rewards = [SimpleNamespace(reward=v) for v in (1.0, 0.0, 2.0, 0.0, 1.0, 3.0)]
    six = samples + [samples[-1]]
    algo = _cfg("algorithm.advantage_eps=0.0").algorithm
    adv = advantages.group_advantages(six, rewards, algo, group_size=3)
    expected = []
    for g in (np.array([1.0, 0.0, 2.0]), np.array([0.0, 1.0, 3.0])):
        expected += list((g - g.mean()) / g.std(ddof=1))
    np.testing.assert_allclose(adv.values, expected, rtol=1e-12)
    assert adv.rewards == [1.0, 0.0, 2.0, 0.0, 1.0, 3.0] and adv.trainable == [True] * 6


# ------------------------------------------------------------------ train

class _TrainEngine:
    """forward_backward returns per-position logprobs ``-0.5`` for every datum; records the batches."""

    def __init__(self):
        self.batches, self.steps, self.forward_calls = [], 0, 0

    def forward_logprobs(self, datums):
        self.forward_calls += 1
        return [torch.full((len(d.model_input),), -0.25) for d in datums]

    def forward_backward(self, datums, loss_fn, loss_cfg):
        self.batches.append((len(datums), loss_fn))
        return SimpleNamespace(metrics={"loss:sum": float(len(datums)), "tokens:count": 1.0},
                               loss_fn_outputs=[{"logprobs": torch.full((len(d.model_input),), -0.5)} for d in datums])

    def optim_step(self):
        self.steps += 1
        return {"grad_norm": float(self.steps), "learning_rate": 0.1 * self.steps, "success": self.steps != 2}


def _samples(groups=4, n=2):
    from ferrule.rl.batch import Sample

    return [Sample(group=g, prompt_ids=(1, 2), response_ids=(3, 4, 5), rollout_logprobs=(-1.0, -1.0, -1.0),
                   truncated=False) for g in range(groups) for _ in range(n)]


def test_train_stage_steps_once_per_minibatch_of_whole_groups_and_measures_ppo_kl():
    cfg = _cfg("train.optim_steps_per_rollout=2", "rollout.n_samples_per_prompt=2")
    samples, engine = _samples(), _TrainEngine()
    rollout_lp = [torch.tensor(s.rollout_logprobs) for s in samples]
    out = train.train_policy(engine, samples, [0.5, -0.5] * 4, rollout_lp, cfg=cfg, reference=None,
                             roles=ONE_PROCESS, num_groups=4)
    assert engine.batches == [(4, "ppo"), (4, "ppo")] and engine.forward_calls == 1 and out.need_old
    assert (out.grad_norms, out.learning_rates, out.skipped) == ([1.0, 2.0], [0.1, 0.2], 1)
    assert out.sums == [{"loss:sum": 4.0}, {"loss:sum": 4.0}]
    d = -0.25 - -0.5  # log(p_old / p_cur) on every response token
    assert out.ppo_kl == pytest.approx(math.exp(d) - 1 - d, rel=1e-12)
    assert all(torch.equal(lp, torch.full((3,), -0.25)) for lp in out.trainer_logprobs)  # the old logprobs


def test_train_stage_uses_rollout_logprobs_when_one_step_needs_no_old_ones():
    cfg = _cfg("train.optim_steps_per_rollout=1", "algorithm.use_tis=false")
    samples, engine = _samples(groups=2), _TrainEngine()
    rollout_lp = [torch.tensor(s.rollout_logprobs) for s in samples]
    out = train.train_policy(engine, samples, [0.0] * 4, rollout_lp, cfg=cfg, reference=None, roles=ONE_PROCESS,
                             num_groups=2)
    assert engine.forward_calls == 0 and engine.batches == [(4, "ppo")] and not out.need_old
    d = -1.0 - -0.5
    assert out.ppo_kl == pytest.approx(math.exp(d) - 1 - d, rel=1e-12)
    assert all(torch.equal(lp, torch.full((3,), -0.5)) for lp in out.trainer_logprobs)  # from the first fb


class _CategoricalEngine:
    """A one-position policy ``pi = softmax(z)`` over ``V`` tokens behind the train-engine calls: each datum
    is one response token ``y``; ``forward_backward`` runs the real ``ferrule.losses`` loss on
    ``log pi(y)`` and accumulates ``sum_y p(y) * grad loss_y`` into ``z.grad`` (``p``: the sampling
    distribution, so the gradient is the update's expectation over the samples)."""

    def __init__(self, z, p):
        self.z, self.p = z.detach().clone().requires_grad_(True), p

    def _lp(self, d):
        return torch.log_softmax(self.z, -1)[int(d.loss_fn_inputs["target_tokens"][-1])].reshape(1)

    def forward_logprobs(self, datums):
        return [self._lp(d).detach() for d in datums]

    def forward_backward(self, datums, loss_fn, loss_cfg):
        from ferrule import losses as L

        outs = []
        for d in datums:
            loss, _ = L.get_loss(loss_fn)(self._lp(d), d.loss_fn_inputs, loss_cfg)
            (self.p[int(d.loss_fn_inputs["target_tokens"][-1])] * loss.sum()).backward()
            outs.append({"logprobs": self._lp(d).detach()})
        return SimpleNamespace(metrics={"loss:sum": 0.0}, loss_fn_outputs=outs)

    def optim_step(self):
        return {"grad_norm": 0.0, "learning_rate": 0.0, "success": True}


@pytest.mark.parametrize("behaviour", ["untempered", "sampled"])
def test_tis_against_the_sampled_distribution_makes_the_tempered_update_the_untempered_policy_gradient(behaviour):
    """Tokens drawn at temperature T train the untempered policy pi. The expected update over
    ``y ~ pi_T`` is, per position, ``-(1/V) sum_y pi_T(y) A(y) (e_y - pi)`` with TIS against the
    untempered logprobs (biased: with a constant ``A`` it is ``-(A/V)(pi_T - pi)``, not 0), and
    ``-(1/V) sum_y pi(y) A(y) (e_y - pi)``, the on-policy gradient of pi, with ``tis_behaviour=sampled``
    (weights ``pi / pi_T``, none past tis_cap here). Reference: the closed forms in float64 numpy."""
    from ferrule.rl.batch import Sample

    V, T = 6, 0.8
    g = torch.Generator().manual_seed(SEED)
    z = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    pi, pi_t = torch.softmax(z, -1).numpy(), torch.softmax(z / T, -1).numpy()
    assert (pi / pi_t).max() < 2.0  # below tis_cap: the weights are exact
    cfg = _cfg("algorithm.use_tis=true", f"algorithm.tis_behaviour={behaviour}", "train.optim_steps_per_rollout=1",
               "algorithm.loss_aggregation=token_mean")
    samples = [Sample(group=0, prompt_ids=(0,), response_ids=(y,), rollout_logprobs=(math.log(pi[y]),),
                      sampling_logprobs=(math.log(pi_t[y]),), truncated=False) for y in range(V)]
    for adv in (np.full(V, -0.5), torch.randn(V, generator=g, dtype=torch.float64).numpy()):
        engine = _CategoricalEngine(z, torch.from_numpy(pi_t))
        train.train_policy(engine, samples, list(adv), [torch.tensor(s.rollout_logprobs) for s in samples],
                           cfg=cfg, reference=None, roles=ONE_PROCESS, num_groups=1)
        weight = pi if behaviour == "sampled" else pi_t
        want = -sum(weight[y] * adv[y] * (np.eye(V)[y] - pi) for y in range(V)) / V
        np.testing.assert_allclose(engine.z.grad.numpy(), want, atol=1e-8, rtol=1e-6)  # datum inputs are fp32
    const = -0.5 * ((pi_t - pi) if behaviour == "untempered" else np.zeros(V)) / V
    engine = _CategoricalEngine(z, torch.from_numpy(pi_t))
    train.train_policy(engine, samples, [-0.5] * V, [torch.tensor(s.rollout_logprobs) for s in samples], cfg=cfg,
                       reference=None, roles=ONE_PROCESS, num_groups=1)
    np.testing.assert_allclose(engine.z.grad.numpy(), -const, atol=1e-8)
    if behaviour == "untempered":
        assert np.abs(const).max() > 1e-4  # the bias is far above the fp32 noise


# ------------------------------------------------------------------ sync

@pytest.mark.parametrize("lora", [None, "adapter"])
def test_sync_sends_the_adapter_alone_for_lora_and_every_weight_otherwise(monkeypatch, lora):
    import ferrule.sync as fsync
    from ferrule.rl import distributed as rl_dist

    calls = []
    monkeypatch.setattr(fsync, "sync_weights", lambda e, r, version, check_equal, settings=None: calls.append(
        ("weights", version, check_equal)) or "w-stats")
    monkeypatch.setattr(fsync, "sync_lora_adapter", lambda e, r, version, check_equal: calls.append(
        ("adapter", version, check_equal)) or "a-stats")
    monkeypatch.setattr(rl_dist, "fan_out_rollout_weights", lambda roles, r, v: calls.append(("fan weights", v)))
    monkeypatch.setattr(rl_dist, "fan_out_lora_adapter",
                        lambda roles, r, v, check_equal: calls.append(("fan adapter", v)))
    stats, seconds = sync.sync_policy(SimpleNamespace(lora=lora, step=6), object(), ONE_PROCESS, check_equal=True)
    kind = "adapter" if lora else "weights"
    assert calls == [(kind, 6, True), (f"fan {kind}", 6)]
    assert stats == ("a-stats" if lora else "w-stats") and seconds >= 0


# ------------------------------------------------------------------ record

def test_train_metrics_average_the_optimizer_steps():
    lp = [torch.tensor([-1.0, -3.0]), torch.tensor([-2.0])]
    outcome = train.TrainOutcome(sums=[{"loss:sum": 2.0}, {"loss:sum": 4.0}], grad_norms=[1.0, 3.0],
                                 learning_rates=[0.1, 0.2], skipped=1, ppo_kl=0.01,
                                 trainer_logprobs=[torch.tensor([-1.5, -3.0]), None], need_old=True, seconds=1.0)
    adv = advantages.Advantages([1.0, 0.0], [True, True], np.array([0.7, -0.7]))
    m = record.train_step_metrics(outcome, lp, adv, group_size=2, use_tis=False)
    assert (m["loss"], m["kl"], m["grad_norm"], m["lr"], m["skipped_optim_steps"]) == (3.0, 0.01, 2.0, 0.2, 1)
    assert m["entropy"] == pytest.approx(2.0) and m["train_rollout_logprob_abs_diff"] == pytest.approx(0.25)
    assert m["advantage_abs_mean"] == pytest.approx(0.7) and m["zero_std_group_fraction"] == 0.0


def test_throughput_and_logged_samples():
    samples = _samples(groups=1)  # 2 samples, 3 response tokens, num_tokens 4
    t = record.throughput_metrics(samples, t_rollout=2.0, t_train=5.0, t_sync=1.0)
    assert (t["rollout_tokens_per_s"], t["train_tokens_per_s"]) == (3.0, 2.0)
    results = [GenerateResult((1,), (-1.0,), "stop", 0, j) for j in range(2)]
    rewards = [SimpleNamespace(extracted="4", reward=1.0, score=1.0, correct=True, error_type=None, error=None),
               SimpleNamespace(extracted=None, reward=0.0, score=None, correct=False, error_type="KeyError",
                               error="x")]
    out = record.logged_samples(7, [_prompt(0, answer="4")], results, ["four", "?"], rewards, [0.5, -0.5], limit=5)
    assert out[0] == {"step": 7, "prompt_id": "p0", "sample": 0, "response": "four", "answer": "4", "extracted": "4",
                      "reward": 1.0, "score": 1.0, "correct": True, "advantage": 0.5}
    assert out[1]["reward_error"] == "KeyError: x"
    assert len(record.logged_samples(7, [_prompt(0)], results, ["a", "b"], rewards, [0, 0], limit=1)) == 1


def test_truncate_samples_keeps_the_steps_up_to_the_resume_point(tmp_path):
    record.append_samples(tmp_path, [{"step": s, "i": s} for s in (1, 2, 3)])
    record.truncate_samples(tmp_path, 2)
    lines = (tmp_path / record.SAMPLES_FILE).read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2]


# ------------------------------------------------------------------ checkpoint

class _CkptEngine:
    def __init__(self):
        self.step, self.loaded = 5, []

    def save(self, path):
        path.mkdir(parents=True)
        (path / "weights").write_text("w")

    def load(self, path):
        self.loaded.append(path)
        return {"settings_changed": {}}


class _Sampler:
    def __init__(self):
        self.state = None

    def state_dict(self):
        return {"pos": 3}

    def load_state_dict(self, state):
        self.state = state


def test_checkpoints_keep_the_newest_and_resume_from_the_last(tmp_path):
    cfg = _cfg("checkpoint.keep=2")
    engine, sampler = _CkptEngine(), _Sampler()
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(engine, ONE_PROCESS, tmp_path, step, sampler=sampler, cfg=cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    state = json.loads((tmp_path / "step_000003" / "loop_state.json").read_text())
    assert (state["step"], state["sampler"], state["engine_step"], state["world_size"]) == (3, {"pos": 3}, 5, 1)
    assert state["config"] == cfg.to_dict()
    fresh, log = _Sampler(), []
    assert checkpoint.resume_point(engine, fresh, cfg, tmp_path, log.append) == 3
    assert fresh.state == {"pos": 3} and engine.loaded == [tmp_path / "step_000003" / "engine"]
    with pytest.raises(ConfigError, match="optimizer.lr: checkpointed run has"):
        checkpoint.resume_point(engine, _Sampler(), _cfg("checkpoint.keep=2", "optimizer.lr=0.5"), tmp_path, log.append)


def test_resume_without_a_checkpoint_starts_at_step_zero(tmp_path):
    log = []
    assert checkpoint.resume_point(_CkptEngine(), _Sampler(), _cfg(), tmp_path, log.append) == 0
    assert "no complete checkpoint" in log[0]


# ------------------------------------------------------------------ overlong filtering and dynamic sampling

def _sample(length, truncated, group=0):
    from ferrule.rl.batch import Sample

    return Sample(group=group, prompt_ids=(1,), response_ids=tuple(range(2, 2 + length)),
                  rollout_logprobs=(-1.0,) * length, truncated=truncated)


def test_overlong_penalty_is_dapo_soft_punishment_added_before_the_group_normalization():
    # max_new_tokens 10, buffer 4, penalty 0.5: 0 up to 6 tokens, then -0.5 * (len - 6) / 4; truncated: -0.5
    algo = _cfg("algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=4", "algorithm.overlong_penalty=0.5",
                "algorithm.advantage_eps=0.0").algorithm
    samples = [_sample(5, False), _sample(7, False), _sample(9, False), _sample(10, True)]
    rewards = [SimpleNamespace(reward=v) for v in (1.0, 1.0, 0.0, 1.0)]
    adv = advantages.group_advantages(samples, rewards, algo, group_size=4, max_new_tokens=10)
    assert adv.penalties == [0.0, -0.125, -0.375, -0.5]
    r = np.array([1.0, 0.875, -0.375, 0.5])
    np.testing.assert_allclose(adv.values, (r - r.mean()) / r.std(ddof=1), rtol=1e-12)
    assert adv.rewards == r.tolist() and adv.trainable == [True] * 4
    assert advantages.overlong_penalty(10, True, max_new_tokens=10, buffer_tokens=0, penalty=1.0) == -1.0
    assert advantages.overlong_penalty(10, False, max_new_tokens=10, buffer_tokens=0, penalty=1.0) == 0.0
    m = record.train_step_metrics(train.TrainOutcome([{"loss:sum": 0.0}], [1.0], [0.1], 0, 0.0, [None] * 4, False, 1.0),
                                  [torch.tensor(s.rollout_logprobs) for s in samples], adv, 4, use_tis=False)
    assert m["overlong_penalty_mean"] == pytest.approx(-0.25)


class _WeightEngine(_TrainEngine):
    def forward_backward(self, datums, loss_fn, loss_cfg):
        self.weights = [d.loss_fn_inputs["weights"] for d in datums]
        return super().forward_backward(datums, loss_fn, loss_cfg)


def test_overlong_mask_leaves_truncated_samples_out_of_the_group_and_the_loss():
    algo = _cfg("algorithm.overlong=mask", "algorithm.advantage_eps=0.0").algorithm
    samples = [_sample(3, True), _sample(2, False), _sample(4, False)]
    rewards = [SimpleNamespace(reward=v) for v in (1.0, 0.0, 1.0)]
    adv = advantages.group_advantages(samples, rewards, algo, group_size=3, max_new_tokens=3)
    assert adv.trainable == [False, True, True] and adv.penalties == []
    s = math.sqrt(0.5)  # std(ddof=1) of [0, 1]
    np.testing.assert_allclose(adv.values, [0.0, -0.5 / s, 0.5 / s], rtol=1e-12)
    engine = _WeightEngine()
    cfg = _cfg("rollout.n_samples_per_prompt=3", "rollout.max_new_tokens=3", "algorithm.use_tis=false")
    train.train_policy(engine, samples, adv.values, [torch.tensor(x.rollout_logprobs) for x in samples], cfg=cfg,
                       reference=None, roles=ONE_PROCESS, num_groups=1, trainable=adv.trainable)
    w = [x[-len(s_.response_ids):] for x, s_ in zip(engine.weights, samples)]
    assert torch.equal(w[0], torch.zeros(3))  # token_mean over the 6 tokens of the two kept samples
    assert all(torch.allclose(x, torch.full_like(x, 1 / 6)) for x in w[1:])


@pytest.mark.parametrize("overrides, message", [
    (("algorithm.overlong_buffer_tokens=4",), "used only with algorithm.overlong=penalty"),
    (("algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=256"), "must be in [0, rollout.max_new_tokens"),
    (("algorithm.overlong=penalty", "algorithm.overlong_penalty=-1"), "algorithm.overlong_penalty: must be >= 0"),
    (("algorithm.dynamic_sampling_max_rounds=0",), "algorithm.dynamic_sampling_max_rounds: must be >= 1"),
])
def test_filter_settings_are_checked(overrides, message):
    from ferrule.rl.config_checks import _algorithm_problems

    problems = _algorithm_problems(_cfg(*overrides))
    assert len(problems) == 1 and message in problems[0]


def test_overlong_mode_is_one_of_keep_mask_penalty():
    with pytest.raises(ConfigError, match="algorithm.overlong"):
        _cfg("algorithm.overlong=cut")


class _PromptCounter:
    def __init__(self):
        self.position = 0

    def next_batch(self, k):
        out = [_prompt(i) for i in range(self.position, self.position + k)]
        self.position += k
        return out

    def state_dict(self):
        return {"cursor": self.position}


def _dynamic_trainer(*overrides):
    """A GRPOTrainer with fake engines: prompt i's n samples score ``i % 3 == 0`` (all equal: 0) or
    their sample index (spread) — every third prompt's group is uninformative."""
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rl.rewards import RewardResult

    t = object.__new__(GRPOTrainer)
    t.cfg = _cfg(f"train.seed={SEED}", "train.prompts_per_step=3", f"rollout.n_samples_per_prompt={N}",
                 "algorithm.dynamic_sampling=true", *overrides)
    t.roles, t.sampler, t.rollout, t._media_cache = ONE_PROCESS, _PromptCounter(), _Engine(), {}
    t.prompts = SimpleNamespace(ids=lambda p, kind: (1, p.index))
    t.stop_ids, t.stop_strings, t.engine, t.synced_version = (7,), (), SimpleNamespace(step=5), 5
    t.rollout_lock = threading.RLock()
    t.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "x")
    t.score = score.Scorer(0.0, lambda line: None)
    counter = iter(range(10**6))
    t.reward_fn = lambda text, p: RewardResult(0.0 if p.index % 3 == 0 else float(next(counter) % N), False, True,
                                               None)
    return t


def test_dynamic_sampling_drops_zero_variance_groups_and_refills_with_new_seeds():
    t = _dynamic_trainer()
    batch = t.produce(STEP)
    m = batch.selection
    # round 0: prompts 0,1,2 (0 flat); round 1: 3,4,5 (3 flat) -> kept 1,2,4 in arrival order
    assert [p.index for p in batch.prompts] == [1, 2, 4] and t.sampler.position == 6
    assert [r.prompt_index for r in batch.results] == [0, 0, 1, 1, 2, 2]
    assert m == {"dynamic_sampling_rounds": 2, "dynamic_sampling_kept_groups": 3,
                 "dynamic_sampling_dropped_groups": 2, "dynamic_sampling_filled_groups": 0}
    seeds = [params.seed for _, params in t.rollout.calls]
    refill = int.from_bytes(hashlib.sha256(f"ferrule-rollout.r1.0:{SEED}:{STEP}".encode()).digest()[:8], "big") % 2**63
    assert seeds == [_shard_seed(0), refill] and batch.weight_version == 5 and batch.rounds == 2
    assert batch.sampler_state == {"cursor": 6}  # after the last round's draw: what its checkpoint records


def test_dynamic_sampling_fills_a_short_step_with_dropped_groups_at_the_round_bound():
    t = _dynamic_trainer("algorithm.dynamic_sampling_max_rounds=1")
    batch = t.produce(STEP)
    m = batch.selection
    assert [p.index for p in batch.prompts] == [1, 2, 0]  # the flat group 0 fills the third place
    assert m["dynamic_sampling_filled_groups"] == 1 and m["dynamic_sampling_rounds"] == 1


def test_a_user_error_in_the_rollout_thread_reaches_the_trainer_as_itself():
    """train.schedule=one_step_off / async: what the rollout thread raises is raised at the trainer's
    next step; a user error (one line, exit code 2 in the CLI) stays that error, anything else is wrapped
    as 'the rollout thread failed before step N' with the cause chained."""
    from ferrule.rl.envs.base import EnvironmentFailedError
    from ferrule.rl.schedules import AsyncSchedule

    for exc, wrapped in ((EnvironmentFailedError("every episode failed"), False), (KeyError("bug"), True)):
        def produce(step, exc=exc):
            raise exc

        trainer = SimpleNamespace(produce=produce, on_sync=None, before_sync=None)
        with AsyncSchedule(trainer, start=0, last=3, bound=1) as schedule:
            with pytest.raises(BaseException) as err:
                schedule._take(1)
        assert (err.type is RuntimeError and err.value.__cause__ is exc) if wrapped else err.value is exc
