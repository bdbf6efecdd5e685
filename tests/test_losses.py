"""ferrule.losses against an independent float64 reference written here (per-token loops over
Python floats, formulas transcribed from the Tinker loss docs, Schulman 2017, MiniMax-M1 and
Schulman's KL-approximation note), plus checks against the installed tinker SDK."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
import torch

from ferrule import losses as L

SEED = 1234
NUM_TOKENS = 13
VOCAB = 50
TOL = 1e-12
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")


# --------------------------------------------------------------------------- reference


def ref_token(name, t, x, cfg):
    """(loss, dloss/dt) for one token, Python floats. x: dict of per-token floats."""
    w = x.get("weights", 1.0)
    if name == "cross_entropy":
        return -w * t, -w
    q, a = x["logprobs"], x["advantages"]
    r = math.exp(t - q)
    c = 1.0
    if "rollout_logprobs" in x:
        c = min(math.exp(q - x["rollout_logprobs"]), cfg.get("tis_cap", 2.0))
    if name == "importance_sampling":
        val, grad = -r * a, -r * a
    elif name == "ppo":
        lo, hi = x.get("clip_low_threshold", cfg.get("clip_low_threshold", 0.8)), x.get(
            "clip_high_threshold", cfg.get("clip_high_threshold", 1.2)
        )
        clip_r = min(max(r, lo), hi)
        if clip_r * a < r * a:  # clipped branch strictly smaller: constant, no gradient
            val, grad = -clip_r * a, 0.0
        else:
            val, grad = -r * a, -r * a
    elif name == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        coef = min(max(r, lo), hi)
        val, grad = -coef * a * t, -coef * a
    elif name == "dro":
        beta = cfg.get("beta", 0.05)
        val, grad = -(t * a - 0.5 * beta * (t - q) ** 2), -(a - beta * (t - q))
    val, grad = c * val, c * grad
    kl_coef = cfg.get("kl_coef", 0.0)
    if "ref_logprobs" in x and kl_coef > 0:
        d = x["ref_logprobs"] - t
        val += kl_coef * (math.exp(d) - d - 1.0)
        grad += kl_coef * (1.0 - math.exp(d))
    return w * val, w * grad


def reference(name, t, inputs, cfg):
    n = len(t)
    per = {k: v.tolist() for k, v in inputs.items() if k != "target_tokens"}
    vals, grads = [], []
    for i in range(n):
        x = {k: v[i] for k, v in per.items()}
        v, g = ref_token(name, float(t[i]), x, cfg)
        vals.append(v)
        grads.append(g)
    return np.array(vals), np.array(grads)


def make_inputs(name, n=NUM_TOKENS, seed=SEED, weights=True, tis=False, ref=False):
    g = torch.Generator().manual_seed(seed)
    t = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    inputs = {"target_tokens": torch.randint(0, VOCAB, (n,), generator=g)}
    if name == "cross_entropy" or weights:
        w = torch.randn(n, generator=g, dtype=torch.float64)
        w[::4] = 0.0  # masked positions
        inputs["weights"] = w
    if name != "cross_entropy":
        # ratios spread over roughly [0.55, 1.8]: some inside, some outside the clip band
        inputs["logprobs"] = t + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        inputs["advantages"] = torch.randn(n, generator=g, dtype=torch.float64)
        if tis:
            inputs["rollout_logprobs"] = inputs["logprobs"] + 0.8 * torch.randn(n, generator=g, dtype=torch.float64)
        if ref:
            inputs["ref_logprobs"] = t + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    return t, inputs


def run(name, t, inputs, cfg=None, **kw):
    tl = t.clone().requires_grad_(True)
    loss, metrics = L.get_loss(name)(tl, inputs, cfg, **kw)
    loss.sum().backward()
    return loss.detach(), tl.grad, metrics


# --------------------------------------------------------------------------- values and grads

EXTENSIONS = {
    "plain": ({}, {}),
    "tis": ({"tis": True}, {"tis_cap": 1.5}),
    "kl": ({"ref": True}, {"kl_coef": 0.3}),
    "tis+kl": ({"tis": True, "ref": True}, {"tis_cap": 1.3, "kl_coef": 0.1}),
}
LOSS_CFGS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.25},
    "cispo": {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15},
    "dro": {"beta": 0.2},
}


def test_cross_entropy_value_grad_metrics():
    t, inputs = make_inputs("cross_entropy")
    loss, grad, m = run("cross_entropy", t, inputs)
    rv, rg = reference("cross_entropy", t, inputs, {})
    np.testing.assert_allclose(loss.numpy(), rv, rtol=0, atol=TOL)
    np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    w = inputs["weights"].numpy()
    assert float(m["loss:sum"]) == pytest.approx(rv.sum(), abs=TOL)
    assert float(m["weights:sum"]) == pytest.approx(w.sum(), abs=TOL)
    assert float(m["tokens:sum"]) == np.count_nonzero(w)


@pytest.mark.parametrize("ext", list(EXTENSIONS))
@pytest.mark.parametrize("name", RL_LOSSES)
@pytest.mark.parametrize("weights", [False, True], ids=["noweights", "weights"])
def test_rl_value_grad(name, ext, weights):
    flags, ext_cfg = EXTENSIONS[ext]
    cfg = {**LOSS_CFGS[name], **ext_cfg}
    t, inputs = make_inputs(name, weights=weights, **flags)
    loss, grad, m = run(name, t, inputs, cfg)
    rv, rg = reference(name, t, inputs, cfg)
    np.testing.assert_allclose(loss.numpy(), rv, rtol=0, atol=TOL)
    np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    assert float(m["loss:sum"]) == pytest.approx(rv.sum(), abs=TOL)
    # metrics: sums over tokens with weight != 0
    active = inputs["weights"].numpy() != 0 if weights else np.ones(NUM_TOKENS, bool)
    tn, qn = t.numpy(), inputs["logprobs"].numpy()
    r = np.exp(tn - qn)
    assert float(m["tokens:sum"]) == active.sum()
    assert float(m["ratio:sum"]) == pytest.approx(r[active].sum(), abs=TOL)
    if name in ("ppo", "cispo"):
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        a = inputs["advantages"].numpy()
        if name == "ppo":
            clipped = np.clip(r, lo, hi) * a < r * a
        else:
            clipped = (r < lo) | (r > hi)
        assert 0 < clipped[active].sum() < active.sum(), "test data must exercise both branches"
        assert float(m["clipped_tokens:sum"]) == clipped[active].sum()
    if flags.get("tis"):
        raw = np.exp(qn - inputs["rollout_logprobs"].numpy())
        assert 0 < (raw[active] > cfg["tis_cap"]).sum() < active.sum()
        assert float(m["tis_truncated_tokens:sum"]) == (raw[active] > cfg["tis_cap"]).sum()
        assert float(m["tis_weight:sum"]) == pytest.approx(np.minimum(raw, cfg["tis_cap"])[active].sum(), abs=TOL)
    else:
        assert "tis_weight:sum" not in m
    if flags.get("ref"):
        d = inputs["ref_logprobs"].numpy() - tn
        assert float(m["ref_kl:sum"]) == pytest.approx((np.exp(d) - d - 1)[active].sum(), abs=TOL)


def test_kl_reported_without_penalty():
    t, inputs = make_inputs("importance_sampling", ref=True)
    loss, grad, m = run("importance_sampling", t, inputs)  # kl_coef defaults to 0
    rv, rg = reference("importance_sampling", t, inputs, {})
    np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    assert float(m["ref_kl:sum"]) > 0


@pytest.mark.parametrize("name", ("ppo", "cispo"))
def test_defaults_match_tinker_docs(name):
    t, inputs = make_inputs(name)
    _, grad, _ = run(name, t, inputs)  # no config: Tinker defaults 0.8 / 1.2
    _, rg = reference(name, t, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    assert dict(L.LOSS_CONFIG_DEFAULTS["dro"])["beta"] == 0.05


# --------------------------------------------------------------------------- clipping boundaries


def _one(a, t, q=0.0):
    return torch.tensor(t, dtype=torch.float64), {
        "target_tokens": torch.zeros(len(t), dtype=torch.long),
        "logprobs": torch.full((len(t),), q, dtype=torch.float64),
        "advantages": torch.tensor(a, dtype=torch.float64),
    }


def test_ppo_clip_boundaries():
    eps = 1e-9
    # r = exp(t) with q = 0: exactly 1.0 at t = 0, placed on the band edges lo = 1 / hi = 1.
    for cfg in ({"clip_low_threshold": 0.5, "clip_high_threshold": 1.0}, {"clip_low_threshold": 1.0, "clip_high_threshold": 2.0}):
        t, inputs = _one(a=[1.0, 1.0, -1.0, -1.0, 2.0, -2.0], t=[0.0, eps, 0.0, -eps, -1.0, 1.0])
        loss, grad, m = run("ppo", t, inputs, cfg)
        rv, rg = reference("ppo", t, inputs, cfg)
        np.testing.assert_allclose(loss.numpy(), rv, rtol=0, atol=TOL)
        np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    # On the edge (r == hi, A > 0) the gradient flows; just past it, it is cut.
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.0}
    t, inputs = _one(a=[1.0, 1.0], t=[0.0, eps])
    _, grad, m = run("ppo", t, inputs, cfg)
    assert grad.tolist() == [-1.0, 0.0] and float(m["clipped_tokens:sum"]) == 1
    cfg = {"clip_low_threshold": 1.0, "clip_high_threshold": 2.0}
    t, inputs = _one(a=[-1.0, -1.0], t=[0.0, -eps])
    _, grad, m = run("ppo", t, inputs, cfg)
    assert grad.tolist() == [1.0, 0.0] and float(m["clipped_tokens:sum"]) == 1
    # Out of the band on the "good" side (A > 0, r < lo): min picks r*A, gradient flows.
    t, inputs = _one(a=[1.0], t=[-3.0])
    _, grad, m = run("ppo", t, inputs, cfg)
    assert grad.item() == pytest.approx(-math.exp(-3.0), abs=TOL) and float(m["clipped_tokens:sum"]) == 0


def test_ppo_matches_tinker_torch_min_formula():
    """The docs' literal implementation (torch.min + torch.clamp) gives the same gradient,
    including ties inside the band and on its edges."""
    t, inputs = _one(a=[1.0, 1.0, -1.0, -1.0, 0.5, -0.5, 0.0], t=[0.0, 1e-9, 0.0, -1e-9, 0.1, -0.3, 0.4])
    cfg = {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}
    t2 = t.clone().requires_grad_(True)
    r = torch.exp(t2 - inputs["logprobs"])
    (-torch.min(r * inputs["advantages"], torch.clamp(r, 1.0, 1.0) * inputs["advantages"])).sum().backward()
    _, grad, _ = run("ppo", t, inputs, cfg)
    assert torch.equal(grad, t2.grad)


def test_cispo_clip_boundaries():
    cfg = {"clip_low_threshold": 1.0, "clip_high_threshold": 1.5}
    t, inputs = _one(a=[1.0, -2.0, 1.0, 3.0], t=[0.0, -1e-9, 1.0, -0.2], q=0.0)
    loss, grad, m = run("cispo", t, inputs, cfg)
    rv, rg = reference("cispo", t, inputs, cfg)
    np.testing.assert_allclose(loss.numpy(), rv, rtol=0, atol=TOL)
    np.testing.assert_allclose(grad.numpy(), rg, rtol=0, atol=TOL)
    # r == lo exactly is not clipped; every token keeps a gradient (the CISPO point)
    assert grad.tolist() == [-1.0, 2.0 * 1.0, -1.5, -3.0] and float(m["clipped_tokens:sum"]) == 3


def test_tis_truncation_boundary():
    """c = min(exp(logprobs - rollout_logprobs), tis_cap): a ratio equal to the cap is not
    counted as truncated, one just above it is, and its weight is the cap."""
    t, inputs = _one(a=[1.0, 1.0, 1.0], t=[0.0, 0.0, 0.0])
    inputs["rollout_logprobs"] = torch.tensor([0.0, -1e-9, 0.5], dtype=torch.float64)
    _, grad, m = run("importance_sampling", t, inputs, {"tis_cap": 1.0})
    assert grad.tolist() == [-1.0, -1.0, -math.exp(-0.5)]
    assert float(m["tis_truncated_tokens:sum"]) == 1
    assert float(m["tis_weight:sum"]) == pytest.approx(2.0 + math.exp(-0.5), abs=TOL)


# --------------------------------------------------------------------------- weights, dtypes


@pytest.mark.parametrize("name", ("cross_entropy",) + RL_LOSSES)
def test_zero_weights_give_zero_loss_and_grad(name):
    t, inputs = make_inputs(name, ref=name != "cross_entropy")
    cfg = {"kl_coef": 0.5} if name != "cross_entropy" else None
    inputs["weights"] = torch.zeros(NUM_TOKENS, dtype=torch.float64)
    loss, grad, m = run(name, t, inputs, cfg)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(grad, torch.zeros_like(grad))
    assert float(m["tokens:sum"]) == 0 and L.finalize_metrics(m).get("ratio:mean", 0.0) == 0.0


def test_cross_entropy_linear_in_signed_weights():
    t, inputs = make_inputs("cross_entropy")
    inputs["weights"] = torch.tensor([3.5, -2.0, 0.0, 1e-3] * 3 + [-7.0], dtype=torch.float64)
    _, grad, _ = run("cross_entropy", t, inputs)
    assert torch.equal(grad, -inputs["weights"])


def test_bf16_logprobs_computed_in_float32():
    t, inputs = make_inputs("ppo")
    tl = t.to(torch.bfloat16).requires_grad_(True)
    loss, _ = L.ppo(tl, {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert tl.grad.dtype == torch.bfloat16
    _, rg = reference("ppo", tl.detach().double(), inputs | {"logprobs": inputs["logprobs"].float().double(),
        "advantages": inputs["advantages"].float().double(), "weights": inputs["weights"].float().double()}, {})
    np.testing.assert_allclose(tl.grad.double().numpy(), rg, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- split invariance


@pytest.mark.parametrize("name", ("cross_entropy",) + RL_LOSSES)
def test_split_invariance(name):
    flags = {} if name == "cross_entropy" else {"tis": True, "ref": True}
    cfg = None if name == "cross_entropy" else {**LOSS_CFGS[name], "kl_coef": 0.2}
    t, inputs = make_inputs(name, n=2 * NUM_TOKENS, **flags)
    ent = torch.rand(2 * NUM_TOKENS, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    whole_loss, whole_grad, whole_m = run(name, t, inputs, cfg, entropy=ent)
    cut = 11
    parts = []
    for sl in (slice(0, cut), slice(cut, None)):
        parts.append(run(name, t[sl], {k: v[sl] for k, v in inputs.items()}, cfg, entropy=ent[sl]))
    # elementwise formula: per-token loss and gradient are bit-identical
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_loss)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_grad)
    summed = L.sum_metrics([p[2] for p in parts])
    assert set(summed) == set(whole_m)
    fin_s, fin_w = L.finalize_metrics(summed), L.finalize_metrics(whole_m)
    for key in fin_w:
        assert fin_s[key] == pytest.approx(fin_w[key], abs=TOL), key
        if "tokens" in key:
            assert fin_s[key] == fin_w[key], key  # counts add exactly
    assert "entropy:mean" in fin_w and fin_w["entropy:mean"] == pytest.approx(
        ent.numpy()[(inputs["weights"] != 0).numpy()].mean(), abs=TOL)


def test_per_datum_clip_threshold_inputs():
    t, inputs = make_inputs("ppo")
    cfg = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.25}
    per_datum = inputs | {"clip_low_threshold": torch.tensor([0.7], dtype=torch.float64),
                          "clip_high_threshold": torch.full((NUM_TOKENS,), 1.25, dtype=torch.float64)}
    L.validate_loss_inputs("ppo", per_datum)
    _, g1, _ = run("ppo", t, per_datum)
    _, g2, _ = run("ppo", t, inputs, cfg)
    assert torch.equal(g1, g2)


def test_token_entropy():
    logits = torch.randn(3, 5, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    z = logits.numpy()
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(L.token_entropy(logits).numpy(), -(p * np.log(p)).sum(-1), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- errors


def _rl():
    return make_inputs("ppo")[1]


@pytest.mark.parametrize(
    "name, inputs, cfg, match",
    [
        ("grpo", {}, None, r"unknown loss_fn 'grpo'; known losses: cispo, cross_entropy, dro, gspo, importance_sampling, ppo"),
        ("stable_reinforce", {}, None, r"exists in the Tinker API but is not implemented"),
        ("ppo", {k: v for k, v in _rl().items() if k != "advantages"}, None, r"needs loss_fn_inputs\['advantages'\]"),
        ("ppo", _rl() | {"advantages": torch.zeros(NUM_TOKENS - 1, dtype=torch.float64)}, None, r"'advantages'.*shape \(12,\).*\[13\]"),
        ("ppo", _rl() | {"advantages": torch.tensor([0.0] * 5 + [math.nan] + [0.0] * 7)}, None, r"\['advantages'\]\[5\] = nan is not finite"),
        ("dro", _rl() | {"logprobs": torch.tensor([-math.inf] + [0.0] * 12)}, None, r"\['logprobs'\]\[0\] = -inf"),
        ("ppo", _rl(), {"clip_epsilon": 0.2}, r"key 'clip_epsilon' is not accepted by loss 'ppo'; accepted keys: clip_low_threshold"),
        ("cross_entropy", make_inputs("cross_entropy")[1], {"beta": 0.1}, r"'beta' is not accepted by loss 'cross_entropy'"),
        ("dro", _rl(), {"beta": "high"}, r"loss_fn_config\['beta'\] must be a finite number"),
        ("ppo", _rl(), {"clip_low_threshold": 1.3}, r"clip_low_threshold <= clip_high_threshold"),
        ("importance_sampling", _rl(), {"kl_coef": 0.1}, r"needs loss_fn_inputs\['ref_logprobs'\]"),
        ("ppo", _rl() | {"mask": torch.ones(NUM_TOKENS)}, None, r"'mask' is not accepted.*express masks as weights"),
        ("cross_entropy", {"target_tokens": torch.zeros(3, dtype=torch.long)}, None, r"needs loss_fn_inputs\['weights'\]"),
        ("ppo", _rl() | {"target_tokens": torch.full((NUM_TOKENS,), VOCAB)}, None, r"id 50 >= the vocabulary size 50"),
        ("ppo", _rl() | {"target_tokens": torch.zeros(NUM_TOKENS)}, None, r"1-D integer tensor"),
    ],
)
def test_validation_errors(name, inputs, cfg, match):
    with pytest.raises(ValueError, match=match):
        L.validate_loss_inputs(name, inputs, cfg, vocab_size=VOCAB)


def test_validation_batch_errors_and_ok():
    good = make_inputs("ppo", weights=False)[1]
    assert L.validate_loss_inputs("ppo", [good, good], {"clip_high_threshold": 1.5})["clip_high_threshold"] == 1.5
    with pytest.raises(ValueError, match="empty batch"):
        L.validate_loss_inputs("ppo", [])
    with pytest.raises(ValueError, match=r"datum 1: loss_fn_inputs keys .* differ from datum 0"):
        L.validate_loss_inputs("ppo", [good, good | {"weights": torch.ones(NUM_TOKENS)}])
    with pytest.raises(ValueError, match=r"datum 1: .*'advantages'\]\[2\]"):
        L.validate_loss_inputs("ppo", [good, good | {"advantages": torch.tensor([0, 0, math.inf] + [0.0] * 10)}])


def test_get_loss_and_call_errors():
    with pytest.raises(ValueError, match="known losses: cispo, cross_entropy"):
        L.get_loss("reinforce")
    t, inputs = make_inputs("ppo")
    with pytest.raises(ValueError, match="token-aligned with target_tokens"):
        L.ppo(t[:-1], inputs)
    with pytest.raises(ValueError, match="not accepted"):
        L.ppo(t, inputs, {"betta": 1.0})


# --------------------------------------------------------------------------- tinker SDK


def test_names_and_keys_match_tinker_sdk():
    from tinker import types
    from tinker.types import datum as tinker_datum

    tinker_names = set(typing.get_args(types.LossFnType))
    assert set(L.LOSSES) <= tinker_names
    assert set(L.LOSSES) | {"stable_reinforce", "custom"} == tinker_names
    tinker_keys = set(tinker_datum._KEY_TO_TYPE)
    ferrule_extensions = {"rollout_logprobs", "ref_logprobs"}
    for name, (required, optional) in L.LOSS_INPUT_KEYS.items():
        assert set(required) <= tinker_keys, name
        assert set(optional) - ferrule_extensions <= tinker_keys, name
    # the SDK's request type accepts our config keys unchanged
    for name, defaults in L.LOSS_CONFIG_DEFAULTS.items():
        types.ForwardBackwardInput(data=[], loss_fn=name, loss_fn_config=dict(defaults))


def test_tinker_datum_roundtrip_and_metric_combine():
    """Inputs built by the SDK (Python lists -> its dtype coercion) validate and compute, and our
    metrics survive the SDK's client-side chunk combine (keys 'name:reduction')."""
    from tinker import types
    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results

    t, inputs = make_inputs("ppo", weights=False)
    datums = []
    for sl in (slice(0, 5), slice(5, None)):
        d = types.Datum(
            model_input=types.ModelInput.from_ints(inputs["target_tokens"][sl].tolist()),
            loss_fn_inputs={k: v[sl].tolist() for k, v in inputs.items()},
        )
        datums.append({k: v.to_torch() for k, v in d.loss_fn_inputs.items()})
    assert datums[0]["target_tokens"].dtype == torch.int64 and datums[0]["advantages"].dtype == torch.float32
    L.validate_loss_inputs("ppo", datums, {"clip_low_threshold": 0.9}, vocab_size=VOCAB)
    outs = []
    for sl, d in zip((slice(0, 5), slice(5, None)), datums):
        _, m = L.ppo(t[sl].float(), d, {"clip_low_threshold": 0.9})
        outs.append(types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[{}],
                                                metrics=L.finalize_metrics(m)))
    combined = combine_fwd_bwd_output_results(outs)
    assert set(combined.metrics) == set(outs[0].metrics)
    assert combined.metrics["loss:sum"] == pytest.approx(sum(o.metrics["loss:sum"] for o in outs))
    assert combined.metrics["tokens:sum"] == NUM_TOKENS


