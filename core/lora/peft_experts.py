"""Routed-expert adapters <-> PEFT's 3-D expert-parameter format (``target_parameters``).

transformers keeps a MoE layer's routed experts as fused 3-D parameters (``Qwen3MoeExperts`` /
``InklingExperts``: ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), which PEFT 0.21
adapts through ``target_parameters`` (``peft.tuners.lora.layer.ParamWrapper``). ferrule's routed
experts share one ``A`` per layer and linear and keep one ``B`` per expert
(:func:`ferrule.lora.appliers.apply_routed_experts`); this module writes and reads them in PEFT's
layout (see :func:`export_routed`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ferrule.mapping import MappingError, TPSplit, Rename, StackExperts

from .peft_base import PEFT_PREFIX, ExportContext, copy_factor_plans
from ferrule.megatron.param_gather import BoundParam, iter_full, plan_gather

__all__ = ["EXPERT_PARAMS", "export_routed", "load_routed", "expert_module"]

#: transformers' fused expert parameters (``Qwen3MoeExperts``: ``gate_up_proj`` ``[E, 2I, H]``,
#: ``down_proj`` ``[E, H, I]``) per megatron expert linear; PEFT targets them with
#: ``target_parameters`` in this order (``peft.tuners.lora.layer.ParamWrapper``).
EXPERT_PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_LOCAL_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])$")


def expert_module(table: Any, mctx: Any, layer: str, leaf: str) -> str:
    """HF module path of a layer's experts (``model.layers.3.mlp.experts``), from the table row of
    expert 0's weight: a per-expert checkpoint key (``...experts.0.gate_proj.weight``, Qwen3-MoE) or
    a stacked 3-D one (``...experts.gate_up_proj``, Inkling)."""
    weight = f"{layer}.local_experts.0.{leaf}.weight"
    mapping, _ = table.resolve(weight)
    key = mapping.hf_keys(weight, mctx)[0]
    m = re.match(r"^(.*)\.\d+\.[^.]+\.weight$", key)
    return m.group(1) if m else key.rsplit(".", 1)[0]


def _b_to_hf(table: Any, mctx: Any, layer: str, leaf: str, expert: int, b: Any) -> Any:
    """One expert's ``B`` ``[out, r]`` in the HF 3-D parameter's row layout (the row's ``to_hf``;
    per-expert checkpoint parts such as gate / up are concatenated, as transformers fuses them)."""
    import torch

    row, wild = table.resolve(f"{layer}.local_experts.{expert}.{leaf}.weight")
    parts = row.to_hf(b, mctx, wild)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def _b_to_mcore(table: Any, mctx: Any, layer: str, leaf: str, expert: int, b_stacked: Any) -> Any:
    """Inverse of :func:`_b_to_hf` for expert ``expert`` of ``b_stacked`` ``[E, out, r]``."""
    row, wild = table.resolve(f"{layer}.local_experts.{expert}.{leaf}.weight")
    if isinstance(row, StackExperts):
        return row.to_mcore([b_stacked], mctx, wild)
    n = len(row.hf_keys(f"{layer}.local_experts.{expert}.{leaf}.weight", mctx))
    return row.to_mcore(list(b_stacked[expert].chunk(n, 0)), mctx, wild)


def _expert_keys(module: str, leaf: str, leaves_here: set[str]) -> tuple[str, str]:
    """PEFT keys of one expert parameter's factors. PEFT nests a second ``ParamWrapper`` around the
    first when both parameters of the experts module are targeted, so ``gate_up_proj``'s factors then
    live under ``base_layer``."""
    inner = leaf == "linear_fc1" and "linear_fc2" in leaves_here
    base = f"{PEFT_PREFIX}{module}.{'base_layer.' if inner else ''}"
    return base + "lora_A.weight", base + "lora_B.weight"


def _routed_groups(entries: Sequence[Any]) -> dict[tuple[str, str], list[tuple[int, Any]]]:
    out: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for e in entries:
        m = _LOCAL_EXPERT_RE.match(e.global_name)
        if m is None:
            raise MappingError(f"{e.global_name} is not a routed-expert linear (…mlp.experts.local_experts.E.linear_fcN).")
        out.setdefault((m.group(1), m.group(3)), []).append((int(m.group(2)), e.adapter))
    for group in out.values():
        group.sort(key=lambda x: x[0])
    return out


def export_routed(entries: Sequence[Any], ctx: ExportContext) -> Iterator[tuple[str, Any]]:
    """PEFT tensors of routed-expert adapters (collective over EP and PP).

    Per layer and linear, PEFT's ``ParamWrapper`` layout for ``E`` experts: ``lora_A.weight``
    ``[E * r, in]`` (expert-major: rows ``e*r .. e*r+r`` are expert ``e``'s ``A``; here ``A`` is
    shared, so it repeats) and ``lora_B.weight`` ``[out, r * E]`` (expert-minor: column
    ``k * E + e`` is expert ``e``'s ``B[:, k]``), i.e. ``delta_e = B[:, :, e] @ A[e]`` as in
    ``ParamWrapper.get_delta_weight``.
    """
    import torch

    params: dict[str, BoundParam] = {}
    groups: list[tuple[str, list[str]]] = []
    for (layer, leaf), experts in _routed_groups(entries).items():
        a = experts[0][1].lora_A
        a_name = f"{layer}.{leaf}.lora_A"
        params[a_name] = BoundParam(a_name, a, Rename(a_name, hf=a_name, tp=TPSplit.REPLICATED), ())
        row, _ = ctx.table.resolve(f"{layer}.local_experts.{experts[0][0]}.{leaf}.weight")
        stack = torch.stack([ad.lora_B.detach() for _, ad in experts])  # [n_local, out, r]
        b_name = f"{layer}.{leaf}.lora_B.{experts[0][0]}"
        params[b_name] = BoundParam(b_name, stack, dataclasses.replace(row, tp=TPSplit.REPLICATED), ())
        groups += [(f"{layer}.{leaf}|A", [a_name]), (f"{layer}.{leaf}|B", [b_name])]
    steps = plan_gather(params, groups, ctx.ranks)
    adapted: dict[str, set[str]] = {}
    for stage in steps:
        for step in stage:
            layer_leaf = step.key.split("|")[0]
            layer, leaf = layer_leaf.rsplit(".", 1)
            adapted.setdefault(layer, set()).add(leaf)
    pending_a: dict[str, Any] = {}
    pending_b: dict[str, list[tuple[int, Any]]] = {}
    for key, names, (t,) in iter_full(steps, params, ctx.ranks):
        layer_leaf, part = key.split("|")
        if part == "A":
            pending_a[layer_leaf] = t
            continue
        pending_b.setdefault(layer_leaf, []).append((int(names[0].rsplit(".", 1)[1]), t))
        if len(pending_b[layer_leaf]) < ctx.ranks.ep:  # a routed step yields once per EP rank
            continue
        layer, leaf = layer_leaf.rsplit(".", 1)
        full_b = torch.cat([b for _, b in sorted(pending_b.pop(layer_leaf), key=lambda x: x[0])])  # [E, out, r]
        full_b = torch.stack([_b_to_hf(ctx.table, ctx.mapping, layer, leaf, e, full_b[e]) for e in range(len(full_b))])
        a = pending_a.pop(layer_leaf)
        n_exp, out, r = full_b.shape
        key_a, key_b = _expert_keys(expert_module(ctx.table, ctx.mapping, layer, leaf), leaf, adapted[layer])
        yield key_a, a.unsqueeze(0).expand(n_exp, *a.shape).reshape(n_exp * r, a.shape[1]).contiguous()
        yield key_b, full_b.permute(1, 2, 0).reshape(out, r * n_exp).contiguous()


def load_routed(entries: Sequence[Any], tensors: Mapping[str, Any], ctx: ExportContext, *,
                dry_run: bool = False) -> tuple[set[str], list[str]]:
    """Inverse of :func:`export_routed` for this rank's experts (not collective); the ``E`` blocks
    of ``lora_A`` must be equal (one shared ``A``), else the layer is refused."""
    import torch

    used: set[str] = set()
    problems: list[str] = []
    plans = []
    groups = _routed_groups(entries)
    leaves_by_layer: dict[str, set[str]] = {}
    for layer, leaf in groups:
        leaves_by_layer.setdefault(layer, set()).add(leaf)
    for (layer, leaf), experts in groups.items():
        key_a, key_b = _expert_keys(expert_module(ctx.table, ctx.mapping, layer, leaf), leaf, leaves_by_layer[layer])
        missing = [k for k in (key_a, key_b) if k not in tensors]
        if missing:
            problems.append(f"{layer}.{leaf}: missing {missing}")
            continue
        used.update((key_a, key_b))
        a_all, b_all = tensors[key_a], tensors[key_b]
        r = experts[0][1].lora_A.shape[0]
        if a_all.dim() != 2 or b_all.dim() != 2 or a_all.shape[0] % r or b_all.shape[1] % r:
            problems.append(f"{layer}.{leaf}: PEFT expert factors of shapes {tuple(a_all.shape)}, {tuple(b_all.shape)} "
                            f"do not fit rank {r}.")
            continue
        n_exp = a_all.shape[0] // r
        a_blocks = a_all.reshape(n_exp, r, -1)
        if any(not torch.equal(a_blocks[0], a_blocks[e]) for e in range(1, n_exp)):
            problems.append(f"{layer}.{leaf}: ferrule shares one lora_A across the experts, but the adapter's "
                            f"per-expert lora_A differ (an adapter trained with per-expert A cannot be imported exactly).")
            continue
        b_stacked = b_all.reshape(b_all.shape[0], r, n_exp).permute(2, 0, 1)  # [E, out, r]
        for e, ad in experts:
            if e >= n_exp:
                problems.append(f"{layer}.{leaf}: expert {e} is missing (the adapter has {n_exp} experts).")
                continue
            try:
                a_e, b_e = a_blocks[0], _b_to_mcore(ctx.table, ctx.mapping, layer, leaf, e, b_stacked)
            except MappingError as exc:
                problems.append(f"{layer}.{leaf}: expert {e}: {exc}")
                continue
            if tuple(a_e.shape) != tuple(ad.lora_A.shape) or tuple(b_e.shape) != tuple(ad.lora_B.shape):
                problems.append(f"{layer}.{leaf}: expert {e} factors {tuple(a_e.shape)}, {tuple(b_e.shape)} vs "
                                f"{tuple(ad.lora_A.shape)}, {tuple(ad.lora_B.shape)}.")
                continue
            plans.append((ad, a_e, b_e))
    return copy_factor_plans(plans, used, problems, dry_run=dry_run)
