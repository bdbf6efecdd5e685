"""The conformance kit's media case: logits of a prompt with media through every tower vs HF transformers.

A family with towers (``register_towers``) opts in by defining, beside ``TINY_HF_CONFIG`` in its
variant module, ``tiny_media(hf_config: dict) -> {modality: [item, ...]}``: preprocessed media items
for the tiny model (the format of :mod:`ferrule.media`; an item's placeholder count is ``TowerSpec.item_tokens``),
one modality per declared tower at least. :func:`check_media_logits_parity` then

- writes a prompt of random text tokens (no placeholder id among them) with each item's
  placeholders in order (text, item, text, item, ..., text);
- runs the family's transformers model (:func:`ferrule.conformance.fields.hf_model_class`, fp32,
  the family's ``attn_implementation``) with the media as its forward keywords
  (``TowerSpec.hf_input``, :func:`ferrule.media.hf_media_inputs`);
- runs the Megatron model with its towers attached (``provider_build``), the media scattered into
  the token embeddings by :func:`ferrule.megatron.towers.embed_with_media`, weights loaded from the
  same HF files through the mapping table (the towers' rows included);
- asserts the max abs logit difference is within ``atol`` (:data:`~ferrule.conformance.numeric.LOGITS_ATOL_FP32`)
  and that each modality's media change HF's logits by more than ``min_effect`` (a tower that were a
  no-op, or a prompt that missed it, would make the comparison say nothing about it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ferrule.conformance.numeric import (LOGITS_ATOL_FP32, _build, _variant_module, logits_max_diff, single_rank,
                                        tiny_hf_dir)
from ferrule.conformance.fields import hf_model_class, text_vocab_size
from ferrule.contract import registry
from ferrule.megatron.weights import load_hf_into_mcore

__all__ = ["media_prompt", "tiny_media_of", "check_media_logits_parity", "mcore_media_logits"]

SEED = 4321


def tiny_media_of(family: str, hf_config: Mapping[str, Any]) -> dict | None:
    """The family's ``tiny_media(hf_config)`` items, or None if its variant module defines none."""
    fn = getattr(_variant_module(family), "tiny_media", None)
    return None if fn is None else fn(dict(hf_config))


def media_prompt(hf_config: Mapping[str, Any], media: Mapping[str, list], towers: Mapping[str, tuple]):
    """``[1, s]`` int64 ids: random text (seeded, no placeholder id) around each item's placeholder run.

    ``towers`` is :func:`ferrule.media.towers_for_config`'s ``{modality: (spec, _, placeholder id)}``.
    """
    import torch

    g = torch.Generator().manual_seed(SEED)
    placeholders = {pid for _, _, pid in towers.values()}
    vocab = text_vocab_size(hf_config)

    def text(n: int) -> torch.Tensor:
        ids = torch.randint(0, vocab, (n,), generator=g)
        for pid in placeholders:
            ids[ids == pid] = next(i for i in range(vocab) if i not in placeholders)
        return ids

    parts = [text(3)]
    for modality, items in media.items():
        for item in items:
            parts += [torch.full((towers[modality][0].item_tokens(item),), towers[modality][2]), text(2)]
    return torch.cat(parts).unsqueeze(0)


def mcore_media_logits(model: Any, ids: "Any", media: Mapping[str, list]):
    """``[1, s, vocab]`` logits of an unwrapped ``GPTModel`` with towers attached, ``media`` scattered in."""
    import torch

    from ferrule.megatron.towers import embed_with_media

    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    return model(ids, pos, attention_mask=None, decoder_input=embed_with_media(model, ids, pos, [dict(media)]))


def check_media_logits_parity(family: str, work_dir: str | os.PathLike, *, atol: float = LOGITS_ATOL_FP32,
                              min_effect: float = 1e-4) -> dict[str, Any] | None:
    """Megatron (+ towers) vs HF logits on a prompt with media for every tower (fp32, TP=1).

    Returns:
        ``{"logits_max_abs_diff": float, "effects": {modality: max |logit change| its media make in HF}}``,
        or None when the family declares no towers.

    Raises:
        AssertionError: the family has towers but no ``tiny_media`` (or none for a tower), a modality
            does not change HF's logits, or the logits differ by more than ``atol``.
    """
    import torch

    from ferrule.media import hf_media_inputs, towers_for_config

    if not registry.get_towers(family):
        return None
    src = tiny_hf_dir(family, Path(work_dir) / "hf_media")
    hf_config = json.loads((src / "config.json").read_text())
    towers = towers_for_config(hf_config)
    media = tiny_media_of(family, hf_config)
    assert media is not None, (f"{family} declares towers {sorted(towers)} but its variant module has no "
                               f"tiny_media(hf_config), so the kit cannot check them (docs/plugins.md).")
    uncovered = sorted(set(towers) - {m for m, items in media.items() if items})
    assert not uncovered, f"{family}: tiny_media gives no items for the tower(s) {uncovered}; give one each."
    ids = media_prompt(hf_config, media, towers)
    spec = registry.get_family(family)
    hf = hf_model_class(family, hf_config["model_type"]).from_pretrained(
        src, use_kernels=False, dtype=torch.float32, attn_implementation=spec.attn_implementation).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, **hf_media_inputs(towers, media, 1, "cpu", hf_config)).logits
        effects = {}
        for modality in media:
            rest = {m: items for m, items in media.items() if m != modality}
            without = hf(input_ids=ids, **hf_media_inputs(towers, rest, 1, "cpu", hf_config)).logits
            effects[modality] = (ref - without).abs().max().item()
    weak = {m: e for m, e in effects.items() if e <= min_effect}
    assert not weak, (f"{family}: the {sorted(weak)} media change HF's logits by only {weak}; the kit would not see a "
                      f"wrong tower. Make tiny_media / TINY_HF_CONFIG reach them.")
    with single_rank():
        (model,) = _build(family, hf_config)
        load_hf_into_mcore([model], src, registry.get_converter(family).resolved_mapping(), hf_config=hf_config)
        with torch.no_grad():
            out = mcore_media_logits(model.eval(), ids, media)[..., : text_vocab_size(hf_config)]
    diff = logits_max_diff(family, out, ref)
    assert diff <= atol, f"{family}: Megatron+towers vs HF logits with media max abs diff {diff:.3g} > {atol}"
    return {"logits_max_abs_diff": diff, "effects": effects}
