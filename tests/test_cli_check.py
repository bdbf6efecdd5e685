"""``ferrule check``: a checkpoint ferrule reproduces passes (exit 0); a plugin bug is located (exit 1).

References: HF transformers' logits and hidden states on the same checkpoint, the source
safetensors files (round trip).
"""

from __future__ import annotations

import re

import pytest

from ferrule.conformance import numeric as cn
from fixture_plugins import ROOT, plugin_env
from inproc import environment, run_ferrule

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_check_passes_on_qwen2(tmp_path):
    from ferrule.converters.check import run_check

    src = cn.tiny_hf_dir("qwen2", tmp_path / "hf")
    report = run_check(src, seq_len=24, grads=True)
    assert [(r.step, r.status) for r in report.rows] == [
        ("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"), ("logits (tp=1, fp32)", "ok"),
        ("gradients (tp=1, fp32)", "ok")]
    assert report.rows[-1].detail.startswith("27 parameters, max relative |megatron - HF| = ")  # every HF tensor
    assert report.ok and report.divergence == []


@pytest.mark.timeout(600)
def test_check_passes_on_a_multimodal_family_with_text_logits(tmp_path):
    """A model_type transformers' AutoModelForCausalLM does not read (``inkling2``: text + vision tower) is loaded
    with the family's ``hf_model_class`` (Inkling2ForConditionalGeneration); the logits step compares text logits."""
    import inkling2_vision_fixtures as vf

    from ferrule.converters.check import run_check

    vf.hf_model(vf.config_dict()).save_pretrained(tmp_path / "hf")
    report = run_check(tmp_path / "hf", seq_len=16)
    assert [(r.step, r.status) for r in report.rows] == [
        ("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"), ("logits (tp=1, fp32)", "ok")]