# --------------------------------------------------------------------------- entropy bonus

@pytest.mark.parametrize("name", RL_LOSSES + ("gspo",))
def test_entropy_bonus_subtracts_coef_times_weighted_entropy(name):
    """``l = l0 - w * c * H`` (not TIS-weighted), d l / d H = -w * c; the float64 reference is the
    loss without the bonus (checked above) minus the hand-computed term."""
    t, inputs = make_inputs(name if name != "gspo" else "ppo", tis=name != "gspo")
    coef = 0.05
    h = torch.rand(NUM_TOKENS, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 4
    hl = h.clone().requires_grad_(True)
    base, _, m0 = run(name, t, inputs, None, entropy=h)
    tl = t.clone().requires_grad_(True)
    loss, metrics = L.get_loss(name)(tl, inputs, {"entropy_coef": coef}, entropy=hl)
    loss.sum().backward()
    w = inputs["weights"]
    assert torch.allclose(loss.detach(), base - w * coef * h, rtol=0, atol=TOL)
    assert torch.allclose(hl.grad, -w * coef, rtol=0, atol=TOL)
    active = w != 0
    assert float(metrics["entropy:sum"]) == pytest.approx(float(h[active].sum()), abs=TOL)
    assert float(m0["entropy:sum"]) == float(metrics["entropy:sum"])  # reporting is unchanged
    with pytest.raises(ValueError, match="entropy_coef'] = 0.05 > 0 needs the policy's per-token entropy"):
        L.get_loss(name)(t, inputs, {"entropy_coef": coef})
    with pytest.raises(ValueError, match="entropy_coef"):
        L.resolve_loss_config(name, {"entropy_coef": -0.1})
