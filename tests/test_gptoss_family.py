"""The gpt-oss-shaped fixture family (tests/fixtures/ferrule-gptoss-fixture) under ``ferrule check``: passes, and
every planted mistake is localised (training: tests/test_gptoss_train.py).

The family is written from docs/plugins.md alone (attention sinks, clamped interleaved SwiGLU experts, router /
expert / attention biases, alternating sliding and full layers, YaRN, head_dim != hidden / heads); the kit passes
it at TP=1 and TP=2 (tests/test_fixture_families.py). References: HF transformers' ``GptOssForCausalLM`` (the
logits, gradients and hidden states ``ferrule check`` compares).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from fixture_plugins import plugin_env
from inproc import environment

pytestmark = pytest.mark.slow

GPTOSS = ("ferrule-gptoss-fixture",)


#: The issue's 13 planted gpt-oss plugin mistakes (``FERRULE_GPTOSS_FIXTURE_BUG``) -> what was planted where (the
#: truth the tool's output is compared with): the layer and op of the first tensor or computation the mistake
#: changes, and the row of ``ferrule check`` that must name them first ("divergence" for a numeric mistake,
#: "convert" / "update groups" for a structural one).
PLANTED = {
    "gate_up": (0, "mlp", "divergence"),          # experts' gate / up read from each other's interleaved columns
    "qkv": (0, "attention", "divergence"),        # q/k/v concatenated instead of megatron's per-group interleave
    "eps": (0, "input_norm", "divergence"),       # a translation row computing the wrong RMSNorm epsilon
    "sinks": (0, "attention", "divergence"),      # a dropped HF key (the sinks Ignored, vanilla softmax)
    "rope": (0, "attention", "divergence"),       # a wrong rope row (a RoPE base that ignores rope_theta)
    "window": (0, "attention", "divergence"),     # a wrong translation value (the window on the full layers)
    "clamp": (0, "mlp", "divergence"),            # swiglu_limit read but not applied
    "offset": (0, "mlp", "divergence"),           # no +1 on the experts' up half
    "router": (0, "mlp", "divergence"),           # softmax over all experts before the top-k
    "o_bias": (0, "attention", "divergence"),     # the o_proj bias read with the wrong sign
    "bias": (0, "mlp", "convert"),                # a missing bias mapping (no row for the router bias)
    "groups": (0, "attention", "update groups"),  # a wrong update group (the sinks left out of the attention group)
    "tp_axis": (0, "attention", "divergence"),    # a wrong TP axis (q/k/v bias split like gate/up): TP > 1 only
}
#: the mistakes whose logits are right (the row named is a structural one) and the one that needs TP > 1
STRUCTURAL = {bug for bug, (_, _, row) in PLANTED.items() if row != "divergence"}
TP_ONLY = {"tp_axis"}


#: The planted gradient mistake: a provider that feeds each router a detached copy of its input. The logits, the
#: round trip and every capture point are right; only the gradients of what lies below the routers differ (HF's
#: routing weights pass gradient into the hidden states), so only a gradient check can see it.
GRADIENT_BUG = "detached_router"


def _assert_gradient_mistake_caught(report, label):
    rows = _rows(report)
    assert rows["logits"][0] == "ok", report.rows  # the forward pass is right
    status, detail = rows["gradients"]
    # the worst tensor feeds a router (measured: layer 1's post_attention_layernorm, relative 0.42)
    assert status == "FAIL" and re.search(r"; worst: model\.layers\.\d\.", detail), report.rows
    assert not report.ok and report.rows[-1].step == f"gradients ({label}, fp32)", report.rows


def _assert_kit_refuses(result, case):
    """The kit's training-step case fails on ``result`` (as the kit class reads it from its run), naming the
    gradients: a family with this mistake cannot pass the kit, so cannot be VALIDATED."""
    from ferrule.conformance.kit import FamilyConformance

    assert "gradients" in result["error"] and "differ from HF's" in result["error"], result
    key = "train"
    with pytest.raises(pytest.fail.Exception, match=r"gpt_oss \(training step, TP=\d\): .*gradients"):
        if case == "tp1":
            FamilyConformance().test_training_step("gpt_oss", {"gpt_oss": {key: result}})
        else:
            FamilyConformance().test_training_step_tp2("gpt_oss", {"gpt_oss": {"ok": True, key: result}})


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


#: how ``ferrule check`` names a layer and op: the divergence row ("first departure: layer 0 mlp (max diff ...)") and
#: a structural FAIL row ("layer 0 mlp: MappingError: ...")
_NAMED = re.compile(r"(?:first departure: )?layer (\d+) (\w+)[ :]")


def _named(report):
    """``(row, layer, op)`` of the first FAIL row that names a layer and op, as the tool printed it."""
    for r in report.rows:
        m = _NAMED.match(r.detail) if r.status == "FAIL" else None
        if m:
            return r.step.split(" (")[0], int(m.group(1)), m.group(2)
    return None


def _assert_localised(report, bug):
    layer, op, row = PLANTED[bug]
    rows = _rows(report)
    assert not report.ok, (bug, report.rows)
    # a numeric mistake fails the logits; a structural one leaves nothing to compare (convert) or right logits
    logits = rows.get("logits", ("absent",))[0]
    assert logits == ("absent" if row == "convert" else "ok" if bug in STRUCTURAL else "FAIL"), (bug, report.rows)
    assert _named(report) == (row, layer, op), (bug, report.rows)
    if bug == "sinks":  # a dropped HF key is also named by tensor in the round trip
        assert rows["round trip"][0] == "FAIL" and "model.layers.0.self_attn.sinks" in rows["round trip"][1]
    elif "round trip" in rows:  # every other mistake converts back bit-exact
        assert rows["round trip"][0] == "ok", (bug, rows["round trip"])


@pytest.mark.timeout(600)
def test_gptoss_passes_check_with_gradients_and_each_planted_mistake_is_localised_at_tp1(gptoss_hf):
    """The correct family passes every step at TP=1, gradients of all 37 tensors included; each of the 12 planted
    mistakes that can show at TP=1 is named by its layer and op (the first diverging capture point for a numeric
    one, the convert or update-groups row for a structural one); the TP-axis mistake cannot show at TP=1 (it
    passes); a wrong update group names the parameters a weight sync would lose. The planted gradient mistake
    (routers fed a detached input: right logits) fails ``--grads`` and the kit's training-step case."""
    env, hf = gptoss_hf
    good = _check(env, hf, grads=True)
    assert good.ok, good.rows
    assert [r.step for r in good.rows] == ["config", "convert (tp=1)", "round trip (tp=1)", "logits (tp=1, fp32)",
                                           "gradients (tp=1, fp32)"]
    assert good.rows[-1].detail.startswith("37 parameters, "), good.rows[-1]
    reports = {bug: _check(env, hf, bug) for bug in PLANTED.keys() - TP_ONLY}
    for bug, report in reports.items():
        _assert_localised(report, bug)
    assert _check(env, hf, "tp_axis", round_trip=False).ok
    _assert_gradient_mistake_caught(_check(env, hf, GRADIENT_BUG, grads=True, round_trip=False), "tp=1")
    from ferrule.conformance import numeric as cn
    from ferrule.conformance.tp1 import _run

    with environment(dict(env, FERRULE_GPTOSS_FIXTURE_BUG=GRADIENT_BUG)):  # the kit's TP=1 training-step case
        _assert_kit_refuses(_run(lambda: cn.check_training_step("gpt_oss", hf.parent / "kit", src=hf)), "tp1")
    with environment(dict(env, FERRULE_GPTOSS_FIXTURE_BUG="groups")):  # its weight sync: the sinks would stay stale
        lost = _run(lambda: cn.check_training_step("gpt_oss", hf.parent / "kit_groups", src=hf))["error"]
    assert lost.startswith("WeightSyncError: ") and "core_attention.softmax_offset (layer 0 attention)" in lost, lost
    groups = _rows(reports["groups"])["update groups"][1]
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset (layer 0 attention)" in groups, groups
    assert "decoder.layers.0.mlp.router.bias (layer 0 mlp)" in _rows(reports["bias"])["convert"][1]


