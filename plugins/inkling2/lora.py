"""Inkling-2's LoRA appliers (``register_lora_appliers``; docs/lora.md, docs/families/inkling2.md).

Every Inkling-2 MLP is an MoE block (no dense MLP, no shared experts), so the kinds are:

- ``attention``: the megatron linears of :class:`~ferrule.plugins.inkling2.layers.Inkling2Attention`,
  each one ``nn.Linear`` of transformers' ``Inkling2SlidingAttention`` / ``Inkling2FullAttention``
  (in-memory names, :data:`ferrule.plugins.inkling2.inkling2_text.PEFT_LINEAR_ROWS`): ``linear_q``
  (``q_proj.linear``), ``linear_k`` / ``linear_v`` (``k_proj.linear`` / ``v_proj.linear``), ``linear_r``
  (``relative_position_bias.linear``), ``linear_gate`` (``o_proj.gate_proj``), ``linear_sink``
  (``sink_proj``), ``linear_proj`` (``o_proj.linear``) and, on full-attention layers, the dynamic
  convolutions' ``k_sconv.weight_proj`` / ``v_sconv.weight_proj`` (``k_proj.sconv.weight_proj``, ...).
  Adapters are the core's :func:`~ferrule.lora.layers.attach_adapter` (column / row parallel) and travel
  through the core's :func:`~ferrule.lora.peft_format.export_linear` / ``load_linear``. Five of these HF
  modules are called ``linear``, so each adapter carries ``peft_target`` (the path below ``self_attn.``)
  for ``adapter_config.json``'s ``target_modules``.
- ``routed_experts``: the core applier (megatron ``SequentialMLP``; PEFT ``target_parameters``
  ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
- ``loop_gate`` (Inkling-2-Loop): :func:`apply_loop_gate`.
- ``lm_head``: refused (:func:`apply_lm_head` says why).

The multimodal ``inkling2`` family registers the same appliers: they see only the language model's
``decoder`` (the vision tower is never adapted and stays frozen); its PEFT names come from
:data:`ferrule.plugins.inkling2.inkling2.PEFT_MAPPING` (``model.language_model.layers.L...``).
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import torch
from ferrule.lora.appliers import LoraTargetError
from ferrule.lora.layers import LoraAdapter, _drop_adapter_keys, _ignore_missing_adapter_keys, attach_adapter
from ferrule.plugins.inkling2.inkling2_loop import GATE_LINEARS

__all__ = ["apply_attention", "apply_loop_gate", "apply_lm_head", "GateLoraHolder"]

_ATTENTION = re.compile(r"^decoder\.layers\.\d+\.self_attention\.(linear_q|linear_k|linear_v|linear_r|linear_gate|"
                        r"linear_sink|linear_proj|k_sconv\.weight_proj|v_sconv\.weight_proj)$")
#: why the dynamic convolutions' ``weight_proj`` is never adapted (``"all"`` leaves it out; naming it is refused)
_WEIGHT_PROJ_REFUSED = (
    "{name}: target_modules {named} names a dynamic convolution's weight_proj (HF k_proj.sconv.weight_proj / "
    "v_proj.sconv.weight_proj), which ferrule does not adapt: peft 0.21 applies transformers 5.24's checkpoint renames to the keys "
    "of an adapter it loads (peft.utils.transformers_weight_conversion; conversion_mapping 'inkling2_text' turns "
    "'sconv.weight_proj' into 'sconv.weight_proj.weight'), so peft.PeftModel.from_pretrained leaves its factors at "
    "their zero initialisation; drop it.")
_GATE = re.compile(r"^decoder\.layers\.\d+\.(q|k|v|mlp)_message_gate$")


def apply_attention(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt the attention linears selected by ``settings.target_modules`` (module docstring).

    Target names: ``"all"``, megatron leaves (``linear_q``, ``linear_gate``, ``weight_proj``, ...), or HF
    names matched as PEFT matches them (a dotted suffix of the in-memory path: ``q_proj.linear``,
    ``o_proj.gate_proj``, ``sink_proj``, ``linear`` = all five ``*.linear``). ``q_proj`` alone names
    transformers' ``Inkling2QueryProjection`` wrapper, which is not a linear (PEFT refuses it too).
    """
    done = []
    for local, module in chunk.named_modules():
        if not _ATTENTION.match(local):
            continue
        name = ctx.global_names.get(local, local)
        if local.endswith(".weight_proj"):
            if settings.target_modules != "all" and ctx.selects(name, "attention"):
                raise LoraTargetError(_WEIGHT_PROJ_REFUSED.format(name=name, named=list(ctx.last_named)))
            continue
        if ctx.selects(name, "attention"):
            adapter = attach_adapter(module, global_name=name, kind="attention", settings=settings,
                                     tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
            adapter.peft_target = ctx.hf_modules(name)[0].split(".self_attn.", 1)[1]
            done.append(name)
    return done


def apply_lm_head(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Refuse LoRA on Inkling-2's output layer when a target names it (``"all"`` never does).

    Raises:
        LoraTargetError: ``lm_head`` / ``output_layer`` is named: the unembedding holds ``vocab_size`` rows in
            ferrule and in the released checkpoint but ``unpadded_vocab_size`` rows in transformers'
            ``lm_head`` (``Inkling2UnpadVocab``), and the export does not cut an adapter's ``lora_B`` to it;
            also, the output layer's soft-cap / padding-mask forward hooks (``model._install_output``) are
            registered first, so an adapter's hook would add its delta after the soft-cap, unlike HF.
    """
    if hasattr(chunk, "output_layer") and ctx.selects("output_layer", "lm_head"):
        raise LoraTargetError("target_modules names the output layer (lm_head): LoRA on Inkling-2's unembedding is "
                              "not implemented (ferrule and the released checkpoint hold vocab_size rows, transformers' "
                              "lm_head unpadded_vocab_size, and the adapter export does not cut lora_B to it; the "
                              "output layer's soft-cap and padding-mask hooks would also run before an adapter's); "
                              "drop 'lm_head' / 'output_layer'.")
    return []


class GateLoraHolder(torch.nn.Module):
    """Holds the adapter (``self.lora``) of one message-gate weight; named like transformers' ``nn.Linear``
    (``down_proj``, ``forget_gate_proj``, ``message_gate_proj``) so that the adapter's module name maps to
    its PEFT name. No parameters of its own: the gate's ``state_dict`` and sharded state dict are unchanged."""

    def __init__(self, adapter: Any) -> None:
        super().__init__()
        self.lora = adapter
        # kept out of the base model's state_dict / sharded state dict (ferrule.lora.checkpoint saves adapters)
        self._register_state_dict_hook(_drop_adapter_keys)
        self.register_load_state_dict_post_hook(_ignore_missing_adapter_keys)


def apply_loop_gate(chunk: Any, settings: Any, ctx: Any) -> list[str]:
    """Adapt Inkling-2-Loop's message gates (:class:`~ferrule.plugins.inkling2.layers.Inkling2LoopMessageGate`).

    The gate's weights are raw parameters, but each is one ``nn.Linear`` in transformers
    (``Inkling2LoopMessageGate.down_proj`` ``[rank, 2H]``, ``forget_gate_proj`` / ``message_gate_proj``
    ``[H, rank]``, fp32), so the LoRA form is PEFT's for a linear: ``W x + s B (A dropout(x))`` with
    ``A`` ``[r, in]``, ``B`` ``[out, r]`` (a :class:`~ferrule.lora.layers.LoraAdapter` in the weight's
    dtype, replicated over TP like the gate). Selected by ``"all"``, by the HF names (``down_proj``,
    ``forget_gate_proj``, ``message_gate_proj``, ``q_message_gate.down_proj``, ...) or by the released
    names (``down_weight``, ``forget_weight``, ``gain_weight``). ``A`` is drawn as
    :func:`~ferrule.lora.layers.attach_adapter` draws it (kaiming-uniform, seeded by ``settings.init_seed``
    and the holder's name); ``B`` is zero.
    """
    done = []
    for local, gate in chunk.named_modules():
        if not _GATE.match(local):
            continue
        for weight_name, hf_name in GATE_LINEARS:
            name = f"{ctx.global_names.get(local + '.' + weight_name, local)}.{hf_name}"
            if isinstance(settings.target_modules, tuple) and weight_name in settings.target_modules:
                ctx.matched.add(weight_name)
            elif not ctx.selects(name, "loop_gate"):
                continue
            if hasattr(gate, hf_name):
                raise ValueError(f"{name} already has a LoRA adapter; apply LoRA once per model.")
            weight = getattr(gate, weight_name)
            out_f, in_f = weight.shape
            gen = torch.Generator().manual_seed((settings.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            a = torch.empty(settings.rank, in_f, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            adapter = LoraAdapter(in_local=in_f, out_local=out_f, rank=settings.rank, scaling=settings.scaling,
                                  dropout=settings.dropout, parallel="column", kind="loop_gate", tp_size=1,
                                  dtype=weight.dtype, device=weight.device)
            adapter.peft_target = name.split(".layers.", 1)[1].split(".", 1)[1]  # q_message_gate.down_proj
            with torch.no_grad():
                adapter.lora_A.copy_(a)
            gate.add_module(hf_name, GateLoraHolder(adapter))  # Inkling2LoopMessageGate.forward adds it
            done.append(name)
    return done
