"""Inkling-2-Loop text (HF ``model_type='inkling2_loop_text'``, ``Inkling2LoopForCausalLM``): translation, provider,
mapping, update groups.

Same Megatron model as :mod:`ferrule.plugins.inkling2.inkling2_text` plus the loop
(:mod:`ferrule.plugins.inkling2.loop`). HF layout = what ``Inkling2LoopForCausalLM.save_pretrained``
writes: Inkling-2's released layout plus ``model.llm.layers.L.controllers.{attn,k,v,mlp}.{down,forget,
gain}_weight`` on loop layers and ``model.llm.middle_cycle_cross_pass_{,kv_}queries``. Module-level data only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.config_translation import ConfigTranslationError, Derived, Require
from ferrule.mapping import MappingTable, Rename
from ferrule.plugins.inkling2.config import HF_DEFAULTS, TEXT_ENTRIES, Inkling2ConfigTranslation
from ferrule.plugins.inkling2.inkling2_text import UPDATE_GROUPS as TEXT_UPDATE_GROUPS
from ferrule.plugins.inkling2.inkling2_text import peft_text_mappings, text_model_mappings
from ferrule.contract.specs import UpdateGroup

#: ``Inkling2LoopTextConfig`` defaults (transformers 5.24) where they differ from ``Inkling2TextConfig``'s.
LOOP_DEFAULTS = dict(HF_DEFAULTS, hidden_size=2304, num_hidden_layers=24, num_attention_heads=24,
                     swa_num_attention_heads=24, log_scaling_n_floor=8192, moe_intermediate_size=1152,
                     n_routed_experts=128, loop_layer_index_start=6, loop_layer_index_end=18, loop_num_passes=3,
                     loop_gate_rank=64)

_LOOP_CONFIG_KEYS = {"core_start": "loop_layer_index_start", "core_end": "loop_layer_index_end",
                     "num_passes": "loop_num_passes", "gate_rank": "loop_gate_rank"}


def _loop_option(key: str):
    """``key`` as an integer, checked as ``Inkling2LoopTextConfig.validate_architecture`` checks it."""

    def derive(hf: Mapping[str, Any]) -> int:
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTranslationError(f"inkling2_loop: HF key {key!r}={value!r} must be an integer.")
        start, end, block = hf.get("loop_layer_index_start"), hf.get("loop_layer_index_end"), hf.get(
            "n_layers_per_attn_res_block")
        if key == "loop_num_passes" and value < 1 or key == "loop_gate_rank" and value < 1:
            raise ConfigTranslationError(f"inkling2_loop: HF key {key!r}={value} must be at least 1.")
        if key == "loop_layer_index_start" and (value <= 0 or value % block):
            raise ConfigTranslationError(f"inkling2_loop: loop_layer_index_start={value} must be > 0 and a multiple "
                                         f"of n_layers_per_attn_res_block={block}.")
        if key == "loop_layer_index_end" and (value % block or not start < value <= hf.get("num_hidden_layers")):
            raise ConfigTranslationError(
                f"inkling2_loop: loop_layer_index_end={value} must be a multiple of n_layers_per_attn_res_block="
                f"{block} in ({start}, num_hidden_layers={hf.get('num_hidden_layers')}].")
        return value

    def to_hf(value, _cfg, _opts) -> dict:
        return {key: value}

    derive.__name__ = f"{key}_from_hf"
    return Derived(key, derive, to_hf, hf_keys=(key,), target="option")


LOOP_ENTRIES: tuple = (
    Require("model_type", ("inkling2_loop_text",), reason="the text model of the Inkling-2-Loop family"),
    *(e for e in TEXT_ENTRIES if getattr(e, "hf", None) != "model_type"),
    *(_loop_option(k) for k in ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes", "loop_gate_rank")),
)


@dataclass(frozen=True)
class Inkling2LoopConfigTranslation(Inkling2ConfigTranslation):
    """Inkling-2 translation that first applies ``loop_config`` (``core_start`` ... ``gate_rank``) as
    ``Inkling2LoopTextConfig.__post_init__`` does."""

    def to_mcore(self, hf_config: Mapping[str, Any]):
        config = dict(hf_config)
        text = config.get("text_config") if config.get("model_type") not in self.model_types else None
        target = dict(text) if isinstance(text, Mapping) else config
        loop = target.pop("loop_config", None) or {}
        for old, new in _LOOP_CONFIG_KEYS.items():
            if old in loop:
                target[new] = loop[old]
        if target is not config:
            config["text_config"] = target
        return super().to_mcore(config)


CONFIG_TRANSLATION = Inkling2LoopConfigTranslation(name="inkling2_loop", entries=LOOP_ENTRIES,
                                                   model_types=("inkling2_loop_text",),
                                                   defaults=tuple(LOOP_DEFAULTS.items()))


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """This rank's megatron Inkling-2-Loop model for an ``inkling2_loop_text`` HF config (``ProviderSpec.build``)."""
    from ferrule.plugins.inkling2.loop import Inkling2LoopBlock
    from ferrule.plugins.inkling2.model import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, block_cls=Inkling2LoopBlock, **options)


