"""MoE layers that train at tensor parallelism > 1 without sequence parallelism (every MoE family).

ferrule builds megatron with ``sequence_parallel=False`` (the local spec's torch norms cannot do
SP), so every TP rank holds the *same* full sequence. megatron-core 0.16's token dispatchers
(``MoEAlltoAllTokenDispatcher``: all-to-all over EP, then all-gather over the expert-TP group;
``MoEAllGatherTokenDispatcher``: all-gather over the TP x EP group) assume each TP rank holds its
own slice of the tokens, as under SP. Fed replicated tokens they count every token ``tp`` times in
the routed experts (measured: expert gradients exactly 2x at TP=2), which is why megatron's
``MoELayer.forward`` refuses training at TP > 1 without SP.

:class:`TokenSplitMoELayer` gives the dispatcher exactly what it sees under SP, inside the MoE layer
only (Inkling's short convolutions mix tokens along the sequence, so the rest of the model stays
replicated):

- the router runs on the full replicated sequence (its weight gradient is then the full gradient on
  every TP rank, as megatron's finalize_model_grads expects of a parameter it does not all-reduce
  over TP when ``sequence_parallel`` is False); megatron ``TopKRouter``\\ s get their aux-loss /
  z-loss reduction groups narrowed from ``tp_cp`` to ``cp`` (and ``tp_dp_cp`` to ``dp_cp``), since
  the tokens they see are no longer split over TP: token counts, ``total_num_tokens`` and the z-loss
  coefficient then equal TP=1's;
- the flat tokens ``[T, hidden]`` and the router's ``probs [T, E]`` are padded to a multiple of
  the split group's size (pad rows: zero vectors, zero probs, no expert in ``routing_map``, so no
  dispatcher moves or counts them) and split over that group (:func:`token_split_group`: the TP group,
  or at ``ep == 1`` the expert-TP group) with ``scatter_to_sequence_parallel_region``
  (forward: own slice; backward: all-gather, so the router and the residual stream get the full
  gradient on every rank); ``routing_map`` is sliced the same way (no gradient);
- preprocess / dispatch / experts / combine / postprocess run unchanged on the slice;
- the output is gathered with ``gather_from_sequence_parallel_region(...,
  tensor_parallel_output_grad=False)`` (forward: all-gather; backward: own slice of the
  replicated gradient), the pad rows dropped.

Expert gradients then come out as under SP: with ``etp == tp`` every expert-TP shard sees each
token once (the dispatcher's all-gather over the expert-TP group); with ``ep > 1`` and ``etp < tp``
each rank's experts see its slice and megatron DDP sums them over the expert-data-parallel group
(which holds the other TP ranks); with ``ep == 1`` and ``etp < tp`` (megatron DDP reduces the experts
over the dense DP group only) the split is over the expert-TP group, so nothing needs summing over TP.
Dense parameters (router, shared experts computed on the full sequence) are replicated over TP with
full gradients, as before. On CPU, megatron's alltoall dispatcher gathers uneven token counts over
the expert-TP group, which gloo cannot (:func:`ferrule.megatron.cpu_compat.patch_gloo_uneven_all_gather`).

Used by the local spec's MoE layer (``ferrule.megatron.gpt_builder._layer_spec`` swaps (:func:`with_token_split`)
megatron's ``MoELayer`` for :class:`TokenSplitMoELayer`) and by the plugin MoE layers (Inkling,
Inkling-2), which call :meth:`TokenSplitMoELayer.routed_experts` with their own router's output.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

__all__ = ["TokenSplitMoELayer", "replicated_over_tp", "token_split_group", "with_token_split",
           "guard_expert_bias_add", "release_dispatcher_graph"]


class _DefaultGroupsMLPFilter(logging.Filter):
    """Drops megatron-core 0.16's ``Unknown MLP type: <class '...ModuleSpec'>. Using default kwargs.`` for the
    layers where it is benign; every other record passes.

    ``TransformerLayer.__init__`` passes its process groups to the MLP only when the MLP class *is* one of
    ``MoELayer`` / ``GroupedMLP`` / ``SequentialMLP`` / ``MLP`` / ``TEFusedMLP`` (``in`` a tuple: identity),
    and logs that line for any other class, once per layer: for every :class:`TokenSplitMoELayer` (each MoE
    layer of Qwen3-MoE and Inkling) and plugin ``MLP`` subclass (Inkling's dense MLP). Built without them, a
    ``MoELayer`` takes ``get_default_pg_collection()`` and an ``MLP`` the default TP group: megatron's
    ``parallel_state`` groups, the ones the layer holds unless someone built it with another
    ``pg_collection``. So the record is dropped when the layer being built (read from the
    ``TransformerLayer.__init__`` frame that logs it) has a ``MoELayer`` / ``MLP`` subclass and the
    ``parallel_state`` TP (and EP) groups; otherwise (a foreign MLP class, custom groups) it stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Unknown MLP type"):
            return True
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == "__init__" and "submodules" in frame.f_locals
                                         and "pg_collection" in frame.f_locals):
            frame = frame.f_back
        if frame is None:
            return True
        module = getattr(getattr(frame.f_locals["submodules"], "mlp", None), "module", None)
        if not (isinstance(module, type) and issubclass(module, (MoELayer, MLP))):
            return True
        from megatron.core import parallel_state as ps

        try:
            default = {"tp": ps.get_tensor_model_parallel_group(), "ep": ps.get_expert_model_parallel_group()}
        except (AssertionError, RuntimeError):  # parallel_state not initialized: keep the record
            return True
        groups = frame.f_locals["pg_collection"]
        return any(getattr(groups, name, group) is not group for name, group in default.items())


