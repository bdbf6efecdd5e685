"""Inkling-2 family plugin (Thinking Machines' Inkling-2 / Inkling-2-Loop MoE; reference:
``transformers.models.inkling2`` and ``transformers.models.inkling2_loop``, transformers 5.24).

A sibling of :mod:`ferrule.plugins.inkling` (why: docs/families/inkling2.md); where the HF operation is the
same, both use the core's module (:mod:`ferrule.megatron.shared_layers`,
:func:`ferrule.config_translation.layer_types.sliding_layers_from_hf`), and neither imports the other."""
