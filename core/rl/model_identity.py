"""What identifies the model a run trains: the sizes and content hashes of ``model.hf_dir``'s files.

A checkpoint's ``loop_state.json`` records :func:`model_files` of ``model.hf_dir`` as the run saw it
at its start (key :data:`MODEL_FILES_KEY`). ``--resume`` compares it with the folder as it is now
(:func:`model_changes`): a folder whose weights or tokenizer changed in place (same path, same
shapes) would continue the run from other weights and tokenize with another vocabulary, silently;
it is refused naming each file, unless ``checkpoint.allow_model_change`` (``--allow-model-change``).
The same record lets a folder that moved be given again (``model.hf_dir=NEW``): the resume accepts
the new path when its files are the recorded ones.

The files are the weights (``*.safetensors``, ``*.bin``, their index), ``config.json`` and the
tokenizer's (:data:`TOKENIZER_FILES`, ``chat_template*``); a README or a hidden file may change
freely. The hash is XXH3-64 (:func:`ferrule.fs.integrity.file_digest`, about 4 GB/s per core: a 16 GB
model costs about 4 s at the start of a run and again on ``--resume``).
"""

from __future__ import annotations

import os
from pathlib import Path
from ferrule.fs.integrity import file_digest

__all__ = ["MODEL_FILES_KEY", "TOKENIZER_FILES", "model_files", "model_changes"]

#: Key of ``loop_state.json`` holding :func:`model_files` of the run's ``model.hf_dir``.
MODEL_FILES_KEY = "model_files"

#: Tokenizer files of an HF folder (transformers' ``PreTrainedTokenizer*`` names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def _identifies(name: str) -> bool:
    return (name.endswith(_WEIGHT_SUFFIXES) or name == "config.json" or name in TOKENIZER_FILES
            or name.startswith("chat_template"))


def model_files(hf_dir: str | os.PathLike) -> dict[str, dict]:
    """``{file name: {"bytes": int, "xxh3_64": str}}`` of the files of ``hf_dir`` that identify the
    model (module docstring), top level only, sorted by name.

    Raises:
        OSError: a file cannot be read.
    """
    folder = Path(hf_dir)
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.name.startswith(".") and _identifies(p.name):
            out[p.name] = {"bytes": p.stat().st_size, "xxh3_64": file_digest(p)}
    return out


def model_changes(recorded: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """One phrase per file that differs between two :func:`model_files` records (empty: the same
    model), e.g. ``"model.safetensors changed (same size 1,234 bytes, other content)"``."""
    out = []
    for name in sorted(set(recorded) | set(current)):
        a, b = recorded.get(name), current.get(name)
        if a == b:
            continue
        if b is None:
            out.append(f"{name} is missing")
        elif a is None:
            out.append(f"{name} is new")
        elif a.get("bytes") != b.get("bytes"):
            out.append(f"{name} changed ({a.get('bytes'):,} -> {b.get('bytes'):,} bytes)")
        else:
            out.append(f"{name} changed (same size, {b.get('bytes'):,} bytes, other content)")
    return out
