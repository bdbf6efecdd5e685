"""Inkling vision + audio towers in the Megatron model vs ``InklingForConditionalGeneration`` (fp32, CPU).

Referee: transformers' ``InklingForConditionalGeneration`` (eager attention) on a prompt holding
one image (6 patches) and one audio clip (6 dMel frames); the same preprocessed media go to both
models. Logits: max abs diff <= 1e-5. The core's scatter keeps the graph: the text embedding gets
gradients on a multimodal batch, equal to HF autograd's.
"""

from __future__ import annotations

import json

import pytest
import torch

from inkling_fixtures import MM_AUDIO_TOKEN, MM_IMAGE_TOKEN, tiny_inkling_mm_dir, tiny_media

ATOL = 1e-5


def _prompt(n_img: int, n_aud: int) -> torch.Tensor:
    """``[1, s]``: text, the image placeholders, text, the audio placeholders, text (tiny-vocab ids)."""
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(0, 80, (n,), generator=g)  # noqa: E731
    return torch.cat([text(3), torch.full((n_img,), MM_IMAGE_TOKEN), text(2), torch.full((n_aud,), MM_AUDIO_TOKEN),
                      text(4)]).unsqueeze(0)


def _hf(path):
    from transformers import InklingForConditionalGeneration

    return InklingForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def _mcore(path):
    from ferrule.contract import registry
    from ferrule.megatron.provider import provider_build
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    hf_config = json.loads((path / "config.json").read_text())
    (model,) = provider_build("inkling")(hf_config, ParallelLayout())
    load_hf_into_mcore([model], path, registry.get_converter("inkling").resolved_mapping(), hf_config=hf_config)
    return model


def _mcore_logits(model, ids, media):
    from ferrule.megatron.towers import embed_with_media

    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    emb = embed_with_media(model, ids, pos, [media])
    return model(ids, pos, attention_mask=None, decoder_input=emb)


def test_logits_match_hf_with_image_and_audio(tmp_path):
    from ferrule.conformance.numeric import single_rank

    path = tiny_inkling_mm_dir(tmp_path / "mm")
    pixel_values, dmel = tiny_media()
    ids = _prompt(pixel_values.shape[0], dmel.shape[0])
    hf = _hf(path).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixel_values, audio_input_ids=dmel[None],
                 audio_input_ids_mask=torch.ones(1, dmel.shape[0], dtype=torch.bool)).logits
        text_only = hf(input_ids=ids).logits
    with single_rank():
        model = _mcore(path).eval()
        with torch.no_grad():
            out = _mcore_logits(model, ids, {"vision": [pixel_values], "audio": [dmel]})[..., : ref.shape[-1]]
    # the media change the logits (the towers are not a no-op), so matching them means something
    assert (ref - text_only).abs().max() > 0.1
    diff = (out - ref).abs().max().item()
    assert diff <= ATOL, f"Megatron+towers vs HF logits max abs diff {diff:.3g}"


