"""A synthetic multimodal task and a tiny random multimodal Inkling, for the shipped multimodal RL example.

``python -m ferrule_examples.inkling_shapes OUT_DIR`` writes

- ``OUT_DIR/images/N.png``: 32 x 32 pictures drawn with PIL, each with 1-3 coloured squares and
  0-2 coloured circles on a white background, one shape per cell of a 3 x 3 grid so shapes never
  overlap (seeded, deterministic);
- ``OUT_DIR/task.jsonl``: one prompt per picture, TMLv0-style chat ``messages`` whose user turn
  holds the image part and the question ``"how many squares?"``; ``answer`` is the count;
- ``OUT_DIR/model``: a random ``InklingForConditionalGeneration`` (2 text layers, hidden 32; vision
  tower patch 8, 2 layers; audio tower) saved with ``save_pretrained``, plus a character-level
  tokenizer whose special tokens are the TMLv0 tokens the template writes (so the registered
  ``tmlv0`` template renders prompts, one ``<|unused_200054|>`` image placeholder per image, and the
  model's ``image_token_id`` is that token's id here).

A 32 x 32 picture is 4 x 5 = 20 patches (``InklingImageProcessor``'s tiling: ``ceil(H/8)`` rows,
``floor(W/8) + 1`` columns), so each prompt carries 20 image placeholder tokens.
:func:`square_count_reward` is the exact-answer reward. ``examples/configs/inkling_mm_tiny.yaml``
trains it with GRPO on CPU.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

__all__ = ["build_shapes_task", "square_count_reward", "draw_shapes", "TMLV0_TOKENS", "TINY_MM_TEXT_CONFIG"]

#: TMLv0 special tokens the template writes (tml-renderers' names), plus ``<unk>``.
TMLV0_TOKENS = ["<unk>", "<|endoftext|>", "<|message_system|>", "<|message_user|>", "<|message_model|>",
                "<|content_text|>", "<|content_image|>", "<|content_model_end_sampling|>", "<|content_thinking|>",
                "<|end_message|>", "<|content_audio_input|>", "<|audio_end|>", "<|unused_200054|>",
                "<|unused_200053|>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:?!\n")
COLOURS = ((220, 30, 30), (30, 160, 30), (30, 60, 220), (230, 180, 20))
SIZE = 32
GRID = 3  # shapes sit in distinct cells of a GRID x GRID grid
QUESTION = "how many squares?"

#: ``InklingTextConfig`` kwargs of the example model (vocab and token ids are added from the tokenizer).
TINY_MM_TEXT_CONFIG = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=16, rel_extent=64,
    d_rel=4, layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "dense"], intermediate_size=64,
    max_position_embeddings=256, logits_mup_width_multiplier=1.0,
)


def square_count_reward(response: str, prompt=None) -> float:
    """1.0 if the first number in the response equals the prompt's answer (the square count), else 0.0."""
    m = re.search(r"\d+", response)
    return float(m is not None and prompt is not None and m.group(0) == str(prompt.answer))


def draw_shapes(rng, squares: int, circles: int):
    """A ``SIZE x SIZE`` RGB ``PIL.Image`` with ``squares`` filled squares and ``circles`` filled circles."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cells = rng.permutation(GRID * GRID)[: squares + circles]  # one shape per cell: shapes never touch
    cell = SIZE // GRID
    for k, c in enumerate(cells.tolist()):
        s = int(rng.integers(5, cell - 2))  # side - 1 in pixels
        x = (c % GRID) * cell + 1 + int(rng.integers(0, cell - 1 - s))
        y = (c // GRID) * cell + 1 + int(rng.integers(0, cell - 1 - s))
        colour = COLOURS[int(rng.integers(0, len(COLOURS)))]
        (draw.rectangle if k < squares else draw.ellipse)([x, y, x + s, y + s], fill=colour)
    return image


def build_shapes_task(out_dir, *, seed: int = 0, prompts: int = 32, model: bool = True) -> Path:
    """Write ``out_dir/images``, ``out_dir/task.jsonl`` and ``out_dir/model``; returns ``out_dir``.
    ``model=False`` leaves the random Inkling out of ``out_dir/model`` (tokenizer only), for other families' builders."""
    import numpy as np
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import InklingConfig, InklingForConditionalGeneration, PreTrainedTokenizerFast

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with open(out / "task.jsonl", "w") as f:
        for i in range(prompts):
            squares, circles = int(rng.integers(1, 4)), int(rng.integers(0, 3))
            draw_shapes(rng, squares, circles).save(out / "images" / f"{i}.png")
            content = [{"type": "image", "image": f"images/{i}.png"}, {"type": "text", "text": QUESTION}]
            f.write(json.dumps({"id": f"shapes:{i}", "messages": [{"role": "user", "content": content}],
                                "answer": str(squares)}) + "\n")
    vocab = {t: i for i, t in enumerate(TMLV0_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(TMLV0_TOKENS)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(out / "model")
    text = dict(TINY_MM_TEXT_CONFIG, vocab_size=len(vocab), eos_token_id=vocab["<|content_model_end_sampling|>"],
                pad_token_id=vocab["<|endoftext|>"], bos_token_id=None)
    config = InklingConfig(text_config=text, vision_config={"num_hidden_layers": 2, "patch_size": 8},
                           audio_config={"mel_vocab_size": 16}, image_token_id=vocab["<|unused_200054|>"],
                           audio_token_id=vocab["<|unused_200053|>"], image_bos_token_id=vocab["<|content_image|>"],
                           audio_bos_token_id=vocab["<|content_audio_input|>"])
    if model:
        torch.manual_seed(seed)
        InklingForConditionalGeneration(config).float().save_pretrained(out / "model")
    return out


if __name__ == "__main__":
    from ferrule_examples.builder_cli import builder_main

    sys.exit(builder_main("ferrule_examples.inkling_shapes", __doc__, build_shapes_task))
