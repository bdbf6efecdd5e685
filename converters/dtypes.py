"""Floating dtypes of HF checkpoints in conversion: the main dtype of a source checkpoint, the tensors
stored in another one (restored by the export), and the dtype ``config.json`` states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ferrule.formats.safetensors_io import CheckpointError

__all__ = ["write_config_dtype"]

_FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _dtype_name(reader: Any) -> str:
    """The checkpoint's main floating dtype: the one holding the most bytes (e.g. ``"bfloat16"``)."""
    sizes: dict[str, int] = {}
    for k in reader.keys():
        name = reader.dtype_name(k)
        if name in _FLOAT_NAMES:
            numel = 1
            for d in reader.shape(k):
                numel *= int(d)
            sizes[name] = sizes.get(name, 0) + numel * (4 if name == "F32" else 2)
    if not sizes:
        raise CheckpointError("checkpoint has no floating-point tensors (F32/BF16/F16); pass dtype= explicitly.")
    return _FLOAT_NAMES[max(sizes, key=lambda n: (sizes[n], n))]


def _other_float_dtypes(reader: Any, main: str) -> dict[str, str]:
    """``{hf_key: dtype}`` for floating tensors stored in another dtype than ``main``.

    E.g. transformers keeps Inkling's ShortConv weights and router bias / global scale in fp32
    inside a bf16 checkpoint (``_keep_in_fp32_modules_strict``); the export restores each such
    tensor's own dtype, so the round trip stays bit-exact.
    """
    out = {}
    for k in reader.keys():
        name = _FLOAT_NAMES.get(reader.dtype_name(k))
        if name is not None and name != main:
            out[k] = name
    return out


def write_config_dtype(config_path: Path, dtype: str) -> None:
    """Make ``config.json`` state ``dtype`` (``"float32"`` ...) as the dtype of its weights.

    Sets ``dtype`` (transformers >= 4.56's key; ``from_pretrained`` loads in it by default) and
    ``torch_dtype`` where the file has it, at the top level and in each nested sub-config that
    names one (``text_config``, ``vision_config`` ...), so every part loads as written.
    """
    original = json.loads(config_path.read_text())
    config = json.loads(config_path.read_text())

    def fix(d: dict) -> None:
        d["dtype"] = dtype
        if "torch_dtype" in d:
            d["torch_dtype"] = dtype
        for v in d.values():
            if isinstance(v, dict) and ("dtype" in v or "torch_dtype" in v):
                fix(v)

    fix(config)
    if config != original:  # a file that already states it stays byte for byte
        config_path.write_text(json.dumps(config, indent=2) + "\n")