@pytest.mark.timeout(300)
def test_gradients_at_tp2_of_a_family_with_q_k_norms_match_hf(tmp_path, pooled_ranks):
    """Qwen3's per-head q/k norms are replicated over TP and each rank applies them to its own heads, so its raw
    gradient is partial; the check sums them over TP as megatron's gradient finalization does (refused before;
    without the sum they are off by ~the other rank's share), and every tensor's gradient matches HF's. --ep 2
    together with --tp 2 is refused in one line, before any conversion, for every family."""
    from ferrule.conformance import numeric as cn
    from ferrule.converters.check import run_check

    hf = cn.tiny_hf_dir("qwen3", tmp_path / "hf", overrides={"num_key_value_heads": 2})
    from safetensors import safe_open

    with safe_open(hf / "model.safetensors", "pt") as f:  # every checkpoint tensor, the q/k norms included
        keys = list(f.keys())
    assert any(k.endswith("self_attn.q_norm.weight") for k in keys)
    report = run_check(hf, tp=2, seq_len=16, grads=True, round_trip=False)
    assert report.ok and report.rows[-1].step == "gradients (tp=2, fp32)", report.rows
    assert report.rows[-1].detail.startswith(f"{len(keys)} parameters, "), report.rows[-1]
    with pytest.raises(ValueError, match=r"grads=True at tp=2, ep=2: .* ep > 1 with tp=1 only"):
        run_check(hf, tp=2, ep=2, grads=True)
    from inproc import run_ferrule

    cli = run_ferrule(["check", hf, "--tp", "2", "--ep", "2", "--grads"], env=dict(os.environ, COLUMNS="500"))
    assert cli.returncode == 2 and "--grads with --tp 2 --ep 2: expected --ep 1, or --tp 1" in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


