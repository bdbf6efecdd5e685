"""Batch format, input checks and batch planning of the train engine: ``Datum``, :func:`prepare_batch`,
DP assignment, micro-batches.

:class:`Datum` mirrors Tinker's ``Datum`` (``tinker.types.Datum``: ``model_input`` +
``loss_fn_inputs``) with the model input reduced to its token ids, so the service maps a
Tinker request 1:1 (``model_input.to_ints()`` -> ``Datum.model_input``; each ``TensorData`` ->
a torch tensor). Alignment (Tinker's): position ``i`` of ``model_input`` predicts
``loss_fn_inputs["target_tokens"][i]``; every per-token input has the same length ``N``.

:func:`prepare_batch` checks a batch before any gradient is touched (token ids inside the
vocabulary, token-aligned loss inputs, media against their placeholders, routing-replay routes,
the loss's own inputs) and turns it into CPU tensors (:class:`PreparedDatum`); one bad datum
refuses the whole call, naming the datum and the fix.

Planning is pure Python on token counts (no collectives), so every rank computes the
same plan from the same batch:

- :func:`assign_dp_ranks` — online least-loaded assignment of each datum to a data-parallel
  rank by token count ("sequence-length balancing"). The loads carry over across the
  ``forward_backward`` calls of one accumulation window, so datum ``k`` of the window goes to
  the same rank, in the same order, however the window is split into calls. That is what makes
  the accumulated gradient bit-identical across splits (see :func:`pack_microbatches`).
- :func:`pack_microbatches` — a rank's data, longest first, greedily packed into
  micro-batches whose padded size ``count * max_len`` stays within a token budget (sorting by
  length keeps the padding of RL batches, whose lengths vary widely, to a few percent).
  With ``max_tokens=None`` every datum is its own micro-batch: gradients then accumulate datum
  by datum in window order, which is bit-identical for any split of the window into calls.
  With a budget, packed micro-batches are exact in real arithmetic but the floating-point
  summation order inside a GEMM depends on which data share a micro-batch, so results across
  *different* call splits agree to rounding (~1e-7 relative in fp32), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ferrule.losses import validate_loss_inputs
from ferrule.media import check_media

__all__ = ["Datum", "FBOutput", "PreparedDatum", "prepare_batch", "assign_dp_ranks", "pack_microbatches"]


@dataclass
class Datum:
    """One training example (Tinker's ``Datum`` with token ids as model input).

    Attributes:
        model_input: token ids ``[N]`` (list of int or a 1-D integer tensor).
        loss_fn_inputs: Tinker names -> ``[N]`` tensors (or lists): ``target_tokens`` (int64),
            ``weights``, ``logprobs`` (the sampler's), ``advantages`` (float32), and the
            optional keys :data:`ferrule.losses.LOSS_INPUT_KEYS` lists per loss.
        media: for a family with towers (``register_towers``): ``{modality: [item, ...]}``, one
            tensor per media part in order of appearance, dim 0 = the placeholder tokens it fills
            in ``model_input`` (Inkling: vision ``pixel_values`` ``[n_patches, 2, P, P, 3]``
            float32, audio dMel ids ``[n_frames, 80]`` int). None or empty: text only.
        routed_experts: MoE routing replay (R3, :mod:`ferrule.megatron.routing_replay`): per
            ``model_input`` token and MoE layer the experts to route it to, ``[N, num_moe_layers,
            top_k]`` integer (the rollout's ``GenerateResult.routed_experts``); None: the routers pick.
            Within one call either every datum carries routes or none does.
    """

    model_input: Any
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)
    media: dict[str, Any] | None = None
    routed_experts: Any = None


@dataclass
class FBOutput:
    """Result of :meth:`TrainEngine.forward_backward` (Tinker's ``ForwardBackwardOutput``).

    Attributes:
        loss_fn_outputs: one dict per datum, in the caller's order: ``logprobs`` ``[N]`` float32
            (log-probability of ``target_tokens`` under the pre-step weights) and
            ``elementwise_loss`` ``[N]`` float32 (the per-token loss terms; their sum is the
            datum's loss), CPU tensors.
        metrics: ``"name:reduction"`` -> float, summed over the whole batch (all micro-batches
            and data-parallel ranks), plus derived ``:mean`` ratios
            (:func:`ferrule.losses.finalize_metrics`).
        loss_fn_output_type: ``"ArrayRecord"`` (Tinker's type tag).
    """

    loss_fn_outputs: list[dict[str, Any]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"


def _as_tensor(value: Any, dtype: torch.dtype, where: str) -> torch.Tensor:
    if hasattr(value, "to_torch"):          # tinker.TensorData
        value = value.to_torch()
    elif hasattr(value, "to_ints"):         # tinker.ModelInput
        value = value.to_ints()
    if isinstance(value, torch.Tensor):
        if dtype == torch.int64 and (value.dtype.is_floating_point or value.dtype == torch.bool):
            raise ValueError(f"{where} must hold integer token ids, got dtype {value.dtype}.")
        return value.detach().to("cpu", dtype if dtype == torch.int64 else value.dtype
                                 if value.dtype.is_floating_point else dtype)
    try:
        return torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{where} cannot be converted to a {dtype} tensor: {exc}") from exc


class PreparedDatum:
    """A checked datum (:func:`prepare_batch`): CPU tensors ``tokens`` ``[N]`` int64, ``inputs`` (name ->
    ``[N]``), ``media`` (modality -> list of tensors, checked against the placeholders; empty for text)
    and ``routes`` (``[N, num_moe_layers, top_k]`` int16 expert ids, or None)."""

    __slots__ = ("tokens", "inputs", "media", "routes")

    def __init__(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor],
                 media: dict[str, list[torch.Tensor]] | None = None, routes: torch.Tensor | None = None):
        self.tokens, self.inputs, self.media, self.routes = tokens, inputs, media or {}, routes


def _checked_routes(engine: Any, d: Any, n: int, i: int) -> torch.Tensor | None:
    """A datum's ``routed_experts`` checked: ``[n, num_moe_layers, top_k]`` ids in ``[0, num_experts)``."""
    value = getattr(d, "routed_experts", None)
    if value is None:
        return None
    routes = torch.as_tensor(value)
    routers = engine.moe_routers
    if not routers:
        raise ValueError(f"datum {i}: routed_experts given, but the model has no MoE router; drop them.")
    want = (n, len(routers), routers[0].topk)
    if routes.dtype.is_floating_point or routes.dtype == torch.bool or tuple(routes.shape) != want:
        raise ValueError(f"datum {i}: routed_experts must be integer ids of shape {want} (tokens, MoE layers, "
                         f"top_k), got {routes.dtype} {tuple(routes.shape)}.")
    experts = routers[0].config.num_moe_experts
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= experts):
        raise ValueError(f"datum {i}: routed_experts holds ids outside [0, {experts}); they come from another model.")
    return routes.to("cpu", torch.int16)


def prepare_batch(engine: Any, batch: Sequence[Any], loss_fn: str | None,
                  loss_fn_config: Mapping[str, Any] | None) -> tuple[list[PreparedDatum], dict]:
    """Check ``batch`` for ``engine`` and return its data as CPU tensors, plus the loss config to use.

    Args:
        engine: the :class:`~ferrule.megatron.engine.TrainEngine` (its ``vocab_size``, ``max_positions``,
            ``towers``, ``family`` and, for routed data, ``moe_routers`` are read).
        batch: :class:`Datum`, ``{"model_input", "loss_fn_inputs"}`` dicts or ``tinker.Datum``.
        loss_fn: a :mod:`ferrule.losses` name, or None for ``forward_logprobs`` (only
            ``target_tokens`` are kept).
        loss_fn_config: that loss's config.

    Raises:
        ValueError / TypeError: the first bad datum, by index, and what to change.
    """
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence) or len(batch) == 0:
        raise ValueError("empty batch: forward_backward / forward_logprobs need a non-empty list of Datum.")
    out: list[PreparedDatum] = []
    for i, d in enumerate(batch):
        if isinstance(d, Mapping):
            d = Datum(d.get("model_input"), dict(d.get("loss_fn_inputs") or {}), d.get("media"), d.get("routed_experts"))
        tokens = _as_tensor(d.model_input, torch.int64, f"datum {i}: model_input")
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"datum {i}: model_input must be a non-empty 1-D list of token ids, "
                             f"got shape {tuple(tokens.shape)}.")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= engine.vocab_size:
            raise ValueError(f"datum {i}: model_input holds token id {lo if lo < 0 else hi} outside "
                             f"[0, {engine.vocab_size}); the tokens do not belong to this model's tokenizer.")
        if engine.max_positions and tokens.numel() > engine.max_positions:
            raise ValueError(f"datum {i}: {tokens.numel()} tokens exceed max_position_embeddings "
                             f"{engine.max_positions}; truncate the datum.")
        inputs = {}
        for key, value in (d.loss_fn_inputs or {}).items():
            dtype = torch.int64 if key == "target_tokens" else torch.float32
            inputs[key] = _as_tensor(value, dtype, f"datum {i}: loss_fn_inputs[{key!r}]")
        if "target_tokens" not in inputs:
            raise ValueError(f"datum {i}: loss_fn_inputs['target_tokens'] is missing (position i of "
                             f"model_input predicts target_tokens[i]).")
        if inputs["target_tokens"].shape != tokens.shape:
            raise ValueError(f"datum {i}: target_tokens has length {inputs['target_tokens'].numel()} but "
                             f"model_input has {tokens.numel()}; they must be token-aligned (same length).")
        media = check_media(tokens, getattr(d, "media", None), engine.towers, f"datum {i}", engine.family)
        out.append(PreparedDatum(tokens, inputs, media, _checked_routes(engine, d, tokens.numel(), i)))
    with_routes = [p.routes is not None for p in out]
    if any(with_routes) and not all(with_routes):
        raise ValueError(f"data {[i for i, w in enumerate(with_routes) if not w][:5]} carry no routed_experts while "
                         "others do; routing replay needs routes for every datum of a call, or for none.")
    if loss_fn is None:  # forward_logprobs: only target_tokens matter
        for i, p in enumerate(out):
            validate_loss_inputs("cross_entropy", {"target_tokens": p.inputs["target_tokens"],
                                                   "weights": torch.zeros(p.tokens.numel())},
                                 vocab_size=engine.vocab_size)
            p.inputs = {"target_tokens": p.inputs["target_tokens"]}
        return out, {}
    validate_loss_inputs(loss_fn, [p.inputs for p in out], loss_fn_config, vocab_size=engine.vocab_size)
    return out, dict(loss_fn_config or {})


def assign_dp_ranks(lengths: Sequence[int], dp_size: int, loads: list[int] | None = None) -> list[int]:
    """Assign each datum to a data-parallel rank, least-loaded first (online, in order).

    Args:
        lengths: token count of each datum, in the caller's order.
        dp_size: number of data-parallel ranks.
        loads: tokens already assigned to each rank in this accumulation window; updated in
            place (pass the same list to every call of one window). None starts from zeros.

    Returns:
        ``rank[i]`` for each datum: the rank with the smallest load so far (ties -> the lowest
        rank index). Deterministic, so every rank computes the same assignment.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}; expected >= 1.")
    if loads is None:
        loads = [0] * dp_size
    if len(loads) != dp_size:
        raise ValueError(f"loads has {len(loads)} entries for dp_size={dp_size}.")
    out = []
    for n in lengths:
        r = min(range(dp_size), key=lambda i: (loads[i], i))
        loads[r] += int(n)
        out.append(r)
    return out


def pack_microbatches(indices: Sequence[int], lengths: Mapping[int, int] | Sequence[int],
                      max_tokens: int | None, *, packed: bool = False) -> list[list[int]]:
    """Group ``indices`` into micro-batches of at most ``max_tokens`` padded tokens.

    A micro-batch of ``b`` data padded to its longest (``s`` tokens) costs ``b * s`` tokens.
    With a budget the data are taken longest first (ties in arrival order) and packed greedily,
    so each micro-batch holds data of similar length and little padding. A datum longer than
    ``max_tokens`` gets a micro-batch of its own (never split: a datum's tokens attend to each
    other). ``max_tokens=None`` puts every datum in its own micro-batch, in arrival order (what
    the bit-identical split invariance rests on). ``packed=True`` (the engine concatenates a
    micro-batch's data into one row, megatron's ``thd`` format) counts real tokens: data are
    taken in arrival order while their summed length fits the budget.

    Returns:
        A list of micro-batches, each a list of datum indices.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; expected None or an integer >= 1.")
    if max_tokens is None:
        return [[i] for i in indices]
    if packed:
        groups: list[list[int]] = []
        used = 0
        for i in indices:
            n = int(lengths[i])
            if groups and used + n <= max_tokens:
                groups[-1].append(i)
                used += n
            else:
                groups.append([i])
                used = n
        return groups
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in sorted(indices, key=lambda i: -int(lengths[i])):
        n = int(lengths[i])
        if cur and (len(cur) + 1) * max(cur_max, n) > max_tokens:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    return out
