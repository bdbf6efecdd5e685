"""The model-option names :func:`ferrule.megatron.gpt_builder.build_from_hf_config` knows, import-free.

A family's config translation produces model options (``target="option"`` rows); the default build passes
:data:`MODEL_OPTION_KEYS` to ``build_gpt_model``, reads :data:`BUILDER_READ_OPTIONS` itself, migrates
:data:`DEPRECATED_OPTION_NAMES` (with a ``FutureWarning``) and refuses any other name. Kept apart from the
builder (which imports torch) so that ``ferrule plugins`` can run each family's cheap build check without
importing torch or megatron.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MODEL_OPTION_KEYS", "BUILDER_READ_OPTIONS", "DEPRECATED_OPTION_NAMES", "unknown_model_options"]

#: Model options passed on to :func:`ferrule.megatron.gpt_builder.build_gpt_model`.
MODEL_OPTION_KEYS = (
    "vocab_size", "max_sequence_length", "share_embeddings_and_output_weights", "rotary_base",
    "position_embedding_type", "rotary_percent", "rope_scaling", "layer_spec", "embedding_multiplier",
    "attn_logit_softcapping", "final_logit_softcapping", "extra_norms", "zero_centered_norms",
    "pre_norms", "qk_norm", "layer_rope",
)
#: Model options :func:`~ferrule.megatron.gpt_builder.build_from_hf_config` reads itself: ``activation``, and
#: ``core_attention`` (the default when the caller passes none).
BUILDER_READ_OPTIONS = ("activation", "core_attention")
#: Options of earlier releases that still build, migrated with a ``FutureWarning``: old name -> replacement
#: (the migration itself: ``ferrule.megatron.gpt_builder.DEPRECATED_MODEL_OPTIONS``).
DEPRECATED_OPTION_NAMES = {
    "local_rotary_base": "the layer_rope option (ferrule.config_translation.layer_types.LAYER_TYPE_ROPE_ENTRIES in the "
                         "translation, instead of a local_rotary_base row)",
}


def unknown_model_options(names: Iterable[str]) -> list[str]:
    """The names the default build neither passes on, reads, nor migrates (sorted)."""
    known = set(MODEL_OPTION_KEYS) | set(BUILDER_READ_OPTIONS) | set(DEPRECATED_OPTION_NAMES)
    return sorted(set(names) - known)
