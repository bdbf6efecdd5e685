"""Block-scaled FP8 (MXFP8) checkpoints in ``ferrule convert``: what the torch_dist checkpoint records
of the source's quantization, and the MXFP8 export.

``hf-to-torch-dist`` reads a quantized HF checkpoint dequantized (:mod:`ferrule.formats.quantized_weights`);
the torch_dist holds the dequantized weights, so its ``hf/config.json`` loses ``quantization_config``
(it describes the weights stored), and ``ferrule_checkpoint.json`` keeps it under
``hf_quantization``: ``{"config": quantization_config, "tensors": {hf_key: {"scale": scale key,
"scale_dtype": "U8", "dtype": "F8_E4M3", "block": [block_m, block_n]}}}``.

The source's scales are kept beside, in ``hf/mxfp8_scales.safetensors`` (one byte per 32 weights; for
an NVFP4 source (:mod:`ferrule.formats.nvfp4`) its block scales, one byte per 16 weights, and its per-matrix
``_amax`` / ``_outer_scale_denominator``). An NVFP4 tensor's entry in ``tensors`` also has
``"format": "nvfp4"``, ``"amax"``, ``"denominator"`` (their keys) and ``"shape"`` (the dequantized one).

With ``keep_quantized=True`` (``--keep-quantized``; ``mxfp8=True`` / ``--mxfp8`` is its older name, from
before NVFP4 sources) an NVFP4 source's tensors are written back NVFP4 when they still hold the source's
values (:func:`ferrule.formats.nvfp4.requantize_nvfp4_exactly`: the source's bytes and side tensors come back);
a changed (trained) one is refused, named (ferrule has no NVFP4 quantizer; docs/convert.md "NVFP4").

``torch-dist-to-hf`` writes the dequantized (e.g. bf16) folder by default; with ``keep_quantized=True`` it
quantizes again every tensor the source stored quantized (same names, block grid and scale dtype)
and puts ``quantization_config`` back. A tensor that still holds the source's values is written
with the source's own scales (:func:`ferrule.formats.quantized_weights.requantize_exactly`: the source's
bytes come back); a changed one (trained) gets fresh scales by transformers' rule
(:func:`ferrule.formats.quantized_weights.quantize_mxfp8`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrule.formats.quantized_weights import DequantizingReader, quantize_mxfp8, requantize_exactly
from ferrule.formats.safetensors_io import CheckpointError
from ferrule.formats.nvfp4 import requantize_nvfp4_exactly

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SCALES_FILE", "source_quantization", "requantizer", "restore_quantization_config", "drop_quantization_config"]

#: File in ``OUT_DIR/hf`` holding the source checkpoint's MXFP8 scales (under their HF names).
SCALES_FILE = "mxfp8_scales.safetensors"


def source_quantization(reader: Any, hf_side_dir: Path) -> dict | None:
    """The ``hf_quantization`` entry for ``ferrule_checkpoint.json`` (None: the source is not quantized);
    drops ``quantization_config`` from ``hf_side_dir/config.json`` when it is."""
    if not isinstance(reader, DequantizingReader):
        return None
    drop_quantization_config(hf_side_dir / "config.json")
    if reader.quantized:
        from safetensors.torch import save_file

        save_file({info[role]: reader.raw.get(info[role]).contiguous() for info in reader.quantized.values()
                   for role in ("scale", "amax", "denominator") if role in info}, str(hf_side_dir / SCALES_FILE))
    return {"config": reader.quantization_config, "tensors": reader.quantized}


def mxfp8_bytes_saved(meta: dict, ckpt_dir: Path, out_dtype: str) -> int:
    """Bytes a ``--keep-quantized`` export writes fewer than a ``out_dtype`` one: each tensor the source quantized
    is 1 byte per value instead of ``out_dtype``'s itemsize (its scales are already counted with the
    ``hf/`` side files). Value counts come from the source scales' shapes times their block
    (:data:`SCALES_FILE` header only); 0 when that file is absent (the estimate then stays the bf16 size, an over-estimate)."""
    path = Path(ckpt_dir) / "hf" / SCALES_FILE
    tensors = (meta.get("hf_quantization") or {}).get("tensors") or {}
    if not tensors or not path.is_file():
        return 0
    from safetensors import safe_open

    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(out_dtype, 4)
    saved = 0
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
        for info in tensors.values():
            if info["scale"] in stored:
                n_scales = 1
                for d in f.get_slice(info["scale"]).get_shape():
                    n_scales *= d
                per_value = 0.5 if info.get("format") == "nvfp4" else 1  # bytes a value takes quantized
                saved += int(n_scales * info["block"][0] * info["block"][1] * (itemsize - per_value))
    return saved


def requantizer(meta: dict, mxfp8: bool, ckpt_dir: Path) -> Callable[..., Iterator[tuple[str, "torch.Tensor"]]] | None:
    """``fn(hf_name, stored, out) -> (name, tensor)...``: ``(hf_name, out)`` for a tensor the source did not
    quantize, the MXFP8 values and scale of ``stored`` (the torch_dist's tensor) for one it did; None
    when ``mxfp8`` is False.

    Raises:
        CheckpointError: ``mxfp8`` but the source was not quantized, or not with power-of-two
            (E8M0) scales, whose values alone round-trip exactly.
    """
    if not mxfp8:
        return None
    quant = meta.get("hf_quantization")
    if not quant:
        raise CheckpointError("--keep-quantized: the source HF checkpoint of this torch_dist checkpoint was not "
                              "quantized (ferrule_checkpoint.json has no hf_quantization); export it without "
                              "--keep-quantized.")
    tensors = quant["tensors"]
    other = sorted({t["scale_dtype"] for t in tensors.values() if t.get("format") != "nvfp4"} - {"U8", "F8_E8M0"})
    if other:
        raise CheckpointError(f"--keep-quantized: the source's scales are {other}, not power-of-two E8M0 (U8 / "
                              f"F8_E8M0), so re-quantizing would not give its values back; export without "
                              f"--keep-quantized (dequantized).")

    source_scales = {}
    if (Path(ckpt_dir) / "hf" / SCALES_FILE).is_file():
        from safetensors.torch import load_file

        source_scales = load_file(str(Path(ckpt_dir) / "hf" / SCALES_FILE))

    return _Requantize(tensors, source_scales)


class _Requantize:
    """:func:`requantizer`'s function, a module-level class so that it pickles: the conversion workers it is
    passed to are spawned processes whenever the export runs on several ranks (or in a process where
    ``torch.distributed`` is already initialized), and a local closure does not pickle."""

    def __init__(self, tensors: dict, source_scales: dict) -> None:
        self.tensors, self.source_scales = tensors, source_scales

    def __call__(self, name: str, stored: "torch.Tensor", out: "torch.Tensor") -> Iterator[tuple[str, "torch.Tensor"]]:
        info = self.tensors.get(name)
        if info is None:
            yield name, out
            return
        if info.get("format") == "nvfp4":
            yield from _nvfp4_back(name, info, stored, self.source_scales)
            return
        scale = self.source_scales.get(info["scale"])
        values = requantize_exactly(stored, scale) if scale is not None else None
        if values is None:  # changed since import (or no source scales): transformers' rule
            values, scale = quantize_mxfp8(stored, tuple(info["block"]), info["scale_dtype"])
        yield name, values
        yield info["scale"], scale


def _nvfp4_back(name: str, info: dict, stored: "torch.Tensor", source: dict) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The source's NVFP4 codes of ``stored`` and its side tensors; CheckpointError when ``stored`` changed."""
    sides = [source.get(info[role]) for role in ("scale", "amax", "denominator")]
    codes = None if any(t is None for t in sides) else requantize_nvfp4_exactly(stored, *sides)
    if codes is None:
        raise CheckpointError(f"--keep-quantized: {name} no longer holds the source's NVFP4 values (changed since "
                              f"the import, e.g. trained; or {SCALES_FILE} lacks its scales) and ferrule has no NVFP4 "
                              f"quantizer; "
                              f"export without --keep-quantized (dequantized).")
    yield name, codes
    for role, tensor in zip(("scale", "amax", "denominator"), sides):
        yield info[role], tensor


def restore_quantization_config(config_path: Path, meta: dict) -> None:
    """Put the source's ``quantization_config`` back into a ``--keep-quantized`` export's ``config.json`` (none when the
    source had none: an NVFP4 checkpoint read by its tensor names)."""
    config = json.loads(config_path.read_text())
    if not meta["hf_quantization"]["config"]:
        return
    config["quantization_config"] = meta["hf_quantization"]["config"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def drop_quantization_config(config_path: Path) -> None:
    """Remove ``quantization_config`` from ``config_path`` (a folder of dequantized weights); no-op without one."""
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2) + "\n")
