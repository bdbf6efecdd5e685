"""LoRA for the Megatron train engine (``ferrule.lora``; docs/lora.md).

- :class:`LoraSettings`: rank, alpha, dropout, target modules (``"all"``), rsLoRA, init seed.
- Appliers (:mod:`ferrule.lora.appliers`): one per module kind, through the hook
  ``register_lora_appliers`` (family-specific, plugin ``"*"``, else the core's for megatron's
  column/row-parallel linears); :func:`apply_lora` attaches them and freezes the base.
- HF PEFT interop (:mod:`ferrule.lora.peft_format`): :func:`hf_adapter_state_dict`,
  :func:`peft_config`, :func:`load_hf_adapter`.

Use ``TrainEngine.from_hf(dir, lora=LoraSettings(rank=8, alpha=16))``. Importing this package
imports no torch.
"""

from __future__ import annotations

from typing import Any

from .settings import ALL_TARGETS, MAX_LORA_RANK, LoraSettings

__all__ = ["ALL_TARGETS", "MAX_LORA_RANK", "LoraSettings", "apply_lora", "adapter_entries", "hf_adapter_state_dict", "peft_config",
           "load_hf_adapter", "AdapterFormatError", "LoraTargetError", "read_peft_dir", "settings_from_peft_config",
           "checkpoint_settings"]

_LAZY = {
    "apply_lora": "ferrule.lora.model", "adapter_entries": "ferrule.lora.model",
    "hf_adapter_state_dict": "ferrule.lora.peft_format", "peft_config": "ferrule.lora.peft_format",
    "load_hf_adapter": "ferrule.lora.peft_format", "AdapterFormatError": "ferrule.lora.peft_base",
    "read_peft_dir": "ferrule.lora.peft_format", "LoraTargetError": "ferrule.lora.appliers",
    "settings_from_peft_config": "ferrule.cli.lora", "checkpoint_settings": "ferrule.lora.settings",
}


def __getattr__(name: str) -> Any:
    # lazy attributes keep `import ferrule.lora` free of torch (PEP 562), not an import-cycle workaround
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ferrule.lora' has no attribute {name!r}")
