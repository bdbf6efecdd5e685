"""Llama (HF ``model_type='llama'``): config translation, provider, mapping table, update groups.

Covers Llama-2 / Llama-3(.0) style checkpoints and the models that reuse the architecture
(SmolLM2, TinyLlama, ...). Architecture (HF ``transformers/models/llama/modeling_llama.py``):
RMSNorm pre-norm, SwiGLU MLP (``down(silu(gate(x)) * up(x))``), RoPE with the
``rotate_half`` (non-interleaved) layout, GQA (``num_key_value_heads``), no biases by default,
optional tied embeddings. In Megatron-Core terms: ``normalization='RMSNorm'``,
``gated_linear_unit=True`` with silu, ``add_bias_linear=False``, ``add_qkv_bias=False``,
``qk_layernorm=False``, ``position_embedding_type='rope'`` with ``rotary_base = rope_theta``.

What the translation refuses (``ConfigTranslationError`` naming the key), instead of silently
building a different model:

- ``rope_type`` other than ``'default'`` (Llama-3.1/3.2 ``'llama3'``, and ``'linear'``,
  ``'dynamic'``, ``'yarn'``, ...): ferrule's Megatron builder
  (:mod:`ferrule.megatron.gpt_builder`) applies plain RoPE from ``rotary_base`` only and its
  public API has no hook to rescale the inverse frequencies;
- ``attention_bias: true`` (HF then adds biases to q/k/v *and* o_proj; Megatron's
  ``add_bias_linear`` would also add MLP biases) and ``mlp_bias: true``;
- ``hidden_act`` other than ``silu``;
- ``partial_rotary_factor`` other than 1 (top level or in ``rope_parameters``): transformers'
  ``LlamaForCausalLM`` ignores it (``LlamaRotaryEmbedding.compute_default_rope_parameters`` builds
  frequencies over the whole ``head_dim``, transformers 5.25), while megatron's ``rotary_percent``
  would rotate only that fraction (5.1e-2 off HF's logits on the tiny model). Which of the two the
  checkpoint was trained with cannot be read from the config, so it is refused.

``pretraining_tp`` is listed as ``Harmless``: transformers >= 5 ignores it, and in older versions
it only sliced the same matmuls (numerically the same model). It stays in ``config.json``
unchanged. Any other key that the table neither translates nor lists is refused.

Module-level data only (discovery names it, so it must stay light). There is no provider
function: ``ProviderSpec(family="llama")`` takes the default build, megatron's GPT builder
driven by :data:`CONFIG_TRANSLATION`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ferrule.config_translation import (
    DECODER_ENTRIES,
    ConfigTranslation,
    ConfigTranslationError,
    Constant,
    Derived,
    Harmless,
    Require,
    head_dim_from_hf,
    head_dim_to_hf,
    rope_theta_from_hf,
    rope_theta_to_hf,
)
from ferrule.mapping import MappingTable
from ferrule.mapping.decoder import DECODER_ATTENTION, DECODER_EDGE, DECODER_IGNORES, DECODER_MLP, decoder_update_groups

__all__ = ["CONFIG_TRANSLATION", "MAPPING", "UPDATE_GROUPS", "TINY_HF_CONFIG", "llama_rope_theta_from_hf"]


# ---------------------------------------------------------------------------------------------
# HF config <-> Megatron TransformerConfig (CONFIG_TRANSLATION)
# ---------------------------------------------------------------------------------------------

def llama_rope_theta_from_hf(hf: Mapping[str, Any]) -> float:
    """RoPE base for a Llama config; refuses scaled RoPE with a Llama-specific message.

    Reads ``rope_parameters`` (transformers >= 5) or legacy ``rope_theta`` / ``rope_scaling``
    through :func:`ferrule.config_translation.rope_theta_from_hf`.

    Raises:
        ConfigTranslationError: ``rope_type`` is not ``'default'`` (e.g. Llama-3.1's
            ``'llama3'``), ``partial_rotary_factor`` is not 1 (module docstring), or the config has
            no RoPE base.
    """
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if isinstance(params, Mapping):
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type != "default":
                raise ConfigTranslationError(
                    f"llama: HF config has {key}.rope_type={rope_type!r}; ferrule-llama supports only "
                    f"unscaled RoPE ('default'). Llama-3.1/3.2 checkpoints use 'llama3' scaling "
                    f"(frequency-dependent rescaling of the inverse frequencies), which ferrule's "
                    f"Megatron builder (ferrule.megatron.gpt_builder, plain RoPE from rotary_base) "
                    f"cannot express. Use a checkpoint with default RoPE (Llama-2, Llama-3.0, SmolLM2)."
                )
    for params in (hf, hf.get("rope_parameters"), hf.get("rope_scaling")):
        factor = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
        if factor is not None and factor != 1:
            raise ConfigTranslationError(
                f"llama: HF config has partial_rotary_factor={factor!r}; transformers' LlamaForCausalLM ignores it "
                f"and rotates every channel of each head, while megatron's rotary_percent would rotate only "
                f"{factor!r} of them: the two models differ and the config does not say which one the checkpoint "
                f"was trained as. Remove the key (or set it to 1.0) if the model is an HF Llama (full rotary); a "
                f"model trained with partial rotary needs a family whose HF model applies it.")
    return rope_theta_from_hf(hf)


#: HF ``llama`` config <-> megatron (see :mod:`ferrule.config_translation`).
CONFIG_TRANSLATION = ConfigTranslation(
    name="llama",
    entries=(
        Require("model_type", ("llama",)),
        Require("hidden_act", ("silu",), reason="megatron's gated MLP is built with silu (SwiGLU)"),
        Require("attention_bias", (False,), default=False,
                reason="HF adds q/k/v and o_proj biases; megatron's add_bias_linear would also add MLP biases"),
        Require("mlp_bias", (False,), default=False, reason="MLP biases are not mapped"),
        Harmless("pretraining_tp", "transformers >= 5 ignores it; older versions only sliced the same matmuls"),
        *DECODER_ENTRIES,
        Derived("kv_channels", head_dim_from_hf, head_dim_to_hf, hf_keys=("head_dim",)),
        Constant("add_qkv_bias", False),
        Constant("qk_layernorm", False),
        Derived("rotary_base", llama_rope_theta_from_hf, rope_theta_to_hf,
                hf_keys=("rope_parameters", "rope_theta", "rope_scaling"), target="option"),
    ),
)


# ---------------------------------------------------------------------------------------------
# Parameter mapping (MAPPING) and weight-sync groups (UPDATE_GROUPS): the shared Llama-shaped
# decoder rows of ferrule.mapping.decoder, unchanged. Keys are global mcore names (``*`` = layer).
# ---------------------------------------------------------------------------------------------

#: Llama mapping table. ``linear_qkv`` interleaves per KV group ``[q.. , k, v]`` (layout in
#: :class:`ferrule.mapping.FuseQKV`); ``linear_fc1`` is ``[gate; up]``. HF Llama checkpoints
#: already store q/k in the ``rotate_half`` RoPE layout that Megatron uses, so no permutation.
MAPPING = MappingTable(family="llama", mappings=(*DECODER_EDGE, *DECODER_ATTENTION, *DECODER_MLP),
                       ignores=DECODER_IGNORES)

#: One unit per layer for attention and for the MLP; embedding, final norm and output layer
#: optional (``output_layer`` is absent when the embeddings are tied, and off the last PP stage).
UPDATE_GROUPS = decoder_update_groups()

# ---------------------------------------------------------------------------------------------
# Tiny random model for the conformance kit (ferrule.conformance.numeric): HF config keys,
# model_type included; the kit builds ``AutoConfig.for_model(**TINY_HF_CONFIG)`` with a fixed
# seed. Shaped like SmolLM2 in miniature: GQA 6 query heads over 2 KV heads, tied embeddings,
# a non-default rope_theta, and a vocabulary that Megatron pads (96 -> 128 rows).
# ---------------------------------------------------------------------------------------------

TINY_HF_CONFIG = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
