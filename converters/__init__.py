"""HF <-> Megatron torch_dist conversion (``ferrule.converters``).

Public API (imported lazily, so ``import ferrule.converters`` stays light):

- :func:`hf_to_torch_dist`, :func:`torch_dist_to_hf`: whole-checkpoint conversion
  (:mod:`ferrule.converters.checkpoint`).
- the commands that drive them, mounted by ``ferrule.cli`` by ``"module:attr"`` name (the core imports
  nothing of the converters): ``ferrule convert`` and ``ferrule check``
  (:mod:`ferrule.converters.commands`), ``ferrule export`` (:mod:`ferrule.converters.export`).
- re-exported from the core (the converters import downward only):
  :func:`load_hf_into_mcore`, :func:`export_mcore_to_hf`, :func:`global_param_names`
  (:mod:`ferrule.megatron.weights`, shared with the train engine and weight sync) and
  :class:`SafetensorsReader`, :class:`ShardedSafetensorsWriter`, :class:`CheckpointError`
  (:mod:`ferrule.formats.safetensors_io`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "hf_to_torch_dist": "ferrule.converters.checkpoint",
    "torch_dist_to_hf": "ferrule.converters.checkpoint",
    "ConversionError": "ferrule.converters.checkpoint",
    "read_checkpoint_metadata": "ferrule.converters.checkpoint",
    "load_hf_into_mcore": "ferrule.megatron.weights",
    "export_mcore_to_hf": "ferrule.megatron.weights",
    "global_param_names": "ferrule.megatron.weights",
    "SafetensorsReader": "ferrule.formats.safetensors_io",
    "ShardedSafetensorsWriter": "ferrule.formats.safetensors_io",
    "CheckpointError": "ferrule.formats.safetensors_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ferrule.converters' has no attribute {name!r}")