@pytest.mark.timeout(1200)
def test_gptoss_passes_check_at_tp2_etp1_and_each_planted_mistake_is_localised(gptoss_hf, pooled_ranks, dist_pool):
    """--tp 2 --etp 1 (the sinks and attention split over TP, the biased experts whole): the correct family passes,
    gradients included (refused at TP > 1 before; gpt-oss has no q/k norm, whose raw gradients would be partial per
    rank), and all 13 planted mistakes, the q/k/v bias split like a gate/up block included (same shapes, wrong
    numbers: only TP > 1 shows it), are named by layer and op. The round trip runs for the dropped key only (the
    TP=1 test shows every other planted mistake converting back bit-exact; the good check, this layout's). The
    planted gradient mistake passes the kit's TP=2 logits and round trip, and fails its training step and
    ``--grads`` at this layout."""
    env, hf = gptoss_hf
    # the kit's TP=2 launch (as its class runs it, in the session's ranks) on the planted gradient mistake
    out = hf.parent / "kit_tp2.json"
    dist_pool.run(["-m", "ferrule.conformance.tp", "--work", str(hf.parent / "kit_tp2"), "--out", str(out), "gpt_oss"],
                  env=dict(env, FERRULE_GPTOSS_FIXTURE_BUG=GRADIENT_BUG, OMP_NUM_THREADS="1"), timeout=300)
    kit = json.loads(out.read_text())["gpt_oss"]
    assert kit["ok"], kit  # logits and round trip at TP=2 pass
    with environment(env):
        _assert_kit_refuses(kit["train"], "tp2")
    _assert_gradient_mistake_caught(_check(env, hf, GRADIENT_BUG, tp=2, etp=1, grads=True, round_trip=False),
                                    "tp=2, etp=1")
    good = _check(env, hf, tp=2, etp=1, grads=True)
    assert good.ok and good.rows[2].step == "round trip (tp=2, etp=1)", good.rows
    assert good.rows[3].step == "logits (tp=2, etp=1, fp32)", good.rows
    assert good.rows[4].step == "gradients (tp=2, etp=1, fp32)" and good.rows[4].detail.startswith("37 parameters, ")
    # --ep 2 (refused before): each rank's experts hold both ranks' tokens until DDP's 1/ep scaling, which the
    # check applies (without it the experts' gradients are 2x: relative 1; measured 5.3e-7 with it)
    ep2 = _check(env, hf, ep=2, etp=1, grads=True, round_trip=False)
    assert ep2.ok and ep2.rows[-1].step == "gradients (tp=1, ep=2, etp=1, fp32)", ep2.rows
    assert ep2.rows[-1].detail.startswith("37 parameters, "), ep2.rows[-1]
    # the missing mapping row last: its conversion fails in the ranks (the pool keeps its ranks: tests/dist_pool.py)
    for bug in sorted(PLANTED, key=lambda b: PLANTED[b][2] == "convert"):
        _assert_localised(_check(env, hf, bug, tp=2, etp=1, round_trip=bug == "sinks"), bug)


