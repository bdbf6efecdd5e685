"""Family ``inkling2`` (text model + vision tower) vs transformers' ``Inkling2ForConditionalGeneration`` (fp32, CPU).

Referee: transformers 5.24's ``Inkling2ForConditionalGeneration`` (eager) on a prompt holding two images
of different token grids; the same items go to both (``hf_vision_inputs`` builds what
``Inkling2ImageProcessor`` returns). Logits: max abs diff <= 1e-5; the word-embedding gradient through
the scatter: within 1e-5 relative of HF autograd. Conversion: HF -> torch_dist -> HF is bit-exact and
the export loads in transformers with no missing or unexpected key.
"""

from __future__ import annotations

import json

import pytest
import torch

from inkling2_vision_fixtures import IMAGE_TOKEN, config_dict, hf_model, images

ATOL = 1e-5
GRIDS = ((2, 3), (1, 2))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("inkling2_mm")
    hf_model(config_dict()).save_pretrained(path)
    return path


def _prompt() -> torch.Tensor:
    """``[1, s]``: text, image 1's 6 placeholders, text, image 2's 2 placeholders, text."""
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(2, 240, (n,), generator=g)  # noqa: E731
    return torch.cat([text(3), torch.full((6,), IMAGE_TOKEN), text(2), torch.full((2,), IMAGE_TOKEN),
                      text(4)]).unsqueeze(0)


def _mcore(path):
    from ferrule.contract import registry
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.megatron.provider import provider_build

    hf_config = json.loads((path / "config.json").read_text())
    (model,) = provider_build("inkling2")(hf_config, ParallelLayout())  # text model + vision tower
    load_hf_into_mcore([model], path, registry.get_converter("inkling2").resolved_mapping(), hf_config=hf_config)
    return model


def test_image_prompt_logits_and_embedding_gradient_match_hf(tiny_dir):
    from transformers import Inkling2ForConditionalGeneration

    from ferrule.conformance.numeric import single_rank
    from ferrule.megatron.towers import embed_with_media
    from ferrule.plugins.inkling2.towers import hf_vision_inputs

    items, ids = images(6, GRIDS), _prompt()
    hf = Inkling2ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ref = hf(input_ids=ids, **hf_vision_inputs(items, {})).logits
    ref.logsumexp(-1).sum().backward()
    ref_grad = hf.model.language_model.embed_tokens.weight.grad
    with torch.no_grad():
        text_only = hf(input_ids=ids).logits
    with single_rank():
        model = _mcore(tiny_dir).eval()
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        out = model(ids, pos, attention_mask=None, decoder_input=embed_with_media(model, ids, pos, [{"vision": items}]))
        out = out[..., : ref.shape[-1]]
        out.logsumexp(-1).sum().backward()
        grad = model.embedding.word_embeddings.weight.grad[: ref_grad.shape[0]]
    assert (ref - text_only).abs().max() > 0.1  # the images change the logits
    diff = (out - ref).abs().max().item()
    assert diff <= ATOL, f"inkling2 + vision tower vs Inkling2ForConditionalGeneration logits max abs diff {diff:.3g}"
    scale = ref_grad.abs().max().item()
    assert scale > 0 and (grad - ref_grad).abs().max().item() <= ATOL * scale


