"""``cross_entropy`` with rank-2 ``target_tokens`` / ``weights`` ``[N, K]`` (the off-policy distillation
recipes' top-k targets), driven by the unmodified ``tinker`` 0.38.0 SDK.

Referees: HF transformers' float64 log-softmax of the served base (a fresh LoRA client's adapters
are zero, so it is the base) for the ``[N, K]`` logprobs and the loss; for split invariance, the
same batch sent whole to a server whose chunk size holds it and chunked (3 data per request) to
the shared server: the trained sampler weights must be equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
from serve_helpers import MODEL_NAME, RunningServer, adam, base, sampler_weights, server  # noqa: E402,F401
from tinker import types  # noqa: E402

K = 3
LENGTHS = (5, 8, 4, 7, 6)


def rank2_data(seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    data, raw = [], []
    for n in LENGTHS:
        tokens = torch.randint(0, 96, (n,), generator=g)
        targets = torch.randint(0, 96, (n, K), generator=g)
        weights = torch.rand(n, K, generator=g)
        weights[0] = 0.0
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens.tolist()),
                                loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                                "weights": types.TensorData.from_torch(weights)}))
        raw.append((tokens, targets, weights))
    return data, raw


def test_rank2_cross_entropy_logprobs_and_loss_match_hf(server, base):
    tc = server.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    data, raw = rank2_data()
    out = tc.forward(data, "cross_entropy").result(timeout=120)
    hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    total = 0.0
    for (tokens, targets, weights), o in zip(raw, out.loss_fn_outputs):
        with torch.no_grad():
            lp = torch.log_softmax(hf(tokens[None]).logits[0].double(), -1).gather(-1, targets)   # [N, K]
        got = torch.tensor(o["logprobs"].to_numpy(), dtype=torch.float64)
        assert tuple(got.shape) == (len(tokens), K)
        assert float((got - lp).abs().max()) < 1e-5
        total += float(-(weights.double() * lp).sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_rank2_cross_entropy_is_split_invariant(server, base, tmp_path):
    whole = RunningServer(base, tmp_path / "whole", chunk_len=1024)
    try:
        paths = []
        for srv in (whole, server):          # one request, then three (chunk_len 3)
            tc = srv.client().create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
            data, _ = rank2_data(seed=11)
            tc.forward_backward(data, "cross_entropy").result(timeout=120)
            tc.optim_step(adam()).result(timeout=120)
            paths.append((srv, tc.save_weights_for_sampler("rank2").result(timeout=120).path))
        a, b = (sampler_weights(srv, p) for srv, p in paths)
        changed = sampler_weights(server, paths[1][1])
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
        hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
        assert any(not torch.equal(changed[k], hf[k]) for k in changed if k in hf)   # the step did train
    finally:
        whole.stop()


def test_rank2_needs_matching_weights_and_cross_entropy(server):
    tc = server.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.zeros(3, 2, dtype=torch.int64)),
                                      "weights": types.TensorData.from_torch(torch.ones(3))})
    with pytest.raises(tinker.BadRequestError, match=r"need weights of the same shape"):
        tc.forward([bad], "cross_entropy").result(timeout=60)
    assert len(tc.forward([rank2_data()[0][0]], "cross_entropy").result(timeout=60).loss_fn_outputs) == 1
