"""Exact decode path for models the static KV cache cannot hold: transformers' own ``DynamicCache``.

:class:`ferrule.rollout._static_cache.DecodeState` keeps keys and values only, for full and
sliding-window attention layers. Models with other per-layer state (Inkling: four ShortConv
states per layer, local/global relative-position attention, ``layer_types`` ``"hybrid"`` /
``"hybrid_sliding"``) decode instead through the model's own cache
(``DynamicCache(config=model.config)``, which holds the conv states and the sliding windows,
transformers ``cache_utils``), one token per step, with the same API as ``DecodeState``.

The engine feeds this state rows of *equal prompt length* only (it groups requests by length),
so there is no padding and every row computes exactly what a full forward over its own tokens
computes (Inkling's relative bias and log scaling use token indices, which left padding would
shift). No CUDA graphs: the cache grows each step. ``plugins/inkling/tests/test_inkling_rollout.py`` checks the
sampled tokens' logprobs against one full forward of ``InklingForCausalLM`` (fp32, <= 1e-5).
"""

from __future__ import annotations

from typing import Any

import torch
from ferrule.rollout._static_cache import cache_kwarg_name

__all__ = ["HFCacheDecodeState", "HF_CACHE_LAYER_TYPES", "uses_hf_cache"]

#: ``config.layer_types`` values whose decode through transformers' own cache is verified exact against a
#: full forward (Inkling: ``plugins/inkling/tests/test_inkling_rollout.py``). A model with any other unsupported layer
#: type is still refused by the engine (no silent fallback).
HF_CACHE_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})


def uses_hf_cache(config: Any) -> bool:
    """True if every ``layer_types`` entry of ``config`` (or its text config) is in :data:`HF_CACHE_LAYER_TYPES`."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    return bool(types) and set(types) <= HF_CACHE_LAYER_TYPES


class HFCacheDecodeState:
    """Prefill + per-token decode with transformers' ``DynamicCache`` (rows of equal length, no padding)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache_kw = cache_kwarg_name(model)
        self.cache: Any = None
        self.tokens: torch.Tensor | None = None

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prompt_mask: torch.Tensor,
                media_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the prompts ``[batch, P]`` (all real tokens); return last-position logits ``[batch, vocab]`` fp32.

        ``media_inputs``: extra keywords of the model's forward for this prefill only (e.g. Inkling's
        ``pixel_values`` / ``audio_input_ids``); decode steps see only the cache.

        Raises:
            ValueError: a row is padded (the engine must group rows by prompt length).
        """
        from transformers import DynamicCache

        p = input_ids.shape[1]
        if not bool(prompt_mask[:, :p].all()):
            raise ValueError("HFCacheDecodeState needs unpadded rows of equal prompt length; group requests by length.")
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, use_cache=True, **{self.cache_kw: self.cache}, logits_to_keep=1,
                         **(media_inputs or {}))
        return out.logits[:, -1, :].float()

    def set_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> None:
        """Stage the next tokens ``[batch]`` (``positions`` / ``slot`` are implied by the cache)."""
        self.tokens = tokens[:, None].clone()

    def step(self) -> torch.Tensor:
        """One decode step; returns logits ``[batch, vocab]`` fp32."""
        out = self.model(input_ids=self.tokens, use_cache=True, **{self.cache_kw: self.cache}, logits_to_keep=1)
        return out.logits[:, -1, :].float()
