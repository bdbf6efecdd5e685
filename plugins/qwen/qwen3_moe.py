"""Qwen3-MoE (HF ``model_type='qwen3_moe'``): config translation and provider.

Architecture (HF ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``): Qwen3 attention
(q/k RMSNorm, explicit ``head_dim``, no bias) and, in every layer, a sparse MoE block:
a bias-free router ``gate`` over ``num_local_experts`` (legacy ``num_experts``) SwiGLU experts
of width ``moe_intermediate_size``; softmax over all experts, top ``num_experts_per_tok``, then
renormalised over the top-k when ``norm_topk_prob``. Megatron equivalents:
``num_moe_experts``, ``moe_ffn_hidden_size``, ``moe_router_topk`` and
``moe_router_pre_softmax = not norm_topk_prob`` (see
:func:`ferrule.config_translation.pre_softmax_from_norm_topk_prob`). No shared expert.
Dense layers between sparse ones (``decoder_sparse_step != 1`` or ``mlp_only_layers``) are
not supported.

Module-level data only. No provider function: the family's ``ProviderSpec`` uses the default
build driven by :data:`CONFIG_TRANSLATION`.
"""

from __future__ import annotations

from ferrule.config_translation import (
    ConfigTranslation,
    Constant,
    Derived,
    Field,
    Harmless,
    Require,
    head_dim_from_hf,
    head_dim_to_hf,
    num_experts_from_hf,
    num_experts_to_hf,
    pre_softmax_from_norm_topk_prob,
    pre_softmax_to_norm_topk_prob,
)
from ferrule.plugins.qwen.qwen2 import QWEN_COMMON_ENTRIES

#: HF ``qwen3_moe`` config <-> megatron (see :mod:`ferrule.config_translation`).
CONFIG_TRANSLATION = ConfigTranslation(
    name="qwen3_moe",
    entries=(
        Require("model_type", ("qwen3_moe",)),
        Require("attention_bias", (False,), default=False,
                reason="Qwen3 attention bias would need o_proj bias; megatron ties it to MLP biases"),
        Require("decoder_sparse_step", (1,), default=1, reason="every layer must be an MoE layer"),
        Require("mlp_only_layers", ([],), default=[], reason="dense layers inside an MoE stack are not implemented"),
        *QWEN_COMMON_ENTRIES,
        Derived("kv_channels", head_dim_from_hf, head_dim_to_hf, hf_keys=("head_dim",)),
        Constant("add_qkv_bias", False),
        Constant("qk_layernorm", True),
        Derived("num_moe_experts", num_experts_from_hf, num_experts_to_hf,
                hf_keys=("num_local_experts", "num_experts")),
        Field("num_experts_per_tok", "moe_router_topk", cast=int),
        Field("moe_intermediate_size", "moe_ffn_hidden_size", cast=int),
        Derived("moe_router_pre_softmax", pre_softmax_from_norm_topk_prob, pre_softmax_to_norm_topk_prob,
                hf_keys=("norm_topk_prob",)),
        Field("router_aux_loss_coef", "moe_aux_loss_coeff", default=0.001, cast=float),
        Harmless("output_router_logits", "HF then also returns router logits / adds its aux loss to `loss`; "
                 "the logits are unchanged (ferrule's aux loss is moe_aux_loss_coeff)"),
        Constant("moe_router_score_function", "softmax"),
        Constant("moe_router_load_balancing_type", "aux_loss"),
        Constant("moe_grouped_gemm", False),
    ),
)


# ---- parameter mapping (MAPPING) and update groups (UPDATE_GROUPS) ----

from ferrule.mapping import ExpertFuseGateUp, ExpertRename, MappingTable, Rename, TPSplit  # noqa: E402
from ferrule.mapping.decoder import DECODER_EDGE, DECODER_IGNORES, DECODER_MLP, layer_suffixes  # noqa: E402
from ferrule.mapping.decoder import decoder_update_groups  # noqa: E402
from ferrule.plugins.qwen.qwen3 import QWEN3_ATTENTION  # noqa: E402
from ferrule.contract.specs import UpdateGroup  # noqa: E402

#: Pre-MLP norm (shared decoder row) and the bias-free router ``[num_experts, hidden]``.
MOE_ROUTER = (DECODER_MLP[0], Rename("decoder.layers.*.mlp.router.weight", "model.layers.*.mlp.gate.weight"))
#: Routed experts: per expert in HF files (``mlp.experts.E.{gate,up,down}_proj.weight``) and in
#: megatron's ``SequentialMLP`` (``mlp.experts.local_experts.E.linear_fc1/fc2``); ``E`` is the
#: *global* expert index.
MOE_EXPERTS = (
    ExpertFuseGateUp("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                     gate="model.layers.*.mlp.experts.*.gate_proj.weight",
                     up="model.layers.*.mlp.experts.*.up_proj.weight"),
    ExpertRename("decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
                 "model.layers.*.mlp.experts.*.down_proj.weight", tp=TPSplit.ROW),
)

#: Qwen3-MoE mapping table: shared decoder edge rows, Qwen3 attention, router and routed experts.
MAPPING = MappingTable(family="qwen3_moe", mappings=(*DECODER_EDGE, *QWEN3_ATTENTION, *MOE_ROUTER, *MOE_EXPERTS),
                       ignores=DECODER_IGNORES)

#: Weight-sync groups, derived from the same rows: attention per layer; router (+ pre-MLP norm)
#: per layer; one unit per routed expert (prefix ``decoder.layers.L.mlp.experts.local_experts.E.``).
#: Qwen3-MoE has no shared expert, so the bare ``linear_fc1/linear_fc2`` suffixes only match
#: routed experts.
UPDATE_GROUPS = decoder_update_groups(QWEN3_ATTENTION, middle=(
    UpdateGroup(key="moe_router", suffixes=layer_suffixes(MOE_ROUTER)),
    UpdateGroup(key="routed_expert", suffixes=layer_suffixes(MOE_EXPERTS)),
))

#: A tiny random config for conformance tests (``transformers.Qwen3MoeConfig`` kwargs):
#: 4 experts, top-2, norm_topk_prob, untied.
TINY_HF_CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