@pytest.mark.timeout(300)
def test_hf_torch_dist_round_trip_is_bit_exact_and_loads_in_transformers(tiny_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import Inkling2ForConditionalGeneration

    from ferrule.converters import hf_to_torch_dist, torch_dist_to_hf

    hf_to_torch_dist(tiny_dir, tmp_path / "td")
    torch_dist_to_hf(tmp_path / "td", tmp_path / "back")
    src, back = load_file(tiny_dir / "model.safetensors"), {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(f))
    assert sorted(back) == sorted(src)
    assert sum(k.startswith("model.visual.") for k in src) == 8 + 2 + 18 * 2  # tower + merger biases + 2 layers
    bad = [k for k in src if back[k].dtype != src[k].dtype or not torch.equal(back[k], src[k])]
    assert not bad, f"round trip changed {bad}"
    _, info = Inkling2ForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == "inkling2" and cfg["vision_config"] == json.loads(
        (tiny_dir / "config.json").read_text())["vision_config"]


def test_translation_checks_the_top_level_keys():
    from ferrule.config_translation import ConfigTranslationError
    from ferrule.plugins.inkling2.inkling2 import CONFIG_TRANSLATION

    cfg = config_dict()
    kwargs, options = CONFIG_TRANSLATION.to_mcore(cfg)
    assert kwargs["num_layers"] == 3 and options["unpadded_vocab_size"] == 250
    with pytest.raises(ConfigTranslationError, match=r"top-level HF config key\(s\) \['audio_config'\]"):
        CONFIG_TRANSLATION.to_mcore(dict(cfg, audio_config={}))
    with pytest.raises(ConfigTranslationError, match="model_type='inkling2_text'"):
        CONFIG_TRANSLATION.to_mcore(cfg["text_config"])
    back = CONFIG_TRANSLATION.to_hf(kwargs, options, cfg)
    assert back["text_config"]["final_logit_softcapping"] == 3.0 and back["vision_config"] == cfg["vision_config"]


def test_embedded_rollout_with_images_matches_full_hf_forward(tiny_dir):
    """Prompts with images (and one without) in, sampled tokens' logprobs == one full HF forward within 1e-5."""
    from transformers import Inkling2ForConditionalGeneration

    from ferrule.rollout.base import GenerateRequest, SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.plugins.inkling2.towers import hf_vision_inputs

    media = [images(6, ((2, 3),)), images(6, ((1, 2), (1, 1)), seed=4), None]
    prompts = [[5, 6, 7] + [IMAGE_TOKEN] * 6 + [8, 9], [5] + [IMAGE_TOKEN] * 2 + [3, IMAGE_TOKEN, 9], [4, 5, 6]]
    reqs = [GenerateRequest(tuple(p), media=None if m is None else {"vision": m}) for p, m in zip(prompts, media)]
    engine = EmbeddedEngine(hf_dir=tiny_dir)
    results = engine.generate(reqs, SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=3, ignore_eos=True))
    hf = Inkling2ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert sorted(r.prompt_index for r in results) == [0, 0, 1, 1, 2, 2]
    for r in results:
        p, m = prompts[r.prompt_index], media[r.prompt_index]
        with torch.no_grad():
            logp = hf(input_ids=torch.tensor([p + list(r.token_ids)]),
                      **(hf_vision_inputs(m, {}) if m else {})).logits[0].log_softmax(-1)
        ref = torch.stack([logp[len(p) - 1 + j, t] for j, t in enumerate(r.token_ids)])
        assert (ref - torch.tensor(r.logprobs)).abs().max().item() <= ATOL

    # weight sync of the tower: the engine's checkpoint names are the released keys (what MAPPING exports)
    from safetensors.torch import load_file

    src = load_file(tiny_dir / "model.safetensors")
    before = engine.get_hf_state_dict()
    assert sorted(before) == sorted(src)
    # the unembedding's padded rows (transformers drops them on load) read back as the checkpoint's zeros
    assert torch.equal(before["model.llm.unembed.weight"], src["model.llm.unembed.weight"])
    visual = {k: v * 2 for k, v in src.items() if k.startswith("model.visual.")}
    engine.update_weights(list(visual.items()), version=1)
    now = engine.get_hf_state_dict()
    assert all(torch.equal(now[k], v) for k, v in visual.items())


def test_update_groups_cover_the_model_with_its_tower(tiny_dir):
    from ferrule.contract import registry
    from ferrule.conformance.numeric import single_rank
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.megatron.provider import provider_build
    from ferrule.sync.groups import build_update_units

    hf_config = json.loads((tiny_dir / "config.json").read_text())
    with single_rank():
        (model,) = provider_build("inkling2")(hf_config, ParallelLayout())
    names = [n for n, _ in model.named_parameters()]
    units = build_update_units(names, registry.get_update_groups("inkling2"))
    tower_units = {u.group for u in units if u.prefix.startswith("towers.")}
    assert tower_units == {"vision_tower", "vision_tower_bias", "vision_tower_layer"}
    assert sum(len(u.names) for u in units if u.prefix.startswith("towers.")) == sum(
        n.startswith("towers.vision.") for n in names) == 46


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_image_prompt_at_tp2_and_ep2_over_two_gloo_processes(dist_pool, tmp_path):
    """One torchrun launch: the image prompt's logits at TP=2 and EP=2 == HF within 1e-5, export bit-exact (tower
    included), the tower identical on both ranks."""
    from pathlib import Path

    from inkling2_vision_fixtures import TEXT

    hf_model(config_dict(text=dict(TEXT, num_key_value_heads=2))).save_pretrained(tmp_path / "mm")  # TP=2 splits KV
    repo = Path(__file__).resolve().parents[3]
    proc = dist_pool.run([str(repo / "tests" / "dist" / "inkling2_mm_worker.py"), str(tmp_path)],
                         timeout=280, env={"OMP_NUM_THREADS": "1"}, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"tp2", "ep2"}
    for case, r in results.items():
        assert r["export_exact"] and r["tower_replicated"], (case, r)
        assert r["logits_diff"] <= ATOL, (case, r)
