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
    from ferrule import registry
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    hf_config = json.loads((path / "config.json").read_text())
    (model,) = registry.provider_build("inkling")(hf_config, ParallelLayout())
    load_hf_into_mcore([model], path, registry.get_converter("inkling").resolved_mapping(), hf_config=hf_config)
    return model


def _mcore_logits(model, ids, media):
    from ferrule.megatron.towers import embed_with_media

    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    emb = embed_with_media(model, ids, pos, [media])
    return model(ids, pos, attention_mask=None, decoder_input=emb)


def test_logits_match_hf_with_image_and_audio(tmp_path):
    from ferrule.conformance_numeric import single_rank

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
    from ferrule.conformance_numeric import single_rank

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
