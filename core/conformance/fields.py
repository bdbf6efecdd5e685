"""What HF's instantiated model uses, read for the conformance kit (:mod:`ferrule.conformance.numeric`
re-exports every public name): the class the kit builds a family's tiny model with, the text vocabulary
of a (multimodal) config, rotary ``cos``/``sin`` tables and the translated fields HF's modules expose."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from ferrule.contract import registry
from ferrule.contract.specs import resolve_ref

__all__ = ["hf_model_class", "text_vocab_size", "full_width", "rotary_tables_hf", "rotary_tables_mcore", "rotary_tables_by_layer",
           "translated_fields_vs_hf"]


def hf_model_class(family: str, model_type: str):
    """The transformers class the kit builds and loads ``family``'s tiny model with: ``AutoModelForCausalLM``,
    or the family's ``hf_model_class`` when ``model_type`` is no causal LM type (e.g. ``inkling_mm_model``)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ref = registry.get_family(family).hf_model_class
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or ref is None:
        return AutoModelForCausalLM
    return resolve_ref(ref)


def text_vocab_size(hf_config: Mapping[str, Any]) -> int:
    """``vocab_size`` of the text model (a multimodal config holds it in ``text_config``)."""
    return int(hf_config["vocab_size"] if "vocab_size" in hf_config else hf_config["text_config"]["vocab_size"])


def rotary_tables_hf(hf_model, seq_len: int, layer_type: str | None = None):
    """``(cos, sin)`` ``[seq_len, rotary_dim]`` (fp64) that HF's model applies at positions 0..seq_len-1
    (a half-width table, one column per rotated pair, widened: :func:`full_width`).

    From ``model.model.rotary_emb(x, position_ids)``: HF's inverse frequencies after scaling, times
    its ``attention_scaling``. ``layer_type`` (e.g. ``"full_attention"``) selects the table of that
    layer type for models with one RoPE per type (``Gemma3RotaryEmbedding.forward(x, position_ids,
    layer_type)``).
    """
    import torch

    rotary = hf_model.model.rotary_emb
    x = torch.zeros(1, seq_len, 1, dtype=torch.float32)
    pos = torch.arange(seq_len).unsqueeze(0)
    cos, sin = rotary(x, pos) if layer_type is None else rotary(x, pos, layer_type)
    return full_width(cos[0].double(), sin[0].double())


