"""Embedded rollout for Inkling: sampled-token logprobs equal one full forward of InklingForCausalLM.

The engine decodes Inkling through transformers' own cache (ShortConv states + sliding windows;
``ferrule.rollout._hf_cache_decode``), one batch per prompt length. Referee: a single forward of
the same ``InklingForCausalLM`` over prompt + response without any cache (fp32), log-softmax at
the positions that sampled each token. Tolerance 1e-5 (fp32).
"""

from __future__ import annotations

import torch

from inkling_fixtures import tiny_inkling_dir

ATOL = 1e-5


def test_sampled_logprobs_equal_full_forward(tmp_path):
    from transformers import InklingForCausalLM

    from ferrule.rollout.base import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    path = tiny_inkling_dir(tmp_path / "m", {"sliding_window_size": 3, "rel_extent": 5})
    engine = EmbeddedEngine(hf_dir=path)
    assert engine._windows is None  # Inkling layers go through the HF-cache path
    prompts = [[5, 9, 11, 3], [7, 8], [1, 2, 3, 4, 5, 6, 7]]  # different lengths: grouped, never padded
    params = SamplingParams(n=3, max_new_tokens=9, temperature=1.0, seed=11, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert len(results) == 9 and all(len(r.token_ids) == 9 for r in results)
    ref = InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for r in results:
        prompt = prompts[r.prompt_index]
        ids = torch.tensor([prompt + list(r.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
        n = len(prompt)
        want = logp[n - 1:-1].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(r.logprobs) - want).abs().max().item())
    assert worst <= ATOL, worst
    # same seed, same samples (the per-length grouping is deterministic)
    again = engine.generate(prompts, params)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def test_update_weights_takes_every_checkpoint_tensor(tmp_path):
    from safetensors.torch import load_file

    from ferrule.rollout.embedded import EmbeddedEngine

    path = tiny_inkling_dir(tmp_path / "m")
    engine = EmbeddedEngine(hf_dir=path)
    saved = load_file(str(path / "model.safetensors"))
    doubled = {k: v * 2 for k, v in saved.items()}
    engine.update_weights(doubled.items(), version=1)
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in doubled.items())  # includes the router's e_score_correction_bias
