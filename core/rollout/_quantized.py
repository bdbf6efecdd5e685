"""Block-scaled FP8 (MXFP8 / fine-grained FP8) HF folders for :class:`~ferrule.rollout.embedded.EmbeddedEngine`.

transformers' own CPU load of such a folder is not the model for every family: for Inkling-2's
released MXFP8 routed experts (``mlp.experts.{w13,w2}_weight`` + ``..._weight_scale``) transformers
5.24 on CPU reports the scales as unexpected keys and keeps the raw FP8 values unscaled
(tests/test_convert_mxfp8.py). So a quantized folder is read here as the converters read it
(:func:`ferrule.formats.quantized_weights.open_hf_weights`: transformers' ``Fp8Dequantize`` arithmetic, the
scales hidden) and built from its config without ``quantization_config``; the engine then loads the
dequantized tensors under their checkpoint names (transformers' reverse conversion,
:mod:`ferrule.rollout._checkpoint_names`), as it loads a torch_dist export.
"""

from __future__ import annotations

import json
import os
from typing import Any
from ferrule.formats.quantized_weights import open_hf_weights, quantization_config_of, strip_quantization

__all__ = ["check_hf_dir", "dequantized_source"]


def check_hf_dir(hf_dir: str | os.PathLike) -> None:
    """Raise ``FileNotFoundError`` (naming it) unless ``hf_dir`` is a directory with a ``config.json``."""
    if not os.path.exists(hf_dir):
        raise FileNotFoundError(f"HF checkpoint directory {os.fspath(hf_dir)!r} does not exist.")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"{os.fspath(hf_dir)!r} has no config.json; pass an HF checkpoint directory.")


def dequantized_source(hf_dir: str | os.PathLike) -> tuple[Any, dict] | None:
    """``(config without quantization_config, {checkpoint name: dequantized tensor})`` of a quantized HF
    folder, or None when ``config.json`` declares no quantization (:func:`~ferrule.formats.quantized_weights.quantization_config_of`).

    The tensors are in the config's ``dtype`` (bf16 for Inkling-2-Small-MXFP8), held in memory at once.

    Raises:
        ferrule.formats.safetensors_io.CheckpointError: an unsupported ``quant_method`` or an inconsistent
            quantized checkpoint (as the converters raise).
    """
    raw = json.loads(open(os.path.join(os.fspath(hf_dir), "config.json")).read())
    if quantization_config_of(raw) is None:
        return None
    from transformers import AutoConfig

    config = AutoConfig.for_model(**strip_quantization(raw))
    reader = open_hf_weights(hf_dir, raw)
    return config, {k: reader.get(k) for k in reader.keys()}
