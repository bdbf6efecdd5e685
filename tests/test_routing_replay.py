"""MoE routing replay (R3, arXiv 2510.11370) end to end on CPU: embedded rollout -> train forward.

For a tiny Qwen3-MoE (megatron ``TopKRouter``, softmax top-k), Inkling (shared-expert-sink router,
sigmoid top-k with a selection bias, softmax over the picked routed and the shared logits) and
Inkling-2 (sigmoid top-k with a selection bias): one random checkpoint boots a ``TrainEngine`` (fp32) and
an ``EmbeddedEngine`` whose routers are perturbed (seeded noise on every ``mlp.gate.weight``: a
rollout whose routing really differs from the trainer's, as bf16 kernels or a stale version would).
The rollout samples with ``return_routed_experts``; then:

- the routes equal what the HF routers pick in one teacher-forced forward of the same model
  (independent of the decode path's bookkeeping: left padding, KV cache steps);
- the train forward with the routes routes every token to exactly those experts (captured at the MoE
  layers' dispatch, ``preprocess``), while the trainer's own routing differs on some tokens (so a
  forward that ignored the routes fails the test);
- the train-vs-rollout logprob mismatch (mean |train - rollout| over the response tokens) with the
  routes is below the mismatch without them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

SEED = 0
#: std of the noise added to the rollout's router weights (tiny models' router rows have norm ~0.2-1)
ROUTER_NOISE = 0.3
#: Qwen3-MoE decodes left-padded prompts of different lengths in one batch (its routes are cut out of the padded
#: batch); the Inkling families decode through transformers' cache, one batch per prompt length, so they get prompts
#: of one length (one batch: half the decode steps of two lengths)
PROMPTS = {"qwen3_moe": [[3, 4, 5, 6, 7], [8, 9]], "inkling": [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]}
PROMPTS["inkling2"] = PROMPTS["inkling"]
NEW_TOKENS = 8
FAMILIES = ["qwen3_moe", "inkling", "inkling2"]


def _gates(model):
    from ferrule.rollout._routes import hf_routers

    return [m for _, m in hf_routers(model)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``{family: (train engine, rollout engine, results)}``, one random checkpoint per family."""
    from ferrule.conformance.numeric import tiny_hf_dir
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    out = {}
    for fam in FAMILIES:
        hf = tiny_hf_dir(fam, tmp_path_factory.mktemp(fam) / "hf")
        rollout = EmbeddedEngine(hf_dir=hf)
        torch.manual_seed(SEED)
        with torch.no_grad():
            for gate in _gates(rollout.model):
                gate.weight.add_(torch.randn_like(gate.weight) * ROUTER_NOISE)
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=2, seed=SEED, ignore_eos=True,
                                return_raw_logprobs=True, return_routed_experts=True)
        out[fam] = (TrainEngine.from_hf(hf), rollout, rollout.generate(PROMPTS[fam], params))
    return out


def _datums(prompts, results, routes: bool):
    from ferrule.megatron.batching import Datum

    data = []
    for r in results:
        seq = prompts[r.prompt_index] + list(r.token_ids)
        data.append(Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])}, None,
                          r.routed_experts if routes else None))
    return data


