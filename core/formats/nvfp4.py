"""NVFP4 weights (4-bit E2M1 values, an FP8 scale per 16 values, a per-matrix factor): found and read dequantized.

``ferrule.formats.nvfp4`` is the NVFP4 half of :mod:`ferrule.formats.quantized_weights` (which calls it; read that
module first). The layout is the one of the released Inkling-2-Mini (``inkling2_loop``) checkpoints,
as transformers 5.24 reads them (``core_model_loading.Inkling2LoopDequantizeExperts`` and the
``inkling2_loop_text`` patterns of ``conversion_mapping.py``): a weight ``K`` (e.g.
``model.llm.layers.L.mlp.experts.w13_weight``) of logical shape ``[..., rows, cols]`` is stored as
four tensors,

- ``K``: ``uint8`` (safetensors ``U8``) ``[..., rows, cols / 2]``, two E2M1 codes per byte, the even
  element (column ``2j``) in the low nibble, the odd one (``2j + 1``) in the high nibble;
- ``K + "_scale"``: ``float8_e4m3fn`` (``F8_E4M3``) ``[..., rows, cols / 16]``, one block scale per 16
  consecutive values of a row;
- ``K + "_amax"``: ``[...]`` (one value per matrix: ``[num_experts]`` for stacked experts, 0-d for a
  plain matrix), float (``F32`` / ``BF16`` / ``F16``);
- ``K + "_outer_scale_denominator"``: float, 0-d, one element, or ``[...]`` like ``K_amax``.

E2M1 (OCP Microscaling spec v1.0, FP4): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no
inf / NaN; codes 0..7 are 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives
(code 8 is -0.0). Dequantization, in float32 and then cast once to the output dtype, in transformers'
order: ``(e2m1(code) * float(block_scale)) * (float(amax) / float(denominator))``. The first product
is exact (a 2-bit by a 4-bit significand); the per-matrix factor is an arbitrary float32, so the
result is generally not representable in bfloat16: the values depend on the output dtype exactly as
``from_pretrained(dtype=...)``'s do, and ferrule dequantizes straight into the dtype it stores.

:func:`requantize_nvfp4_exactly` is the exact reverse for values that came from the checkpoint
(``torch-dist-to-hf --keep-quantized`` writes the source's bytes back with it); ferrule has no NVFP4 quantizer
for changed (trained) values (docs/convert.md "NVFP4").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SCALE_SUFFIX", "AMAX_SUFFIX", "DENOMINATOR_SUFFIX", "BLOCK", "e2m1_values", "dequantize_nvfp4",
           "requantize_nvfp4_exactly", "find_nvfp4", "has_nvfp4"]

SCALE_SUFFIX, AMAX_SUFFIX, DENOMINATOR_SUFFIX = "_scale", "_amax", "_outer_scale_denominator"
#: values per block scale (NVFP4's micro-block)
BLOCK = 16
_FACTOR_DTYPES = ("F32", "BF16", "F16")


def e2m1_values() -> "torch.Tensor":
    """``[16]`` float32: the value of each E2M1 code, from the bit layout (sign, 2 exponent bits of bias 1, 1 mantissa bit)."""
    import torch

    out = []
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)
        out.append(-mag if sign else mag)
    return torch.tensor(out, dtype=torch.float32)


def dequantize_nvfp4(packed: "torch.Tensor", block_scales: "torch.Tensor", amax: "torch.Tensor",
                     denominator: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The ``[..., rows, cols]`` values of an NVFP4 weight (module docs), computed in float32, cast to ``dtype``.

    Args:
        packed: ``[..., rows, cols / 2]`` uint8, two E2M1 codes per byte (even element in the low nibble).
        block_scales: ``[..., rows, cols / 16]`` (float8_e4m3fn in the checkpoints; any dtype is widened to float32).
        amax: ``[...]`` per-matrix values (0-d for one matrix).
        denominator: 0-d, one element, or ``[...]``.
        dtype: output dtype.

    Raises:
        ValueError: shapes that do not fit together (what was expected is named).
    """
    import torch

    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 codes must be uint8 (two E2M1 codes per byte), got {packed.dtype}.")
    lead, rows, half = tuple(packed.shape[:-2]), packed.shape[-2], packed.shape[-1]
    cols = 2 * half
    if tuple(block_scales.shape) != (*lead, rows, cols // BLOCK) or cols % BLOCK:
        raise ValueError(f"block scales {tuple(block_scales.shape)} do not fit codes {tuple(packed.shape)}: expected "
                         f"{(*lead, rows, cols // BLOCK)} (one per {BLOCK} values, {cols} values a row).")
    if tuple(amax.shape) != lead and not (not lead and amax.numel() == 1):
        raise ValueError(f"amax {tuple(amax.shape)} does not fit codes {tuple(packed.shape)}: expected {lead} "
                         f"(one per matrix).")
    if denominator.numel() != 1 and tuple(denominator.shape) != lead:
        raise ValueError(f"outer scale denominator {tuple(denominator.shape)} does not fit codes "
                         f"{tuple(packed.shape)}: expected one element or {lead}.")
    table = e2m1_values()
    codes = packed.long()
    values = torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1)  # [..., rows, cols / 2, 2]
    values = values.reshape(*lead, rows, cols // BLOCK, BLOCK) * block_scales.float()[..., None]
    factor = amax.float().reshape(lead) / denominator.float().reshape(lead if denominator.numel() != 1 else ())
    values = values * factor.reshape(*lead, 1, 1, 1)
    return values.reshape(*lead, rows, cols).to(dtype)


def _bits(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def requantize_nvfp4_exactly(weight: "torch.Tensor", block_scales: "torch.Tensor", amax: "torch.Tensor",
                             denominator: "torch.Tensor") -> "torch.Tensor | None":
    """The packed codes ``q`` with ``dequantize_nvfp4(q, block_scales, amax, denominator, weight.dtype)`` equal to
    ``weight`` bit for bit (-0.0 included), or None if some value has no such code.

    Each of the 16 codes is dequantized in ``weight``'s dtype and compared; distinct E2M1 values differ by a
    factor of at least 4/3, more than one rounding of bf16 / fp16 / fp32 can merge, so a match is unique.

    Args:
        weight: ``[..., rows, cols]`` float32 / bfloat16 / float16 (e.g. a tensor read from the checkpoint and
            not changed since).
        block_scales, amax, denominator: the source's (shapes as :func:`dequantize_nvfp4`).

    Returns:
        ``[..., rows, cols / 2]`` uint8 (even element in the low nibble), or None.
    """
    import torch

    lead, rows, cols = tuple(weight.shape[:-2]), weight.shape[-2], weight.shape[-1]
    if cols % BLOCK or tuple(block_scales.shape) != (*lead, rows, cols // BLOCK):
        return None
    scale = block_scales.float()[..., None]
    factor = (amax.float().reshape(lead) / denominator.float().reshape(lead if denominator.numel() != 1 else ()))
    factor = factor.reshape(*lead, 1, 1, 1)
    target = _bits(weight.reshape(*lead, rows, cols // BLOCK, BLOCK))
    codes = torch.full(target.shape, -1, dtype=torch.long)
    for code, value in enumerate(e2m1_values().tolist()):
        candidate = _bits(((torch.tensor(value) * scale) * factor).to(weight.dtype).expand(target.shape))
        codes[(candidate == target) & (codes < 0)] = code
    if bool((codes < 0).any()):
        return None
    codes = codes.reshape(*lead, rows, cols)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def has_nvfp4(reader: Any) -> bool:
    """Whether the checkpoint holds NVFP4 tensors: a ``*_amax`` / ``*_outer_scale_denominator`` key, or a ``U8``
    weight with an ``F8_E4M3`` ``*_scale`` (then checked by :func:`find_nvfp4`)."""
    keys = set(reader.keys())
    return any(k.endswith((AMAX_SUFFIX, DENOMINATOR_SUFFIX)) for k in keys) or \
        any(reader.dtype_name(k) == "U8" and k + SCALE_SUFFIX in keys and reader.dtype_name(k + SCALE_SUFFIX) == "F8_E4M3"
            for k in keys)


def find_nvfp4(reader: Any, keys: set[str], problems: list[str]) -> tuple[dict[str, dict], set[str]]:
    """The NVFP4 weights of a checkpoint and the side tensors to hide.

    A weight is NVFP4 when a ``K_amax`` or ``K_outer_scale_denominator`` exists; all four tensors of
    the module docs must then be present with their dtypes and shapes. A ``U8`` weight with an
    ``F8_E4M3`` ``K_scale`` but neither factor is reported too (an NVFP4 weight missing both). Every
    malformed one is appended to ``problems`` as one line naming the tensor.

    Args:
        reader: a :class:`~ferrule.formats.safetensors_io.SafetensorsReader` (``shape``, ``dtype_name``).
        keys: its keys.
        problems: list the caller reports (one :class:`~ferrule.formats.safetensors_io.CheckpointError`).

    Returns:
        ``({K: info}, hidden)``: ``info`` is ``{"format": "nvfp4", "scale": K_scale, "amax": K_amax,
        "denominator": K_outer_scale_denominator, "scale_dtype": "F8_E4M3", "dtype": "U8",
        "block": [1, 16], "shape": [..., rows, cols]}`` (``shape``: the dequantized one).
    """
    stems = {k[:-len(s)] for k in keys for s in (AMAX_SUFFIX, DENOMINATOR_SUFFIX) if k.endswith(s)}
    stems |= {k for k in keys if reader.dtype_name(k) == "U8" and k + SCALE_SUFFIX in keys
              and reader.dtype_name(k + SCALE_SUFFIX) == "F8_E4M3"}
    found: dict[str, dict] = {}
    hidden: set[str] = set()
    for k in sorted(stems):
        names = {"scale": k + SCALE_SUFFIX, "amax": k + AMAX_SUFFIX, "denominator": k + DENOMINATOR_SUFFIX}
        missing = [n for n in (k, *names.values()) if n not in keys]
        if missing:
            problems.append(f"NVFP4 weight {k} lacks {missing} (needs {k}, {k}{SCALE_SUFFIX}, {k}{AMAX_SUFFIX}, "
                            f"{k}{DENOMINATOR_SUFFIX})")
            continue
        line = _check_one(reader, k, names)
        if line:
            problems.append(line)
            continue
        shape = list(reader.shape(k))
        found[k] = {"format": "nvfp4", **names, "scale_dtype": "F8_E4M3", "dtype": "U8", "block": [1, BLOCK],
                    "shape": shape[:-1] + [2 * shape[-1]]}
        hidden |= set(names.values())
    return found, hidden


def _check_one(reader: Any, k: str, names: dict[str, str]) -> str | None:
    """One line naming what is wrong with NVFP4 weight ``k``, or None."""
    dt = {role: reader.dtype_name(n) for role, n in names.items()}
    if reader.dtype_name(k) != "U8":
        return f"NVFP4 weight {k} is {reader.dtype_name(k)}, expected U8 (two E2M1 codes per byte)"
    if dt["scale"] != "F8_E4M3":
        return f"NVFP4 block scale {names['scale']} is {dt['scale']}, expected F8_E4M3"
    for role in ("amax", "denominator"):
        if dt[role] not in _FACTOR_DTYPES:
            return f"NVFP4 {role} {names[role]} is {dt[role]}, expected one of {list(_FACTOR_DTYPES)}"
    shape, sshape = tuple(reader.shape(k)), tuple(reader.shape(names["scale"]))
    if len(shape) < 2:
        return f"NVFP4 weight {k} has shape {shape}, expected [..., rows, cols / 2]"
    lead, cols = shape[:-2], 2 * shape[-1]
    if cols % BLOCK or sshape != (*lead, shape[-2], cols // BLOCK):
        return (f"NVFP4 block scale {names['scale']} {sshape} does not tile {k} {shape} ({cols} values a row): expected "
                f"{(*lead, shape[-2], cols / BLOCK if cols % BLOCK else cols // BLOCK)}, one scale per {BLOCK} values")
    ashape, dshape = tuple(reader.shape(names["amax"])), tuple(reader.shape(names["denominator"]))
    if ashape != lead and not (not lead and ashape in ((), (1,))):
        return f"NVFP4 amax {names['amax']} has shape {ashape}, expected {lead} (one per matrix of {k} {shape})"
    if dshape not in ((), (1,)) and dshape != lead:
        return (f"NVFP4 denominator {names['denominator']} has shape {dshape}, expected () or {lead} "
                f"(for {k} {shape})")
    return None
