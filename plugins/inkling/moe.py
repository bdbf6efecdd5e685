"""Inkling MLPs for megatron-core 0.16.1: dense MLP, shared-expert-sink router, shared experts, MoE layer.

Referee: ``transformers/models/inkling/modeling_inkling.py`` (transformers 5.24): ``InklingMLP``,
``InklingTopkRouter``, ``InklingSharedExperts``, ``InklingExperts``, ``InklingMoE`` and the
``mlp_sconv`` of ``InklingDecoderLayer``. Activations are megatron's ``[s, b, hidden]``.

Parallelism: routed experts are megatron ``SequentialMLP`` experts (expert-parallel over EP,
tokens moved by megatron's token dispatcher). The router and the shared experts are *dense*
parameters: the router is replicated, the shared experts are split over TP like a dense MLP and
replicated over EP. Their parameter names (``mlp.router.*``, ``mlp.shared_experts.*``) contain no
``experts`` component outside ``shared_experts``, and :func:`ferrule.sync.groups.is_routed_expert_param`
never classifies a ``shared_experts`` parameter as routed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from ferrule.megatron.moe import TokenSplitMoELayer
from ferrule.megatron.routing_replay import routed_topk
from ferrule.plugins.inkling.layers import InklingShortConv

__all__ = ["InklingDenseMLP", "InklingRouter", "InklingSharedExperts", "InklingMoELayer"]


class InklingDenseMLP(MLP):
    """Dense SwiGLU MLP with a learned output scale and the MLP-output ShortConv.

    HF ``InklingMLP.forward``: ``down(silu(gate(x)) * up(x)) * global_scale``, then
    ``InklingDecoderLayer.mlp_sconv``. Megatron ``MLP`` parameters: ``linear_fc1`` ``[2*ffn, hidden]``
    = ``[gate; up]`` (column-parallel, stride 2), ``linear_fc2`` ``[hidden, ffn]`` (row-parallel);
    plus ``global_scale`` ``[1]`` and ``mlp_sconv.weight`` ``[hidden, 1, W]`` (replicated).
    """

    def __init__(self, config, submodules, conv_kernel_size: int = 4, **kwargs):
        kwargs.setdefault("ffn_hidden_size", config.ffn_hidden_size)
        super().__init__(config, submodules, **kwargs)
        self.global_scale = torch.nn.Parameter(torch.ones(1, dtype=config.params_dtype))
        self.mlp_sconv = InklingShortConv(config, config.hidden_size, conv_kernel_size)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # MLP's: its submodules only
        state.update(make_sharded_tensors_for_checkpoint({"global_scale": self.global_scale}, prefix, {},
                                                         sharded_offsets))
        return state

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        out, bias = super().forward(hidden_states)
        assert bias is None, "Inkling MLPs have no bias"
        return self.mlp_sconv(out * self.global_scale), None


class InklingRouter(MegatronModule):
    """Shared-expert-sink router, HF ``InklingTopkRouter.forward`` (all in fp32).

    ``weight`` ``[E + S, hidden]`` scores ``E`` routed then ``S`` shared experts (HF
    ``mlp.gate.weight``); ``expert_bias`` ``[E]`` (HF ``e_score_correction_bias``, frozen:
    ``requires_grad=False``) only shifts the *selection*; ``global_scale`` ``[1]`` fp32. Per token::

        l = weight @ x                            [E + S]
        top = topk(sigmoid(l[:E]) + expert_bias, k)
        a = concat(l[:E][top], l[E:])             k routed + S shared logits
        w = softmax(logsigmoid(a)) * route_scale * global_scale   (= sigmoid(a) / sum sigmoid(a) * ...)

    :meth:`route` returns megatron's ``(probs [T, E], routing_map [T, E] bool)`` for the
    routed part and the shared experts' weights ``gammas [T, S]``. Replicated over TP and EP.

    Under routing replay (:mod:`ferrule.megatron.routing_replay`) ``top`` is the rollout's experts and
    everything after it (the sink softmax over the ``k`` picked routed logits and the ``S`` shared
    logits) is computed from this router's logits, as R3 prescribes.
    """

    def __init__(self, config, pg_collection=None, *, n_shared_experts: int, route_scale: float):
        super().__init__(config=config)
        self.num_experts = config.num_moe_experts
        self.n_shared = int(n_shared_experts)
        self.topk = config.moe_router_topk
        self.route_scale = float(route_scale)
        self.layer_number = None
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts + self.n_shared, config.hidden_size,
                                                     dtype=torch.float32))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
        self.global_scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.expert_bias = torch.nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def route(self, hidden_states: torch.Tensor):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(flat.float(), self.weight.float())
        E = self.num_experts
        choice = logits[:, :E].sigmoid() + self.expert_bias.float()
        top = routed_topk(self, choice, self.topk)  # or the replayed experts (R3)
        picked = torch.cat([logits[:, :E].gather(-1, top), logits[:, E:]], dim=-1)
        log_probs = F.logsigmoid(picked)
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(hidden_states.dtype)
        probs = torch.zeros(flat.shape[0], E, dtype=weights.dtype, device=flat.device).scatter(1, top, weights[:, :self.topk])
        routing_map = torch.zeros(flat.shape[0], E, dtype=torch.bool, device=flat.device).scatter(1, top, True)
        return probs, routing_map, weights[:, self.topk:]

    def forward(self, hidden_states, padding_mask=None):
        probs, routing_map, _ = self.route(hidden_states)
        return probs, routing_map


class InklingSharedExperts(MegatronModule):
    """``S`` shared SwiGLU experts weighted per token by the router, HF ``InklingSharedExperts.forward``.

    ``out = sum_j gammas[:, j] * down_j(silu(gate_j x) * up_j x)``, the sum over experts in fp32.
    Parameters, stacked over experts: ``linear_fc1.weight`` ``[S, 2*ffn, hidden]`` (per expert
    ``[gate; up]``) and ``linear_fc2.weight`` ``[S, hidden, ffn]``. Replicated over TP (every rank
    computes the full shared output from the full input, so gradients agree without a reduction)
    and over EP: these are never expert-parallel parameters.

    LoRA: a ``lora`` adapter on ``linear_fc1`` / ``linear_fc2``
    (:class:`ferrule.plugins.inkling.lora.StackedLoraAdapter`, attached by the ``shared_experts``
    applier) adds its per-expert low-rank term to that ``bmm`` (``[gate; up]`` halves for fc1).
    """

    def __init__(self, config, n_shared_experts: int, ffn_hidden_size: int):
        super().__init__(config=config)
        self.n, self.ffn = int(n_shared_experts), int(ffn_hidden_size)
        H = config.hidden_size
        self.linear_fc1 = _Holder(torch.empty(self.n, 2 * self.ffn, H, dtype=config.params_dtype))
        self.linear_fc2 = _Holder(torch.empty(self.n, H, self.ffn, dtype=config.params_dtype))
        if config.perform_initialization:
            torch.nn.init.normal_(self.linear_fc1.weight, std=config.init_method_std)
            torch.nn.init.normal_(self.linear_fc2.weight, std=config.init_method_std)

    def forward(self, hidden_states: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        shape, dtype = hidden_states.shape, hidden_states.dtype
        x = hidden_states.reshape(1, -1, shape[-1]).expand(self.n, -1, -1)  # [S, T, H]
        w1 = self.linear_fc1.weight
        gate = torch.bmm(x, w1[:, : self.ffn].transpose(1, 2))
        up = torch.bmm(x, w1[:, self.ffn:].transpose(1, 2))
        lora1, lora2 = getattr(self.linear_fc1, "lora", None), getattr(self.linear_fc2, "lora", None)
        if lora1 is not None:
            delta = lora1(x)  # [S, T, 2*ffn]
            gate, up = gate + delta[..., : self.ffn], up + delta[..., self.ffn:]
        act = F.silu(gate) * up * gammas.reshape(-1, self.n, 1).transpose(0, 1)
        down = torch.bmm(act, self.linear_fc2.weight.transpose(1, 2))  # [S, T, H]
        if lora2 is not None:
            down = down + lora2(act)
        return down.float().sum(dim=0).to(dtype).view(shape)


class _Holder(MegatronModule):
    """Holds one replicated ``weight`` (so parameter names read ``linear_fc1.weight``).

    A LoRA adapter attached as ``lora`` stays out of the base model's (sharded) state dict: the
    adapter is saved per rank by :mod:`ferrule.lora.checkpoint`.
    """

    def __init__(self, tensor: torch.Tensor):
        super().__init__(config=None)
        self.weight = torch.nn.Parameter(tensor)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for key in [k for k in state if k.startswith(prefix + "lora.")]:
            del state[key]
        return state


class InklingMoELayer(TokenSplitMoELayer):
    """Routed + shared experts + MLP-output ShortConv, HF ``InklingMoE.forward`` then ``mlp_sconv``.

    ``out = mlp_sconv(routed(x) + shared_experts(x, gammas))`` where the router
    (:class:`InklingRouter`) gives the routed probabilities and the shared weights from one
    normalisation. Routed experts go through megatron's dispatcher (``alltoall`` / ``allgather``)
    and ``SequentialMLP`` (``mlp.experts.local_experts.E.linear_fc1/fc2``; ``fc1`` = ``[gate; up]``;
    the router weight scales the SwiGLU output before ``fc2``, which is linear, so equal to HF's
    scaling after ``down``).

    At TP > 1 (no sequence parallelism) the routed tokens are split over TP around the dispatcher
    (:class:`ferrule.megatron.moe.TokenSplitMoELayer`); the router, the shared experts and the
    ShortConv run on the full replicated sequence.
    """

    def __init__(self, config, submodules, layer_number=None, pg_collection=None, *, n_shared_experts: int,
                 conv_kernel_size: int):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.shared_experts = InklingSharedExperts(config, n_shared_experts, config.moe_ffn_hidden_size)
        self.mlp_sconv = InklingShortConv(config, config.hidden_size, conv_kernel_size)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        probs, routing_map, gammas = self.router.route(hidden_states)
        out = self.routed_experts(hidden_states, probs, routing_map)
        out = out + self.shared_experts(hidden_states, gammas)
        return self.mlp_sconv(out), None
