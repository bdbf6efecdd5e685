"""megatron-core modules and tensor-parallel helpers that more than one family's model uses (local spec, no
TransformerEngine): Inkling's and Inkling-2's shared operations live here, so neither family imports the other.

Each module matches one function of its numerical referee, the HF class it is named after
(``transformers/models/inkling/modeling_inkling.py``, transformers 5.24; Inkling-2's
``modeling_inkling2.py`` computes the same: docs/families/inkling2.md lists which of its classes map here).
Megatron activations are ``[seq, batch, hidden]`` (``s, b, h``); HF's are ``[batch, seq, hidden]``.

- :func:`mark_tp_sharded`, :func:`tp_sharded_state_dict`: a custom module's parameter split over tensor
  parallelism (TP): megatron's grad-norm / checkpoint attributes and its torch_dist shards.
- :class:`InklingRMSNorm`: RMSNorm as HF computes it (fp32 normalisation, weight times the cast result).
- :class:`InklingNormedEmbedding`: vocab-parallel token embedding followed by that norm.
- :class:`InklingRelativeLogits`: the query-content-dependent relative position bias (a bank of
  bias-vs-distance profiles), replicated over TP.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

__all__ = ["mark_tp_sharded", "tp_sharded_state_dict", "InklingRMSNorm", "InklingNormedEmbedding",
           "InklingRelativeLogits"]


def mark_tp_sharded(param: torch.nn.Parameter, dim: int) -> None:
    """Mark ``param`` as split over TP on ``dim`` (megatron's grad-norm / checkpoint attributes)."""
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            delattr(param, attr)
    set_tensor_model_parallel_attributes(param, True, dim, 1)


def tp_sharded_state_dict(module: torch.nn.Module, prefix: str, axis_map: dict, sharded_offsets=()) -> dict:
    """``sharded_state_dict`` of a module whose own tensors are TP-split on ``axis_map[name]`` (others replicated)."""
    state = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)


class InklingRMSNorm(torch.nn.Module):
    """RMSNorm exactly as HF ``InklingRMSNorm.forward``: ``w * (x_fp32 * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    Used for ``input_layernorm``, ``pre_mlp_layernorm``, q/k norms (per head, ``[head_dim]``),
    the embedding norm and the final norm. Weight ``[hidden]``, initialised to ones; replicated
    over TP. Accepts megatron's ``build_module`` keywords (``config``, ``hidden_size``, ``eps``).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class InklingRelativeLogits(MegatronModule):
    """Query-content-dependent relative position bias, HF ``InklingRelativeLogits.forward``.

    ``weight`` ``[d_rel, rel_extent]`` (HF ``rel_logits_proj.proj``) is a bank of bias-vs-distance
    profiles; each query token's relative state ``r`` ``[b, s, heads, d_rel]`` mixes them:
    ``bias[b, h, q, k] = (r[b, q, h] @ weight)[q - k]`` for ``0 <= q - k < rel_extent``, else 0.
    Returns ``[b, heads, s_q, s_k]`` (fp32 when inputs are). Replicated over TP: every rank
    uses it for its own heads, so its gradient is summed over the TP group
    (``copy_to_tensor_model_parallel_region`` on the weight: identity forward, all-reduce backward).
    """

    def __init__(self, config, d_rel: int, rel_extent: int):
        super().__init__(config=config)
        self.rel_extent = int(rel_extent)
        self.weight = torch.nn.Parameter(torch.empty(d_rel, rel_extent, dtype=config.params_dtype))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)

    def forward(self, rel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        logits = (rel @ weight).transpose(1, 2)  # [b, heads, s_q, extent]
        distance = (q_pos[:, None] - k_pos[None, :])[None, None]
        index = distance.clamp(0, self.rel_extent - 1).expand(*logits.shape[:2], -1, -1)
        bias = logits.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= self.rel_extent), 0.0)


class InklingNormedEmbedding(LanguageModelEmbedding):
    """Token embedding followed by RMSNorm, HF ``InklingNormedEmbedding.forward``.

    megatron's ``LanguageModelEmbedding`` (``word_embeddings``: vocab-parallel
    ``[padded_vocab, hidden]``, no position embedding; output ``[s, b, hidden]``) plus
    ``embed_norm`` (replicated). With ``padding_idx`` (HF ``pad_token_id``) the padding row gets a
    zero gradient, as ``nn.Embedding(padding_idx=...)`` gives it.
    """

    def __init__(self, config, vocab_size: int, max_sequence_length: int, padding_idx: int | None = None):
        super().__init__(config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                         position_embedding_type="none")
        self.embed_norm = InklingRMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        self.padding_idx = padding_idx
        emb = self.word_embeddings
        if padding_idx is not None and emb.vocab_start_index <= padding_idx < emb.vocab_end_index:
            local = padding_idx - emb.vocab_start_index

            def _zero_padding_row(grad):
                grad = grad.clone()
                grad[local] = 0
                return grad

            emb.weight.register_hook(_zero_padding_row)

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        return self.embed_norm(super().forward(input_ids=input_ids, position_ids=position_ids))
