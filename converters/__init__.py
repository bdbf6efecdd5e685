"""HF <-> Megatron torch_dist conversion (``ferrule.converters``).

Public API (imported lazily, so ``import ferrule.converters`` stays light):

- :func:`hf_to_torch_dist`, :func:`torch_dist_to_hf`: whole-checkpoint conversion
  (:mod:`ferrule.converters.checkpoint`); ``ferrule convert`` (:mod:`ferrule.converters.cli`)
  is the command-line front end.
- :func:`load_hf_into_mcore`, :func:`export_mcore_to_hf`: load HF weights into live, possibly
  sharded Megatron modules, and export them back as full HF tensors
  (:mod:`ferrule.converters.weights`; the train engine and weight sync use them).
- :class:`SafetensorsReader`, :class:`ShardedSafetensorsWriter`, :class:`CheckpointError`
  (:mod:`ferrule.converters.safetensors_io`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "hf_to_torch_dist": "ferrule.converters.checkpoint",
    "torch_dist_to_hf": "ferrule.converters.checkpoint",
    "ConversionError": "ferrule.converters.checkpoint",
    "read_checkpoint_metadata": "ferrule.converters.checkpoint",
    "load_hf_into_mcore": "ferrule.converters.weights",
    "export_mcore_to_hf": "ferrule.converters.weights",
    "global_param_names": "ferrule.converters.weights",
    "SafetensorsReader": "ferrule.converters.safetensors_io",
    "ShardedSafetensorsWriter": "ferrule.converters.safetensors_io",
    "CheckpointError": "ferrule.converters.safetensors_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ferrule.converters' has no attribute {name!r}")
