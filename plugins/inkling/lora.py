"""Inkling's LoRA appliers (``register_lora_appliers``; docs/lora.md).

- ``attention``: Inkling's attention block has separate megatron linears ``linear_q``, ``linear_k``,
  ``linear_v``, ``linear_r`` (column-parallel) and ``linear_proj`` (row-parallel), each one HF
  module (``q_proj``, ``k_proj``, ``v_proj``, ``r_proj``, ``o_proj``): adapters come from the core's
  :func:`~ferrule.lora.layers.attach_adapter` and travel through the core's mapping-table driven
  :func:`~ferrule.lora.peft_format.export_linear` / ``load_linear``.
- ``shared_experts``: Inkling's shared experts are stacked ``[S, ...]`` weights applied with
  ``bmm`` (:class:`~ferrule.plugins.inkling.moe.InklingSharedExperts`), not linears; they are not
  adapted (``"all"`` leaves them out; naming them explicitly is refused).
- Dense MLP and routed experts use the core appliers (megatron ``MLP`` / ``SequentialMLP``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["apply_attention", "apply_shared_experts"]

_ATTENTION = re.compile(r"^decoder\.layers\.\d+\.self_attention\.(linear_q|linear_k|linear_v|linear_r|linear_proj)$")


def apply_attention(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt ``self_attention.linear_{q,k,v,r,proj}`` selected by ``settings.target_modules``."""
    from ferrule.lora.layers import attach_adapter

    done = []
    for local, module in chunk.named_modules():
        if _ATTENTION.match(local):
            name = ctx.global_names.get(local, local)
            if ctx.selects(name, "attention"):
                attach_adapter(module, global_name=name, kind="attention", settings=settings, tp_rank=ctx.tp_rank,
                               tp_size=ctx.tp_size)
                done.append(name)
    return done


def apply_shared_experts(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt nothing; refuse explicit targets that only Inkling's shared experts would match."""
    from ferrule.lora.appliers import LoraTargetError

    if settings.target_modules != "all" and "shared_experts" in settings.target_modules:
        raise LoraTargetError("Inkling's shared experts are stacked bmm weights, not linear modules: LoRA does not "
                              "adapt them yet; drop 'shared_experts' from target_modules.")
    return []
