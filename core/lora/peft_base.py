"""What every PEFT exporter / loader of adapters shares: the key prefix, the export context, the
naming table, the final copy of a load, and the error type.

:mod:`ferrule.lora.peft_format` (linear modules, engine-level API) and
:mod:`ferrule.lora.peft_experts` (routed experts) both build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ferrule.mapping import TPSplit

__all__ = ["PEFT_PREFIX", "AdapterFormatError", "ExportContext", "copy_factor_plans", "peft_naming_table"]

#: PEFT's prefix of saved adapter keys for a ``*ForCausalLM`` base model
PEFT_PREFIX = "base_model.model."


class AdapterFormatError(ValueError):
    """PEFT adapter tensors do not fit this model's adapters (keys, shapes, fused parts); all listed."""


@dataclasses.dataclass
class ExportContext:
    """Shared by the export / load functions of every applier.

    Attributes:
        table: the family's mapping table; mapping: its context with the padded vocabulary.
        ranks: :class:`ferrule.megatron.param_gather.ParallelRanks` of this rank.
    """

    table: Any
    mapping: Any
    ranks: Any
    #: per-engine memo of export plans (an applier's gather plan for its entries is the same on every
    #: call: the adapters' structure is fixed once the engine is built); keys are the applier's own
    cache: dict = dataclasses.field(default_factory=dict)


def _hf_modules(entry: Any, ctx: ExportContext) -> tuple[Any, tuple[str, ...], list[str]]:
    """(base mapping row, its wildcards, HF module paths) of one adapted module."""
    weight = entry.global_name + ".weight"
    mapping, wild = ctx.table.resolve(weight)
    return mapping, wild, [k.removesuffix(".weight") for k in mapping.hf_keys(weight, ctx.mapping)]


def _factor_mappings(entry: Any, mapping: Any) -> tuple[Any, Any]:
    """Mapping rows that gather ``A`` and ``B`` like megatron splits them (see :mod:`ferrule.lora.layers`)."""
    rep = dataclasses.replace(mapping, tp=TPSplit.REPLICATED)
    if entry.adapter.parallel == "column":
        return rep, mapping
    return mapping, rep


def copy_factor_plans(plans: Sequence[tuple[Any, Any, Any]], used: set[str], problems: list[str], *,
                      dry_run: bool) -> tuple[set[str], list[str]]:
    """The end of every applier's ``load``: copy each ``(adapter, lora_A, lora_B)`` of ``plans`` in
    place, only when there are no ``problems`` and not ``dry_run``; return ``(used, problems)``."""
    import torch

    if problems or dry_run:
        return used, problems
    with torch.no_grad():
        for adapter, a, b in plans:
            adapter.lora_A.copy_(a)
            adapter.lora_B.copy_(b)
    return used, []


def peft_naming_table(table: Any) -> Any:
    """The table that names adapters for PEFT: ``table.peft_table`` (transformers' in-memory module
    names, :class:`~ferrule.mapping.MappingTable`) when the family gives one, else ``table``."""
    return getattr(table, "peft_table", None) or table
