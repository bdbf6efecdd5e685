"""``ferrule check``: a checkpoint ferrule reproduces passes (exit 0); a plugin bug is located (exit 1).

References: HF transformers' logits and hidden states on the same checkpoint, the source
safetensors files (round trip).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ferrule import conformance_numeric as cn
from fixture_plugins import ROOT, plugin_env

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_check_passes_on_qwen2(tmp_path):
    from ferrule.converters.check import run_check

    src = cn.tiny_hf_dir("qwen2", tmp_path / "hf")
    report = run_check(src, seq_len=24)
    assert [(r.step, r.status) for r in report.rows] == [
        ("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"), ("logits (tp=1, fp32)", "ok")]
    assert report.ok and report.divergence == []


@pytest.mark.timeout(600)
def test_check_locates_a_dropped_sliding_window(tmp_path):
    """A plugin that drops Mistral's window: exit 1, and the report names layer 0's attention."""
    env = plugin_env(tmp_path, ("ferrule-swa-fixture",))
    make = subprocess.run([sys.executable, "-c", "import sys; from ferrule import conformance_numeric as cn; "
                           "cn.tiny_hf_dir('mistral', sys.argv[1])", str(tmp_path / "hf")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert make.returncode == 0, make.stderr[-2000:]
    env["FERRULE_SWA_FIXTURE_BAD_WINDOW"] = "1"
    proc = subprocess.run([sys.executable, "-m", "ferrule.cli", "check", str(tmp_path / "hf"), "--seq-len", "16"],
                          env=dict(env, COLUMNS="200"), cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    import re

    out = proc.stdout
    assert re.search(r"round trip \(tp=1\)\s*│ ok", out), out
    assert re.search(r"logits \(tp=1, fp32\)\s*│ FAIL", out), out
    assert "first departure: layer 0 attention" in out, out
    assert "per-layer divergence" in out
