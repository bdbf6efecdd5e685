"""Opt-in: the llama plugin on the real SmolLM2-135M-Instruct checkpoint (CI opts in: ``.ci/run`` sets the variable).

Set ``FERRULE_LLAMA_SMOLLM2_DIR`` to a directory made by ``ferrule assets smollm2 DIR``
(``DIR/hf`` required; ``DIR/torch_dist`` is used if present, else converted into a temp dir).
Checks (megatron's parallel state is set up and torn down around the model, ``single_rank``):

1. torch_dist -> HF reproduces every safetensors tensor of ``DIR/hf`` bit-exactly;
2. Megatron (built by the llama provider, fp32, weights loaded from the torch_dist checkpoint)
   vs HF transformers ``LlamaForCausalLM`` (fp32, from ``DIR/hf``) on a real prompt rendered
   with the ``smollm2`` chat template: max |logits diff| <= :data:`REAL_ATOL` and the same
   greedy next token at every position.

About 40 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ENV = "FERRULE_LLAMA_SMOLLM2_DIR"
#: fp32 tolerance on logits (|logit| up to ~30) through 30 layers; bf16-stored weights are
#: exact in fp32, so only the summation order differs between the two implementations.
REAL_ATOL = 1e-3
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
#: the main job's batch in the test: 2 prompts x 4 samples (GRPO groups of 4; still 2 mini-batches, so the
#: PPO ratio and the old-logprob pass run) of <= 16 new tokens (the config's 32 for rollout and evaluation alike:
#: no assertion reads the text, and decoding is most of a step) and 4 evaluation prompts
SMALL_BATCH = ("train.prompts_per_step=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=16",
               "eval.n_prompts=4")


def _check(asset_dir: str, work: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferrule.contract import registry
    from ferrule.chat import render_chat
    from ferrule.conformance.numeric import single_rank
    from ferrule.converters import SafetensorsReader, hf_to_torch_dist, torch_dist_to_hf
    from ferrule.converters.checkpoint import load_torch_dist_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    hf_dir, td_dir = Path(asset_dir) / "hf", Path(asset_dir) / "torch_dist"
    if not (td_dir / "metadata.json").is_file():
        td_dir = hf_to_torch_dist(hf_dir, Path(work) / "torch_dist")
    torch_dist_to_hf(td_dir, Path(work) / "hf_back")
    a, b = SafetensorsReader(hf_dir), SafetensorsReader(Path(work) / "hf_back")
    assert a.keys() == b.keys(), sorted(set(a.keys()) ^ set(b.keys()))
    changed = [k for k in a.keys() if a.get(k).dtype != b.get(k).dtype or not torch.equal(a.get(k), b.get(k))]
    assert not changed, f"torch_dist -> HF changed {changed}"

    hf_config = json.loads((hf_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = render_chat("smollm2", PROMPT, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    del hf
    with single_rank():
        (model,) = registry.provider_build("llama")(hf_config, ParallelLayout(),
                                                                      params_dtype=torch.float32)
        load_torch_dist_into_mcore([model], td_dir)
        model.eval()
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            out = model(ids, pos, attention_mask=None)[..., : hf_config["vocab_size"]].float()
    return {
        "tokens": int(ids.shape[1]),
        "max_abs_diff": (out - ref).abs().max().item(),
        "max_abs_logit": ref.abs().max().item(),
        "argmax_equal": bool(torch.equal(out.argmax(-1), ref.argmax(-1))),
        "next_token": tok.decode([int(out[0, -1].argmax())]),
        "dtype_megatron": str(next(model.parameters()).dtype),
    }


@pytest.mark.skipif(not os.environ.get(ENV), reason=f"opt-in: set {ENV}=DIR (made by `ferrule assets smollm2 DIR`)")
def test_smollm2_round_trip_and_logits(tmp_path):
    asset_dir = os.environ[ENV]
    if not (Path(asset_dir) / "hf" / "config.json").is_file():
        pytest.fail(f"{ENV}={asset_dir} has no hf/config.json; run `ferrule assets smollm2 {asset_dir}` first.")
    result = _check(asset_dir, str(tmp_path))
    print(result)
    assert result["max_abs_diff"] <= REAL_ATOL, result
    assert result["argmax_equal"], result


@pytest.mark.skipif(not os.environ.get(ENV), reason=f"opt-in: set {ENV}=DIR (made by `ferrule assets smollm2 DIR`)")
@pytest.mark.timeout(900)
def test_readme_main_job_runs_two_steps(tmp_path):
    """The README's main job, as a user runs it (``ferrule train examples/configs/smollm2_arithmetic.yaml``),
    for 2 GRPO steps on the real model, in-process: it writes a metrics line per step with a finite loss and
    a reward in [0, 1], and the reward-curve PNG. (CI used to run this as a
    separate command before the tests; here it shares a test worker instead of an interpreter of its own.)
    Every stage of the config runs (the step-0 evaluation, rollouts, the old-logprob pass and two optimizer
    steps per rollout, the last step's checkpoint, the plot) on a smaller batch (:data:`SMALL_BATCH`): the
    config's 4 prompts x 8 samples and 32 evaluation prompts made this the suite's longest test (175 s in
    CI, 106 s of it the 2 steps' forward/backward matmuls at one thread), for no more than it checks."""
    import math

    repo = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(repo / "tests"))  # ferrule's in-process CLI runner (also when run from this folder)
    from inproc import run_ferrule

    asset_dir = Path(os.environ[ENV]).resolve()
    run_dir = tmp_path / "run"
    proc = run_ferrule(["train", repo / "examples" / "configs" / "smollm2_arithmetic.yaml", "--run-dir", run_dir,
                        "train.steps=2", *SMALL_BATCH, f"model.hf_dir={asset_dir / 'hf'}"], cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from ferrule.rl.metrics import read_metrics

    entries = read_metrics(run_dir / "metrics.jsonl")
    steps = [e for e in entries if "loss" in e]  # step 0 holds the first evaluation only
    assert [e["step"] for e in steps] == [1, 2], entries
    assert "eval_reward_mean" in entries[0], entries[0]
    for e in steps:
        assert math.isfinite(e["loss"]) and 0.0 <= e["reward_mean"] <= 1.0, e
    png = run_dir / "reward_curve.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


if __name__ == "__main__":
    print(json.dumps(_check(sys.argv[1], sys.argv[2])))
