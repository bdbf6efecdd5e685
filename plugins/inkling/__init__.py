"""Inkling family plugin (Thinking Machines' multimodal MoE; reference:
``transformers.models.inkling``, chat format TMLv0 from ``tml-renderers``)."""