def _quiet_default_groups_mlp_warning() -> None:
    """Install :class:`_DefaultGroupsMLPFilter` on megatron's ``transformer_layer`` logger (once per process)."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _DefaultGroupsMLPFilter) for f in log.filters):
        log.addFilter(_DefaultGroupsMLPFilter())


_quiet_default_groups_mlp_warning()  # this module defines the MoE layer every MoE family builds on


def replicated_over_tp(layer) -> bool:
    """Whether ``layer``'s (a megatron ``MoELayer``) input is replicated over TP: ``tp > 1`` and no SP."""
    return layer.tp_group.size() > 1 and not layer.config.sequence_parallel


def token_split_group(layer):
    """The group ``layer`` splits its replicated tokens over, or None (no split).

    ``ep > 1``: the TP group (exactly SP's layout; the routed experts' gradients are then summed over the
    expert-data-parallel group, which holds the TP ranks outside the dispatcher's group, since megatron marks
    expert weights ``allreduce=False`` at ``ep > 1``). ``ep == 1``: megatron DDP reduces the expert weights
    over the dense data-parallel group only, so the tokens are split over the dispatcher's own group (the
    expert-TP group, ``etp`` ranks inside the TP group): every expert shard sees each token once and the
    ``tp / etp`` copies of a shard compute identical gradients; at ``etp == 1`` nothing is split (the
    dispatcher moves nothing and every rank computes the whole, replicated result).
    """
    if not replicated_over_tp(layer):
        return None
    if layer.ep_group.size() > 1:
        return layer.tp_group
    group = layer.token_dispatcher.tp_ep_group
    return group if group.size() > 1 else None


