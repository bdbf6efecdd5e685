"""Inkling's synthetic "how many squares?" task on a tiny random multimodal Inkling-2, for the shipped example.

``python -m ferrule_examples.inkling2_shapes OUT_DIR`` writes what :func:`ferrule_examples.inkling_shapes.build_shapes_task`
writes (``images/N.png`` 32 x 32 PIL-drawn pictures, ``task.jsonl`` TMLv0 chat prompts with one image part and
the question, the character-level TMLv0 tokenizer under ``model/``) with the model replaced by a random
``Inkling2ForConditionalGeneration``: the text model of :data:`ferrule_examples.inkling2_synthetic.TINY_TEXT_CONFIG`
(an unembedding padded from the tokenizer's 83 ids to :data:`PADDED_VOCAB` rows) and a 2-layer vision tower
with 4 px patches merged 2 x 2, so a 32 x 32 picture is a 4 x 4 grid of 8 px token squares: 16 image
placeholder tokens per prompt (``image_token_id`` = the tokenizer's ``<|unused_200054|>``).
``examples/configs/inkling2_mm_tiny.yaml`` trains it with GRPO on CPU (reward
:func:`ferrule_examples.inkling_shapes.square_count_reward`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["build_inkling2_shapes_task", "VISION_CONFIG", "PADDED_VOCAB"]

#: ``Inkling2VisionConfig`` kwargs of the example model's tower (the text hidden size is added)
VISION_CONFIG = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                     spatial_merge_size=2, posemb_grid_size=4, projection_hidden_dim=32)
#: rows of the example model's (padded) embedding / unembedding; the tokenizer has 83 ids
PADDED_VOCAB = 88


def build_inkling2_shapes_task(out_dir, *, seed: int = 0, prompts: int = 32) -> Path:
    """Write ``out_dir/images``, ``out_dir/task.jsonl`` and ``out_dir/model``; returns ``out_dir``."""
    import torch
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    from ferrule_examples.inkling_shapes import build_shapes_task
    from ferrule_examples.inkling2_synthetic import TINY_TEXT_CONFIG

    out = build_shapes_task(out_dir, seed=seed, prompts=prompts, model=False)  # images, task, tokenizer
    vocab = json.loads((out / "model" / "tokenizer.json").read_text())["model"]["vocab"]
    text = dict(TINY_TEXT_CONFIG, vocab_size=PADDED_VOCAB, unpadded_vocab_size=len(vocab),
                eos_token_id=vocab["<|content_model_end_sampling|>"], pad_token_id=vocab["<|endoftext|>"],
                bos_token_id=None)
    config = Inkling2Config(text_config=text, vision_config=dict(VISION_CONFIG, text_hidden_size=text["hidden_size"]),
                            image_token_id=vocab["<|unused_200054|>"])
    torch.manual_seed(seed)
    Inkling2ForConditionalGeneration(config).float().save_pretrained(out / "model")
    return out


if __name__ == "__main__":
    from ferrule_examples.builder_cli import builder_main

    sys.exit(builder_main("ferrule_examples.inkling2_shapes", __doc__, build_inkling2_shapes_task))
