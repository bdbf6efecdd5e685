"""A tiny random Inkling and a synthetic learnable task, for the shipped RL example and its test.

``python -m ferrule_examples.inkling_synthetic OUT_DIR`` writes

- ``OUT_DIR/model``: a random ``InklingForCausalLM`` (2 layers: one local dense, one global MoE
  with 4 routed experts top-2 and 2 shared experts; 33 k parameters) saved with
  ``save_pretrained``, plus a character-level tokenizer (``tokenizers`` WordLevel over single
  characters and the ChatML control tokens, ~50 ids), so a policy starts near uniform;
- ``OUT_DIR/task.jsonl``: 64 prompts (``"say <n>"``, answer ``"7"``).

The reward (:func:`target_token_share`) is the share of the response's characters (= tokens, with
this tokenizer) equal to a target (default ``"7"``): about 1/50 for a uniform policy, 1.0 for a
policy that only writes the target. ``examples/configs/inkling_tiny.yaml`` trains it with GRPO.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["target_token_share", "build_tiny_inkling", "TINY_TEXT_CONFIG"]

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz .,:?!\n")

#: ``InklingTextConfig`` kwargs of the example model (vocab and token ids are added from the tokenizer).
TINY_TEXT_CONFIG = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, rel_extent=32,
    d_rel=4, layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"], intermediate_size=64,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
    max_position_embeddings=256, logits_mup_width_multiplier=1.0, route_scale=1.0,
)


def target_token_share(response: str, prompt=None, *, target: str = "7") -> float:
    """Share of the response's characters equal to ``target`` (0.0 for an empty response)."""
    return response.count(target) / len(response) if response else 0.0


def build_tiny_inkling(out_dir, *, seed: int = 0, prompts: int = 64, model: bool = True) -> Path:
    """Write ``out_dir/model`` (random tiny Inkling + char tokenizer) and ``out_dir/task.jsonl``; returns ``out_dir``.
    ``model=False`` writes the tokenizer and the task only (for builders of other families' models on this task)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import InklingForCausalLM, InklingTextConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(out / "model")
    config = InklingTextConfig(vocab_size=len(vocab), eos_token_id=vocab["<|im_end|>"],
                               pad_token_id=vocab["<|endoftext|>"], bos_token_id=None, **TINY_TEXT_CONFIG)
    if model:
        torch.manual_seed(seed)
        InklingForCausalLM(config).float().save_pretrained(out / "model")
    with open(out / "task.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": f"say {i}", "answer": "7"}) + "\n")
    return out


if __name__ == "__main__":
    from ferrule_examples.builder_cli import builder_main

    sys.exit(builder_main("ferrule_examples.inkling_synthetic", __doc__, build_tiny_inkling))
