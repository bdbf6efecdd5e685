"""Inkling-2 family plugin (reference: ``transformers.models.inkling2`` / ``inkling2_loop``)."""
