"""Offline assets for running tinker-cookbook 0.6.1's multimodal recipes against ``ferrule serve``
(``recipes/vlm_classifier/train.py``, ``recipes/audio/emotion/sl_train.py``).

No hub download: all are made here.

- ``MODEL_DIR``: a tiny random ``InklingForConditionalGeneration`` (13 M parameters, fp32) with the
  real o200k vocabulary (201,088 ids, so the cookbook's ``tml_v0`` renderer's token ids fit), the
  released 40 px vision patch and placeholder ids (image 200054, audio 200053), 512 positions.
- ``CACHE_DIR``: an HF datasets cache holding a stand-in for ``dpdl-benchmark/caltech101`` (the
  recipe's ``dataset=caltech101``): two classes drawn with PIL (a red square, a blue disc, on
  noise), 8 train and 4 test 64 x 48 images, where datasets' offline ``Cache`` builder finds a hub
  dataset (``<org>___<name>/default/0.0.0/<hash>/<name>-<split>.arrow`` + ``dataset_info.json``).
- ``AUDIO_DIR``: a stand-in for the emotion recipe's prepared Expresso data (its ``data_dir``):
  ``sft_train.jsonl`` (8 clips) and ``dev.jsonl`` (4), one manifest row per 0.5 s 16 kHz mono WAV
  (a 220 Hz tone for ``happy``, 440 Hz for ``sad``), the fields ``prepare_data.py`` writes.

``INKLING2=1`` makes ``MODEL_DIR`` a tiny Inkling-2 instead (:func:`make_inkling2_model`).

Usage: ``[INKLING2=1] python make_assets.py MODEL_DIR CACHE_DIR AUDIO_DIR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def make_model(out: Path) -> None:
    import torch
    from transformers import InklingConfig, InklingForConditionalGeneration

    from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG

    text = {k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"}
    text.update(vocab_size=201088, max_position_embeddings=512)
    cfg = InklingConfig(text_config=text, vision_config={"num_hidden_layers": 2, "patch_size": 40},
                        audio_config={"n_mel_bins": 80, "mel_vocab_size": 16})
    torch.manual_seed(0)
    InklingForConditionalGeneration(cfg).save_pretrained(out)


def make_inkling2_model(out: Path) -> None:
    """A tiny random ``Inkling2ForConditionalGeneration`` (13 M parameters, fp32): the TMLv0 vocabulary
    (``unpadded_vocab_size`` 200058, embedding padded to 201024, as released), eos 200006, image id 200054,
    the released 20 px x 2 vision geometry (one token per 40 x 40 square), 512 positions."""
    import torch
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    from ferrule_examples.inkling2_synthetic import TINY_TEXT_CONFIG

    text = dict(TINY_TEXT_CONFIG, vocab_size=201024, unpadded_vocab_size=200058, eos_token_id=200006,
                max_position_embeddings=512)
    vision = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=3, patch_size=20,
                  spatial_merge_size=2, posemb_grid_size=4, projection_hidden_dim=20, text_hidden_size=32)
    torch.manual_seed(0)
    Inkling2ForConditionalGeneration(Inkling2Config(text_config=text, vision_config=vision,
                                                    image_token_id=200054)).save_pretrained(out)


def make_dataset(cache: Path) -> None:
    import datasets
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)

    def image(label: int) -> Image.Image:
        im = Image.fromarray(rng.integers(0, 60, (48, 64, 3), dtype=np.uint8))
        draw = ImageDraw.Draw(im)
        (draw.rectangle if label == 0 else draw.ellipse)((16, 8, 48, 40), fill=(220, 30, 30) if label == 0 else (30, 30, 220))
        return im

    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["red_square", "blue_disc"])})
    out = cache / "dpdl-benchmark___caltech101" / "default" / "0.0.0" / ("0" * 40)
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n in (("train", 8), ("test", 4)):
        labels = [i % 2 for i in range(n)]
        ds = datasets.Dataset.from_dict({"image": [image(x) for x in labels], "label": labels}, features=features,
                                        split=split)
        tmp = cache / f"tmp-{split}"
        ds.save_to_disk(str(tmp))
        target = out / f"caltech101-{split}.arrow"
        os.replace(next(tmp.glob("*.arrow")), target)
        splits[split] = {"name": split, "num_bytes": target.stat().st_size, "num_examples": n,
                         "dataset_name": "caltech101"}
    datasets.DatasetInfo(features=features, dataset_name="caltech101", config_name="default",
                         builder_name="caltech101",
                         splits=datasets.SplitDict.from_split_dict(splits)).write_to_directory(str(out))


def make_audio(out: Path) -> None:
    import json

    import numpy as np
    from scipy.io import wavfile

    (out / "wav").mkdir(parents=True, exist_ok=True)
    texts = ("hello there", "good morning", "see you soon", "thank you")
    for split, n in (("sft_train", 8), ("dev", 4)):
        rows = []
        for i in range(n):
            style, rate = ("happy", "sad")[i % 2], 16000
            t = np.arange(rate // 2) / rate
            wave = (0.3 * np.sin(2 * np.pi * (220 if style == "happy" else 440) * t) * 32767).astype(np.int16)
            path = f"wav/{split}_{i}.wav"
            wavfile.write(out / path, rate, wave)
            rows.append({"id": f"{split}_{i}", "text": texts[i % 4], "emotion": style, "path": path,
                         "num_frames": len(wave), "sample_rate": rate})
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    (make_inkling2_model if os.environ.get("INKLING2") == "1" else make_model)(Path(sys.argv[1]))
    make_dataset(Path(sys.argv[2]))
    make_audio(Path(sys.argv[3]))
    print(f"model in {sys.argv[1]}, image dataset cache in {sys.argv[2]}, audio clips in {sys.argv[3]}")
