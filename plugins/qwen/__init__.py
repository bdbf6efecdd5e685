"""Qwen family plugin: Qwen2 / Qwen2.5, Qwen3 dense and Qwen3-MoE.

``plugin.py`` holds only the hook implementations; each variant module (``qwen2.py``,
``qwen3.py``, ``qwen3_moe.py``) holds that variant's config translation, provider, mapping
table and update-group table as module-level data.
"""
