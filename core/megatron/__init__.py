"""Megatron-Core train-engine runtime: device backend, CPU compatibility, parallel layout,
SDPA core attention, the GPT model builder, and the one module that moves live weights
(:mod:`ferrule.megatron.weights`: bind, TP/EP/PP gather, HF load and export).

Import-light: submodules are imported on demand (``ferrule.megatron.device``,
``.parallel``, ``.gpt_builder``, ``.attention``, ``.cpu_compat``). ``cpu_compat`` is only ever
imported by :func:`ferrule.megatron.device.get_backend` on a machine without CUDA.
"""

__all__ = ["device", "parallel", "gpt_builder", "attention"]
