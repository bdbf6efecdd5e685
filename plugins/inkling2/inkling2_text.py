"""Inkling-2 text (HF ``model_type='inkling2_text'``, ``Inkling2ForCausalLM``): translation, provider, mapping, update groups.

HF layout = what ``Inkling2ForCausalLM.save_pretrained`` writes and ``from_pretrained`` reads: the
*released* layout (transformers 5.24 ``conversion_mapping.py`` entry ``inkling2_text`` renames it on
load and back on save): ``model.llm.embed.weight``, ``model.llm.embed_norm.weight``,
``model.llm.layers.L.attn.{wq_du,wk_dv,wv_dv,wr_du,gate_attn,attn_sink_proj,wo_ud}.weight``,
``attn.{q,rel}_l2_clip.scale``, ``attn.rel_logits_proj.proj``, sliding ``attn.{k,v}_sconv.weight`` /
full ``attn.{k,v}_sconv.{static_w,weight_proj}``, ``attn_norm`` / ``{q,k,v}_input_norm``, ``mlp_norm``,
``attn_sconv.weight``, ``mlp_sconv.weight``, ``mlp.gate.{weight,bias}``, ``mlp.experts.{w13,w2}_weight``
(``w13`` gate/up rows interleaved), ``model.llm.attn_res.{attn_queries.(L-1),mlp_queries.L,output_query}``,
``model.llm.norm.weight``, ``model.llm.unembed.weight`` (``vocab_size`` rows; rows past
``unpadded_vocab_size`` are zeros, which ``Inkling2UnpadVocab`` drops on load and restores on save).

Module-level data only; torch and megatron are imported inside :func:`build_provider` and the mappings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.mapping import MappingError, MappingTable, Rename, StackExperts, StackExpertsInterleaved, TPSplit
from ferrule.plugins.inkling2.config import TEXT_ENTRIES, Inkling2ConfigTranslation
from ferrule.contract.specs import UpdateGroup

#: HF ``inkling2_text`` config <-> megatron (see :mod:`ferrule.plugins.inkling2.config`).
CONFIG_TRANSLATION = Inkling2ConfigTranslation(name="inkling2_text", entries=TEXT_ENTRIES)


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """This rank's megatron Inkling-2 model for an ``inkling2_text`` HF config (``ProviderSpec.build``).

    Options: see :func:`ferrule.plugins.inkling2.model.build_from_hf_config`.
    """
    from ferrule.plugins.inkling2.model import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, **options)


@dataclass(frozen=True)
class OffsetRename(Rename):
    """:class:`Rename` whose HF key carries the layer index shifted by ``offset`` (first wildcard).

    HF ``model.llm.attn_res.attn_queries.i`` belongs to decoder layer ``i + 1`` (layer 0 has no
    attention input; transformers' ``Inkling2IndexOffsetWeightRename(offset=1)``).
    """

    offset: int = 0

    def hf_keys(self, mcore_name, ctx=None):
        wild = self.match(mcore_name)
        if wild is None:
            raise MappingError(f"{mcore_name!r} does not match {type(self).__name__} pattern {self.mcore!r}.")
        index = int(wild[0]) + self.offset
        if index < 0:
            raise MappingError(f"{mcore_name!r}: layer {wild[0]} has no HF {self.hf!r} entry.")
        return (self.hf.replace("*", str(index), 1),)


_L = "decoder.layers.*."

#: mcore <-> released HF rows per layer, as (mcore suffix, HF suffix under ``model.llm.layers.L.``, TP split).
LAYER_ROWS = (
    ("self_attention.linear_q.weight", "attn.wq_du.weight", TPSplit.COLUMN),
    ("self_attention.linear_k.weight", "attn.wk_dv.weight", TPSplit.COLUMN),
    ("self_attention.linear_v.weight", "attn.wv_dv.weight", TPSplit.COLUMN),
    ("self_attention.linear_r.weight", "attn.wr_du.weight", TPSplit.COLUMN),
    ("self_attention.linear_gate.weight", "attn.gate_attn.weight", TPSplit.COLUMN),
    ("self_attention.linear_sink.weight", "attn.attn_sink_proj.weight", TPSplit.COLUMN),
    ("self_attention.linear_proj.weight", "attn.wo_ud.weight", TPSplit.ROW),
    ("self_attention.q_clip.scale", "attn.q_l2_clip.scale", TPSplit.COLUMN),
    ("self_attention.r_clip.scale", "attn.rel_l2_clip.scale", TPSplit.COLUMN),
    ("self_attention.rel_logits_proj.weight", "attn.rel_logits_proj.proj", TPSplit.REPLICATED),
    ("post_attention_convolution.weight", "attn_sconv.weight", TPSplit.REPLICATED),
    # sliding layers: static KV convolutions, one input norm
    ("input_layernorm.weight", "attn_norm.weight", TPSplit.REPLICATED),
    ("self_attention.k_sconv.weight", "attn.k_sconv.weight", TPSplit.COLUMN),
    ("self_attention.v_sconv.weight", "attn.v_sconv.weight", TPSplit.COLUMN),
    # full layers: dynamic KV convolutions, q/k/v input norms
    ("q_input_layernorm.weight", "q_input_norm.weight", TPSplit.REPLICATED),
    ("k_input_layernorm.weight", "k_input_norm.weight", TPSplit.REPLICATED),
    ("v_input_layernorm.weight", "v_input_norm.weight", TPSplit.REPLICATED),
    ("self_attention.k_sconv.static_weight", "attn.k_sconv.static_w", TPSplit.ROW),
    ("self_attention.v_sconv.static_weight", "attn.v_sconv.static_w", TPSplit.ROW),
    ("self_attention.k_sconv.weight_proj.weight", "attn.k_sconv.weight_proj", TPSplit.COLUMN),
    ("self_attention.v_sconv.weight_proj.weight", "attn.v_sconv.weight_proj", TPSplit.COLUMN),
    # MLP side
    ("pre_mlp_layernorm.weight", "mlp_norm.weight", TPSplit.REPLICATED),
    ("post_mlp_convolution.weight", "mlp_sconv.weight", TPSplit.REPLICATED),
    ("mlp.router.weight", "mlp.gate.weight", TPSplit.REPLICATED),
    ("mlp.router.expert_bias", "mlp.gate.bias", TPSplit.REPLICATED),
)


def text_model_mappings(llm: str = "model.llm.", lm_head: str = "model.llm.unembed.weight") -> tuple:
    """The text model's rows with the released layout under ``llm`` (``model.llm.`` for both model types)."""
    h = llm + "layers.*."
    return (
        Rename("embedding.word_embeddings.weight", llm + "embed.weight", tp=TPSplit.VOCAB),
        Rename("embedding.embed_norm.weight", llm + "embed_norm.weight"),
        Rename("decoder.final_layernorm.weight", llm + "norm.weight"),
        Rename("decoder.final_input.query", llm + "attn_res.output_query"),
        Rename("output_layer.weight", lm_head, tp=TPSplit.VOCAB),
        *(Rename(_L + m, h + hf, tp=tp) for m, hf, tp in LAYER_ROWS),
        Rename(_L + "mlp_input.query", llm + "attn_res.mlp_queries.*"),
        OffsetRename(_L + "attention_input.query", llm + "attn_res.attn_queries.*", offset=-1),
        StackExpertsInterleaved(_L + "mlp.experts.local_experts.*.linear_fc1.weight", hf=h + "mlp.experts.w13_weight",
                                tp=TPSplit.GATE_UP),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc2.weight", hf=h + "mlp.experts.w2_weight",
                     tp=TPSplit.ROW),
    )