def release_dispatcher_graph(dispatcher) -> int:
    """Drop the tensors of the last forward's autograd graph that a megatron token dispatcher keeps as attributes
    (megatron-core 0.16: the alltoall dispatcher's ``probs``, the all-gather dispatcher's ``local_probs``); returns
    how many. Call it once the forward is past the dispatcher (:meth:`TokenSplitMoELayer.postprocess` does).

    Kept, such a tensor made every trained MoE engine immortal: its graph holds the router weight's
    ``AccumulateGrad`` node, which holds megatron DDP's gradient hook, whose closure holds the DDP module, which
    holds the layer and so the dispatcher: a cycle through C++ references that Python's garbage collector cannot
    see. Measured before this: one Qwen3-MoE ``TrainEngine`` built, stepped and dropped in one process stayed
    alive with its model, optimizer and process groups (+48 OS threads per engine on a gloo rank, their gloo
    threads; the 2-rank test pool reached 533 threads after ``tests/test_moe_tp.py``'s 11 engines and was
    replaced). Dense models keep no such tensor and were freed. The forward's own graph keeps what backward
    needs; nothing reads these attributes after the dispatcher's ``combine_postprocess``.
    """
    state = vars(dispatcher)
    stale = [name for name, value in state.items() if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    for name in stale:
        state[name] = None
    return len(stale)


class _TokenSplit:
    """Pads ``num_tokens`` replicated rows to a multiple of the group size and keeps this rank's slice."""

    def __init__(self, group, num_tokens: int):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.num_tokens = num_tokens
        self.pad = (-num_tokens) % self.size
        self.local = (num_tokens + self.pad) // self.size

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pad:
            return x
        if x.dtype == torch.bool:
            return torch.cat([x, x.new_zeros((self.pad, *x.shape[1:]))])
        return F.pad(x, (0, 0, 0, self.pad))

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` (identical on every rank) -> this rank's ``[T_pad / tp, ...]``; backward all-gathers."""
        from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(self._padded(x), group=self.group)

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """Like :meth:`scatter` for a tensor without gradient (``routing_map``)."""
        return self._padded(x)[self.rank * self.local:(self.rank + 1) * self.local]

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's ``[T_pad / tp, ...]`` -> ``[T, ...]`` on every rank; backward keeps own slice."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        full = gather_from_sequence_parallel_region(y, tensor_parallel_output_grad=False, group=self.group)
        return full[: self.num_tokens]


class TokenSplitMoELayer(MoELayer):
    """megatron ``MoELayer`` that splits replicated tokens over TP around the dispatcher (module docstring).

    At ``tp == 1`` or with ``sequence_parallel`` it is megatron's ``MoELayer`` unchanged.

    Raises:
        ValueError: at construction, with ``tp > 1`` and no SP, for what this path does not cover:
            ``moe_shared_expert_overlap`` (the dispatcher would run the shared experts on the slice),
            ``moe_latent_size`` (needs TransformerEngine), the ``flex`` dispatcher (DeepEP / HybridEP);
            in :meth:`forward`, megatron's partial CUDA-graph ``intermediate_tensors``.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        if not replicated_over_tp(self):
            return
        etp, tp = self.token_dispatcher.tp_size, self.tp_group.size()
        if self.ep_group.size() == 1 and (etp > tp or tp % etp):
            raise ValueError(f"MoE at tp={tp} without sequence parallelism and ep=1 needs the expert TP size "
                             f"(etp={etp}) to divide tp; set etp to a divisor of tp (default: etp = tp).")
        bad = [name for name, on in (("moe_shared_expert_overlap", config.moe_shared_expert_overlap),
                                     ("moe_latent_size", config.moe_latent_size),
                                     ("moe_token_dispatcher_type='flex'", config.moe_token_dispatcher_type == "flex"))
               if on]
        if bad:
            raise ValueError(f"MoE at tp={self.tp_group.size()} without sequence parallelism does not support {bad}; "
                             "turn it off or use tp=1 (split the experts with ep).")
        from megatron.core import parallel_state as ps

        # megatron's TopKRouter reduces its aux-loss token counts (and divides the z-loss coefficient) over tp_cp
        # (tp_dp_cp for the global aux loss), assuming SP-split tokens; here it sees the full sequence
        cp, dp_cp = getattr(pg_collection, "cp", None), getattr(pg_collection, "dp_cp", None)
        cp = ps.get_context_parallel_group() if cp is None else cp
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True) if dp_cp is None else dp_cp
        for attr, group in (("tp_cp_group", cp), ("tp_dp_cp_group", dp_cp)):
            if hasattr(self.router, attr):
                setattr(self.router, attr, group)

    def routed_experts(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Routed experts' output for the router's ``probs [T, E]`` / ``routing_map [T, E]`` (bool).

        ``hidden_states`` ``[s, b, hidden]`` (``T = s * b`` flat tokens, replicated over TP); returns
        ``[s, b, hidden]`` in its dtype, replicated over TP, with the tokens split over TP around the
        dispatcher over :func:`token_split_group` (any ``T``: padded to a multiple of that group's size).
        """
        group = token_split_group(self)
        if group is None:
            x, probs = self.preprocess(hidden_states, probs, routing_map)
            dispatched, probs = self.dispatch(x, probs)
            out, _ = self.routed_experts_compute(dispatched, probs)
            return self.postprocess(self.combine(out), None)
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        split = _TokenSplit(group, flat.shape[0])
        x, probs = self.preprocess(split.scatter(flat), split.scatter(probs), split.slice(routing_map))
        dispatched, probs = self.dispatch(x, probs)
        out, _ = self.routed_experts_compute(dispatched, probs)
        out = self.postprocess(self.combine(out), None)
        return split.gather(out).view(shape)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        """megatron's ``MoELayer.postprocess`` (the dispatcher's last step of a forward), then
        :func:`release_dispatcher_graph` on this layer's dispatcher."""
        output = super().postprocess(output, shared_expert_output)
        release_dispatcher_graph(self.token_dispatcher)
        return output

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        """megatron ``MoELayer.forward`` (shared experts + router + routed experts), tokens split over TP."""
        if not replicated_over_tp(self):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if intermediate_tensors is not None:
            raise ValueError("MoE at tp > 1 without sequence parallelism: partial CUDA-graph capture "
                             "(intermediate_tensors) is not supported.")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def run(hidden_states, padding_mask):
            shared = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            out = self.routed_experts(hidden_states, probs, routing_map)
            return out if shared is None else out + shared

        if self.moe_layer_recompute:
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(run, False, hidden_states, padding_mask), None
        return run(hidden_states, padding_mask), None


def with_token_split(layer_spec):
    """``layer_spec`` (a megatron layer ``ModuleSpec``) with megatron's ``MoELayer`` MLP swapped for
    :class:`TokenSplitMoELayer`; any other spec is returned as it is."""
    import dataclasses

    mlp = getattr(getattr(layer_spec, "submodules", None), "mlp", None)
    if getattr(mlp, "module", None) is not MoELayer:
        return layer_spec
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, mlp=dataclasses.replace(mlp, module=TokenSplitMoELayer)))


def _own_fc2_output(_module, _inputs, output):
    """Forward hook of an expert's biased ``linear_fc2``: its output as a tensor of its own, not a view."""
    out, bias = output
    return (out.clone(), bias) if out._is_view() else output


def guard_expert_bias_add(chunks) -> int:
    """Let biased routed experts train: hook each expert ``MLP``'s ``linear_fc2`` (with a bias) so that its output
    is never a view.

    megatron-core 0.16.1's ``MLP.forward`` adds an expert's fc2 bias in place when the router's probabilities
    are passed in (``output += output_bias * per_token_scale``, ``transformer/mlp.py:247``). At expert-TP 1 the
    row-parallel fc2 returns ``_ReduceFromModelParallelRegion``'s input as is, a view made by a custom autograd
    function, so the first backward pass of a biased-MoE family (gpt-oss) raised ``RuntimeError: Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace``. The hook clones only such a view
    (no copy at expert-TP > 1, where the all-reduce returns a new tensor). Idempotent; returns the number of
    experts hooked now.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    hooked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, SequentialMLP):
                continue
            for expert in module.local_experts:
                fc2 = getattr(expert, "linear_fc2", None)
                if getattr(fc2, "bias", None) is None or getattr(fc2, "_ferrule_own_output", False):
                    continue
                fc2.register_forward_hook(_own_fc2_output)
                fc2._ferrule_own_output = True
                hooked += 1
    return hooked
