"""Inkling-2 text (plugins/inkling2) vs transformers 5.24's ``Inkling2TextConfig`` / ``Inkling2ForCausalLM``, TP=1, fp32.

Referee: ``Inkling2ForCausalLM`` (eager attention: its only implementation) on tiny random models whose
zero-initialised parts (attention-residual queries, dynamic-convolution static taps, router bias) are
perturbed strongly, so every block is exercised. Logits: max abs diff <= 1e-5. Gradients of a summed
token log-likelihood: every HF parameter within 1e-5 relative (max abs diff / max abs HF gradient); HF's
gradients are brought to the released layout by ``save_pretrained`` itself (transformers' own reverse
conversion), so the comparison is independent of ferrule's mapping table. Exactness: both sides in float64
(tests/fp64_reference.py) agree within 1e-10 relative, and ferrule's fp32 gradients are within 1e-5 of that.
"""

from __future__ import annotations

import json

import pytest
import torch

from inkling2_fixtures import CONFIGS, _is_loop, tiny_inkling2_dir

ATOL = 1e-5
GRAD_RTOL = 1e-5
#: a looped layer's gradient sums its passes (3 here), with cancellation: measured worst 1.27e-5 on one tensor of
#: 217 (every other <= 1e-5; the loop-free configs: <= 3.9e-6), so the loop config gets 3e-5
LOOP_GRAD_RTOL = 3e-5
SEQ = 12

def _variant(path):
    from ferrule.plugins.inkling2 import inkling2_loop, inkling2_text

    hf_config = json.loads((path / "config.json").read_text())
    return (inkling2_loop if hf_config["model_type"] == "inkling2_loop_text" else inkling2_text), hf_config


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _mcore(path):
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    variant, hf_config = _variant(path)
    (model,) = variant.build_provider(hf_config, ParallelLayout())
    load_hf_into_mcore([model], path, variant.MAPPING, hf_config=hf_config)
    return model, hf_config


def _ids(vocab):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _summed_logprob(logits, ids):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).sum()


def test_translation_reads_every_hf_field():
    from transformers import Inkling2TextConfig, PreTrainedConfig

    from ferrule.plugins.inkling2.config import HF_DEFAULTS
    from ferrule.plugins.inkling2.inkling2_text import CONFIG_TRANSLATION

    fields = set(Inkling2TextConfig.__dataclass_fields__) - set(PreTrainedConfig.__dataclass_fields__)
    assert fields - set(CONFIG_TRANSLATION.hf_keys()) - set(CONFIG_TRANSLATION.harmless_keys()) == set()
    defaults = {k: f.default for k, f in Inkling2TextConfig.__dataclass_fields__.items() if k in HF_DEFAULTS}
    assert defaults == {k: v for k, v in HF_DEFAULTS.items() if k in defaults}


def test_translation_refuses_what_is_not_implemented():
    from ferrule.config_translation import ConfigTranslationError
    from ferrule.plugins.inkling2.inkling2_text import CONFIG_TRANSLATION, TINY_HF_CONFIG

    with pytest.raises(ConfigTranslationError, match="scoring_func"):
        CONFIG_TRANSLATION.to_mcore(dict(TINY_HF_CONFIG, scoring_func="softmax"))
    with pytest.raises(ConfigTranslationError, match="unpadded_vocab_size"):
        CONFIG_TRANSLATION.to_mcore(dict(TINY_HF_CONFIG, unpadded_vocab_size=101))
    _, options = CONFIG_TRANSLATION.to_mcore(dict(TINY_HF_CONFIG, routed_scaling_factor=2.5))
    assert options["route_scale"] == 2.5  # the attribute_map alias


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients_match_hf_tp1(name, tmp_path):
    from safetensors.torch import load_file

    from ferrule.conformance.numeric import single_rank
    from ferrule.mapping import MappingContext

    path = tiny_inkling2_dir(tmp_path / name, CONFIGS[name])
    hf = _hf(path).train()
    ids = _ids(hf.config.unpadded_vocab_size)
    ref = hf(input_ids=ids).logits
    _summed_logprob(ref, ids).backward()
    with torch.no_grad():  # HF's gradients in the released layout, written by transformers itself
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        for n, b in hf.named_buffers():
            b.zero_()
    hf.save_pretrained(tmp_path / "hf_grads")
    hf_grads = load_file(tmp_path / "hf_grads" / "model.safetensors")
    with single_rank():
        model, hf_config = _mcore(path)
        model.train()
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(ids)
        out = model(ids, pos, attention_mask=None)[..., : hf.config.vocab_size]
        _summed_logprob(out, ids).backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        ctx = MappingContext.from_hf_config(hf_config, padded_vocab_size=model.output_layer.weight.shape[0])
        ours = _variant(path)[0].MAPPING.mcore_to_hf(grads, ctx)
    width = ref.shape[-1]
    assert ref.abs().max() > 0.5
    if _is_loop(CONFIGS[name]):  # the loop passes matter: the same weights with one pass give other logits
        one_pass = _hf(path).eval()
        one_pass.config.loop_num_passes = 1
        with torch.no_grad():
            assert (one_pass(input_ids=ids).logits - ref).abs().max() > 1e-3
    diff = (out[..., :width] - ref).abs().max().item()
    assert diff <= ATOL, f"{name}: Megatron vs HF logits max abs diff {diff:.3g}"
    assert (out[..., width:] <= torch.finfo(out.dtype).min / 2).all()  # padded rows carry no probability
    assert set(ours) == set(hf_grads), sorted(set(ours) ^ set(hf_grads))
    bad = {}
    for key, g in hf_grads.items():
        scale = g.abs().max().item()
        rel = (ours[key] - g).abs().max().item() / max(scale, 1e-12)
        if not rel <= (LOOP_GRAD_RTOL if _is_loop(CONFIGS[name]) else GRAD_RTOL):
            bad[key] = (rel, scale)
    assert not bad, f"{name}: gradients differ (relative, scale): {bad}"
    zero = [k for k, g in hf_grads.items() if g.abs().max() == 0 and not k.endswith(("gate.bias", "experts.w13_weight",
                                                                                      "experts.w2_weight"))]
    assert zero == [], f"identically zero gradients (a block is not exercised): {zero}"


