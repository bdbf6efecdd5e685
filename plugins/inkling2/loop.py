"""Inkling-2-Loop pieces (HF ``transformers/models/inkling2_loop/modeling_inkling2_loop.py``, transformers 5.24).

A range of decoder layers ``[loop_layer_index_start, loop_layer_index_end)`` runs ``loop_num_passes``
times. Every pass after the first restarts from the pre-loop hidden and block states and feeds each
loop layer four messages (query, key, value, MLP) that learned queries read from the previous pass's
blocks (``Inkling2LoopMessageAttentionResidual``); low-rank message gates mix them in
(:class:`Inkling2LoopMessageGate`). Parameters are replicated over TP (they act on full hidden states).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from ferrule.plugins.inkling2.layers import Inkling2LoopMessageGate, attend_blocks
from ferrule.plugins.inkling2.model import Inkling2Block

__all__ = ["Inkling2LoopMessageQueries", "Inkling2LoopBlock"]


class Inkling2LoopMessageQueries(MegatronModule):
    """The message queries (a submodule, so the block's sharded state dict holds them), replicated."""

    def __init__(self, config, num_loop_layers: int):
        super().__init__(config=config)
        shape = (2 * num_loop_layers, config.hidden_size)
        self.queries = torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float32))
        self.kv_queries = torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


class Inkling2LoopBlock(Inkling2Block):
    """:class:`Inkling2Block` with the loop (HF ``Inkling2LoopTextModel.forward``).

    ``message_input.queries`` / ``message_input.kv_queries`` ``[2 * n_loop, H]`` fp32 are the released tensors
    (``middle_cycle_cross_pass_queries``: query and MLP query of each loop layer;
    ``middle_cycle_cross_pass_kv_queries``: key and value queries); loop layer ``i`` reads its messages
    with ``[q_2i, kv_2i, kv_2i+1, q_2i+1]`` (HF ``Inkling2LoopMergeMessageQueries``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layer = self.layers[0]
        self.start, self.end, self.passes = layer.loop_range
        n = self.end - self.start
        self.message_input = Inkling2LoopMessageQueries(self.config, n)

    def _run(self, layers, h, bs, attention_mask, messages_from=None):
        for i, layer in enumerate(layers):
            messages = None
            if messages_from is not None:
                q, kv = self.message_input.queries, self.message_input.kv_queries
                query = torch.stack([q[2 * i], kv[2 * i], kv[2 * i + 1], q[2 * i + 1]])
                messages = attend_blocks(*messages_from, query)
            new = layer(h, bs, attention_mask=attention_mask, messages=messages)
            if layer.is_block_boundary:
                bs = torch.cat([bs, h.unsqueeze(-2)], dim=-2)
            h = new
        return h, bs

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, inference_context=None, **_unused):
        if packed_seq_params is not None or inference_context is not None:
            raise NotImplementedError("Inkling-2-Loop: packed (THD) sequences and megatron inference contexts are not "
                                      "supported; pass [b, s] batches.")
        layers = list(self.layers)
        h = hidden_states
        bs = h.new_zeros(*h.shape[:-1], 0, h.shape[-1])
        h, bs = self._run(layers[:self.start], h, bs, attention_mask)
        pre_h, pre_bs = h, bs
        h, bs = self._run(layers[self.start:self.end], h, bs, attention_mask)
        for _ in range(1, self.passes):
            previous = (bs[..., pre_bs.shape[-2] + 1:, :], h)
            h, bs = self._run(layers[self.start:self.end], pre_h, pre_bs, attention_mask, messages_from=previous)
        h, bs = self._run(layers[self.end:], h, bs, attention_mask)
        out = self.final_input(bs, h)[0]
        return self.final_layernorm(out).to(h.dtype)
