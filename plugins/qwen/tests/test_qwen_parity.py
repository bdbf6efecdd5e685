"""Megatron (ferrule provider + mapping table) vs HF transformers logits for tiny random Qwen models.

Referee: transformers' Qwen2/Qwen3/Qwen3-MoE forward in fp32. Tolerance 1e-5 max abs diff
(the observed differences are ~1e-7: fp32 summation order only).

- TP=1 in this process (``ferrule.conformance.numeric.check_logits_parity``).
- One ``torchrun`` launch with 2 gloo processes (plugins/qwen/tests/dist/qwen_parity_worker.py): TP=2 for
  Qwen2 / Qwen3 tied / Qwen3-MoE, EP=2 for Qwen3-MoE (alltoall and allgather dispatchers),
  export at PP=2, and torch_dist resharding (saved at TP=1 -> loaded at TP=2, saved at TP=2 ->
  loaded at TP=1, MoE saved at EP=2 -> loaded at TP=2). Every case also checks that
  ``export_mcore_to_hf`` reproduces the HF safetensors bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrule import envs
from ferrule.conformance import numeric as cn

ATOL = 1e-5
REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "dist" / "qwen_parity_worker.py"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_logits_match_hf_tp1(family, tmp_path):
    diff = cn.check_logits_parity(family, tmp_path, atol=ATOL)
    assert diff <= ATOL


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_tp2_ep2_pp2_and_resharding_over_two_gloo_processes(dist_pool, tmp_path):
    from ferrule.converters import hf_to_torch_dist

    cn.tiny_hf_dir("qwen2", tmp_path / "qwen2")
    cn.tiny_hf_dir("qwen3", tmp_path / "qwen3_tied", overrides={"num_key_value_heads": 2, "tie_word_embeddings": True})
    cn.tiny_hf_dir("qwen3", tmp_path / "qwen3_untied",
                   overrides={"num_key_value_heads": 2, "tie_word_embeddings": False})
    cn.tiny_hf_dir("qwen3_moe", tmp_path / "qwen3_moe")
    hf_to_torch_dist(tmp_path / "qwen3_untied", tmp_path / "qwen3_untied_td")  # saved at TP=1
    env = envs.child_env(OMP_NUM_THREADS="1")
    proc = dist_pool.run([str(WORKER), str(tmp_path)], timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    expected_cases = {"qwen2_tp2", "qwen3_tied_tp2", "qwen3_moe_tp2", "qwen3_moe_ep2", "qwen3_moe_ep2_allgather",
                      "qwen3_untied_pp2_export", "qwen3_untied_td_tp1_to_tp2", "qwen3_untied_td_tp2_to_tp1",
                      "qwen3_moe_td_ep2_to_tp2"}
    assert set(results) == expected_cases
    not_exact = [c for c, r in results.items() if not r["export_exact"]]
    assert not not_exact, f"export differs from the HF files: {not_exact}"
    too_far = {c: r["logits_diff"] for c, r in results.items() if "logits_diff" in r and not r["logits_diff"] <= ATOL}
    assert not too_far, f"logits differ from HF by more than {ATOL}: {too_far}"
