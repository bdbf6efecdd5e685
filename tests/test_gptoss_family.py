"""The gpt-oss-shaped fixture family (tests/fixtures/ferrule-gptoss-fixture) under ``ferrule check``: passes, and
every planted mistake is localised (training: tests/test_gptoss_train.py).

The family is written from docs/plugins.md alone (attention sinks, clamped interleaved SwiGLU experts, router /
expert / attention biases, alternating sliding and full layers, YaRN, head_dim != hidden / heads); the kit passes
it at TP=1 and TP=2 (tests/test_fixture_families.py). References: HF transformers' ``GptOssForCausalLM`` (the
logits, gradients and hidden states ``ferrule check`` compares).
"""

from __future__ import annotations

import pytest

from fixture_plugins import plugin_env
from inproc import environment

pytestmark = pytest.mark.slow

GPTOSS = ("ferrule-gptoss-fixture",)


#: planted gpt-oss plugin mistake (``FERRULE_GPTOSS_FIXTURE_BUG``) -> the layer and op ``ferrule check`` must name first
PLANTED = {
    "gate_up": "layer 0 mlp",          # experts' gate / up read from each other's interleaved columns
    "qkv": "layer 0 attention",        # q/k/v concatenated instead of megatron's per-group interleave
    "eps": "layer 0 input_norm",       # a translation row computing the wrong RMSNorm epsilon
    "sinks": "layer 0 attention",      # the sinks dropped (an HF key Ignored, vanilla softmax)
    "rope": "layer 0 attention",       # a RoPE-base row that ignores rope_theta
    "window": "layer 0 attention",     # the window on the full-attention layers instead of the sliding ones
    "clamp": "layer 0 mlp",            # swiglu_limit read but not applied
    "offset": "layer 0 mlp",           # no +1 on the experts' up half
    "router": "layer 0 mlp",           # softmax over all experts before the top-k
    "o_bias": "layer 0 attention",     # the o_proj bias read with the wrong sign
}


@pytest.fixture(scope="module")
def gptoss_hf(tmp_path_factory):
    """The fixture plugin's env and its tiny HF folder (made once for this module's checks; read only)."""
    from ferrule.conformance import numeric as cn

    root = tmp_path_factory.mktemp("gptoss")
    env = plugin_env(root, GPTOSS)
    with environment(env):
        cn.tiny_hf_dir("gpt_oss", root / "hf")
    return env, root / "hf"


def _check(env, hf, bug="", **kw):
    from ferrule.converters.check import run_check

    with environment(dict(env, FERRULE_GPTOSS_FIXTURE_BUG=bug)):
        return run_check(hf, seq_len=16, **kw)


def _rows(report):
    return {r.step.split(" (")[0]: (r.status, r.detail) for r in report.rows}


def _assert_localised(report, bug, where):
    rows = _rows(report)
    assert not report.ok and rows["logits"][0] == "FAIL", (bug, report.rows)
    assert rows["divergence"][1].startswith(f"first departure: {where} "), (bug, rows["divergence"])
    # a dropped HF key is also named by tensor (the round trip); every other mistake converts back bit-exact
    assert rows["round trip"][0] == ("FAIL" if bug == "sinks" else "ok"), (bug, rows["round trip"])
    if bug == "sinks":
        assert "model.layers.0.self_attn.sinks" in rows["round trip"][1]


@pytest.mark.timeout(600)
def test_gptoss_passes_check_with_gradients_and_each_planted_mistake_is_localised_at_tp1(gptoss_hf):
    """The correct family passes every step at TP=1, gradients of all 37 tensors included; each planted mistake fails
    the logits and the first diverging capture point names its layer and op; the TP-axis mistake cannot show at
    TP=1 (it passes); a wrong update group is a FAIL row naming the parameters a weight sync would lose."""
    env, hf = gptoss_hf
    good = _check(env, hf, grads=True)
    assert good.ok, good.rows
    assert [r.step for r in good.rows] == ["config", "convert (tp=1)", "round trip (tp=1)", "logits (tp=1, fp32)",
                                           "gradients (tp=1, fp32)"]
    assert good.rows[-1].detail.startswith("37 parameters, "), good.rows[-1]
    for bug, where in PLANTED.items():
        _assert_localised(_check(env, hf, bug), bug, where)
    assert _check(env, hf, "tp_axis").ok
    groups = _rows(_check(env, hf, "groups"))
    assert groups["update groups"][0] == "FAIL" and "core_attention.softmax_offset" in groups["update groups"][1]


@pytest.mark.timeout(1200)
def test_gptoss_passes_check_at_tp2_etp1_and_each_planted_mistake_is_localised(gptoss_hf, pooled_ranks):
    """--tp 2 --etp 1 (the sinks and attention split over TP, the biased experts whole): the correct family passes,
    gradients included (refused at TP > 1 before; gpt-oss has no q/k norm, whose raw gradients would be partial per
    rank), and every planted mistake, plus the q/k/v bias split like a gate/up block (same shapes, wrong numbers: only
    TP > 1 shows it), names its layer and op."""
    env, hf = gptoss_hf
    good = _check(env, hf, tp=2, etp=1, grads=True)
    assert good.ok and good.rows[3].step == "logits (tp=2, etp=1, fp32)", good.rows
    assert good.rows[4].step == "gradients (tp=2, etp=1, fp32)" and good.rows[4].detail.startswith("37 parameters, ")
    for bug, where in {**PLANTED, "tp_axis": "layer 0 attention"}.items():
        _assert_localised(_check(env, hf, bug, tp=2, etp=1), bug, where)


@pytest.mark.timeout(300)
def test_gradients_at_tp2_are_refused_for_a_family_with_q_k_norms(tmp_path):
    """Qwen3's q/k norms get partial gradients per rank until megatron's gradient finalization: --grads at --tp 2
    is refused in one line, before any conversion, and --ep 2 for every family."""
    from ferrule.conformance import numeric as cn
    from ferrule.converters.check import run_check

    hf = cn.tiny_hf_dir("qwen3", tmp_path / "hf", overrides={"num_key_value_heads": 2})
    with pytest.raises(ValueError, match=r"grads=True at tp=2 for a family with q/k norms \(qwen3\).*use --tp 1"):
        run_check(hf, tp=2, grads=True)
    with pytest.raises(ValueError, match=r"grads=True at ep=2"):
        run_check(hf, ep=2, grads=True)