#: The linears LoRA adapts, as (mcore suffix, transformers' in-memory module below ``layers.L.``, TP split): the
#: names ``Inkling2ForCausalLM`` holds after loading (transformers' ``conversion_mapping`` entry ``inkling2_text``:
#: ``attn.wq_du`` -> ``self_attn.q_proj.linear``, ``gate_attn`` -> ``self_attn.o_proj.gate_proj``, ...), which HF
#: PEFT adapter keys use.
PEFT_LINEAR_ROWS = (
    ("self_attention.linear_q", "self_attn.q_proj.linear", TPSplit.COLUMN),
    ("self_attention.linear_k", "self_attn.k_proj.linear", TPSplit.COLUMN),
    ("self_attention.linear_v", "self_attn.v_proj.linear", TPSplit.COLUMN),
    ("self_attention.linear_r", "self_attn.relative_position_bias.linear", TPSplit.COLUMN),
    ("self_attention.linear_gate", "self_attn.o_proj.gate_proj", TPSplit.COLUMN),
    ("self_attention.linear_sink", "self_attn.sink_proj", TPSplit.COLUMN),
    ("self_attention.linear_proj", "self_attn.o_proj.linear", TPSplit.ROW),
    ("self_attention.k_sconv.weight_proj", "self_attn.k_proj.sconv.weight_proj", TPSplit.COLUMN),
    ("self_attention.v_sconv.weight_proj", "self_attn.v_proj.sconv.weight_proj", TPSplit.COLUMN),
)


