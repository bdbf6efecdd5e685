"""Multimodal towers in the Megatron model: build, attach, run on a batch's media, scatter.

A family declares its towers with ``register_towers`` (:class:`ferrule.contract.specs.TowerSpec`). The
core owns the wiring:

1. :func:`attach_towers` (called by :func:`ferrule.megatron.provider.provider_build`'s result, so the
   train engine, the converters and the conformance kit all get them) builds each tower and
   attaches it to the first pipeline stage's ``GPTModel`` as ``towers.<name>``: a plain PyTorch
   module, **replicated on every TP rank** (no tensor parallelism inside a tower; its input and
   output are the same on every TP rank, so its gradients are too and need no TP reduction).
   A frozen tower's parameters get ``requires_grad=False``: DDP and the optimizer skip them,
   checkpoints and weight sync still carry them.
2. :func:`embed_with_media` computes the decoder input of one micro-batch: the model's own
   token embedding, then for each tower its output rows scattered (``masked_scatter``, the
   order of ``transformers``' ``InklingModel.forward``) into the placeholder positions. Only a
   frozen tower's own forward runs under ``torch.no_grad``; the scatter and everything after it
   keep the autograd graph, so the text embedding receives gradients at every non-placeholder
   position of a multimodal batch (a failure that zeroed them is known from a peer framework).

Media format (``Datum.media``, checked by :func:`ferrule.media.check_media`): ``{modality:
[item, ...]}`` in order of appearance; an item is a tensor whose dim 0 counts the placeholder
tokens it fills (vision ``[n_patches, ...]``, audio ``[n_frames, ...]``), or its first
``TowerSpec.item_token_dims`` dims (Inkling-2 images ``[rows, cols, ...]``: the tower then gets the
list of items, not their concatenation). Sequence parallelism is refused with towers (the scatter needs the whole
sequence on every rank).
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, Sequence

import torch

from ferrule.compat import renamed_name
from ferrule.contract.specs import resolve_ref

__all__ = ["attach_towers", "embed_with_media", "towers_of"]


def __getattr__(name: str):
    # MediaError / check_media are ferrule.media's (re-exported here before); ferrule.compat lists the old names
    return renamed_name(__name__, name)


#: attribute of the first-stage ``GPTModel`` holding the ``ModuleDict`` of towers
TOWERS_ATTR = "towers"


def towers_of(gpt: Any) -> dict[str, tuple[Any, torch.nn.Module, int]]:
    """``{modality: (TowerSpec, module, placeholder id)}`` attached to an unwrapped ``GPTModel`` (empty if none)."""
    return getattr(gpt, "_ferrule_towers", {})


def attach_towers(chunks: Sequence[Any], specs: Sequence[Any], hf_config: Mapping[str, Any],
                  params_dtype: torch.dtype = torch.float32) -> list:
    """Build the towers of ``specs`` and attach them to the pre-process chunk(s) of ``chunks``.

    Args:
        chunks: this rank's ``GPTModel`` chunks (unwrapped), as the provider returned them.
        specs: the family's :class:`~ferrule.contract.specs.TowerSpec` list (``ferrule.contract.registry.get_towers``).
        hf_config: the HF config dict (passed to each ``build``; placeholder ids are read from it).
        params_dtype: dtype of the tower parameters.

    Returns:
        ``chunks`` (the same objects).

    Raises:
        ValueError: sequence parallelism is on (towers need the whole sequence per rank), or a
            build returned something that is not a ``torch.nn.Module``.
    """
    if not specs:
        return list(chunks)
    for gpt in chunks:
        if not getattr(gpt, "pre_process", False):
            continue
        if getattr(gpt.config, "sequence_parallel", False):
            raise ValueError("multimodal towers: sequence_parallel is not supported (the media scatter needs the "
                             "whole sequence on every TP rank); turn sequence parallelism off.")
        device = next(gpt.parameters()).device
        modules, table = torch.nn.ModuleDict(), {}
        for spec in specs:
            module = resolve_ref(spec.build)(dict(hf_config))
            if not isinstance(module, torch.nn.Module):
                raise ValueError(f"tower {spec.family}/{spec.name}: build {spec.build!r} returned "
                                 f"{type(module).__name__}, expected a torch.nn.Module.")
            module = module.to(device=device, dtype=params_dtype)
            module.requires_grad_(not spec.frozen)
            modules[spec.name] = module
            table[spec.modality] = (spec, module, spec.placeholder_id(hf_config))
        gpt.add_module(TOWERS_ATTR, modules)
        gpt._ferrule_towers = table
    return list(chunks)


def embed_with_media(gpt: Any, tokens: torch.Tensor, position_ids: torch.Tensor,
                     media_rows: Sequence[Mapping[str, Sequence[torch.Tensor]] | None]) -> torch.Tensor:
    """Decoder input ``[s, b, hidden]`` of a micro-batch: token embeddings with tower outputs scattered in.

    Args:
        gpt: the unwrapped first-stage ``GPTModel`` (with towers attached).
        tokens: ``[b, s]`` int64 (padded rows, or one packed row).
        position_ids: ``[b, s]``.
        media_rows: the micro-batch's data's media in the order their tokens appear in
            ``tokens`` (row-major), already checked by :func:`check_media`.

    Returns:
        ``[s, b, hidden]`` in the embedding's dtype; differentiable w.r.t. the word embeddings and
        every non-frozen tower.
    """
    emb = gpt.embedding(input_ids=tokens, position_ids=position_ids)  # [s, b, h]
    out = emb.transpose(0, 1)  # [b, s, h] view: masked_scatter walks it row-major like HF
    for modality, (spec, tower, pid) in towers_of(gpt).items():
        items = [t for m in media_rows if m for t in m.get(modality, ())]
        if not items:
            continue
        if spec.item_token_dims > 1:  # items of different grids: the tower takes the list
            x = [t.to(out.device) for t in items]
        else:
            x = torch.cat([t.to(out.device) for t in items], 0)
        with torch.no_grad() if spec.frozen else contextlib.nullcontext():
            feats = tower(x)
        mask = (tokens == pid).unsqueeze(-1)
        out = out.masked_scatter(mask, feats.to(out.dtype))
    return out.transpose(0, 1).contiguous()
