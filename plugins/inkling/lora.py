"""Inkling's LoRA appliers (``register_lora_appliers``; docs/lora.md).

- ``attention``: Inkling's attention block has separate megatron linears ``linear_q``, ``linear_k``,
  ``linear_v``, ``linear_r`` (column-parallel) and ``linear_proj`` (row-parallel), each one HF
  module (``q_proj``, ``k_proj``, ``v_proj``, ``r_proj``, ``o_proj``): adapters come from the core's
  :func:`~ferrule.lora.layers.attach_adapter` and travel through the core's mapping-table driven
  :func:`~ferrule.lora.peft_format.export_linear` / ``load_linear``.
- ``shared_experts``: Inkling's shared experts are stacked ``[S, ...]`` weights applied with
  ``bmm`` (:class:`~ferrule.plugins.inkling.moe.InklingSharedExperts`), not linears.
  :class:`StackedLoraAdapter` gives each of the ``S`` experts its own low-rank pair, in the layout
  PEFT 0.21 uses for 3-D parameters (``target_parameters``, ``peft.tuners.lora.layer.ParamWrapper``);
  see :func:`export_shared_experts`.
- Dense MLP and routed experts use the core appliers (megatron ``MLP`` / ``SequentialMLP``).

The multimodal ``inkling`` family registers the same appliers: they only see the language model's
``decoder`` (the towers are never adapted and stay frozen), and its PEFT names come from
:data:`ferrule.plugins.inkling.inkling.PEFT_MAPPING` (transformers' module names
``model.language_model.layers.L...``, not the released checkpoint's ``model.llm.*`` keys).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from ferrule.lora.appliers import LoraTargetError
from ferrule.lora.layers import LORA_PARAM_ATTR, attach_adapter
from ferrule.lora.peft_base import PEFT_PREFIX, copy_factor_plans
from ferrule.mapping import Rename, TPSplit
from ferrule.megatron.param_gather import BoundParam, iter_full, plan_gather

__all__ = ["apply_attention", "apply_shared_experts", "export_shared_experts", "load_shared_experts",
           "StackedLoraAdapter", "SHARED_PARAMS"]

_ATTENTION = re.compile(r"^decoder\.layers\.\d+\.self_attention\.(linear_q|linear_k|linear_v|linear_r|linear_proj)$")
_SHARED = re.compile(r"^decoder\.layers\.\d+\.mlp\.shared_experts$")

#: HF ``InklingSharedExperts`` parameters in registration order (``__init__``: ``gate_proj``,
#: ``up_proj``, ``down_proj``). PEFT wraps the targeted ones in nested ``ParamWrapper`` in this
#: order, the first innermost: its factors are saved under one ``base_layer.`` per later target
#: (checked with peft 0.21.2: all three -> ``gate_proj`` at ``shared_experts.base_layer.base_layer.lora_A``).
SHARED_PARAMS = ("gate_proj", "up_proj", "down_proj")


def apply_attention(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt ``self_attention.linear_{q,k,v,r,proj}`` selected by ``settings.target_modules``."""
    done = []
    for local, module in chunk.named_modules():
        if _ATTENTION.match(local):
            name = ctx.global_names.get(local, local)
            if ctx.selects(name, "attention"):
                attach_adapter(module, global_name=name, kind="attention", settings=settings, tp_rank=ctx.tp_rank,
                               tp_size=ctx.tp_size)
                done.append(name)
    return done