def peft_text_mappings(model: str = "model.") -> tuple:
    """The adaptable text-model parameters under transformers' in-memory names (``model`` = ``model.`` for
    ``Inkling2ForCausalLM``, ``model.language_model.`` for ``Inkling2ForConditionalGeneration``): the attention
    linears (:data:`PEFT_LINEAR_ROWS`), the routed experts' fused 3-D ``gate_up_proj`` ``[E, 2I, H]`` (per expert
    ``[gate; up]``, as megatron's ``linear_fc1``) and ``down_proj`` ``[E, H, I]``, and ``lm_head`` (named only so
    that a target naming it is recognised and refused: ``ferrule.plugins.inkling2.lora.apply_lm_head``)."""
    h = model + "layers.*."
    return (
        *(Rename(_L + m + ".weight", h + hf + ".weight", tp=tp) for m, hf, tp in PEFT_LINEAR_ROWS),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc1.weight", hf=h + "mlp.experts.gate_up_proj",
                     tp=TPSplit.GATE_UP),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc2.weight", hf=h + "mlp.experts.down_proj",
                     tp=TPSplit.ROW),
        Rename("output_layer.weight", "lm_head.weight", tp=TPSplit.VOCAB),
    )


#: LoRA's naming table (``MappingTable.peft_table``): transformers' in-memory names of the adaptable modules.
PEFT_MAPPING = MappingTable(family="inkling2_text", mappings=peft_text_mappings())

#: Inkling-2 text mapping table (released layout).
MAPPING = MappingTable(family="inkling2_text", mappings=text_model_mappings(), ignores=(), peft_table=PEFT_MAPPING)

_COMMON_ATTENTION = tuple(m for m, _, _ in LAYER_ROWS[:11])

#: Weight-sync groups per layer: the attention every layer has; the sliding-only and full-only parts
#: (a layer is one kind); the attention-input queries (every layer but 0); the MLP side (input query,
#: norm, output convolution, router); one unit per routed expert; embedding; output (final attention
#: residual, final norm, unembedding).
UPDATE_GROUPS = (
    UpdateGroup(key="embedding", suffixes=("embedding.word_embeddings.weight", "embedding.embed_norm.weight"),
                optional=True),
    UpdateGroup(key="attention", suffixes=_COMMON_ATTENTION),
    UpdateGroup(key="sliding_attention", suffixes=tuple(m for m, _, _ in LAYER_ROWS[11:14]), optional=True),
    UpdateGroup(key="full_attention", suffixes=tuple(m for m, _, _ in LAYER_ROWS[14:21]), optional=True),
    UpdateGroup(key="attention_input", suffixes=("attention_input.query",), optional=True),
    UpdateGroup(key="mlp", suffixes=("mlp_input.query", *(m for m, _, _ in LAYER_ROWS[21:]))),
    UpdateGroup(key="routed_expert", suffixes=("linear_fc1.weight", "linear_fc2.weight")),
    UpdateGroup(key="output", suffixes=("decoder.final_input.query", "decoder.final_layernorm.weight",
                                        "output_layer.weight"), optional=True),
)

#: Tiny random config (``transformers.Inkling2TextConfig`` kwargs) for the conformance kit: sliding and full
#: layers, one KV head on full layers, attention-residual blocks of 2 layers, log scaling from position 3,
#: a padded unembedding (90 of 100 rows), soft-caps low enough to bite.
KIT_FEATURE_KEYS: dict = {}

TINY_HF_CONFIG = {
    "model_type": "inkling2_text", "vocab_size": 100, "unpadded_vocab_size": 90, "hidden_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
    "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 4,
    "d_rel": 4, "rel_extent": 6, "log_scaling_n_floor": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid", "hybrid_sliding"],
    "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
    "max_position_embeddings": 64, "mlp_gate_softcap": 1.5, "mlp_up_softcap": 2.0, "final_logit_softcapping": 3.0,
    "qk_l2_clip_threshold": 0.5, "rel_l2_clip_threshold": 0.3, "eos_token_id": 1,
}
TINY_TP2_OVERRIDES = {"num_key_value_heads": 2}
