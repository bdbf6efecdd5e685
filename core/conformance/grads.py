"""The training-step checks shared by ``ferrule check --grads`` and the conformance kit: gradients vs HF, and the
update groups carrying every trained tensor to a rollout engine.

Gradients (:func:`mcore_grads`, :func:`compare_grads`): one backward pass of ``sum(logits * w)`` (``w``: fixed
seeded weights, :func:`grad_weights`) on both sides. Megatron's gradients are exported to HF tensor names through
the family's mapping table exactly as weights are (each parameter's data swapped for its gradient: every mapping
is linear), after the tensor-parallel reductions a training step's gradient finalization makes
(:func:`finalize_tp_grads`); HF's are written back to its checkpoint names by ``save_pretrained`` (transformers'
own conversion, stacked experts included). Each HF tensor's relative difference ``max|megatron - HF| /
max(max|HF|, 1e-6)`` must be within :data:`GRAD_RTOL` (fp32; the train engine tests' bound).

Update groups (:func:`check_update_groups_reach_rollout`): the real weight sync
(:func:`ferrule.sync.sync_weights`, bucketed path) into a recording engine that starts with every checkpoint
tensor zeroed; afterwards every HF tensor the checkpoint holds (every trained parameter's tensors) must have
arrived exactly once and equal the checkpoint's values bit for bit. A parameter no update group covers, a group
that sends a tensor twice or a unit converted with the wrong row is named.

Core code: imports ferrule's engines, mapping and sync layers, never ``ferrule.converters`` (the converters
import it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ferrule.conformance.fields import text_vocab_size
from ferrule.contract import registry
from ferrule.formats.safetensors_io import SafetensorsReader
from ferrule.megatron.weights import export_mcore_to_hf
from ferrule.sync import sync_weights

__all__ = ["GRAD_RTOL", "grad_weights", "finalize_tp_grads", "scale_expert_grads", "mcore_grads", "hf_checkpoint_grads", "compare_grads",
           "gradient_problem", "check_update_groups_reach_rollout", "RecordingEngine"]

#: relative tolerance of the gradient comparison (fp32): max |megatron - HF| / max |HF| per HF tensor, as the
#: train engine's gradient tests (tests/test_train_engine.py, 1e-5)
GRAD_RTOL = 1e-5


def grad_weights(shape) -> "Any":
    """The fixed ``[b, s, vocab]`` fp32 weights of the gradient step's loss ``sum(logits * w)`` (seeded, scaled by
    ``1 / (b * s)``): every logit gets a gradient, so every parameter that shapes a logit does."""
    import torch

    g = torch.Generator().manual_seed(4321)
    return torch.randn(shape, generator=g, dtype=torch.float32) / (shape[0] * shape[1])


def finalize_tp_grads(model) -> None:
    """The tensor-parallel part of megatron's gradient finalization, as a training step runs it: megatron-core's
    own ``_allreduce_non_tensor_model_parallel_grads`` (``finalize_model_grads``) on ``model``, which sums over
    the TP group the gradients of the q/k norms (``config.qk_layernorm``: a replicated weight that each rank
    applies to its own heads only, so each rank's raw gradient is partial) and of sequence-parallel norms, and
    averages those marked ``average_gradients_across_tp_domain``. Every other replicated weight already holds its
    full gradient on each rank (its input is copied into the TP region, whose backward all-reduces). No-op at
    TP 1. The data-parallel and expert-data-parallel reductions (DDP's) are not run: the checks run at ep 1."""
    import importlib
    import types

    from megatron.core import parallel_state

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package attr: a function

    if parallel_state.get_tensor_model_parallel_world_size() <= 1:
        return
    chunk = types.SimpleNamespace(module=model, ddp_config=types.SimpleNamespace(use_megatron_fsdp=False))
    # looked up on the module: ferrule's guard for TP-sharded q/k norms (layer_options.keep_sharded_qk_norm_grads)
    # wraps it there, as finalize_model_grads (a training step) sees it
    fmg._allreduce_non_tensor_model_parallel_grads([chunk], model.config,
                                                   parallel_state.get_tensor_model_parallel_group())


def scale_expert_grads(params) -> None:
    """At expert parallelism ``ep`` > 1 (and TP 1), divide each routed-expert gradient by ``ep``, the factor megatron's
    DDP applies to it in a training step when every rank ran the same batch (as the checks run it).

    A rank's expert receives the tokens of every rank of its expert-parallel group, so its raw gradient is ``ep``
    times the one batch's; DDP scales expert gradients by ``1 / dp`` and sums them over the expert-data-parallel
    group (``dp / ep`` ranks at TP 1): ``ep * g / dp * dp / ep = g``. Expert parameters are those megatron's DDP
    treats so (``allreduce`` False). No-op at ``ep`` 1.

    Raises:
        ValueError: ``ep`` > 1 together with TP > 1 (how megatron's dispatcher shares the TP ranks' tokens among the
            experts then is not reproduced here).
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep <= 1:
        return
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        raise ValueError(f"gradients at ep={ep} are checked at tp=1 only")
    for p in params:
        if p.grad is not None and not getattr(p, "allreduce", True):
            p.grad.div_(ep)


def mcore_grads(model, family: str, hf_config: Mapping[str, Any], ids, *, table=None) -> dict | None:
    """Megatron's gradients of ``sum(logits * w)`` per HF tensor name, fp64 on CPU (rank 0; None elsewhere).

    Collective at TP > 1 (call on every rank): backward on ``model`` (fp32, loaded), :func:`finalize_tp_grads`,
    then :func:`ferrule.megatron.weights.export_mcore_to_hf` with each parameter's data swapped for its gradient,
    so fused, split and TP-sharded parameters come out as HF tensors exactly as weights do. A parameter without a
    gradient exports as zeros. The parameters' data and ``grad`` are restored (``grad`` None) afterwards.

    Args:
        ids: ``[b, s]`` int64 token ids. table: the mapping table (default: the family's).
    """
    import torch
    import torch.distributed as dist


    params = list(model.parameters())
    for p in params:
        p.grad = None
    vocab = text_vocab_size(dict(hf_config))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    device = params[0].device
    with torch.enable_grad():
        logits = model(ids.to(device), pos.to(device), attention_mask=None)[..., :vocab].float()
        # columns past an HF head narrower than vocab_size (a padded unembedding) are masked: no weight there
        w = grad_weights(tuple(logits.shape)).to(device) * (logits.detach() > -1e30)
        (logits * w).sum().backward()
    finalize_tp_grads(model)
    scale_expert_grads(params)
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad.detach() if p.grad is not None else torch.zeros_like(p.data)
        table = table if table is not None else registry.get_converter(family).resolved_mapping()
        grads = {name: t.detach().double().cpu() for name, t in export_mcore_to_hf([model], table, hf_config=dict(hf_config))}
    finally:
        for p, data in zip(params, saved):
            p.data = data
            p.grad = None
    return grads if not dist.is_initialized() or dist.get_rank() == 0 else None


def hf_checkpoint_grads(hf) -> dict:
    """HF's gradients (after a backward pass on ``hf``) under the checkpoint's tensor names, fp64 on CPU.

    transformers' modules may hold another layout than the files (stacked experts ``mlp.experts.gate_up_proj`` for
    per-expert ``experts.{e}.gate_proj.weight`` tensors), so each parameter's data is swapped for its gradient (zeros
    where none) and written with ``save_pretrained``, which applies transformers' own conversion back to the
    checkpoint layout; the parameters' data is restored afterwards."""
    import tempfile

    import torch
    from safetensors.torch import load_file

    params = list(hf.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad.detach() if p.grad is not None else torch.zeros_like(p.data)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
            out = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                out.update({k: v.double() for k, v in load_file(str(f)).items()})
    finally:
        for p, data in zip(params, saved):
            p.data = data
    return out


def compare_grads(hf, ids, mc_grads: Mapping[str, Any]) -> dict:
    """HF's gradients of the same loss (fp32 ``hf``, ``ids`` ``[b, s]``) vs ``mc_grads`` (:func:`mcore_grads`).

    Returns:
        ``{"max_rel", "worst", "compared", "missing"}``: the largest relative difference ``max|megatron - HF| /
        max(max|HF|, 1e-6)`` over HF tensors (``inf`` for a shape mismatch), the HF tensor name holding it, the
        number of tensors compared, and (up to 8) HF tensors megatron produced no gradient for.
    """
    import torch


    hf.zero_grad(set_to_none=True)
    with torch.enable_grad():
        ref = hf(input_ids=ids).logits.float()
        # megatron's weights are drawn over vocab_size columns; an HF head narrower than that (Inkling-2's
        # unpadded_vocab_size) takes the first ones, as megatron's masked columns get none
        vocab = max(ref.shape[-1], text_vocab_size(hf.config.to_dict()))
        (ref * grad_weights((*ref.shape[:-1], vocab))[..., :ref.shape[-1]]).sum().backward()
    hf_grads = hf_checkpoint_grads(hf)
    hf.zero_grad(set_to_none=True)
    rel: dict[str, float] = {}
    missing = sorted(set(hf_grads) - set(mc_grads))
    for name, theirs in hf_grads.items():
        ours = mc_grads.get(name)
        if ours is None:
            continue
        if ours.shape != theirs.shape:
            rel[name] = float("inf")
            continue
        rel[name] = float((ours - theirs).abs().max()) / max(float(theirs.abs().max()), 1e-6)
    worst = max(rel, key=rel.get) if rel else None
    return {"max_rel": rel[worst] if worst else 0.0, "worst": worst, "compared": len(rel), "missing": missing[:8]}


def gradient_problem(result: Mapping[str, Any], rtol: float = GRAD_RTOL) -> str | None:
    """None when a :func:`compare_grads` result passes (every tensor within ``rtol``, none missing), else one line
    naming the worst tensor and the missing ones."""
    bad = []
    if not result["max_rel"] <= rtol:
        bad.append(f"max relative |megatron - HF| = {result['max_rel']:.3g} > {rtol:g} at {result['worst']}")
    if result["missing"]:
        bad.append(f"no megatron gradient for {result['missing']}")
    return "; ".join(bad) or None


class RecordingEngine:
    """A stand-in rollout engine for :func:`check_update_groups_reach_rollout`: holds HF-named tensors
    (``state``), records every name ``update_weights`` receives (``received``, repeats included) and
    offers ``get_hf_state_dict`` as the embedded engine does."""

    def __init__(self, state: Mapping[str, Any]):
        self.state = dict(state)
        self.received: list[str] = []

    def update_weights(self, named_tensors, version: int) -> None:
        for name, t in named_tensors:
            self.received.append(name)
            self.state[name] = t.detach().cpu().clone()

    def get_hf_state_dict(self) -> dict:
        return dict(self.state)


def check_update_groups_reach_rollout(chunks, family: str, hf_config: Mapping[str, Any], src: str | Path, *,
                                      groups=None) -> int | None:
    """Every HF tensor of the checkpoint ``src`` reaches a rollout engine through the family's update groups.

    Collective (every rank, like a weight sync): ``chunks`` hold ``src``'s weights (loaded through the mapping
    table); :func:`ferrule.sync.sync_weights` (bucketed) sends them to a :class:`RecordingEngine` that starts
    with every non-ignored checkpoint tensor zeroed. On rank 0, every such tensor must have arrived exactly once
    and equal the checkpoint's bit for bit (the engine casts to its dtype, so compared in the checkpoint's).

    Args:
        groups: an update-group table to use instead of the family's (tests pass a broken one).

    Returns:
        The number of HF tensors that arrived (rank 0; None on other ranks).

    Raises:
        AssertionError: (rank 0) naming the tensors that never arrive, arrive more than once, arrive changed or
            are not the checkpoint's; the sync's own ``WeightSyncError`` (every rank) for a table that does not
            fit the parameters (it names them).
    """
    import collections

    import torch
    import torch.distributed as dist


    table = registry.get_converter(family).resolved_mapping()
    sender = not dist.is_initialized() or dist.get_rank() == 0
    reader = SafetensorsReader(Path(src)) if sender else None
    expected = sorted(k for k in reader.keys() if not table.is_ignored(k)) if sender else []
    engine = RecordingEngine({k: torch.zeros_like(reader.get(k)) for k in expected}) if sender else None
    sync_weights(list(chunks), engine, 1, family=family, hf_config=dict(hf_config), mapping=table,
                 update_groups=groups, direct=False)
    if not sender:
        return None
    counts = collections.Counter(engine.received)
    never = [k for k in expected if counts[k] == 0]
    twice = sorted(f"{k} ({n} times)" for k, n in counts.items() if n > 1)
    extra = sorted(k for k in counts if k not in set(expected))
    changed = [k for k in expected if counts[k] and not torch.equal(engine.state[k].to(reader.get(k).dtype),
                                                                     reader.get(k))]
    problems = []
    if never:
        problems.append(f"checkpoint tensors no update group sends (a trained rollout engine keeps them stale): "
                        f"{never[:8]}")
    if twice:
        problems.append(f"tensors sent more than once in one sync (two update groups claim them): {twice[:8]}")
    if changed:
        problems.append(f"tensors that arrive different from the checkpoint: {changed[:8]}")
    if extra:
        problems.append(f"tensors sent that the checkpoint does not hold: {extra[:8]}")
    assert not problems, f"{family}: weight sync through the update groups: " + "; ".join(problems)
    return len(expected)
