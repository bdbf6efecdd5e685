"""Inkling text (HF ``model_type='inkling_text'``, ``InklingForCausalLM``): config translation, provider, mapping, update groups.

HF layout = what ``InklingForCausalLM.save_pretrained`` writes and ``from_pretrained`` reads
(transformers 5.24 has no checkpoint-conversion rules for ``inkling_text``, so keys are the module
names): ``model.embed_tokens.weight``, ``model.embed_tokens.embed_norm.weight``,
``model.layers.L.self_attn.{q,k,v,r,o}_proj.weight``, ``...self_attn.{k,v}_sconv.conv1d.weight``,
``...self_attn.rel_logits_proj.proj``, ``mlp.experts.gate_up_proj [E, 2I, H]`` (per expert
``[gate; up]``), ``mlp.shared_experts.{gate,up,down}_proj [S, ...]``, ``mlp.gate.{weight,
e_score_correction_bias, global_scale}``, ``lm_head.weight``. The released multimodal layout
(``model.llm.*``) is :mod:`ferrule.plugins.inkling.inkling`.

Module-level data only; torch and megatron are imported inside :func:`build_provider` and the
mapping methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.mapping import FuseGateUp, MappingError, MappingTable, Rename, StackExperts, TPSplit
from ferrule.mapping import ParamMapping
from ferrule.plugins.inkling.config import TEXT_ENTRIES, InklingConfigTranslation
from ferrule.contract.specs import UpdateGroup

#: HF ``inkling_text`` config <-> megatron (see :mod:`ferrule.plugins.inkling.config`).
CONFIG_TRANSLATION = InklingConfigTranslation(name="inkling_text", entries=TEXT_ENTRIES, model_types=("inkling_text",))


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """This rank's megatron Inkling ``GPTModel`` chunks for an ``inkling_text`` HF config (``ProviderSpec.build``).

    Options: see :func:`ferrule.plugins.inkling.model.build_from_hf_config`.
    """
    from ferrule.plugins.inkling.model import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, **options)


@dataclass(frozen=True)
class StackSharedGateUp(ParamMapping):
    """Shared experts' ``linear_fc1`` ``[S, 2*ffn, hidden]`` (per expert ``[gate; up]``) <-> HF ``gate_proj``/``up_proj`` ``[S, ffn, hidden]``.

    HF ``InklingSharedExperts`` keeps gate and up as two stacked parameters; the mcore
    tensor concatenates them on dim 1. Replicated over TP and EP (not an expert mapping).
    """

    gate: str = ""
    up: str = ""

    def hf_patterns(self, ctx):
        return (self.gate, self.up)

    def to_mcore(self, hf, ctx, wildcards=()):
        import torch

        gate, up = hf
        if tuple(up.shape) != tuple(gate.shape):
            raise MappingError(f"{self.mcore}: up_proj {tuple(up.shape)} and gate_proj {tuple(gate.shape)} differ.")
        return torch.cat([gate, up], 1)

    def to_hf(self, full, ctx, wildcards=()):
        ffn = full.shape[1] // 2
        return full[:, :ffn].contiguous(), full[:, ffn:].contiguous()


_L = "decoder.layers.*."

#: mcore <-> HF rows shared by every Inkling layer (attention, norms, ShortConvs), as (mcore suffix, HF suffix, TP split).
ATTENTION_ROWS = (
    ("input_layernorm.weight", "input_layernorm.weight", TPSplit.REPLICATED),
    ("self_attention.linear_q.weight", "self_attn.q_proj.weight", TPSplit.COLUMN),
    ("self_attention.linear_k.weight", "self_attn.k_proj.weight", TPSplit.COLUMN),
    ("self_attention.linear_v.weight", "self_attn.v_proj.weight", TPSplit.COLUMN),
    ("self_attention.linear_r.weight", "self_attn.r_proj.weight", TPSplit.COLUMN),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", TPSplit.ROW),
    ("self_attention.k_sconv.weight", "self_attn.k_sconv.conv1d.weight", TPSplit.COLUMN),
    ("self_attention.v_sconv.weight", "self_attn.v_sconv.conv1d.weight", TPSplit.COLUMN),
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", TPSplit.REPLICATED),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", TPSplit.REPLICATED),
    ("self_attention.rel_logits_proj.weight", "self_attn.rel_logits_proj.proj", TPSplit.REPLICATED),
    ("self_attention.attn_sconv.weight", "attn_sconv.conv1d.weight", TPSplit.REPLICATED),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", TPSplit.REPLICATED),
    ("mlp.mlp_sconv.weight", "mlp_sconv.conv1d.weight", TPSplit.REPLICATED),
)


def text_model_mappings(hf_text_model: str = "model.") -> tuple[ParamMapping, ...]:
    """The text model's rows with transformers' ``InklingTextModel`` under ``hf_text_model``.

    ``"model."`` for ``InklingForCausalLM`` (:data:`MAPPING`); ``"model.language_model."`` for the
    text model inside ``InklingForConditionalGeneration`` (its in-memory module names, used for
    PEFT keys: :data:`ferrule.plugins.inkling.inkling.PEFT_MAPPING`). ``lm_head`` sits at the
    top level of both.
    """
    h = hf_text_model + "layers.*."
    return (
        Rename("embedding.word_embeddings.weight", hf_text_model + "embed_tokens.weight", tp=TPSplit.VOCAB),
        Rename("embedding.embed_norm.weight", hf_text_model + "embed_tokens.embed_norm.weight"),
        Rename("decoder.final_layernorm.weight", hf_text_model + "norm.weight"),
        Rename("output_layer.weight", "lm_head.weight", tp=TPSplit.VOCAB),
        *(Rename(_L + m, h + hf, tp=tp) for m, hf, tp in ATTENTION_ROWS),
        # dense MLP layers
        FuseGateUp(_L + "mlp.linear_fc1.weight", gate=h + "mlp.gate_proj.weight", up=h + "mlp.up_proj.weight"),
        Rename(_L + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight", tp=TPSplit.ROW),
        Rename(_L + "mlp.global_scale", h + "mlp.global_scale"),
        # MoE layers: router, routed experts (global expert index), shared experts
        Rename(_L + "mlp.router.weight", h + "mlp.gate.weight"),
        Rename(_L + "mlp.router.expert_bias", h + "mlp.gate.e_score_correction_bias"),
        Rename(_L + "mlp.router.global_scale", h + "mlp.gate.global_scale"),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc1.weight", hf=h + "mlp.experts.gate_up_proj",
                     tp=TPSplit.GATE_UP),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc2.weight", hf=h + "mlp.experts.down_proj",
                     tp=TPSplit.ROW),
        StackSharedGateUp(_L + "mlp.shared_experts.linear_fc1.weight", gate=h + "mlp.shared_experts.gate_proj",
                          up=h + "mlp.shared_experts.up_proj"),
        Rename(_L + "mlp.shared_experts.linear_fc2.weight", h + "mlp.shared_experts.down_proj"),
    )


#: Inkling text mapping table (``inkling_text`` HF layout).
MAPPING = MappingTable(family="inkling_text", mappings=text_model_mappings("model."), ignores=())

#: Weight-sync groups, per layer: attention (norm, projections, ShortConvs, q/k norms, relative
#: bias, output ShortConv); the MLP input norm + output ShortConv every layer has; the dense MLP;
#: the router; the shared experts; one unit per routed expert. A layer is dense or MoE and a model
#: (or a pipeline stage) may hold only one kind, so every MLP-side group is optional, as are the
#: embedding and output groups (first / last pipeline stage only).
UPDATE_GROUPS = (
    UpdateGroup(key="embedding", suffixes=("embedding.word_embeddings.weight", "embedding.embed_norm.weight"),
                optional=True),
    UpdateGroup(key="attention", suffixes=tuple(m for m, _, _ in ATTENTION_ROWS[:12])),
    UpdateGroup(key="mlp_io", suffixes=("pre_mlp_layernorm.weight", "mlp.mlp_sconv.weight")),
    UpdateGroup(key="dense_mlp", suffixes=("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.global_scale"),
                optional=True),
    UpdateGroup(key="moe_router", suffixes=("mlp.router.weight", "mlp.router.expert_bias", "mlp.router.global_scale"),
                optional=True),
    UpdateGroup(key="shared_experts", suffixes=("mlp.shared_experts.linear_fc1.weight",
                                                "mlp.shared_experts.linear_fc2.weight"), optional=True),
    UpdateGroup(key="routed_expert", suffixes=("linear_fc1.weight", "linear_fc2.weight"), optional=True),
    UpdateGroup(key="output", suffixes=("decoder.final_layernorm.weight", "output_layer.weight"), optional=True),
)

#: A tiny random config (``transformers.InklingTextConfig`` kwargs) for the conformance kit:
#: one dense + two MoE layers (4 routed experts top-2, 2 shared), local + global attention.
#: The conformance kit's feature check switches a feature key off on the same weights; Inkling's
#: ``sliding_window`` also sizes the relative-position projection (``rel_logits_proj``), so it cannot
#: be switched off that way. Windows are tested by plugins/inkling/tests/test_inkling_parity.py instead (local-only
#: and hybrid configs, sequences longer than the window).
KIT_FEATURE_KEYS: dict = {}

TINY_HF_CONFIG = {
    "model_type": "inkling_text", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
    "sliding_window_size": 4, "rel_extent": 6, "d_rel": 4, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    "mlp_layer_types": ["dense", "sparse", "sparse"], "intermediate_size": 48, "moe_intermediate_size": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2, "max_position_embeddings": 64,
    "logits_mup_width_multiplier": 4.0, "route_scale": 2.0,
}
