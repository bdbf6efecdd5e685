"""Inkling-2 MoE for megatron-core 0.16.1: sigmoid top-k router, soft-capped SwiGLU experts, MoE layer.

Referee: ``transformers/models/inkling2/modeling_inkling2.py`` (transformers 5.24): ``Inkling2TopKRouter``,
``Inkling2SoftcappedSwiGLU``, ``Inkling2Experts``, ``Inkling2SparseMoeBlock``. Every Inkling-2 MLP is an
MoE block (no dense or shared experts). Routed experts are megatron ``SequentialMLP`` experts
(expert-parallel over EP, tokens moved by megatron's dispatcher); the router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP

from ferrule.megatron.moe import TokenSplitMoELayer
from ferrule.megatron.routing_replay import routed_topk

__all__ = ["Inkling2Router", "Inkling2Experts", "Inkling2MoELayer", "softcapped_swiglu"]


def softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """HF ``Inkling2SoftcappedSwiGLU``: ``cap_g * tanh(g / cap_g) * sigmoid(g) * cap_u * tanh(u / cap_u)`` in fp32."""
    g, u = gate.float(), up.float()
    return (torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)).to(gate.dtype)


class Inkling2Router(MegatronModule):
    """HF ``Inkling2TopKRouter`` (fp32): ``scores = sigmoid(W x)``; experts = ``topk(scores + expert_bias, k)``;
    weights = picked scores / (their sum + 1e-20) * ``route_scale``.

    ``weight`` ``[E, hidden]`` fp32 (HF ``mlp.gate.weight``); ``expert_bias`` ``[E]`` fp32 (HF
    ``e_score_correction_bias``, frozen: ``requires_grad=False``; it only shifts the selection).
    Returns megatron's ``(probs [T, E], routing_map [T, E] bool)``. Replicated over TP and EP. Under routing
    replay (:mod:`ferrule.megatron.routing_replay`) the experts are the replayed ones and the weights the
    picked scores of those.
    """

    def __init__(self, config, pg_collection=None, *, route_scale: float):
        super().__init__(config=config)
        self.num_experts, self.topk, self.route_scale = config.num_moe_experts, config.moe_router_topk, float(route_scale)
        self.layer_number = None
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
        self.expert_bias = torch.nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states, padding_mask=None):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1]).float()
        scores = torch.sigmoid(F.linear(flat, self.weight.float()))
        top = routed_topk(self, scores + self.expert_bias.float(), self.topk)  # or the replayed experts (R3)
        weights = scores.gather(1, top)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        weights = weights.to(hidden_states.dtype)
        probs = torch.zeros(flat.shape[0], self.num_experts, dtype=weights.dtype, device=flat.device).scatter(1, top, weights)
        routing_map = torch.zeros(flat.shape[0], self.num_experts, dtype=torch.bool, device=flat.device).scatter(1, top, True)
        return probs, routing_map


class Inkling2Experts(SequentialMLP):
    """``SequentialMLP`` whose experts compute ``fc2(softcapped_swiglu(fc1(x)) * prob)`` (HF ``Inkling2Experts``).

    Expert ``e``: ``linear_fc1`` ``[2*ffn, hidden]`` = ``[gate; up]`` (per TP rank ``[gate_r; up_r]``),
    ``linear_fc2`` ``[hidden, ffn]``. HF weights after ``down_proj``; the product is linear, so equal.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, *, gate_softcap: float,
                 up_softcap: float):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self.gate_softcap, self.up_softcap = float(gate_softcap), float(up_softcap)

    def _expert(self, expert, tokens, probs):
        h, _ = expert.linear_fc1(tokens)
        gate, up = torch.chunk(h, 2, dim=-1)
        act = softcapped_swiglu(gate, up, self.gate_softcap, self.up_softcap)
        act = (act * probs.unsqueeze(-1)).to(act.dtype)
        out, _ = expert.linear_fc2(act)
        return out

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        outs = [self._expert(e, t, p) for e, t, p in zip(self.local_experts, tokens, probs)]
        return torch.cat(outs, dim=0), None


class Inkling2MoELayer(TokenSplitMoELayer):
    """HF ``Inkling2SparseMoeBlock``: router + routed experts through megatron's dispatcher.

    At TP > 1 (no sequence parallelism) the tokens are split over TP around the dispatcher
    (:class:`ferrule.megatron.moe.TokenSplitMoELayer`), so the experts see each token once and train exactly.
    """

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        probs, routing_map = self.router(hidden_states)
        return self.routed_experts(hidden_states, probs, routing_map), None