def test_text_embedding_gradient_on_multimodal_batch_matches_hf(tmp_path):
    """Fails if the scatter cuts the graph (zero word-embedding gradient) or scatters to the wrong rows."""
    from ferrule.conformance.numeric import single_rank

    path = tiny_inkling_mm_dir(tmp_path / "mm")
    pixel_values, dmel = tiny_media()
    ids = _prompt(pixel_values.shape[0], dmel.shape[0])
    hf = _hf(path).train()
    logits = hf(input_ids=ids, pixel_values=pixel_values, audio_input_ids=dmel[None]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
    logp.backward()
    ref = hf.model.language_model.embed_tokens.weight.grad
    with single_rank():
        model = _mcore(path).train()
        out = _mcore_logits(model, ids, {"vision": [pixel_values], "audio": [dmel]})[..., : ref.shape[0]]
        torch.log_softmax(out[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum().backward()
        grad = model.embedding.word_embeddings.weight.grad[: ref.shape[0]]
        frozen = [n for n, p in model.named_parameters() if n.startswith("towers.") and p.grad is not None]
    pad = hf.config.text_config.pad_token_id  # nn.Embedding(padding_idx=pad): no gradient in either model
    inputs = ids[0, :-1]  # the last token predicts nothing in the loss
    text_rows = inputs[(inputs != MM_IMAGE_TOKEN) & (inputs != MM_AUDIO_TOKEN) & (inputs != pad)].unique()
    assert grad[text_rows].abs().sum(-1).min() > 0, "a text token's embedding row got no gradient"
    # placeholder rows: HF overwrites them too, so their gradient is zero in both
    assert grad[[MM_IMAGE_TOKEN, MM_AUDIO_TOKEN]].abs().max() == 0
    rel = ((grad - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, f"word-embedding gradient vs HF autograd: {rel:.3g} relative"
    assert frozen == [], f"frozen towers got gradients: {frozen}"


def _datum(ids, media):
    from ferrule.megatron.batching import Datum

    tokens = ids[0]
    return Datum(tokens, {"target_tokens": torch.roll(tokens, -1), "weights": torch.ones(tokens.numel())}, media)


def test_towers_travel_on_every_weight_sync(tmp_path):
    """The train engine holds the towers, trains on a multimodal datum, and every sync carries the towers:
    after the train side's tower weights change, sync + ``check_weight_update_equal`` pass; changed again
    without a sync, the check names the tower tensors."""
    from ferrule.conformance.numeric import single_rank
    from ferrule.converters import SafetensorsReader
    from ferrule.megatron.engine import TrainEngine
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.sync import WeightSyncError, check_weight_update_equal, sync_weights

    path = tiny_inkling_mm_dir(tmp_path / "mm")
    pixel_values, dmel = tiny_media()
    ids = _prompt(pixel_values.shape[0], dmel.shape[0])
    with single_rank():
        engine = TrainEngine.from_hf(path)
        rollout = EmbeddedEngine(hf_dir=path)
        out = engine.forward_backward([_datum(ids, {"vision": [pixel_values], "audio": [dmel]})], "cross_entropy")
        assert engine.optim_step(learning_rate=1e-2)["success"]
        towers = {n: p for n, p in engine.model[0].module.named_parameters() if n.startswith("towers.")}
        assert len(towers) == 6 and not any(p.requires_grad for p in towers.values())  # frozen by default
        with torch.no_grad():
            for p in towers.values():
                p.mul_(1.5)
        sync_weights(engine, rollout, version=1)
        report = check_weight_update_equal(engine, rollout)
        assert report.compared == len(SafetensorsReader(path).keys()) and report.skipped == ()  # towers included
        with torch.no_grad():
            towers["towers.audio.encoder.weight"].add_(1.0)
        with pytest.raises(WeightSyncError, match="model.audio.encoder.weight"):
            check_weight_update_equal(engine, rollout)
    assert out.loss_fn_outputs[0]["logprobs"].shape == ids[0].shape


def test_bad_media_is_refused_naming_the_datum(tmp_path):
    from inkling_fixtures import tiny_inkling_dir

    from ferrule.conformance.numeric import single_rank
    from ferrule.megatron.engine import TrainEngine
    from ferrule.media import MediaError

    pixel_values, dmel = tiny_media()
    ids = _prompt(pixel_values.shape[0], dmel.shape[0])
    good = _datum(ids, {"vision": [pixel_values], "audio": [dmel]})
    with single_rank():
        text_engine = TrainEngine.from_hf(tiny_inkling_dir(tmp_path / "text"))
        with pytest.raises(MediaError, match=r"datum 1: has vision media but family 'inkling_text' has no vision "):
            text_engine.forward_backward([_datum(torch.tensor([[1, 2, 3]]), None), good], "cross_entropy")
        engine = TrainEngine.from_hf(tiny_inkling_mm_dir(tmp_path / "mm"))
        before = {n: p.detach().clone() for n, p in engine.model[0].module.named_parameters()}
        two_images = _datum(ids, {"vision": [pixel_values, pixel_values], "audio": [dmel]})
        with pytest.raises(MediaError, match=r"datum 0: 6 vision placeholder tokens \(id 90\) but 12 vision rows in 2"):
            engine.forward_backward([two_images], "cross_entropy")
        no_media = _datum(ids, None)
        with pytest.raises(MediaError, match=r"datum 1: 6 audio placeholder tokens \(id 91\) but 0 audio rows"):
            engine.forward_backward([good, no_media], "cross_entropy")
        with pytest.raises(ValueError, match="audio tower: dMel ids outside"):
            engine.forward_backward([_datum(ids, {"vision": [pixel_values], "audio": [dmel + 100]})], "cross_entropy")
        # nothing trained: every refused call left no gradient behind, and a step changes nothing
        engine.optim_step(learning_rate=1.0)
        after = dict(engine.model[0].module.named_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before)


def test_image_preprocessing_errors_and_patch_count():
    from ferrule.plugins.inkling.towers import audio_to_dmel_ids, image_to_pixel_values

    with pytest.raises(ValueError, match="cannot decode the image"):
        image_to_pixel_values(b"not an image at all", 8)
    with pytest.raises(ValueError, match="sampling rate of 16000"):
        audio_to_dmel_ids([0.0] * 4410, 44100)


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchvision") is None,
                    reason="transformers' InklingImageProcessor needs torchvision (no CPU wheel for torch 2.13 here)")
def test_image_preprocessing_equals_transformers_processor():
    import numpy as np
    from PIL import Image
    from transformers import InklingImageProcessor

    from ferrule.plugins.inkling.towers import image_to_pixel_values

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (37, 50, 3), dtype=np.uint8))
    ref = InklingImageProcessor(size={"height": 16, "width": 16})(image, return_tensors="pt")["pixel_values"]
    ours = image_to_pixel_values(image, 16)
    assert ours.shape == ref.shape and (ours - ref).abs().max() <= 1e-6


def test_embedded_rollout_with_media_matches_full_hf_forward(tmp_path):
    """Prompt tokens + media in, sampled tokens' logprobs equal one full ``InklingForConditionalGeneration`` forward."""
    from ferrule.media import MediaError
    from ferrule.rollout.base import GenerateRequest, SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    path = tiny_inkling_mm_dir(tmp_path / "mm")
    pixel_values, dmel = tiny_media()
    pv2, _ = tiny_media(1, image_hw=(8, 9))
    ids = _prompt(pixel_values.shape[0], dmel.shape[0])[0].tolist()
    ids2 = [7, 3] + [MM_IMAGE_TOKEN] * pv2.shape[0] + [9]
    media = [{"vision": [pixel_values], "audio": [dmel]}, {"vision": [pv2]}]
    engine = EmbeddedEngine(hf_dir=path)
    reqs = [GenerateRequest(tuple(ids), media=media[0]), GenerateRequest(tuple(ids2), media=media[1]),
            GenerateRequest((4, 5, 6))]
    results = engine.generate(reqs, SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=3, ignore_eos=True))
    hf = _hf(path).eval()
    worst = 0.0
    for r in results:
        prompt = list(reqs[r.prompt_index].prompt_token_ids)
        m = reqs[r.prompt_index].media or {}
        full = torch.tensor([prompt + list(r.token_ids)])
        with torch.no_grad():
            # HF's own embedding and tower features, scattered at the *prompt's* placeholders only (a sampled
            # token may equal a placeholder id; the engine embeds it as text, as HF's decode steps do)
            embeds = hf.get_input_embeddings()(full)
            in_prompt = torch.arange(full.shape[1]) < len(prompt)
            for key, pid, feats in (("vision", MM_IMAGE_TOKEN, lambda x: hf.model.get_image_features(x).pooler_output),
                                    ("audio", MM_AUDIO_TOKEN, lambda x: hf.model.get_audio_features(x).last_hidden_state)):
                if key in m:
                    mask = ((full[0] == pid) & in_prompt)[None, :, None]
                    embeds = embeds.masked_scatter(mask, feats(m[key][0]))
            logp = torch.log_softmax(hf(inputs_embeds=embeds).logits[0].float(), -1)
        want = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(r.logprobs) - want).abs().max().item())
    assert len(results) == 6 and worst <= ATOL, worst
    with pytest.raises(MediaError, match=r"request 1 \(id None\): 6 vision placeholder tokens \(id 90\) but 4 "):
        engine.generate([reqs[2], GenerateRequest(tuple(ids2[:2] + [MM_IMAGE_TOKEN] * 6), media={"vision": [pv2, pv2]})],
                        SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("name", ["image_part", "audio_part"])
def test_tmlv0_media_parts_expand_to_tml_renderers_token_counts(name):
    """Golden conversations with an image / audio part (tests/data/tmlv0_golden.jsonl, made by tml-renderers):
    the TMLv0 template writes one placeholder per part; preprocessing the part for the released config
    (patch 40, 16 kHz dMel) and expanding gives tml-renderers' own token count for that span."""
    from pathlib import Path

    from transformers import InklingConfig

    from ferrule.contract import registry
    from ferrule.chat import encode_rendered, render_chat
    from ferrule.media import expand_placeholders, message_media
    from ferrule.tmlv0.tokenizer import load_tmlv0_tokenizer

    golden = Path(__file__).resolve().parents[3] / "tests" / "data" / "tmlv0_golden.jsonl"
    row = next(r for r in map(json.loads, golden.read_text().splitlines()) if r["name"] == name)
    hf_config = InklingConfig().to_dict()  # the released defaults: patch 40, image/audio ids 200054/200053
    towers = registry.get_towers("inkling")
    ids = encode_rendered(load_tmlv0_tokenizer(), render_chat(
        "tmlv0", row["messages"], tools=row["tools"], add_generation_prompt=row["add_generation_prompt"],
        thinking_effort=row["thinking_effort"]))
    media = message_media(row["messages"], towers, hf_config, name)
    expanded = expand_placeholders(ids, media, {t.modality: t.placeholder_id(hf_config) for t in towers}, name)
    counts = iter(m["num_tokens"] for m in row["media"])
    want = [x for t in row["token_ids"] for x in ([t] * next(counts) if t in (200053, 200054) else [t])]
    assert expanded == want and len(expanded) > len(ids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_logits_with_towers_at_tp2_over_two_gloo_processes(dist_pool, tmp_path):
    """Text model split over TP=2, towers replicated: logits with an image and an audio clip match HF, the
    export (towers included) is bit-exact, and the towers are identical on both TP ranks."""
    from pathlib import Path

    tiny_inkling_mm_dir(tmp_path / "mm")
    pixel_values, dmel = tiny_media()
    torch.save({"ids": _prompt(pixel_values.shape[0], dmel.shape[0]), "pixel_values": pixel_values, "dmel": dmel},
               tmp_path / "media.pt")
    repo = Path(__file__).resolve().parents[3]
    proc = dist_pool.run([str(repo / "tests" / "dist" / "inkling_towers_tp2_worker.py"), str(tmp_path)],
                         timeout=280, env={"OMP_NUM_THREADS": "1"}, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["export_exact"] and results["tower_tensors_exported"] == 6, results
    assert results["towers_identical_over_tp"], results
    assert results["logits_diff"] <= ATOL, results