def full_width(cos, sin):
    """``(cos, sin)`` as ``[seq, rotary_dim]``, the rotate-half layout megatron uses (``cat(freqs, freqs)``).

    Most HF rotary embeddings return that already (Llama: ``emb = torch.cat((freqs, freqs), dim=-1)``); some
    return one column per rotated *pair*, ``[seq, rotary_dim / 2]`` (transformers' ``GptOssRotaryEmbedding``:
    ``emb = freqs``, applied by ``_apply_rotary_emb`` to both halves of the head). A table whose two halves
    differ (or whose width is odd) is such a half-width table and is returned widened to ``cat(t, t)``; a
    rotate-half table (equal halves) is returned unchanged. Position 0 alone cannot tell them apart
    (``cos = 1`` everywhere): tables of one row are returned unchanged.
    """
    import torch

    width = cos.shape[-1]
    if cos.shape[0] < 2:
        return cos, sin
    halves_equal = width % 2 == 0 and torch.equal(cos[..., : width // 2], cos[..., width // 2:]) \
        and torch.equal(sin[..., : width // 2], sin[..., width // 2:])
    if halves_equal:
        return cos, sin
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _hf_rotary_layer_types(hf_model) -> list[str] | None:
    """HF ``config.layer_types`` when its rotary embedding takes a ``layer_type`` argument, else None."""
    import inspect

    rotary = hf_model.model.rotary_emb
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    return list(getattr(hf_model.config, "layer_types", None) or []) or None


def rotary_tables_by_layer(hf_model, mcore_model, seq_len: int) -> list[tuple[str, Any, Any]]:
    """``(label, (cos, sin) of megatron, (cos, sin) of HF)`` per RoPE the models apply.

    One row for a model-wide RoPE; for HF models with one RoPE per layer type, one row per decoder
    layer (``"layer i (type)"``), comparing megatron layer ``i``'s own table (``layer_rope`` option:
    ``self_attention.layer_rotary``) or the model-wide one with HF's table for ``layer_types[i]``.
    """
    layer_types = _hf_rotary_layer_types(hf_model)
    if layer_types is None:
        return [("model", rotary_tables_mcore(mcore_model, seq_len), rotary_tables_hf(hf_model, seq_len))]
    rows = []
    for i, (layer, layer_type) in enumerate(zip(mcore_model.decoder.layers, layer_types)):
        own = getattr(layer.self_attention, "layer_rotary", None)
        emb = (own or mcore_model.rotary_pos_emb)(seq_len)[:, 0, 0, :].double()
        rows.append((f"layer {i} ({layer_type})", (emb.cos(), emb.sin()), rotary_tables_hf(hf_model, seq_len, layer_type)))
    return rows


def rotary_tables_mcore(mcore_model, seq_len: int):
    """``(cos, sin)`` ``[seq_len, rotary_dim]`` (fp64) that megatron's ``GPTModel`` applies.

    From ``model.rotary_pos_emb(seq_len)`` (``[s, 1, 1, rotary_dim]`` angles; megatron's
    ``apply_rotary_pos_emb`` rotates the first ``rotary_dim`` channels with ``cos``/``sin`` of them);
    for YaRN times the concentration factor it returns beside them (``mscale``, which megatron's
    attention multiplies cos/sin by, as HF does with ``attention_scaling``).
    """
    emb = mcore_model.rotary_pos_emb(seq_len)
    emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)  # YarnRotaryEmbedding: (angles, mscale)
    emb = emb[:, 0, 0, :].double()
    return emb.cos() * mscale, emb.sin() * mscale


def translated_fields_vs_hf(hf_model, mcore_model) -> list[tuple[str, Any, Any]]:
    """``(field, ferrule value, HF value)`` for each translated quantity HF's modules expose.

    HF values are read from the instantiated model (module shapes and attributes), not from the
    config: layer count, hidden size, MLP width, query heads, KV heads, head width, softmax scale,
    norm epsilon, vocabulary rows, tied embeddings, and (when the MLP has ``act_fn``) the activation
    evaluated on a probe vector.
    """
    import torch

    cfg = mcore_model.config
    layer = hf_model.model.layers[0]
    attn = layer.self_attn
    head_dim = int(attn.head_dim)
    core = mcore_model.decoder.layers[0].self_attention.core_attention
    scale = getattr(core, "sdpa_scale", None) or core.softmax_scale
    rows = [
        ("num_layers", cfg.num_layers, len(hf_model.model.layers)),
        ("hidden_size", cfg.hidden_size, hf_model.model.embed_tokens.weight.shape[1]),
        ("ffn_hidden_size", cfg.ffn_hidden_size if not cfg.num_moe_experts else cfg.moe_ffn_hidden_size,
         _hf_ffn_width(layer, hf_model.model.embed_tokens.weight.shape[1])),
        ("num_attention_heads", cfg.num_attention_heads, attn.q_proj.out_features // head_dim),
        ("num_query_groups", cfg.num_query_groups, attn.k_proj.out_features // head_dim),
        ("kv_channels", cfg.kv_channels, head_dim),
        ("softmax_scale", round(float(scale), 9), round(float(attn.scaling), 9)),
        ("layernorm_epsilon", cfg.layernorm_epsilon, _norm_eps(hf_model.model.norm)),
        ("vocab_size", mcore_model.vocab_size >= hf_model.model.embed_tokens.weight.shape[0], True),
        ("share_embeddings_and_output_weights", bool(mcore_model.share_embeddings_and_output_weights),
         hf_model.lm_head.weight is hf_model.model.embed_tokens.weight),
    ]
    act = getattr(getattr(layer, "mlp", None), "act_fn", None)
    if act is not None:
        probe = torch.linspace(-4, 4, 17)
        ours = cfg.activation_func(probe)
        rows.append(("activation_func", "matches" if torch.allclose(ours, act(probe), atol=1e-6) else
                     f"differs ({cfg.activation_func})", "matches"))
    return rows


def _hf_ffn_width(layer, hidden: int | None = None) -> int:
    """The (expert) MLP width of one HF decoder layer, read from its modules.

    A dense MLP: ``gate_proj.out_features``. Stacked routed experts: the ``intermediate_size`` the experts
    module records (``intermediate_dim``: transformers' ``Qwen3MoeExperts``; ``intermediate_size``:
    ``GptOssExperts``) when it is one of the stacked ``down_proj``'s dimensions, else the dimension of the stacked
    ``down_proj`` ``[E, ., .]`` that is not ``hidden``: its layout is ``[E, hidden, ffn]`` (Qwen3-MoE, out x in)
    or ``[E, ffn, hidden]`` (gpt-oss, in x out; its ``gate_up_proj`` is ``[E, hidden, 2 * ffn]``).
    """
    mlp = layer.mlp
    if hasattr(mlp, "gate_proj"):
        return mlp.gate_proj.out_features
    experts = getattr(mlp, "experts", None)
    if experts is not None and hasattr(experts, "down_proj"):
        shape = tuple(experts.down_proj.shape)
        for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
            recorded = getattr(experts, attr, None)
            if isinstance(recorded, int) and recorded in shape[1:]:
                return recorded
        if hidden is not None and len(shape) == 3 and shape[-1] == hidden:
            return int(shape[-2])
        return int(shape[-1])
    raise AssertionError(f"cannot read the MLP width of HF layer {type(layer).__name__}")


def _norm_eps(norm) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(norm, attr):
            return float(getattr(norm, attr))
    raise AssertionError(f"cannot read the epsilon of HF norm {type(norm).__name__}")