def _train_forward(engine, prompts, results, routes: bool):
    """(per datum logprobs, per MoE layer the [tokens, E] bool routing maps dispatched, in call order)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for n, m in engine.model[0].named_modules() if isinstance(m, MoELayer)]
    maps: list[list[torch.Tensor]] = [[] for _ in layers]
    saved = []
    for k, layer in enumerate(layers):
        orig = layer.preprocess

        def capture(hidden, probs, routing_map, _orig=orig, _k=k):
            maps[_k].append(routing_map.detach().clone())
            return _orig(hidden, probs, routing_map)
        layer.preprocess = capture
        saved.append(layer)
    try:
        lps = engine.forward_logprobs(_datums(prompts, results, routes))
    finally:
        for layer in saved:
            del layer.preprocess
    return lps, maps


def _as_map(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], experts, dtype=torch.bool).scatter(1, ids.long(), True)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_routes_are_the_hf_routers_choice(engines, family):
    from ferrule.rollout._routes import hf_routers

    _, rollout, results = engines[family]
    for r in results:
        seq = PROMPTS[family][r.prompt_index] + list(r.token_ids)
        picked = []
        hooks = [m.register_forward_hook(lambda m, a, o: picked.append(o[2])) for _, m in hf_routers(rollout.model)]
        try:
            with torch.no_grad():
                rollout.model(torch.tensor([seq[:-1]]))
        finally:
            for h in hooks:
                h.remove()
        want = torch.stack(picked, dim=1)  # [P + R - 1, layers, k]
        assert r.routed_experts.dtype == torch.int16 and r.routed_experts.shape == want.shape
        assert torch.equal(r.routed_experts.long().sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_forward_replays_the_rollout_routes_and_narrows_the_mismatch(engines, family):
    train, _, results = engines[family]
    experts = train.moe_routers[0].config.num_moe_experts
    # the data run one micro-batch each (no token budget): datum order = call order, its tokens in one row
    want = [[_as_map(r.routed_experts[:, m], experts) for r in results] for m in range(len(train.moe_routers))]
    fresh_lp, fresh_maps = _train_forward(train, PROMPTS[family], results, routes=False)
    replay_lp, replay_maps = _train_forward(train, PROMPTS[family], results, routes=True)
    differ = 0
    for m, per_layer in enumerate(want):
        assert [torch.equal(got, w) for got, w in zip(replay_maps[m], per_layer)] == [True] * len(results)
        differ += sum(int((got != w).any(-1).sum()) for got, w in zip(fresh_maps[m], per_layer))
    assert differ > 0, "the perturbed rollout routed like the trainer: the test would not see ignored routes"

    def mismatch(lps):
        return torch.cat([(lp[-len(r.token_ids):] - torch.tensor(r.raw_logprobs)).abs()
                          for lp, r in zip(lps, results)]).mean().item()
    off, on = mismatch(fresh_lp), mismatch(replay_lp)
    print(f"{family}: tokens routed differently {differ}; mean |train - rollout| logprob: R3 off {off:.4g}, "
          f"on {on:.4g}")
    assert on < off


def test_unsupported_routing_replay_is_refused_naming_the_key():
    from ferrule.rl.config import ConfigError, config_from_dict

    base = {"model": {"hf_dir": "some/hf"}, "data": {"task": "basic_arithmetic"},
            "algorithm": {"routing_replay": True}}
    config_from_dict(base)  # embedded rollout, one rank: accepted
    bad = dict(base, rollout={"engine": "sglang"}, parallel={"tp": 2, "ep": 2},
               rollout_engine={"cuda_graph": True})
    with pytest.raises(ConfigError) as exc:
        config_from_dict(bad)
    text = "\n".join(exc.value.problems)
    assert "algorithm.routing_replay: rollout.engine=sglang returns no routed experts" in text
    assert "tested at tp = pp = ep = 1 only, not tp=2, ep=2" in text
    assert "rollout_engine.cuda_graph" in text


def test_train_engine_refuses_routes_it_cannot_replay(engines):
    from ferrule.megatron.batching import Datum

    train, _, results = engines["qwen3_moe"]
    r = results[0]
    seq = PROMPTS["qwen3_moe"][r.prompt_index] + list(r.token_ids)
    target = {"target_tokens": torch.tensor(seq[1:])}
    with pytest.raises(ValueError, match=r"datum 0: routed_experts must be integer ids of shape \(\d+, 2, 2\)"):
        train.forward_logprobs([Datum(seq[:-1], target, None, r.routed_experts[1:])])
    with pytest.raises(ValueError, match=r"data \[1\] carry no routed_experts while others do"):
        train.forward_logprobs([Datum(seq[:-1], target, None, r.routed_experts), Datum(seq[:-1], target)])


def test_grpo_step_hands_the_rollout_routes_to_every_train_call(tmp_path, monkeypatch):
    """Two steps of the loop on a tiny Qwen3-MoE with ``algorithm.routing_replay``: every datum of every
    ``forward_backward`` / ``forward_logprobs`` carries the routes the rollout returned for its tokens. A
    dense Qwen3 with the switch on is a config error once its train engine is built."""
    import json

    from test_rl_e2e import CONFIG, _build_model
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from ferrule.megatron.engine import TrainEngine
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.rl.build import build_train_engine
    from ferrule.rl.config import ConfigError, load_config
    from ferrule.rl.loop import GRPOTrainer
    from ferrule.rollout.embedded import EmbeddedEngine

    model = tmp_path / "model"
    _build_model(model)  # the character tokenizer (and a dense model, replaced next)
    dense = json.loads((model / "config.json").read_text())
    (tmp_path / "task.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n"
                                                 for i in range(16)))
    (tmp_path / "c.yaml").write_text(CONFIG)
    overrides = [f"model.hf_dir={model}", f"data.jsonl_path={tmp_path / 'task.jsonl'}",
                 f"logging.run_dir={tmp_path / 'run'}", "train.steps=2", "train.prompts_per_step=2",
                 "rollout.n_samples_per_prompt=2", "algorithm.routing_replay=true"]
    with pytest.raises(ConfigError, match="algorithm.routing_replay: family 'qwen3' has no MoE router"):
        build_train_engine(load_config(tmp_path / "c.yaml", overrides), ParallelLayout(), torch.float32)
    cfg = AutoConfig.for_model(model_type="qwen3_moe", vocab_size=dense["vocab_size"], eos_token_id=dense["eos_token_id"],
                               pad_token_id=dense["pad_token_id"], hidden_size=32, intermediate_size=48,
                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(SEED)
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(model)
    sent: dict[tuple, torch.Tensor] = {}
    seen: list[tuple[tuple, torch.Tensor | None]] = []
    generate, fb, flp = EmbeddedEngine.generate, TrainEngine.forward_backward, TrainEngine.forward_logprobs

    def spy_generate(self, requests, params):
        out = generate(self, requests, params)
        for r in out:
            prompt = list(requests[r.prompt_index].prompt_token_ids)
            sent[tuple(prompt + list(r.token_ids))[:-1]] = r.routed_experts
        return out

    def spy(orig):
        def call(self, batch, *args, **kwargs):
            seen.extend((tuple(d.model_input), d.routed_experts) for d in batch)
            return orig(self, batch, *args, **kwargs)
        return call
    monkeypatch.setattr(EmbeddedEngine, "generate", spy_generate)
    monkeypatch.setattr(TrainEngine, "forward_backward", spy(fb))
    monkeypatch.setattr(TrainEngine, "forward_logprobs", spy(flp))
    GRPOTrainer(load_config(tmp_path / "c.yaml", overrides)).run()
    assert len(seen) == 2 * 2 * 2 * 2  # 2 steps x 4 samples, forward_logprobs (use_tis) + forward_backward
    assert all(routes is not None and torch.equal(routes, sent[ids]) for ids, routes in seen)
