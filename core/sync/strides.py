"""Index arithmetic of the direct weight sync (:mod:`ferrule.sync.direct`): flat element indices of
strided views, and one strided shape that covers two flat index arrays element for element.

Importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["flat_index", "joint_strides", "strided_index"]


def joint_strides(src: "torch.Tensor", dst: "torch.Tensor"
                  ) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int] | None:
    """One strided shape covering two flat index arrays element for element, or None.

    ``src[i]`` and ``dst[i]`` (1-D int64, same length ``n >= 1``) are flat element indices into a
    source and a destination tensor. Returns ``(shape, src_strides, src_offset, dst_strides,
    dst_offset)`` with ``src[i] == src_offset + sum_k idx_k(i) * src_strides[k]`` (row-major
    ``idx`` over ``shape``) and the same for ``dst``, so that
    ``dst_base.as_strided(shape, dst_strides, dst_offset).copy_(src_base.as_strided(shape,
    src_strides, src_offset))`` moves every element where the arrays say. Dimensions are
    merged as far as the runs allow (a contiguous block is one dimension). None if no such
    shape exists or a stride would be negative.
    """
    import torch

    n = src.numel()
    if n == 0 or dst.numel() != n:
        return None
    s_off, d_off = int(src[0]), int(dst[0])
    a, b = src - s_off, dst - d_off
    dims: list[tuple[int, int, int]] = []  # innermost first: (size, src stride, dst stride)
    while a.numel() > 1:
        sa, sb = int(a[1] - a[0]), int(b[1] - b[0])
        if sa < 0 or sb < 0:
            return None
        brk = ((torch.diff(a) != sa) | (torch.diff(b) != sb)).nonzero()
        run = a.numel() if brk.numel() == 0 else int(brk[0]) + 1
        if a.numel() % run:
            return None
        ra, rb = a.view(-1, run), b.view(-1, run)
        step = torch.arange(run, dtype=a.dtype, device=a.device)
        if not (torch.equal(ra, ra[:, :1] + step * sa) and torch.equal(rb, rb[:, :1] + step * sb)):
            return None
        dims.append((run, sa, sb))
        a, b = ra[:, 0].contiguous(), rb[:, 0].contiguous()
    if not dims:
        dims.append((1, 1, 1))
    dims.reverse()
    return (tuple(d[0] for d in dims), tuple(d[1] for d in dims), s_off, tuple(d[2] for d in dims), d_off)


def flat_index(t: "torch.Tensor", base: "torch.Tensor") -> "torch.Tensor | None":
    """Flat indices into contiguous ``base`` of every element of ``t`` (a view of ``base``'s memory), row-major."""
    import torch

    if not base.is_contiguous() or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    off = t.storage_offset() - base.storage_offset()
    probe = torch.arange(base.numel(), dtype=torch.int64, device=base.device)
    try:
        return probe.as_strided(tuple(t.shape), tuple(t.stride()), off).reshape(-1)
    except RuntimeError:  # outside base
        return None


def strided_index(shape: tuple[int, ...], strides: tuple[int, ...], offset: int, device: Any) -> "torch.Tensor":
    """Flat indices ``offset + sum_k i_k * strides[k]`` of every element of ``shape`` (row-major), int64."""
    import torch

    idx = torch.full((1,) * len(shape), offset, dtype=torch.int64, device=device)
    for k, (size, stride) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[k] = size
        idx = idx + (torch.arange(size, dtype=torch.int64, device=device) * stride).view(view)
    return idx.reshape(-1)
