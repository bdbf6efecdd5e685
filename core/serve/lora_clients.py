"""Tinker ``lora_config`` -> ferrule LoRA settings, and the engines of ``ferrule serve``'s training clients.

:func:`lora_settings` maps Tinker's switches onto module names; :func:`build_engine` builds a client's
:class:`~ferrule.megatron.engine.TrainEngine` from the served base. Where the family's LoRA appliers refuse
the output layer (Inkling-2: its unembedding is padded past ``unpadded_vocab_size`` and the adapter export
does not cut ``lora_B`` to HF's ``lm_head`` rows, ``ferrule.plugins.inkling2.lora.apply_lm_head``),
``train_unembed`` is not applied: the tinker SDK sends ``train_unembed=True`` unless told otherwise, so a
refusal would fail every default client of that base (as with tied embeddings, where it is ignored too).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping
from .media_chunks import attention_leaves
from ferrule.lora import LoraSettings

__all__ = ["TINKER_LORA_ALPHA", "lora_settings", "build_engine"]

#: LoRA alpha of Tinker training clients (Tinker's lora_config has no alpha; the tinker-cookbook's
#: ``hyperparam_utils`` assumes ``lora_alpha=32`` when it scales learning rates for LoRA)
TINKER_LORA_ALPHA = 32.0
_OUTPUT_LAYER = re.compile(r"output.layer|lm_head")


def lora_settings(hf_config: Mapping[str, Any], lora_config: Mapping[str, Any] | None) -> Any:
    """Tinker ``lora_config`` -> :class:`ferrule.lora.LoraSettings` (None: full-parameter training).

    ``rank`` -> ``rank``; ``alpha`` = :data:`TINKER_LORA_ALPHA`; ``seed`` -> ``init_seed``;
    ``train_attn`` -> the family's attention linears (:func:`~ferrule.serve.media_chunks.attention_leaves`:
    ``linear_qkv``/``linear_proj`` for most; Inkling-2 ``linear_q/k/v/r/gate/sink/proj``), ``train_mlp`` ->
    ``linear_fc1``/``linear_fc2`` (dense MLPs and routed experts alike), ``train_unembed`` -> ``output_layer``
    (not with tied embeddings: the sampler gets merged weights, and a merged lm_head delta would also change
    the tied input embeddings; dropped by :func:`build_engine` where the family refuses it).

    Raises:
        ValueError: no module to train, or a bad rank.
    """
    if not lora_config:
        return None

    targets = []
    if lora_config.get("train_attn", True):
        targets += attention_leaves(hf_config)
    if lora_config.get("train_mlp", True):
        targets += ["linear_fc1", "linear_fc2"]
    if lora_config.get("train_unembed", True) and not hf_config.get("tie_word_embeddings", False):
        targets.append("output_layer")
    if not targets:
        raise ValueError("lora_config trains nothing (train_attn, train_mlp and train_unembed all false).")
    return LoraSettings(rank=int(lora_config["rank"]), alpha=TINKER_LORA_ALPHA, target_modules=tuple(targets),
                        init_seed=int(lora_config.get("seed") or 0))


def _without_output_layer(lora: Any) -> Any:
    return dataclasses.replace(lora, target_modules=tuple(t for t in lora.target_modules if t != "output_layer"))


def build_engine(backend: Any, lora: Any = None) -> Any:
    """A fresh :class:`~ferrule.megatron.engine.TrainEngine` of ``backend``'s base (``from_hf`` or
    ``from_torch_dist``, its ``optimizer``), with ``lora``'s adapters (None: full-parameter).

    When the family's appliers refuse ``output_layer`` (a :class:`~ferrule.lora.LoraTargetError` naming the
    output layer / lm_head), the engine is built without it and the refusal is kept in
    ``backend.unembed_refused``; later clients of that base leave it out up front (only the first builds twice).

    Raises:
        ferrule.lora.LoraTargetError: any other refused target.
    """
    from ferrule.lora import LoraTargetError
    from ferrule.megatron.engine import TrainEngine

    def build(settings):
        if backend.kind == "hf":
            return TrainEngine.from_hf(backend.base_dir, optimizer=backend.optimizer, lora=settings,
                                       settings=backend.engine_settings.get("train_engine"))
        return TrainEngine.from_torch_dist(backend.base_dir, optimizer=backend.optimizer, load_optimizer=False,
                                           lora=settings, settings=backend.engine_settings.get("train_engine"))

    unembed = lora is not None and "output_layer" in (lora.target_modules or ())
    if unembed and backend.unembed_refused is not None:
        return build(_without_output_layer(lora))
    try:
        return build(lora)
    except LoraTargetError as exc:
        if not unembed or not _OUTPUT_LAYER.search(str(exc)):
            raise
        backend.unembed_refused = str(exc)
        return build(_without_output_layer(lora))