#: float64 on both sides: measured worst 2.4e-15 (logits, relative) and 2.1e-14 (gradients) on the loop config
FP64_RTOL = 1e-10


def _hf_grads_released(hf, out_dir):
    """HF's gradients in the released layout (``save_pretrained`` of the gradients; outside any fp64 context)."""
    from safetensors.torch import load_file

    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        for _, b in hf.named_buffers():
            b.zero_()
    hf.save_pretrained(out_dir)
    return load_file(out_dir / "model.safetensors")


@pytest.mark.parametrize("name", ["loop_2_6_x3", "mqa_full_first_softcaps"])
def test_fp64_logits_and_gradients_match_hf_exactly(name, tmp_path):
    """Both sides in float64 (tests/fp64_reference.py; no op returns float32, backward included): logits and every
    gradient within 1e-10 relative, so the two graphs are the same function and the fp32 gaps are rounding. Then
    ferrule in fp32 against that fp64 HF reference: every gradient within 1e-5 relative (HF's own fp32 run is
    off by up to 1.6e-5 on the loop config: the 1.27e-5 of the fp32-vs-fp32 test is HF's rounding as much as ours)."""
    from fp64_reference import FLOAT32, Float32Watch, fp64_run, relative_errors
    from transformers import AutoModelForCausalLM

    from ferrule.conformance.numeric import single_rank
    from ferrule.mapping import MappingContext

    with Float32Watch() as watch:  # the watch sees fp32 ops (else the fp64 assertion below proves nothing)
        torch.ones(2, dtype=FLOAT32).exp()
    assert watch.ops
    path = tiny_inkling2_dir(tmp_path / name, CONFIGS[name])
    # grouped_mm has no float64 kernel: HF's eager experts loop
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    hf = hf.double().train()
    ids = _ids(hf.config.unpadded_vocab_size)
    with fp64_run():
        ref = hf(input_ids=ids).logits
        _summed_logprob(ref, ids).backward()
    assert ref.dtype == torch.float64
    hf_grads = _hf_grads_released(hf, tmp_path / "hf_grads")
    width = ref.shape[-1]
    pos = torch.arange(SEQ).unsqueeze(0).expand_as(ids)
    with single_rank():
        model, hf_config = _mcore(path)  # fp32 (ferrule refuses params_dtype=float64), loaded, then .double()
        variant = _variant(path)[0]
        ctx = MappingContext.from_hf_config(hf_config, padded_vocab_size=model.output_layer.weight.shape[0])

        def grads():
            got = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            return {k: v.detach().clone() for k, v in variant.MAPPING.mcore_to_hf(got, ctx).items()}

        model.train()
        out32 = model(ids, pos, attention_mask=None)[..., :width]
        _summed_logprob(out32, ids).backward()
        ours32 = grads()
        model.double()
        with fp64_run():
            out = model(ids, pos, attention_mask=None)[..., :width]
            _summed_logprob(out, ids).backward()
        ours = grads()
    assert out.dtype == torch.float64 and set(ours) == set(hf_grads)
    logits_rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert logits_rel <= FP64_RTOL, f"{name}: fp64 logits relative diff {logits_rel:.3g}"
    rel = relative_errors(ours, hf_grads)
    bad = {k: v for k, v in rel.items() if not v <= FP64_RTOL}
    assert not bad, f"{name}: fp64 gradients differ (relative): {bad}"
    rel32 = relative_errors(ours32, hf_grads)
    bad = {k: v for k, v in rel32.items() if not v <= GRAD_RTOL}
    assert not bad, f"{name}: ferrule fp32 gradients vs HF fp64 (relative): {bad}"
    assert (out32.double() - ref).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["mqa_full_first_softcaps", "loop_2_6_x3"])
