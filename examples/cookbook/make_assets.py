"""Offline assets for running tinker-cookbook recipes against ``ferrule serve`` on CPU.

Writes, under OUT (default ``runs/cookbook``):

- ``student/`` and ``teacher/``: tiny random Qwen3 checkpoints (transformers' own
  ``Qwen3ForCausalLM``, 2 layers, hidden 64, Qwen3's 151,936-row vocabulary; seeds 0 and 1), each
  with the Qwen3 tokenizer ferrule rebuilds offline from ``qwen.tiktoken``
  (:mod:`ferrule.plugins.qwen.tokenizer`; nothing comes from a model hub);
- ``hf_home/``: an HF cache holding that tokenizer (and the model's ``config.json``) under the recipes' model names
  (``Qwen/Qwen3-4B-Instruct-2507`` for the student, ``Qwen/Qwen3-8B`` for the teacher), so the
  recipes' ``get_tokenizer(model_name)`` loads it with ``HF_HOME=OUT/hf_home HF_HUB_OFFLINE=1``.

- ``data/``: the working folder the recipes run in, holding local dataset folders named as the
  recipes' hub datasets (``datasets.load_dataset(NAME)`` reads a local folder of that name first):
  ``Anthropic/hh-rlhf`` (DPO) and ``allenai/tulu-3-sft-mixture`` (on-policy distillation's
  prompts), both made from the 128 conversations the tinker-cookbook wheel ships
  (``tinker_cookbook/example_data/conversations.jsonl``). hh-rlhf's ``rejected`` is ``chosen``
  with its last reply swapped for another conversation's reply (a synthetic preference).

The models are random: the runs check that the recipes run end to end against the service, not
that they learn anything useful.
"""

from __future__ import annotations

import sys
from pathlib import Path

NAMES = {"student": "Qwen/Qwen3-4B-Instruct-2507", "teacher": "Qwen/Qwen3-8B"}
#: a fixed fake commit id for the cache's snapshot folder
SNAPSHOT = "0" * 40


def main(out: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ferrule.plugins.qwen.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    for seed, (role, name) in enumerate(NAMES.items()):
        torch.manual_seed(seed)
        cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                          tie_word_embeddings=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
        Qwen3ForCausalLM(cfg).float().save_pretrained(out / role)
        tok.save_pretrained(out / role)
        repo = out / "hf_home" / "hub" / f"models--{name.replace('/', '--')}"
        tok.save_pretrained(repo / "snapshots" / SNAPSHOT)
        cfg.save_pretrained(repo / "snapshots" / SNAPSHOT)   # AutoTokenizer reads config.json too
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
        print(f"{role}: {out / role} (served as {name})")


def write_data(out: Path) -> None:
    import json

    import tinker_cookbook

    src = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    convos = [json.loads(line)["messages"] for line in src.read_text().splitlines() if line.strip()]
    convos = [c for c in convos if {m["role"] for m in c} <= {"user", "assistant"} and c[-1]["role"] == "assistant"]
    tulu = out / "data" / "allenai" / "tulu-3-sft-mixture"
    tulu.mkdir(parents=True, exist_ok=True)
    (tulu / "train.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convos))

    def hh(c, last):
        turns = [("Human: " if m["role"] == "user" else "Assistant: ") + m["content"] for m in c[:-1]]
        return "".join("\n\n" + t for t in turns + ["Assistant: " + last])

    rows = [{"chosen": hh(c, c[-1]["content"]), "rejected": hh(c, convos[(i + 1) % len(convos)][-1]["content"])}
            for i, c in enumerate(convos)]
    hhh = out / "data" / "Anthropic" / "hh-rlhf"
    hhh.mkdir(parents=True, exist_ok=True)
    (hhh / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    (hhh / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    print(f"data: {out / 'data'} ({len(convos)} conversations)")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/cookbook").absolute()
    if "--data-only" not in sys.argv:
        main(root)
    write_data(root)
