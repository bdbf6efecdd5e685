"""Declarative HF-config <-> Megatron-Core ``TransformerConfig`` translation tables.

A family declares one immutable :class:`ConfigTranslation` per variant (module-level data in
``plugins/<family>/<variant>.py``). It has four entry kinds:

- :class:`Field`: a value copied 1:1 between an HF key (with optional legacy aliases) and a
  ``TransformerConfig`` kwarg or a model option.
- :class:`Constant`: an mcore value the family always uses (no HF key), e.g.
  ``normalization='RMSNorm'``.
- :class:`Derived`: a value computed by a *named* function from the whole HF config, with a
  named inverse that returns the HF keys it owns (e.g. RoPE base from ``rope_parameters``).
- :class:`Require`: an HF key whose value must be one of a few supported values (e.g.
  ``hidden_act == 'silu'``); anything else raises :class:`ConfigTranslationError` naming the key,
  the value found and what is supported.
- :class:`Harmless`: an HF key that ferrule deliberately does not translate, with the reason it
  cannot change the model's numbers (e.g. ``use_cache``, Llama's ``pretraining_tp``).

``to_mcore(hf_config)`` reads the config *as transformers parses it*: a dict (``config.json``)
is first parsed by the model_type's ``PretrainedConfig`` class, so defaults, legacy spellings
(``rope_scaling``, top-level ``rope_theta``) and transformers' own normalisation apply exactly as
they do when HF builds the model. It then refuses every key of the config that no entry
translates and that is not :class:`Harmless` for the family (naming each key and the fix), and
returns ``(transformer_config_kwargs, model_options)``: plain Python data (no torch objects)
that :func:`ferrule.megatron.gpt_builder.build_gpt_model` turns into a ``TransformerConfig`` and
a ``GPTModel``. ``to_hf(...)`` inverts it.

Model options understood by the builder: ``vocab_size`` (unpadded HF vocab, tokens),
``max_sequence_length`` (tokens), ``share_embeddings_and_output_weights``, ``rotary_base``,
``rotary_percent`` (fraction of each head rotated, HF ``partial_rotary_factor``),
``rope_scaling`` (None, ``{"type": "linear"|"llama3", "factor": f}`` or a resolved YaRN dict),
``position_embedding_type``, ``activation`` (name, e.g. ``'silu'``), and the
:mod:`ferrule.megatron.gpt_builder` extension options (``embedding_multiplier``,
``attn_logit_softcapping``, ``final_logit_softcapping``,
``extra_norms``, ``zero_centered_norms``, and ``pre_norms``, ``qk_norm``, ``layer_rope`` of
:mod:`ferrule.megatron.layer_options`; an option the builder does not know is an error there).

Importing this module imports neither torch nor megatron (transformers is imported by
``to_mcore`` only).
"""

from __future__ import annotations

# the public names of both modules, importable from here as before the split
from .decoder import (  # noqa: F401
    COMMON_HARMLESS, DECODER_ENTRIES, MEGATRON_LLAMA3_ROPE, ROPE_SCALING_ENTRIES, SLIDING_WINDOW_ENTRIES,
    SUPPORTED_ROPE_TYPES, head_dim_from_hf, head_dim_to_hf, head_dim_to_hf_implicit, is_per_layer_type_rope,
    num_experts_from_hf, num_experts_to_hf, pre_softmax_from_norm_topk_prob, pre_softmax_to_norm_topk_prob,
    rope_scaling_from_hf, rope_theta_from_hf, rope_theta_to_hf, rotary_percent_from_hf,
    window_attn_skip_freq_from_hf, window_size_from_hf, window_size_to_hf, yarn_from_hf)
from .vocabulary import (  # noqa: F401
    ConfigTranslation, ConfigTranslationError, Constant, Derived, ENTRY_KINDS, Entry, Field, Harmless, MISSING,
    Require, SharedRowOverlapWarning, Target, describe_entry, parse_hf_config, register_shared_rows)

__all__ = [
    "DECODER_ENTRIES",
    "ConfigTranslationError",
    "SharedRowOverlapWarning",
    "describe_entry",
    "register_shared_rows",
    "Field",
    "Constant",
    "Derived",
    "Require",
    "Harmless",
    "ConfigTranslation",
    "parse_hf_config",
    "COMMON_HARMLESS",
    "ROPE_SCALING_ENTRIES",
    "SLIDING_WINDOW_ENTRIES",
    "MISSING",
    "rope_theta_from_hf",
    "rope_theta_to_hf",
    "is_per_layer_type_rope",
    "rope_scaling_from_hf",
    "yarn_from_hf",
    "rotary_percent_from_hf",
    "window_size_from_hf",
    "window_attn_skip_freq_from_hf",
    "head_dim_from_hf",
    "head_dim_to_hf",
    "num_experts_from_hf",
    "num_experts_to_hf",
    "pre_softmax_from_norm_topk_prob",
    "pre_softmax_to_norm_topk_prob",
]