class StackedLoraAdapter(torch.nn.Module):
    """Per-expert LoRA factors of one stacked shared-expert weight ``W`` ``[S, out, in]``.

    ``lora_A`` ``[S, r, in]`` and ``lora_B`` ``[S, out, r]``: expert ``j`` computes
    ``y_j = W_j x_j + scaling * B_j (A_j x_j)`` (``x`` ``[S, T, in]`` -> ``[S, T, out]``, batched with
    ``bmm`` like the base). For ``linear_fc1`` (``[gate; up]`` per expert) ``B_j`` covers both
    halves and ``A_j`` is shared by them, as megatron's fused ``linear_fc1`` shares one ``A``.

    Replicated over TP and EP like the base weights (Inkling's shared experts are never split):
    no ``tensor_model_parallel`` attribute (the grad norm counts them once) and no
    ``allreduce=False`` (they are dense parameters, their gradients are reduced over the whole
    data-parallel group).

    Attributes:
        kind: ``"shared_experts"``; parallel: ``"replicated"``; scaling: ``alpha / r`` (rsLoRA
            ``alpha / sqrt(r)``); peft_parameters: the HF parameters it adapts, below the decoder
            layer (``("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")``), for
            ``adapter_config.json``'s ``target_parameters``.
    """

    def __init__(self, *, n_experts: int, in_features: int, out_features: int, rank: int, scaling: float,
                 peft_parameters: tuple[str, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind, self.parallel, self.scaling = "shared_experts", "replicated", float(scaling)
        self.peft_parameters = tuple(peft_parameters)
        self.lora_A = torch.nn.Parameter(torch.zeros(n_experts, rank, in_features, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(n_experts, out_features, rank, dtype=dtype, device=device))
        for p in (self.lora_A, self.lora_B):
            setattr(p, LORA_PARAM_ATTR, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B_j (A_j x_j)`` for ``x`` ``[S, T, in]`` -> ``[S, T, out]`` (in ``x``'s dtype)."""
        h = torch.bmm(x.to(self.lora_A.dtype), self.lora_A.transpose(1, 2))
        return (torch.bmm(h, self.lora_B.transpose(1, 2)) * self.scaling).to(x.dtype)


def _drop_adapter_keys(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "lora.")]:
        del state_dict[key]


def _ignore_missing_adapter_keys(module: Any, incompatible: Any) -> None:
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if ".lora.lora_" not in k]


def _hf_param_paths(table: Any, mctx: Any, global_name: str) -> tuple[str, ...]:
    """Full HF parameter paths of one shared-expert holder (``model.layers.1.mlp.shared_experts.gate_proj``,
    ...; the table row's keys: these 3-D parameters have no ``.weight`` suffix)."""
    return tuple(table.resolve(global_name + ".weight")[0].hf_keys(global_name + ".weight", mctx))


def _peft_parameters(table: Any, mctx: Any, global_name: str) -> tuple[str, ...]:
    """HF parameter paths below the decoder layer of one shared-expert holder (from the table row)."""
    return tuple(re.sub(r"^.*\.layers\.\d+\.", "", k) for k in _hf_param_paths(table, mctx, global_name))


def apply_shared_experts(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt Inkling's stacked shared experts (``mlp.shared_experts.linear_fc1`` / ``linear_fc2``).

    Selected by ``"all"``, by the megatron leaves ``linear_fc1`` / ``linear_fc2`` or, as in PEFT, by
    ``target_parameters`` naming the HF parameters ``mlp.shared_experts.gate_proj`` +
    ``mlp.shared_experts.up_proj`` (together: they share ``A``) / ``mlp.shared_experts.down_proj``
    (``target_modules`` HF names do not select them: transformers keeps them as 3-D parameters, not
    modules).
    ``A`` is drawn as PEFT's ``ParamWrapper`` draws ``lora_A.weight`` ``[S*r, in]``
    (kaiming-uniform, ``a = sqrt(5)``) from a generator seeded by ``settings.init_seed`` and the
    module's global name, so it does not depend on the parallel layout; ``B`` is zero.

    Raises:
        LoraTargetError: ``dropout > 0`` (PEFT's ``ParamWrapper`` refuses dropout, so the adapter
            could not be loaded there), or only one of ``gate_proj`` / ``up_proj`` is named.
    """
    done = []
    for local, module in chunk.named_modules():
        if not _SHARED.match(local):
            continue
        for leaf in ("linear_fc1", "linear_fc2"):
            holder = getattr(module, leaf)
            name = ctx.global_names.get(f"{local}.{leaf}", f"{local}.{leaf}")
            if not ctx.selects(name, "shared_experts", hf_params=_hf_param_paths(ctx.table, ctx.mapping, name)):
                continue
            if settings.dropout > 0:
                raise LoraTargetError(f"{name}: LoRA dropout on Inkling's shared experts is refused (PEFT adapts these "
                                      f"stacked parameters with target_parameters, which has no dropout, so the "
                                      f"adapter could not be loaded there); use dropout=0.")
            if hasattr(holder, "lora"):
                raise ValueError(f"{name} already has a LoRA adapter; apply LoRA once per model.")
            weight = holder.weight
            n_exp, out_f, in_f = weight.shape
            gen = torch.Generator().manual_seed((settings.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            a = torch.empty(n_exp * settings.rank, in_f, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            adapter = StackedLoraAdapter(n_experts=n_exp, in_features=in_f, out_features=out_f, rank=settings.rank,
                                         scaling=settings.scaling,
                                         peft_parameters=_peft_parameters(ctx.table, ctx.mapping, name),
                                         dtype=weight.dtype, device=weight.device)
            with torch.no_grad():
                adapter.lora_A.copy_(a.view(n_exp, settings.rank, in_f))
            holder.lora = adapter  # InklingSharedExperts.forward adds holder.lora(x) to its bmm
            holder._register_state_dict_hook(_drop_adapter_keys)
            holder.register_load_state_dict_post_hook(_ignore_missing_adapter_keys)
            done.append(name)
    return done


# ---------------------------------------------------------------------------------------
# PEFT format: ParamWrapper on HF InklingSharedExperts.{gate,up,down}_proj
# ---------------------------------------------------------------------------------------

_HOLDER = re.compile(r"^(decoder\.layers\.\d+\.mlp\.shared_experts)\.(linear_fc[12])$")


def _hf_params(ctx: Any, global_name: str) -> tuple[Any, tuple[str, ...], list[tuple[str, str]]]:
    """(table row, wildcards, [(HF module path, HF parameter leaf)]) of one holder."""
    row, wild = ctx.table.resolve(global_name + ".weight")
    return row, wild, [tuple(k.rsplit(".", 1)) for k in row.hf_keys(global_name + ".weight", ctx.mapping)]


def _peft_keys(module: str, leaf: str, targeted: set[str]) -> tuple[str, str]:
    """PEFT keys of ``module.leaf``'s factors: one ``base_layer.`` per targeted parameter that PEFT
    wraps around it (those after it in :data:`SHARED_PARAMS`)."""
    depth = sum(1 for p in SHARED_PARAMS[SHARED_PARAMS.index(leaf) + 1:] if p in targeted)
    base = f"{PEFT_PREFIX}{module}.{'base_layer.' * depth}"
    return base + "lora_A.weight", base + "lora_B.weight"


def _targeted(ctx: Any, layer_names: Sequence[str]) -> dict[str, set[str]]:
    """``{layer: {HF parameter leaves adapted}}`` for global holder names."""
    out: dict[str, set[str]] = {}
    for name in layer_names:
        layer = _HOLDER.match(name).group(1)
        out.setdefault(layer, set()).update(leaf for _, leaf in _hf_params(ctx, name)[2])
    return out


def export_shared_experts(entries: Sequence[Any], ctx: Any) -> Iterator[tuple[str, Any]]:
    """PEFT tensors of shared-expert adapters (collective over PP; TP/EP replicas hold the same values).

    PEFT's ``ParamWrapper`` layout for an HF parameter ``[S, out, in]`` with ``S`` experts
    (``get_delta_weight``: ``delta_j = B[:, :, j] @ A[j]``): ``lora_A.weight`` ``[S*r, in]``
    (expert-major: rows ``j*r .. j*r+r`` are expert ``j``'s ``A``) and ``lora_B.weight`` ``[out, r*S]``
    (column ``k*S + j`` is expert ``j``'s ``B[:, k]``). ``linear_fc1``'s ``B`` ``[S, 2I, r]`` is cut
    into ``gate_proj`` / ``up_proj`` by the table row's ``to_hf`` (as its weight is) and both get
    the same ``A``; ``linear_fc2`` maps to ``down_proj`` one to one.
    """
    params: dict[str, BoundParam] = {}
    for e in entries:
        for f in ("lora_A", "lora_B"):
            n = f"{e.global_name}.{f}"
            params[n] = BoundParam(n, getattr(e.adapter, f), Rename(n, hf=n, tp=TPSplit.REPLICATED), ())
    steps = plan_gather(params, [(e.global_name, [f"{e.global_name}.lora_A", f"{e.global_name}.lora_B"])
                                 for e in entries], ctx.ranks, with_experts=False)
    targeted = _targeted(ctx, [s.key for stage in steps for s in stage])
    for key, _, (a, b) in iter_full(steps, params, ctx.ranks):
        row, wild, hf = _hf_params(ctx, key)
        n_exp, r, in_f = a.shape
        a_peft = a.reshape(n_exp * r, in_f).contiguous()
        parts = row.to_hf(b, ctx.mapping, wild)  # each [S, out_part, r]
        if len(parts) != len(hf):
            raise ValueError(f"{key}: the table row gives {len(parts)} HF tensors for {len(hf)} keys.")
        for (module, leaf), b_part in zip(hf, parts):
            key_a, key_b = _peft_keys(module, leaf, targeted[_HOLDER.match(key).group(1)])
            yield key_a, a_peft
            yield key_b, b_part.permute(1, 2, 0).reshape(b_part.shape[1], r * n_exp).contiguous()


def load_shared_experts(entries: Sequence[Any], tensors: Mapping[str, Any], ctx: Any, *,
                        dry_run: bool = False) -> tuple[set[str], list[str]]:
    """Inverse of :func:`export_shared_experts` for this rank's holders (not collective).

    ``gate_proj`` and ``up_proj`` must carry the same ``lora_A`` (ferrule's fused ``linear_fc1``
    has one); an adapter trained by PEFT on them separately is refused, naming the module.
    Nothing is copied unless every entry fits, nor with ``dry_run``.
    """
    used: set[str] = set()
    problems: list[str] = []
    plans = []
    targeted = _targeted(ctx, [e.global_name for e in entries])
    for e in entries:
        row, wild, hf = _hf_params(ctx, e.global_name)
        n_exp, r, in_f = e.adapter.lora_A.shape
        keys = [_peft_keys(m, leaf, targeted[_HOLDER.match(e.global_name).group(1)]) for m, leaf in hf]
        missing = [k for pair in keys for k in pair if k not in tensors]
        if missing:
            problems.append(f"{e.global_name}: missing {missing}")
            continue
        used.update(k for pair in keys for k in pair)
        a_parts = [tensors[ka] for ka, _ in keys]
        if any(not torch.equal(a_parts[0], a) for a in a_parts[1:]):
            problems.append(f"{e.global_name}: Megatron fuses {[leaf for _, leaf in hf]} into one linear_fc1 with one "
                            f"lora_A per expert, but the adapter's lora_A differ between them (an adapter trained on "
                            f"separate parameters cannot be imported exactly).")
            continue
        bad = [f"{ka} {tuple(tensors[ka].shape)} / {kb} {tuple(tensors[kb].shape)}" for ka, kb in keys
               if tensors[ka].dim() != 2 or tuple(tensors[ka].shape) != (n_exp * r, in_f)
               or tensors[kb].dim() != 2 or tensors[kb].shape[1] != r * n_exp]
        if bad:
            problems.append(f"{e.global_name}: PEFT factors {bad} do not fit {n_exp} experts at rank {r} "
                            f"(lora_A [S*r, in] = [{n_exp * r}, {in_f}], lora_B [out, r*S]).")
            continue
        b_parts = [tensors[kb].reshape(tensors[kb].shape[0], r, n_exp).permute(2, 0, 1) for _, kb in keys]
        try:
            b = row.to_mcore(b_parts, ctx.mapping, wild)
        except Exception as exc:  # MappingError / shape errors of the row's own checks
            problems.append(f"{e.global_name}: {exc}")
            continue
        a = a_parts[0].reshape(n_exp, r, in_f)
        if tuple(b.shape) != tuple(e.adapter.lora_B.shape):
            problems.append(f"{e.global_name}.lora_B: the adapter gives {tuple(b.shape)}, this model's adapter has "
                            f"{tuple(e.adapter.lora_B.shape)} (rank or model size differ).")
            continue
        plans.append((e.adapter, a, b))
    return copy_factor_plans(plans, used, problems, dry_run=dry_run)
