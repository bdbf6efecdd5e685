"""Fixture plugin families (tests/fixtures) through the conformance kit, the embedded engine and the TP=2 check.

References: HF transformers' Mistral and Gemma-2 models (logits, rotary tables, module shapes),
the safetensors files transformers saved (round trips).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixture_plugins import FIXTURES, ROOT, plugin_env
from inproc import environment

pytestmark = pytest.mark.slow


@pytest.mark.timeout(2400)
def test_fixture_families_pass_the_kit_at_tp1_and_tp2(dist_pool, tmp_path):
    """Sliding-window (Mistral-like), Gemma-2-like, OLMo-2-like (post-norms only, full-projection q/k norm),
    Gemma-3-text-like (one RoPE per layer type) and gpt-oss-like (attention sinks, clamped interleaved SwiGLU
    experts, biases everywhere, YaRN; TP=2 at expert TP 1) families: every kit case at TP=1 and TP=2, the training
    step (every parameter's gradient vs HF's, a weight sync through the update groups) included. The kit's
    TP=2 launch runs in this session's pool, lent to the child session (``DistPool.lend``), instead of a torchrun."""
    from dist_pool import LEND_ENV

    lent = tmp_path / "lent-pool"
    lent.mkdir()
    env = dict(plugin_env(tmp_path), **{LEND_ENV: str(lent)})
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (CI: --cpu-report) belong to its own plugins
    # -n 0: the repository's addopts say -n auto, and xdist would run the kit's class fixtures
    # (the TP=1 interpreter, the TP=2 launch) once per worker, each family's work twice
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
                                  "--confcutdir", str(FIXTURES), "-o", "timeout=2300",
                                  str(FIXTURES / "kit_fixture_families.py")],
                                 cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        dist_pool.lend(child, lent, timeout=2350)
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(child.args, child.returncode, out.read(), err.read())
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert list(lent.glob("answer-*.json")), "the kit's TP=2 launch did not use the lent pool"
    # 5 families x 9 cases (discovery, specs, completeness, references, update-group coverage,
    # numeric TP=1, numeric TP=2, training step (gradients vs HF, every tensor synced) at TP=1 and at TP=2);
    # the 10th case, media logits, does not apply: none has a tower.
    assert "45 passed, 5 skipped" in summary and "failed" not in summary, summary
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 5 and all("declares no towers" in line for line in skips), "\n".join(skips)


@pytest.mark.timeout(600)
def test_wrong_tp_split_fails_at_tp2_and_blames_the_plugin(dist_pool, tmp_path):
    """o_proj split on the wrong axis: the kit's TP=2 launch fails and names the plugin's TP split."""
    env = plugin_env(tmp_path, ("ferrule-swa-fixture",))
    env["FERRULE_SWA_FIXTURE_BAD_TP"] = "1"
    out = tmp_path / "r.json"
    dist_pool.run(["-m", "ferrule.conformance.tp", "--work", str(tmp_path), "--out", str(out), "mistral"],
                  cwd=ROOT, env=env, timeout=550)
    result = json.loads(out.read_text())["mistral"]
    assert not result["ok"]
    assert "self_attention.linear_proj.weight" in result["error"]
    assert "suspect the plugin" in result["error"] and "TPSplit.COLUMN" in result["error"]


@pytest.mark.timeout(300)
def test_embedded_engine_loads_gemma2_with_the_family_attn_implementation(tmp_path):
    """transformers refuses attn_implementation='sdpa' for Gemma-2; the family chose 'eager'."""
    from ferrule.conformance import numeric as cn
    from ferrule.rollout.embedded import EmbeddedEngine

    env = plugin_env(tmp_path, ("ferrule-gemma2-fixture",))
    with environment(env):
        engine = EmbeddedEngine(hf_dir=cn.tiny_hf_dir("gemma2", tmp_path / "hf"))
        assert engine.model.config._attn_implementation == "eager"


@pytest.mark.timeout(300)
def test_kit_refuses_a_test_sequence_that_hides_the_window(tmp_path):
    """A window as long as the test sequence never bites: the kit says so and names the fix."""
    from ferrule.conformance import numeric as cn

    env = plugin_env(tmp_path, ("ferrule-swa-fixture",))
    with environment(env):
        effects = cn.check_features_reached("mistral", str(tmp_path / "ok"))
        with pytest.raises(AssertionError) as refused:
            cn.check_features_reached("mistral", str(tmp_path / "short"), seq_len=4)
    assert effects["sliding_window"] > 1e-2
    assert "sliding_window=4" in str(refused.value) and "TINY_TEST_SEQ_LEN" in str(refused.value)


def test_token_ids_outside_the_vocabulary_are_named():
    from ferrule.conformance import numeric as cn

    assert cn.test_token_ids(96, 5).shape == (2, 5)
    with pytest.raises(ValueError, match=r"token ids \[96, 200\] are outside the model's vocabulary \[0, 96\)"):
        cn.test_token_ids(96, 3, ids=[[1, 200, 96]])


@pytest.mark.timeout(400)
def test_kit_compares_rotary_tables_per_layer_type(tmp_path):
    """Gemma-3: the kit compares each layer's RoPE with HF's table for its layer type (before: TypeError,
    rotary_emb needs layer_type); a plugin giving every layer one RoPE fails naming the full-attention layer."""
    from ferrule.conformance import numeric as cn

    env = plugin_env(tmp_path, ("ferrule-gemma3-fixture",))
    with environment(env):
        assert cn.check_translation_matches_hf("gemma3", str(tmp_path / "ok")) <= 1e-6
    with environment(dict(env, FERRULE_GEMMA3_FIXTURE_BUG="one_rope")), pytest.raises(AssertionError) as bad:
        cn.check_translation_matches_hf("gemma3", str(tmp_path / "bad"))
    assert str(bad.value).startswith("gemma3: layer 1 (full_attention): rotary cos/sin differ"), str(bad.value)
