"""Shared mapping rows and update groups for Llama-shaped decoders (``ferrule.mapping.decoder``).

The parameter-side companion of :data:`ferrule.config_translation.DECODER_ENTRIES`: a decoder
built from those config rows (RMSNorm pre-norm, GQA attention with a fused ``linear_qkv``,
SwiGLU MLP, optional tied output layer) has exactly these Megatron-Core parameters, and HF
Llama / Qwen2 / Qwen3 checkpoints name them as below (HF ``modeling_llama.py``). A family
composes its :class:`~ferrule.mapping.MappingTable` from the row tuples and adds what is its
own (QKV bias, q/k norms, MoE rows).

Update groups are derived from the same rows (:func:`layer_suffixes`), so a table and its
update groups cannot spell a parameter two ways: :func:`decoder_update_groups` builds the
usual order ``embedding, attention, <middle>, final_norm, output_layer`` with one unit per
layer for attention and for the MLP. The edge groups are optional (a pipeline stage may hold
no embedding; a tied model at PP=1 has no ``output_layer.weight``).

Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ferrule.mapping.vocabulary import FuseGateUp, FuseQKV, Ignore, OutputLayer, ParamMapping, Rename, TPSplit
from ferrule.contract.specs import UpdateGroup

__all__ = [
    "DECODER_ATTENTION",
    "DECODER_EDGE",
    "DECODER_EDGE_GROUPS",
    "DECODER_IGNORES",
    "DECODER_INPUT_NORM",
    "DECODER_MLP",
    "DECODER_MLP_GROUP",
    "DECODER_OUTPUT_PROJ",
    "DECODER_QKV_BIAS",
    "DECODER_QKV_WEIGHT",
    "decoder_update_groups",
    "layer_suffixes",
]

#: Embedding (vocab-parallel, padded rows), tied-or-untied output layer and final norm.
DECODER_EDGE: tuple[ParamMapping, ...] = (
    Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp=TPSplit.VOCAB),
    OutputLayer("output_layer.weight", hf="lm_head.weight", tied_hf="model.embed_tokens.weight"),
    Rename("decoder.final_layernorm.weight", "model.norm.weight"),
)
#: Pre-attention RMSNorm ``[hidden]`` (replicated).
DECODER_INPUT_NORM = Rename("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight")
#: Fused q/k/v projection weight (layout and TP split: :class:`ferrule.mapping.FuseQKV`).
DECODER_QKV_WEIGHT = FuseQKV("decoder.layers.*.self_attention.linear_qkv.weight",
                             q="model.layers.*.self_attn.q_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
                             v="model.layers.*.self_attn.v_proj.weight")
#: Fused q/k/v bias (Qwen2; megatron ``add_qkv_bias=True``).
DECODER_QKV_BIAS = FuseQKV("decoder.layers.*.self_attention.linear_qkv.bias",
                           q="model.layers.*.self_attn.q_proj.bias", k="model.layers.*.self_attn.k_proj.bias",
                           v="model.layers.*.self_attn.v_proj.bias")
#: Attention output projection ``[hidden, heads * head_dim]`` (row-parallel).
DECODER_OUTPUT_PROJ = Rename("decoder.layers.*.self_attention.linear_proj.weight",
                             "model.layers.*.self_attn.o_proj.weight", tp=TPSplit.ROW)
#: The attention rows every Llama-shaped decoder has, in update-unit order.
DECODER_ATTENTION: tuple[ParamMapping, ...] = (DECODER_INPUT_NORM, DECODER_QKV_WEIGHT, DECODER_OUTPUT_PROJ)
#: Pre-MLP RMSNorm and the dense SwiGLU MLP (``linear_fc1 = [gate; up]``, ``linear_fc2`` row-parallel).
DECODER_MLP: tuple[ParamMapping, ...] = (
    Rename("decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"),
    FuseGateUp("decoder.layers.*.mlp.linear_fc1.weight", gate="model.layers.*.mlp.gate_proj.weight",
               up="model.layers.*.mlp.up_proj.weight"),
    Rename("decoder.layers.*.mlp.linear_fc2.weight", "model.layers.*.mlp.down_proj.weight", tp=TPSplit.ROW),
)
#: HF keys that older checkpoints carry and that hold no weights.
DECODER_IGNORES: tuple[Ignore, ...] = (
    Ignore("model.layers.*.self_attn.rotary_emb.inv_freq",
           reason="RoPE inverse frequencies are recomputed from rope_theta by both HF and megatron",
           unused_by_hf=True),
)


def layer_suffixes(rows: Iterable[ParamMapping]) -> tuple[str, ...]:
    """Update-group suffixes of mapping rows: the mcore pattern after its last ``*.``.

    ``decoder.layers.*.mlp.linear_fc1.weight`` -> ``mlp.linear_fc1.weight`` (one unit per
    layer); ``...local_experts.*.linear_fc1.weight`` -> ``linear_fc1.weight`` (one unit per
    expert); a pattern without ``*`` is its own suffix (``embedding.word_embeddings.weight``).
    """
    return tuple(m.mcore.rsplit("*.", 1)[-1] for m in rows)


#: Embedding, final norm and output layer, each optional (absent on some pipeline stages, and
#: ``output_layer`` absent for tied embeddings at PP=1).
DECODER_EDGE_GROUPS: tuple[UpdateGroup, ...] = tuple(
    UpdateGroup(key=key, suffixes=layer_suffixes([row]), optional=True)
    for key, row in (("embedding", DECODER_EDGE[0]), ("final_norm", DECODER_EDGE[2]), ("output_layer", DECODER_EDGE[1]))
)
#: The dense MLP of one layer as one unit.
DECODER_MLP_GROUP = UpdateGroup(key="mlp", suffixes=layer_suffixes(DECODER_MLP))


def decoder_update_groups(attention: Sequence[ParamMapping] = DECODER_ATTENTION,
                          middle: Sequence[UpdateGroup] = (DECODER_MLP_GROUP,)) -> tuple[UpdateGroup, ...]:
    """``(embedding, attention, *middle, final_norm, output_layer)`` for a Llama-shaped decoder.

    Args:
        attention: the family's attention rows (suffixes derived with :func:`layer_suffixes`):
            :data:`DECODER_ATTENTION` plus e.g. :data:`DECODER_QKV_BIAS` or q/k norm rows.
        middle: the groups between attention and the final norm (the dense MLP by default; an
            MoE family passes its router and expert groups).
    """
    embedding, final_norm, output_layer = DECODER_EDGE_GROUPS
    return (embedding, UpdateGroup(key="attention", suffixes=layer_suffixes(attention)), *middle,
            final_norm, output_layer)
