"""``sample`` with ``topk_prompt_logprobs``, ``topk_sample_logprobs``, ``target_prompt_logprobs`` and
``prompt_alt_tokens_k``, driven by the unmodified ``tinker`` 0.38.0 SDK (which decodes the protobuf).

Referee: HF transformers' float64 log-softmax of the served base model (tests/serve_helpers.py's
tiny random Qwen2), at the positions and temperatures the SDK documents for each field.
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
from serve_helpers import MODEL_NAME, base, server  # noqa: E402,F401  (fixtures)
from tinker import types  # noqa: E402

PROMPT = [3, 17, 42, 5, 60, 11, 29, 8]
TEMP = 0.7
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf(base):
    return Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def hf_lp(hf, tokens, temperature=1.0) -> torch.Tensor:
    """``[len(tokens), V]`` float64: row i = log p(. | tokens[:i + 1]) at ``temperature``."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits / temperature, -1)


def test_topk_target_and_alternative_prompt_logprobs_match_hf(server, hf):
    sc = server.client().create_sampling_client(base_model=MODEL_NAME).result()
    targets = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    targets[:, 0] = torch.tensor(PROMPT[1:])            # the prompt's own next tokens
    targets[2, 1], targets[5, 2] = 7, 95
    res = sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=2,
                    sampling_params=types.SamplingParams(max_tokens=6, temperature=TEMP, seed=5),
                    include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3,
                    target_prompt_logprobs=types.TensorData.from_torch(targets),
                    prompt_alt_tokens_k=5).result(timeout=120)
    ref = hf_lp(hf, PROMPT)                                        # row i scores prompt position i + 1
    # top-k of the prompt: row 0 has no context (None), row i the k most likely ids after prompt[:i]
    topk = res.topk_prompt_logprobs
    assert len(topk) == len(PROMPT) and topk[0] is None
    for i in range(1, len(PROMPT)):
        want_lp, want_ids = torch.topk(ref[i - 1], 4)
        assert [t for t, _ in topk[i]] == want_ids.tolist()
        assert max(abs(lp - w) for (_, lp), w in zip(topk[i], want_lp.tolist())) < ATOL
    # target logprobs: the request's shape, 0.0 where it asked nothing
    got = torch.tensor(res.target_prompt_logprobs.to_numpy(), dtype=torch.float64)
    assert tuple(got.shape) == tuple(targets.shape)
    want = ref[:-1].gather(-1, targets.clamp(min=0)).masked_fill(targets < 0, 0.0)
    assert float((got - want).abs().max()) < ATOL
    assert float((got[:, 0] - torch.tensor(res.prompt_logprobs[1:])).abs().max()) < ATOL
    # alternative tokens: [P - 1, k] ids with their logprobs at the request's temperature
    alt_ids = torch.tensor(res.prompt_alt_tokens.tokens.to_numpy())
    alt_lp = torch.tensor(res.prompt_alt_tokens.logprobs.to_numpy(), dtype=torch.float64)
    assert tuple(alt_ids.shape) == (len(PROMPT) - 1, 5)
    tempered = hf_lp(hf, PROMPT, TEMP)[:-1]
    assert float((alt_lp - tempered.gather(-1, alt_ids)).abs().max()) < ATOL
    # top-k of each sampled token: the distribution its own logprob is reported under (tempered)
    for seq in res.sequences:
        full = hf_lp(hf, PROMPT + seq.tokens, TEMP)[len(PROMPT) - 1:-1]
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for t, (tok, own), row in zip(range(len(seq.tokens)), zip(seq.tokens, seq.logprobs), seq.topk_logprobs):
            want_lp, want_ids = torch.topk(full[t], 3)
            assert [i for i, _ in row] == want_ids.tolist()
            assert max(abs(lp - w) for (_, lp), w in zip(row, want_lp.tolist())) < ATOL
            assert abs(own - float(full[t, tok])) < ATOL


def test_sparse_targets_last_n_and_bad_requests(server, hf):
    sc = server.client().create_sampling_client(base_model=MODEL_NAME).result()
    # three cells listed of a [7, 2] request: (1, 0) -> 9, (4, 1) -> 33, (6, 0) -> 2
    td = types.TensorData(data=[9, 33, 2], dtype="int64", shape=[len(PROMPT) - 1, 2],
                          sparse_crow_indices=[0, 0, 1, 1, 1, 2, 2, 3], sparse_col_indices=[0, 1, 0])
    res = sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=1, seed=1), target_prompt_logprobs=td,
                    topk_prompt_logprobs=2, prompt_logprobs_last_n=3, include_prompt_logprobs=True).result(timeout=120)
    out = res.target_prompt_logprobs
    assert out.sparse_crow_indices == td.sparse_crow_indices and out.sparse_col_indices == td.sparse_col_indices
    ref = hf_lp(hf, PROMPT)[:-1]
    want = [float(ref[1, 9]), float(ref[4, 33]), float(ref[6, 2])]
    assert max(abs(a - b) for a, b in zip(out.data, want)) < ATOL
    topk = res.topk_prompt_logprobs                       # last_n applies to top-k too
    assert all(row is None for row in topk[:len(PROMPT) - 3]) and all(row is not None for row in topk[-3:])
    with pytest.raises(tinker.BadRequestError, match=r"target_prompt_logprobs has shape \[3, 2\]"):
        sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=types.SamplingParams(max_tokens=1),
                  target_prompt_logprobs=types.TensorData.from_torch(torch.zeros(3, 2, dtype=torch.int64))
                  ).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match=r"outside \[-1, 96\)"):
        sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=types.SamplingParams(max_tokens=1),
                  target_prompt_logprobs=types.TensorData.from_torch(torch.full((7, 1), 500, dtype=torch.int64))
                  ).result(timeout=60)