_GATES = (("q", "attn"), ("k", "k"), ("v", "v"), ("mlp", "mlp"))
_GATE_WEIGHTS = ("down_weight", "forget_weight", "gain_weight")
LOOP_ROWS = tuple((f"{ours}_message_gate.{w}", f"controllers.{hf}.{w}") for ours, hf in _GATES for w in _GATE_WEIGHTS)

#: The message gates' weights as LoRA adapts them: (gate weight, transformers' ``nn.Linear``) per gate. An adapted
#: weight gets an adapter holder module named like the HF linear (``q_message_gate.down_proj``: see
#: :func:`ferrule.plugins.inkling2.lora.apply_loop_gate`); these rows name the holders for PEFT
#: (``Inkling2LoopMessageGate.down_proj`` / ``forget_gate_proj`` / ``message_gate_proj``, replicated).
GATE_LINEARS = (("down_weight", "down_proj"), ("forget_weight", "forget_gate_proj"), ("gain_weight", "message_gate_proj"))
PEFT_GATE_ROWS = tuple(f"{ours}_message_gate.{hf}" for ours, _ in _GATES for _, hf in GATE_LINEARS)

#: LoRA's naming table: the text model's adaptable modules (``Inkling2LoopForCausalLM`` holds them under the
#: same in-memory names as ``Inkling2ForCausalLM``) plus the message-gate holders.
PEFT_MAPPING = MappingTable(family="inkling2_loop", mappings=(
    *peft_text_mappings(),
    *(Rename(f"decoder.layers.*.{m}.weight", f"model.layers.*.{m}.weight") for m in PEFT_GATE_ROWS),
))

MAPPING = MappingTable(family="inkling2_loop", mappings=(
    *text_model_mappings(),
    *(Rename("decoder.layers.*." + m, "model.llm.layers.*." + hf) for m, hf in LOOP_ROWS),
    Rename("decoder.message_input.queries", "model.llm.middle_cycle_cross_pass_queries"),
    Rename("decoder.message_input.kv_queries", "model.llm.middle_cycle_cross_pass_kv_queries"),
), ignores=(), peft_table=PEFT_MAPPING)

#: Inkling-2's groups plus the loop layers' message gates (one unit per loop layer) and the message queries.
UPDATE_GROUPS = (
    *TEXT_UPDATE_GROUPS,
    UpdateGroup(key="loop_gates", suffixes=tuple(m for m, _ in LOOP_ROWS), optional=True),
    UpdateGroup(key="loop_queries", suffixes=("decoder.message_input.queries", "decoder.message_input.kv_queries")),
)

KIT_FEATURE_KEYS: dict = {}

#: Tiny config for the conformance kit: 5 layers, blocks of 1, layers 1..2 looped 3 times (a sliding and a full
#: loop layer), one KV head on full layers.
TINY_HF_CONFIG = {
    "model_type": "inkling2_loop_text", "vocab_size": 100, "unpadded_vocab_size": 90, "hidden_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
    "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 4,
    "d_rel": 4, "rel_extent": 6, "log_scaling_n_floor": 3,
    "layer_types": ["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 1,
    "max_position_embeddings": 64, "mlp_gate_softcap": 1.5, "mlp_up_softcap": 2.0, "final_logit_softcapping": 3.0,
    "eos_token_id": 1, "loop_layer_index_start": 1, "loop_layer_index_end": 3, "loop_num_passes": 3,
    "loop_gate_rank": 5,
}
TINY_TP2_OVERRIDES = {"num_key_value_heads": 2}
