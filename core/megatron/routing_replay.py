"""Routing replay (R3) in the train engine: MoE routers route each token to the rollout's experts.

R3 ("rollout routing replay", Ma et al. 2025, arXiv 2510.11370, section 3): the rollout engine records,
per token and MoE layer, the top-k experts its router picked (:mod:`ferrule.rollout._routes`); the
training forward takes those experts instead of its own top-k, while the gating weights are still
computed from the *training* router's logits, restricted to the replayed experts (so the router keeps
its gradient). miles and slime do the same with megatron-core's ``RouterReplay``.

Mechanism: megatron-core 0.16's own ``megatron.core.transformer.moe.router_replay.RouterReplay``.
``TopKRouter.routing`` hands its top-k to ``router.router_replay.get_replay_topk`` when the router
holds one (``moe_enable_routing_replay``); with action ``REPLAY_FORWARD`` it returns the target
indices and ``scores.gather(1, indices)``, from which ``topk_routing_with_score_function`` computes
the weights as usual (softmax over the picked logits, or the normalised picked sigmoid scores). The
plugin routers (Inkling, Inkling-2) call the same object through :func:`routed_topk`. ferrule gives
each router its own ``RouterReplay`` when the engine first replays (:func:`attach`) and drives the
instances directly: megatron's process-wide list ``RouterReplay.global_router_replay_instances``
would hold every model a process ever built (tests build many), so ferrule takes its instances out
of it.

Token order: a router sees the flattened ``[s, b]`` tokens of its micro-batch (row ``i * b + j`` =
position ``i`` of sequence ``j``; packed ``thd`` batches are one sequence), which is how
:func:`microbatch_routes` lays the replayed ids out.

Layouts: tested at TP = PP = EP = CP = 1 (any DP). Others raise (:func:`check_layout`).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["attach", "check_layout", "microbatch_routes", "moe_routers", "replay", "clear", "routed_topk"]


def moe_routers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The MoE routers of the model chunks in layer order: the modules named ``*.mlp.router``
    (megatron ``TopKRouter``, :class:`~ferrule.plugins.inkling.moe.InklingRouter`,
    :class:`~ferrule.plugins.inkling2.moe.Inkling2Router`)."""
    return [m for chunk in chunks for n, m in chunk.named_modules() if n.endswith("mlp.router")]


def check_layout(layout) -> None:
    """Refuse a parallel layout routing replay was not tested at.

    Raises:
        ValueError: ``tp``, ``pp``, ``ep``, ``cp`` or ``vpp`` above 1, naming the degree.
    """
    bad = {k: getattr(layout, k, 1) for k in ("tp", "pp", "ep", "cp", "vpp")}
    bad = {k: v for k, v in bad.items() if (v or 1) > 1}
    if bad:
        raise ValueError(f"routing replay (algorithm.routing_replay) is tested at tp = pp = ep = cp = 1 only, not "
                         f"{', '.join(f'{k}={v}' for k, v in bad.items())}; use data parallelism or turn it off.")


def _new_replay():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    inst = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(inst)  # ferrule drives each instance itself
    return inst


def attach(routers: Sequence[torch.nn.Module]) -> None:
    """Give each router without one a ``router_replay`` (megatron ``RouterReplay``, no action: routes as before)."""
    for r in routers:
        if getattr(r, "router_replay", None) is None:
            r.router_replay = _new_replay()


def replay(routers: Sequence[torch.nn.Module], routes: torch.Tensor) -> None:
    """Route the next forward(s) by ``routes`` ``[tokens, layers, top_k]`` (router token order, any int dtype):
    layer ``m``'s router takes ``routes[:, m]``. Stays in force (also for a recomputation in the backward)
    until :func:`clear` or the next call.

    Raises:
        ValueError: ``routes`` has another number of layers or another top-k than the routers.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if routes.shape[1] != len(routers):
        raise ValueError(f"routing replay: routes for {routes.shape[1]} MoE layers, the model has {len(routers)}.")
    for m, r in enumerate(routers):
        if routes.shape[2] != r.topk:
            raise ValueError(f"routing replay: routes pick {routes.shape[2]} experts per token, layer {m}'s router "
                             f"picks {r.topk}; the rollout and train models differ.")
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(routes[:, m].long())
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear(routers: Sequence[torch.nn.Module]) -> None:
    """Back to the routers' own top-k; drop the replayed ids."""
    for r in routers:
        rep = getattr(r, "router_replay", None)
        if rep is not None:
            rep.clear_indices()
            rep.clear_router_replay_action()


def routed_topk(router: torch.nn.Module, choice: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 expert ids for a plugin router's selection scores ``choice`` ``[T, E]``:
    ``topk(choice, k, sorted=False)`` (HF's call), or the replayed ids while :func:`replay` is in force."""
    def default(scores, topk, num_groups=None, group_topk=None):
        return torch.topk(scores, topk, dim=-1, sorted=False)

    rep = getattr(router, "router_replay", None)
    if rep is None:
        return default(choice, k).indices
    return rep.get_replay_topk(choice, k, None, None, default)[1]


def microbatch_routes(routes: Sequence[torch.Tensor], spans: Sequence[tuple[int, int, int]], batch: int,
                      seq: int, device: torch.device) -> torch.Tensor:
    """One micro-batch's replayed ids in router token order, ``[seq * batch, layers, top_k]`` int64.

    ``routes[k]`` ``[n_k, layers, top_k]`` belongs to the datum at ``spans[k] = (row, start, n_k)`` of the
    ``[batch, seq]`` token layout (``ferrule.megatron.engine.TrainEngine._microbatch``). Padding positions get
    experts ``0 .. top_k - 1`` (their outputs are never read).

    Raises:
        ValueError: a datum's routes do not cover its ``n_k`` tokens.
    """
    layers, k = routes[0].shape[1:]
    out = torch.arange(k, dtype=torch.int64).expand(batch, seq, layers, k).clone()
    for idx, ((row, start, n), r) in enumerate(zip(spans, routes)):
        if r.shape != (n, layers, k):
            raise ValueError(f"routing replay: datum {idx} has routes {tuple(r.shape)} for {n} tokens; expected "
                             f"({n}, {layers}, {k}) (one row per model_input token).")
        out[row, start:start + n] = r.long()
    return out.transpose(0, 1).reshape(seq * batch, layers, k).to(device)
