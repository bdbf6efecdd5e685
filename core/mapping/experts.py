"""The routed-expert rows of the mapping vocabulary (:mod:`ferrule.mapping.vocabulary`): one
expert's Megatron ``SequentialMLP`` tensor <-> HF per-expert tensors (:class:`ExpertRename`,
:class:`ExpertFuseGateUp`) or one row of an HF tensor stacked over experts (:class:`StackExperts`,
:class:`StackExpertsInterleaved` for gate/up rows stored interleaved).

mcore patterns carry two ``*``: the layer and the **global** expert index (under EP rank ``e``
holds global experts ``[e * E/ep, (e+1) * E/ep)`` as local ``0..E/ep-1``). Imports only
:mod:`ferrule.mapping.vocabulary`; no torch at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ferrule.mapping.vocabulary import FuseGateUp, MappingContext, MappingError, ParamMapping, Rename, _torch

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ExpertRename", "ExpertFuseGateUp", "StackExperts", "StackExpertsInterleaved", "deinterleave", "interleave"]


@dataclass(frozen=True)
class ExpertRename(Rename):
    """:class:`Rename` for one routed expert (Megatron ``SequentialMLP``).

    mcore ``decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight`` (second ``*`` =
    **global** expert index; under EP rank e holds global experts
    ``[e * E/ep, (e+1) * E/ep)`` as local ``0..E/ep-1``) <-> HF
    ``model.layers.*.mlp.experts.*.down_proj.weight``. Split on the expert-TP group.
    """

    expert = True


@dataclass(frozen=True)
class ExpertFuseGateUp(FuseGateUp):
    """:class:`FuseGateUp` for one routed expert (``local_experts.*.linear_fc1``); see :class:`ExpertRename`."""

    expert = True


@dataclass(frozen=True)
class StackExperts(ParamMapping):
    """One expert's mcore tensor <-> row ``e`` of an HF tensor stacked over experts.

    For HF layouts that store all routed experts of a layer in one tensor
    ``[num_experts, *expert_shape]`` (e.g. transformers-5 in-memory ``mlp.experts.gate_up_proj``
    ``[E, 2*ffn, hidden]`` = per expert ``[gate; up]``, and ``down_proj`` ``[E, hidden, ffn]``).
    mcore pattern has two ``*`` (layer, global expert); the HF pattern has one (layer).
    Export needs every expert of a layer: :meth:`assemble` stacks the per-expert pieces
    returned by :meth:`to_hf`. ``tp`` is the per-expert split (``GATE_UP`` for fc1, ``ROW``
    for fc2).

    ``transposed=True``: HF stores each expert ``[in, out]`` (``x @ W``), megatron ``[out, in]``; e.g. gpt-oss
    ``gate_up_proj [E, hidden, 2*ffn]`` and ``down_proj [E, ffn, hidden]`` (gate/up features interleaved as
    well there: :class:`StackExpertsInterleaved` with ``transposed=True``).
    """

    hf: str = ""
    transposed: bool = field(default=False, kw_only=True)

    expert = True

    def hf_patterns(self, ctx):
        return (self.hf,)

    def expert_index(self, wildcards: tuple[str, ...]) -> int:
        return int(wildcards[1])

    def to_mcore(self, hf, ctx, wildcards=()):
        (stacked,) = hf
        e = self.expert_index(wildcards)
        if ctx.num_experts is not None and stacked.shape[0] != ctx.num_experts:
            raise MappingError(f"{self.hf}: stacked dim 0 is {stacked.shape[0]}; config has {ctx.num_experts} experts.")
        return stacked[e].t().contiguous() if self.transposed else stacked[e]

    def to_hf(self, full, ctx, wildcards=()):
        """The piece for expert ``wildcards[1]`` (not a full HF tensor; see :meth:`assemble`)."""
        return (full.t().contiguous() if self.transposed else full,)

    def assemble(self, pieces: Mapping[int, "torch.Tensor"], ctx: MappingContext) -> "torch.Tensor":
        """Stack per-expert pieces ``{global_expert: tensor}`` into the HF ``[E, ...]`` tensor.

        Raises:
            MappingError: an expert is missing.
        """
        n = ctx.num_experts or len(pieces)
        missing = [e for e in range(n) if e not in pieces]
        if missing:
            raise MappingError(f"{self.hf}: experts {missing} missing; cannot stack {n} experts.")
        return _torch().stack([pieces[e] for e in range(n)], 0)


def deinterleave(t, dim: int):
    """Released ``[g0, u0, g1, u1, ...]`` along ``dim`` -> ``[g0, g1, ...; u0, u1, ...]`` (transformers ``Interleave``).

    ``t`` is any tensor whose ``dim`` has even size (``[..., 2*ffn, ...]``); a contiguous copy is returned.
    """
    shape = list(t.shape)
    n = shape[dim] // 2
    return t.reshape(*shape[:dim], n, 2, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape).contiguous()


def interleave(t, dim: int):
    """Inverse of :func:`deinterleave`."""
    shape = list(t.shape)
    n = shape[dim] // 2
    return t.reshape(*shape[:dim], 2, n, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape).contiguous()


@dataclass(frozen=True)
class StackExpertsInterleaved(StackExperts):
    """A stacked routed ``w13`` ``[E, 2*ffn, hidden]`` with gate/up rows interleaved per expert
    (``g0, u0, g1, u1, ...``: Inkling's and Inkling-2's released ``mlp.experts.w13_weight``, transformers'
    ``Interleave`` op) <-> expert ``e``'s ``linear_fc1`` ``[gate; up]``. TP as :class:`StackExperts` (``GATE_UP``).
    Also the bias ``[E, 2*ffn]``, and with ``transposed=True`` an ``[E, hidden, 2*ffn]`` tensor whose columns
    interleave (gpt-oss ``gate_up_proj``: ``gate = x[..., ::2]``, ``up = x[..., 1::2]``).
    """

    def to_mcore(self, hf, ctx, wildcards=()):
        t = super().to_mcore(hf, ctx, wildcards)
        if t.shape[0] % 2:
            raise MappingError(f"{self.hf}: {t.shape[0]} interleaved gate/up features; expected an even count.")
        return deinterleave(t, 0)

    def to_hf(self, full, ctx, wildcards=()):
        return super().to_hf(interleave(full, 0), ctx, wildcards)
