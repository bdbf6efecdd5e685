"""Block-scaled FP8 checkpoints (MXFP8, fine-grained FP8): read dequantized, write re-quantized.

``ferrule.formats.quantized_weights`` is the one place ferrule reads quantized HF weights. An HF
checkpoint whose ``config.json`` has ``quantization_config.quant_method`` ``"mxfp8"`` or
``"fp8"`` (transformers' ``FineGrainedFP8Config``; e.g. ``thinkingmachines/Inkling-2-Small-MXFP8``)
stores some weights as 8-bit floats with one shared scale per block:

- a weight ``K``: ``float8_e4m3fn`` (safetensors ``F8_E4M3``; ``F8_E5M2`` is read too), shape
  ``[..., rows, cols]`` (leading dims: stacked experts);
- its scale, the sibling ``K + "_scale_inv"`` (``x.weight`` -> ``x.weight_scale_inv``, the name
  transformers' ``FP8Linear`` / ``FP8Experts`` load) or ``K + "_scale"`` (the original Inkling-2
  expert names, ``w13_weight`` -> ``w13_weight_scale``), shape ``[..., rows / block_m, cols / block_n]``
  (a 0-d or one-element scale: one block for the whole tensor). Scale dtypes: ``U8`` holding
  E8M0 exponent bytes (MXFP8 as Inkling-2 ships it: the scale is ``2 ** (byte - 127)``),
  ``F8_E8M0`` (``torch.float8_e8m0fnu``), or ``F32`` / ``BF16`` multipliers (fine-grained FP8);
- ``<stem>.activation_scale`` (static activation scheme) is dropped, as transformers drops it
  when it dequantizes.

NVFP4 weights (4-bit E2M1 codes, an ``F8_E4M3`` scale per 16 values, a per-matrix ``amax /
outer_scale_denominator``: the released Inkling-2-Mini experts) are found by their tensors and
read by :mod:`ferrule.formats.nvfp4`, with or without a ``quantization_config`` (transformers reads them
without one).

MXFP8 is the OCP Microscaling format (OCP MX spec v1.0: E4M3 elements, E8M0 shared scale, blocks of
32 along the reduction dim, ``weight_block_size: [1, 32]``). Dequantization is transformers 5.24's
``integrations.finegrained_fp8.Fp8Dequantize._dequantize_one``: both sides to float32, the scale of
``U8`` bytes as ``exp2(byte - 127)``, multiply block-wise, cast to the model dtype. The block shape
is the weight shape divided by the scale grid, as there. Every product is a 4-bit-significand
value times a power of two, so it is exact in float32 and bfloat16 alike.

:class:`DequantizingReader` presents such a checkpoint as a plain one (scales hidden, each quantized
weight returned dequantized in the checkpoint's ``dtype``); :func:`open_hf_weights` returns it or a
plain :class:`~ferrule.formats.safetensors_io.SafetensorsReader` from the directory's ``config.json``.
:func:`quantize_mxfp8` is the reverse (transformers' ``Fp8Quantize`` with ``scale_fmt="ue8m0"``:
the scale is the smallest power of two with ``amax / scale <= 448``), used by ``torch-dist-to-hf
--keep-quantized``; on values that came from the checkpoint it gives back the same bytes wherever the
source scale was that smallest power of two (transformers' quantizer and the OCP floor rule both
are), and the same values always.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrule.formats.nvfp4 import dequantize_nvfp4, find_nvfp4, has_nvfp4
from ferrule.formats.safetensors_io import CheckpointError, SafetensorsReader

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SUPPORTED_METHODS", "SCALE_SUFFIXES", "DequantizingReader", "open_hf_weights", "quantization_config_of",
           "dequantize_block_fp8", "quantize_mxfp8", "requantize_exactly", "QuantizedTensorInfo"]

#: ``quantization_config.quant_method`` values read here (transformers maps both to FineGrainedFP8HfQuantizer).
SUPPORTED_METHODS = ("mxfp8", "fp8")
#: Sibling suffixes naming a quantized tensor's scale, in the order they are looked for.
SCALE_SUFFIXES = ("_scale_inv", "_scale")
_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_SCALE_NAMES = ("U8", "F8_E8M0", "F32", "BF16", "F16")
_OUT_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
#: Largest finite float8_e4m3fn value (OCP E4M3: 1.75 * 2**8).
FP8_E4M3_MAX = 448.0

QuantizedTensorInfo = dict  # {"scale": key, "scale_dtype": "U8", "dtype": "F8_E4M3", "block": [bm, bn]}


def quantization_config_of(hf_config: dict) -> dict | None:
    """The checkpoint's ``quantization_config`` if ferrule reads it, None if it has none.

    Raises:
        CheckpointError: another ``quant_method`` (GPTQ, AWQ, NVFP4 ...), named with the supported ones.
    """
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"config.json's quantization_config is a {type(qc).__name__} ({qc!r}); transformers "
                              f"writes an object such as {{\"quant_method\": \"mxfp8\", ...}}.")
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise CheckpointError(
            f"config.json has quantization_config.quant_method {method!r}; ferrule reads only {list(SUPPORTED_METHODS)} "
            f"(block-scaled FP8). Dequantize the checkpoint with transformers (from_pretrained + save_pretrained in "
            f"bfloat16) first.")
    return dict(qc)


def _scale_fp32(scales: "torch.Tensor") -> "torch.Tensor":
    import torch

    if scales.dtype == torch.uint8:  # E8M0 exponent bytes (transformers: (byte - 127).exp2())
        return (scales.to(torch.float32) - 127.0).exp2()
    return scales.to(torch.float32)


def dequantize_block_fp8(quantized: "torch.Tensor", scales: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """``quantized * scale`` per block, in float32, cast to ``dtype`` (transformers 5.24's ``Fp8Dequantize``).

    Args:
        quantized: ``[..., rows, cols]`` float8 values.
        scales: ``[..., rows / block_m, cols / block_n]`` (or one element): ``uint8`` E8M0 bytes
            (scale ``2 ** (byte - 127)``), ``float8_e8m0fnu``, or floating multipliers.
        dtype: output dtype.

    Returns:
        ``[..., rows, cols]`` tensor of ``dtype``.

    Raises:
        ValueError: the weight's last two dims are not multiples of the scale grid's.
    """
    import torch

    q = quantized.to(torch.float32)
    rows, cols = q.shape[-2:]
    scale_rows, scale_cols = scales.shape[-2:] if scales.dim() >= 2 else (1, 1)
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"weight shape ({rows}, {cols}) is not divisible by the scale grid ({scale_rows}, {scale_cols}).")
    bm, bn = rows // scale_rows, cols // scale_cols
    s = _scale_fp32(scales).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    return (q.reshape(-1, scale_rows, bm, scale_cols, bn) * s).to(dtype).reshape(q.shape)


def quantize_mxfp8(weight: "torch.Tensor", block: tuple[int, int], scale_dtype: str = "U8"
                   ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """MXFP8-quantize ``weight`` (transformers 5.24 ``Fp8Quantize`` with ``scale_fmt="ue8m0"``).

    Per block: ``amax`` = max ``|w|``; the scale is ``2 ** ceil(log2(amax / 448))`` (1 for an
    all-zero block); values are ``clamp(w / scale, -448, 448)`` cast to ``float8_e4m3fn``.

    Args:
        weight: ``[..., rows, cols]`` floating tensor.
        block: ``(block_m, block_n)`` dividing ``rows`` and ``cols`` (MXFP8: ``(1, 32)``).
        scale_dtype: ``"U8"`` (E8M0 bytes, as Inkling-2 ships) or ``"F8_E8M0"``.

    Returns:
        ``(values [..., rows, cols] float8_e4m3fn, scales [..., rows / block_m, cols / block_n])``.

    Raises:
        ValueError: the block does not divide the weight, or another ``scale_dtype``.
    """
    import torch

    if scale_dtype not in ("U8", "F8_E8M0"):
        raise ValueError(f"MXFP8 scales are power-of-two (E8M0): scale dtype U8 or F8_E8M0, got {scale_dtype!r}.")
    bm, bn = block
    rows, cols = weight.shape[-2:]
    if rows % bm or cols % bn:
        raise ValueError(f"block {tuple(block)} does not divide the weight's last dims ({rows}, {cols}).")
    lead = weight.shape[:-2]
    w = weight.to(torch.float32).reshape(*lead, rows // bm, bm, cols // bn, bn)
    amax = w.abs().amax(dim=(-3, -1))
    inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
    q = torch.clamp(w * (1.0 / inv).unsqueeze(-1).unsqueeze(-3), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).reshape(weight.shape)
    e8m0 = inv.to(torch.float8_e8m0fnu)
    return q, (e8m0.view(torch.uint8) if scale_dtype == "U8" else e8m0)


def requantize_exactly(weight: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor | None":
    """The float8_e4m3fn values ``v`` with ``dequantize_block_fp8(v, scales) == weight``, or None if there are none.

    For weights read from an MXFP8 checkpoint and not changed since, this gives back its exact
    bytes together with its own ``scales`` (:func:`quantize_mxfp8` may pick the other valid scale of
    a block whose largest value rounded to 224: ``224 * s == 448 * s / 2``).

    Args:
        weight: ``[..., rows, cols]`` floating tensor.
        scales: ``[..., rows / block_m, cols / block_n]`` scales (any dtype :func:`dequantize_block_fp8` reads).
    """
    import torch

    rows, cols = weight.shape[-2:]
    scale_rows, scale_cols = scales.shape[-2:] if scales.dim() >= 2 else (1, 1)
    if rows % scale_rows or cols % scale_cols:
        return None
    bm, bn = rows // scale_rows, cols // scale_cols
    s = _scale_fp32(scales).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    w = weight.to(torch.float32)
    q = (w.reshape(-1, scale_rows, bm, scale_cols, bn) / s).reshape(w.shape)
    if not bool(torch.isfinite(q).all()) or float(q.abs().max()) > FP8_E4M3_MAX:
        return None
    values = q.to(torch.float8_e4m3fn)
    return values if torch.equal(dequantize_block_fp8(values, scales, torch.float32), w) else None


class DequantizingReader:
    """A :class:`~ferrule.formats.safetensors_io.SafetensorsReader` over a block-scaled FP8 checkpoint,
    seen as the unquantized checkpoint transformers loads from it.

    ``keys()`` hides scales and activation scales; ``get(K)`` of a quantized ``K`` is
    :func:`dequantize_block_fp8` in ``dtype`` (``dtype_name`` / ``nbytes`` say so); every other
    tensor is read unchanged. :attr:`quantized` lists what was quantized (for the export).

    Args:
        reader: the raw reader.
        quantization_config: the config's ``quantization_config`` (:func:`quantization_config_of`).
        dtype: torch dtype name of dequantized tensors (``"bfloat16"``: the config's ``dtype``).

    NVFP4 weights (:func:`ferrule.formats.nvfp4.find_nvfp4`) are found first, in any checkpoint;
    ``quantization_config`` may then be ``{}``.

    Raises:
        CheckpointError: a scale without its weight, an FP8 weight without its scale, a weight with two scales, a scale of an
            unknown dtype, or a scale grid that does not divide its weight; an NVFP4 weight missing a side tensor
            or with one of the wrong dtype or shape (all offenders named).
    """

    def __init__(self, reader: SafetensorsReader, quantization_config: dict, dtype: str = "bfloat16") -> None:
        if dtype not in _OUT_NAMES:
            raise CheckpointError(f"dequantized dtype {dtype!r}: expected one of {sorted(_OUT_NAMES)}.")
        self.raw, self.quantization_config, self.dtype = reader, dict(quantization_config), dtype
        self.root = reader.root
        keys = set(reader.keys())
        problems: list[str] = []
        # NVFP4 (ferrule.formats.nvfp4): U8 codes + F8_E4M3 block scales + per-matrix amax / denominator
        nvfp4, hidden = find_nvfp4(reader, keys, problems)
        self.quantized: dict[str, QuantizedTensorInfo] = dict(nvfp4)
        for k in sorted(keys - hidden):
            if reader.dtype_name(k) not in _FP8_NAMES:
                continue
            scales = [k + s for s in SCALE_SUFFIXES if k + s in keys]
            if len(scales) > 1:
                problems.append(f"{k} has two scales {scales}")
                continue
            if not scales:
                problems.append(f"{k} is {reader.dtype_name(k)} but has no scale ({k}_scale_inv)")
                continue
            info = self._info(k, scales[0], problems)
            if info is not None:
                self.quantized[k] = info
                hidden.add(scales[0])
            if k.endswith(".weight") and k[:-len("weight")] + "activation_scale" in keys:
                hidden.add(k[:-len("weight")] + "activation_scale")
        # a scale name whose weight is absent (other "*_scale" tensors, e.g. a router's scale, are weights)
        orphans = sorted(k for k in keys - hidden if k.endswith(("_scale_inv", "weight_scale"))
                         and k.removesuffix("_inv").removesuffix("_scale") not in keys)
        problems += [f"{k} is a scale without its weight" for k in orphans]
        if problems:
            raise CheckpointError(f"{reader.root}: the {quantization_config.get('quant_method', 'quantized')} checkpoint is "
                                  f"inconsistent: " + "; ".join(problems[:10])
                                  + (f" ... ({len(problems)} in all)" if len(problems) > 10 else "")
                                  + "; re-export it (transformers save_pretrained).")
        self._keys = sorted(keys - hidden)

    def _info(self, key: str, scale: str, problems: list[str]) -> QuantizedTensorInfo | None:
        shape, sshape, sdt = self.raw.shape(key), self.raw.shape(scale), self.raw.dtype_name(scale)
        if sdt not in _SCALE_NAMES:
            problems.append(f"scale {scale} has dtype {sdt} (expected one of {list(_SCALE_NAMES)})")
            return None
        grid = tuple(sshape[-2:]) if len(sshape) >= 2 else (1, 1)
        if len(shape) < 2 or shape[-2] % grid[0] or shape[-1] % grid[1] or \
                (len(sshape) >= 2 and tuple(sshape[:-2]) != tuple(shape[:-2])):
            problems.append(f"scale {scale} {tuple(sshape)} does not tile {key} {tuple(shape)}")
            return None
        return {"scale": scale, "scale_dtype": sdt, "dtype": self.raw.dtype_name(key),
                "block": [shape[-2] // grid[0], shape[-1] // grid[1]]}

    def keys(self) -> list[str]:
        """Tensor names as transformers' dequantized model sees them (sorted; no scales, no NVFP4 amax / denominators)."""
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape as transformers loads it (an NVFP4 weight: twice its stored last dim)."""
        info = self.quantized.get(key)
        return tuple(info["shape"]) if info is not None and "shape" in info else self.raw.shape(key)

    def dtype_name(self, key: str) -> str:
        return _OUT_NAMES[self.dtype] if key in self.quantized else self.raw.dtype_name(key)

    def nbytes(self, key: str) -> int:
        if key not in self.quantized:
            return self.raw.nbytes(key)
        n = 4 if self.dtype == "float32" else 2
        for d in self.shape(key):
            n *= d
        return n

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._keys)

    def get(self, key: str) -> "torch.Tensor":
        """One tensor; a quantized one dequantized (:func:`dequantize_block_fp8`,
        :func:`ferrule.formats.nvfp4.dequantize_nvfp4`) in :attr:`dtype`.

        Raises:
            KeyError: no such key (scales are not keys of this view).
        """
        import torch

        if key not in self._keys:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.root}")
        if key not in self.quantized:
            return self.raw.get(key)
        info = self.quantized[key]
        if info.get("format") == "nvfp4":
            return dequantize_nvfp4(self.raw.get(key), self.raw.get(info["scale"]), self.raw.get(info["amax"]),
                                    self.raw.get(info["denominator"]), getattr(torch, self.dtype))
        return dequantize_block_fp8(self.raw.get(key), self.raw.get(self.quantized[key]["scale"]),
                                    getattr(torch, self.dtype))

    def iter_tensors(self):
        """Yield ``(key, tensor)`` for every key, one tensor at a time."""
        for k in self._keys:
            yield k, self.get(k)


def _config_dtype(hf_config: dict) -> str:
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if cfg.get(key) in _OUT_NAMES:
                return cfg[key]
    return "bfloat16"  # transformers' Fp8Dequantize default for E8M0 scales without a target dtype


def open_hf_weights(path: str | os.PathLike, hf_config: dict | None = None, dtype: str | None = None
                    ) -> "SafetensorsReader | DequantizingReader":
    """The weights of an HF checkpoint directory as transformers loads them.

    Args:
        path: HF checkpoint directory (or one ``.safetensors`` file: then never dequantized unless
            ``hf_config`` says so).
        hf_config: the parsed ``config.json``; default: read from ``path/config.json`` if present.
        dtype: torch dtype name quantized weights are dequantized into (what ``from_pretrained(dtype=...)``
            gives); default: the config's ``dtype``, else bfloat16. Only NVFP4 values depend on it (an
            MXFP8 / FP8 value is exact in every one of them).

    Returns:
        a :class:`DequantizingReader` when the config has a ``quantization_config`` of
        :data:`SUPPORTED_METHODS` or the checkpoint holds NVFP4 weights (:mod:`ferrule.formats.nvfp4`: found by
        their tensors, as transformers finds them; no ``quantization_config`` needed, FP8 weights with
        block scales beside them are then read too), else a plain :class:`~ferrule.formats.safetensors_io.SafetensorsReader`.

    Raises:
        CheckpointError: unreadable shards, an unsupported ``quant_method``, an inconsistent quantized checkpoint,
            FP8 weights with scales but no ``quantization_config``.
    """
    reader = SafetensorsReader(path)
    if hf_config is None:
        cfg_path = Path(path) / "config.json"
        try:
            hf_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except ValueError as exc:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {exc}") from exc
    qc = quantization_config_of(hf_config)
    if qc is None:
        if has_nvfp4(reader):  # transformers' Inkling2LoopDequantizeExperts reads them without a config
            return DequantizingReader(reader, {}, dtype or _config_dtype(hf_config))
        _refuse_unconfigured_fp8(reader)
        return reader
    return DequantizingReader(reader, qc, dtype or _config_dtype(hf_config))


def _refuse_unconfigured_fp8(reader: SafetensorsReader) -> None:
    """Raise CheckpointError when FP8 weights carry block scales but config.json declares no quantization."""
    keys = set(reader.keys())
    scaled = sorted(k for k in keys if reader.dtype_name(k) in _FP8_NAMES and any(k + s in keys for s in SCALE_SUFFIXES))
    if scaled:
        raise CheckpointError(
            f"{reader.root}: {len(scaled)} FP8 weights carry block scales (first: {scaled[0]}) but config.json has no "
            f"quantization_config; restore the one the checkpoint was saved with (e.g. {{\"quant_method\": \"mxfp8\", "
            f"\"weight_block_size\": [1, 32], \"scale_fmt\": \"ue8m0\"}}) or dequantize it with transformers first.")


def strip_quantization(hf_config: dict) -> dict[str, Any]:
    """A copy of ``hf_config`` without ``quantization_config`` (the config of the dequantized weights)."""
    return {k: v for k, v in hf_config.items() if k != "quantization_config"}
