"""A tiny random Inkling-2 and the synthetic task of Inkling's RL example, for the shipped GRPO example.

``python -m ferrule_examples.inkling2_synthetic OUT_DIR`` writes

- ``OUT_DIR/model``: a random ``Inkling2ForCausalLM`` (2 layers, one sliding and one full, one block of
  attention residuals; 4 routed experts top-2; soft-caps at their defaults; an unembedding padded from
  the tokenizer's 49 ids to 56 rows, ``unpadded_vocab_size`` 49) saved with ``save_pretrained``, plus the
  character-level tokenizer of :mod:`ferrule_examples.inkling_synthetic` (ChatML control tokens included);
- ``OUT_DIR/task.jsonl``: 64 prompts (``"say <n>"``, answer ``"7"``).

The reward is :func:`ferrule_examples.inkling_synthetic.target_token_share` (share of "7" among the
response's characters). ``examples/configs/inkling2_tiny.yaml`` trains it with GRPO.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["build_tiny_inkling2", "TINY_TEXT_CONFIG", "PADDED_VOCAB"]

#: ``Inkling2TextConfig`` kwargs of the example model (vocab and token ids are added from the tokenizer).
TINY_TEXT_CONFIG = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, rel_extent=32,
    d_rel=4, log_scaling_n_floor=16, layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=2,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
)
#: rows of the (padded) embedding / unembedding; the tokenizer has 49 ids
PADDED_VOCAB = 56


def build_tiny_inkling2(out_dir, *, seed: int = 0, prompts: int = 64) -> Path:
    """Write ``out_dir/model`` (random tiny Inkling-2 + char tokenizer) and ``out_dir/task.jsonl``; returns ``out_dir``."""
    import torch
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig

    from ferrule_examples.inkling_synthetic import build_tiny_inkling

    out = Path(out_dir)
    build_tiny_inkling(out, seed=seed, prompts=prompts, model=False)  # tokenizer + task
    tok = json.loads((out / "model" / "tokenizer.json").read_text())["model"]["vocab"]
    config = Inkling2TextConfig(vocab_size=PADDED_VOCAB, unpadded_vocab_size=len(tok), eos_token_id=tok["<|im_end|>"],
                                pad_token_id=tok["<|endoftext|>"], bos_token_id=None, **TINY_TEXT_CONFIG)
    torch.manual_seed(seed)
    Inkling2ForCausalLM(config).float().save_pretrained(out / "model")
    return out


if __name__ == "__main__":
    from ferrule_examples.builder_cli import builder_main

    sys.exit(builder_main("ferrule_examples.inkling2_synthetic", __doc__, build_tiny_inkling2))