@pytest.mark.timeout(600)
def test_check_locates_a_dropped_sliding_window(tmp_path):
    """A plugin that drops Mistral's window: exit 1, and the report names layer 0's attention."""
    env = plugin_env(tmp_path, ("ferrule-swa-fixture",))
    with environment(env):
        cn.tiny_hf_dir('mistral', tmp_path / "hf")
    env["FERRULE_SWA_FIXTURE_BAD_WINDOW"] = "1"
    proc = run_ferrule(["check", tmp_path / "hf", "--seq-len", "16"], env=dict(env, COLUMNS="200"), cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    import re

    out = proc.stdout
    assert re.search(r"round trip \(tp=1\)\s*│ ok", out), out
    assert re.search(r"logits \(tp=1, fp32\)\s*│ FAIL", out), out
    assert "first departure: layer 0 attention" in out, out
    assert "per-layer divergence" in out


def _olmo2_dir(tmp_path):
    env = plugin_env(tmp_path, ("ferrule-olmo2-fixture",))
    with environment(env):
        cn.tiny_hf_dir('olmo2', tmp_path / "hf")
    return env, tmp_path / "hf"


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """The OLMo-2 fixture plugin's env and tiny HF folder, made once for this module's checks (read only)."""
    return _olmo2_dir(tmp_path_factory.mktemp("olmo2"))


def _check(env, hf, *args, bug=""):
    env = dict(env, COLUMNS="200", FERRULE_OLMO2_FIXTURE_BUG=bug)
    return run_ferrule(["check", hf, "--seq-len", "16", *args], env=env, cwd=ROOT)


#: planted OLMo-2 plugin mistake -> the layer and op `ferrule check` must name first.
PLANTED = {"gate_up": "layer 0 mlp", "qkv": "layer 0 attention", "o_proj_t": "layer 0 attention"}


@pytest.mark.timeout(600)
def test_post_norm_family_mistakes_are_localised_at_tp1(olmo2, tmp_path):
    """OLMo-2 layers have no input_layernorm: each planted mistake still gets exit 1 and the right layer/op
    (before: AttributeError, exit 2, no table)."""
    env, hf = olmo2
    good = _check(env, hf)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    assert "Loading weights" not in good.stderr, good.stderr  # transformers' bar of the HF reference load
    for bug, where in PLANTED.items():
        proc = _check(env, hf, bug=bug)
        assert proc.returncode == 1, (bug, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert re.search(r"round trip \(tp=1\)\s*│ ok", proc.stdout), (bug, proc.stdout)
        assert f"first departure: {where} " in proc.stdout, (bug, proc.stdout)
        assert "nan" not in proc.stdout.lower(), (bug, proc.stdout)


@pytest.mark.timeout(1500)
def test_post_norm_family_at_tp2_runs_the_logits_at_tp2_and_localises_each_mistake(olmo2, tmp_path, pooled_ranks):
    """--tp 2: the logits row is computed at TP=2 (the full-projection q/k norm all-reduces there), a
    correct plugin passes, gradients included (every tensor vs HF's after megatron's TP finalization), and every planted mistake (plus a gate/up split on the wrong TP axis,
    which only TP > 1 shows) names its layer and op."""
    env, hf = olmo2
    good = _check(env, hf, "--tp", "2", "--grads")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    assert re.search(r"logits \(tp=2, fp32\)\s*│ ok", good.stdout), good.stdout
    # the TP-sharded full-projection q/k norms' gradients are not summed over TP by megatron's finalization (they
    # were: k_norm.weight relative difference 1)
    assert re.search(r"gradients \(tp=2, fp32\)\s*│ ok", good.stdout), good.stdout
    for bug, where in {**PLANTED, "tp_axis": "layer 0 mlp"}.items():
        proc = _check(env, hf, "--tp", "2", bug=bug)
        assert proc.returncode == 1, (bug, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert re.search(r"logits \(tp=2, fp32\)\s*│ FAIL", proc.stdout), (bug, proc.stdout)
        assert f"first departure: {where} " in proc.stdout, (bug, proc.stdout)


@pytest.mark.timeout(600)
def test_swapped_rows_blame_the_plugin_not_the_checkpoint(olmo2, tmp_path):
    """up_proj / down_proj named in each other's rows: a shape mismatch that says 'suspect the plugin'
    (before: 'suspect the checkpoint')."""
    env, hf = olmo2
    proc = _check(env, hf, bug="swapped_rows")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "suspect the plugin" in out and "swapped rows" in out and "suspect the checkpoint" not in out, out


@pytest.mark.timeout(600)
def test_exit_codes_separate_bad_input_from_a_crashing_plugin(olmo2, tmp_path):
    """No HF directory: exit 2; plugin code raising (the provider): exit 3 and a CRASH row, not 'unusable input'."""
    env, hf = olmo2
    missing = _check(env, tmp_path / "nowhere")
    assert missing.returncode == 2 and "has no config.json" in missing.stderr, missing.stderr
    crash = _check(env, hf, bug="crash")
    assert crash.returncode == 3, crash.stdout[-3000:] + crash.stderr[-3000:]
    assert "CRASH" in crash.stdout and "planted_bug" in crash.stdout, crash.stdout


@pytest.mark.timeout(600)
def test_check_warns_when_the_test_sequence_cannot_reach_the_window(tmp_path):
    """A window as long as the test sequence never binds: a plugin that ignores it passes, with a WARN row
    naming the --seq-len that reaches it."""
    env = plugin_env(tmp_path, ("ferrule-swa-fixture",))
    with environment(env):
        cn.tiny_hf_dir('mistral', tmp_path / "hf")
    env = dict(env, FERRULE_SWA_FIXTURE_BAD_WINDOW="1", COLUMNS="200")
    proc = run_ferrule(["check", tmp_path / "hf", "--seq-len", "4"], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"reach\s*│ WARN", proc.stdout), proc.stdout
    assert "sliding_window=4 >= the 4-token test sequence" in proc.stdout and "--seq-len 5" in proc.stdout


def test_divergence_never_picks_a_missing_point_or_nan():
    """A point one side lacks is 'not compared'; a non-finite megatron value is an infinite (not NaN) departure."""
    import math

    import torch

    from ferrule.converters.check_points import compare, first_departure

    x = torch.ones(1, 2, 4, dtype=torch.float64)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    order = [("embedding", ""), (0, "input_norm"), (0, "attention"), (0, "mlp"), (0, "output")]
    rows = compare(order, {("embedding", ""): x, (0, "attention"): x, (0, "mlp"): x, (0, "output"): x},
                   {("embedding", ""): x, (0, "input_norm"): x, (0, "attention"): x, (0, "mlp"): bad, (0, "output"): x})
    assert rows[1] == (0, "input_norm", None, "not compared: no HF module")
    assert rows[3][2] == math.inf and not any(r[2] is not None and math.isnan(r[2]) for r in rows)
    assert first_departure(rows, 1e-5)[:2] == (0, "mlp")


def test_hf_capture_points_follow_the_layer_shape_and_the_family_override():
    """Llama-style, Gemma-style and OLMo-2-style HF layers give the right capture modules; CHECK_HF_CAPTURE wins."""
    import torch

    from ferrule.converters.check_points import hf_layer_points

    def layer(*names):
        m = torch.nn.Module()
        for n in names:
            setattr(m, n, torch.nn.Identity())
        return m

    llama = layer("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    pts = hf_layer_points(llama)
    assert pts["attention"] is llama.self_attn and pts["pre_mlp_norm"] is llama.post_attention_layernorm
    assert pts["mlp"] is llama.mlp
    olmo2 = layer("self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm")
    pts = hf_layer_points(olmo2)
    assert set(pts) == {"attention", "mlp", "output"}
    assert pts["attention"] is olmo2.post_attention_layernorm and pts["mlp"] is olmo2.post_feedforward_layernorm
    gemma = layer("input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp",
                  "post_feedforward_layernorm")
    assert hf_layer_points(gemma)["pre_mlp_norm"] is gemma.pre_feedforward_layernorm
    own = layer("ln_1", "attn", "ffn")
    pts = hf_layer_points(own, {"input_norm": "ln_1", "attention": "attn", "mlp": "ffn", "pre_mlp_norm": None})
    assert pts["input_norm"] is own.ln_1 and pts["attention"] is own.attn and "pre_mlp_norm" not in pts


@pytest.mark.timeout(600)
def test_check_warns_when_a_soft_cap_never_binds(tmp_path):
    """A final-logit cap far above the logits changes nothing on the test tokens: WARN, naming the key."""
    env = plugin_env(tmp_path, ("ferrule-gemma2-fixture",))
    with environment(env):
        cn.tiny_hf_dir('gemma2', tmp_path / "hf", overrides={'final_logit_softcapping': 1e4})
    proc = run_ferrule(["check", tmp_path / "hf", "--seq-len", "16"], env=dict(env, COLUMNS="250"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "WARN" in out and "final_logit_softcapping changes HF's logits by only" in out, out
    assert "attn_logit_softcapping changes" not in out, out  # the tiny attention cap (0.5) binds