def test_embedded_rollout_logprobs_and_weight_sync(name, tmp_path):
    """Sampled-token logprobs of the embedded engine == one cache-free forward of the HF model (fp32, 1e-5); a
    weight update in the released layout (padded unembedding included) lands in the engine's model exactly."""
    from safetensors.torch import load_file

    from ferrule.rollout.base import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    path = tiny_inkling2_dir(tmp_path / "m", CONFIGS[name])
    engine = EmbeddedEngine(hf_dir=path)
    prompts = [[5, 9, 11, 3], [7, 8], [1, 2, 3, 4, 5, 6, 7]]
    results = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=9, temperature=1.0, seed=11,
                                                      ignore_eos=True))
    ref = _hf(path).eval()
    worst = 0.0
    for r in results:
        prompt = prompts[r.prompt_index]
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=torch.tensor([prompt + list(r.token_ids)])).logits[0], -1)
        want = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(r.logprobs) - want).abs().max().item())
    assert worst <= ATOL, worst
    assert max(max(r.token_ids) for r in results) < CONFIGS[name]["unpadded_vocab_size"]
    doubled = {k: v * 2 for k, v in load_file(str(path / "model.safetensors")).items()}
    engine.update_weights(doubled.items(), version=1)
    engine.model.save_pretrained(tmp_path / "synced")
    synced = load_file(str(tmp_path / "synced" / "model.safetensors"))
    assert synced.keys() == doubled.keys()
    assert [k for k in doubled if not torch.equal(synced[k], doubled[k])] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep2_logits_gradients_and_export_over_two_gloo_processes(dist_pool, tmp_path):
    """One torchrun launch: Inkling-2 and Inkling-2-Loop at EP=2 (alltoall dispatcher): export exact, logits within
    1e-5 of HF, gradients (experts gathered over EP by the mapping table) within the TP=1 tolerances."""
    from pathlib import Path

    from safetensors.torch import load_file

    cases = ["mqa_full_first_softcaps", "loop_2_6_x3"]
    for case in cases:
        path = tiny_inkling2_dir(tmp_path / case, CONFIGS[case])
        hf = _hf(path).train()
        ids = _ids(hf.config.unpadded_vocab_size)
        logits = hf(input_ids=ids).logits
        _summed_logprob(logits, ids).backward()
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
            for _, b in hf.named_buffers():
                b.zero_()
        hf.save_pretrained(tmp_path / f"{case}_grads")
        torch.save({"ids": ids, "logits": logits.detach(),
                    "grads": load_file(tmp_path / f"{case}_grads" / "model.safetensors")}, tmp_path / f"{case}.ref.pt")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    repo = Path(__file__).resolve().parents[3]
    proc = dist_pool.run([str(repo / "tests" / "dist" / "inkling2_parity_worker.py"), str(tmp_path)],
                         timeout=280, env={"OMP_NUM_THREADS": "1"}, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(cases)
    for case, r in results.items():
        assert r["export_exact"] and r["grad_keys_match"], (case, r)
        assert r["logits_diff"] <= ATOL, (case, r)
        assert r["grad_rel_worst"] <= (LOOP_GRAD_RTOL if _is_loop(CONFIGS[case]) else GRAD_RTOL), (case, r)


def test_kit_compares_over_the_hf_head_width():
    """ferrule.conformance.numeric.logits_max_diff: an HF head narrower than vocab_size is compared over its width, and
    Megatron's columns past it must carry no probability (masked), else the kit names them."""
    from ferrule.conformance.numeric import logits_max_diff

    ref = torch.randn(2, 3, 5)
    out = torch.cat([ref + 1e-7, torch.full((2, 3, 3), torch.finfo(torch.float32).min)], dim=-1)
    assert logits_max_diff("fam", out, ref) <= 1e-6
    out[0, 0, 6] = 0.0
    with pytest.raises(AssertionError, match=r"fam: HF logits have 5 columns but Megatron's columns 5..7"):
        logits_max_diff("fam", out, ref)
