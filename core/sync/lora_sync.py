"""Adapter-only weight sync: a LoRA train engine's HF PEFT adapter -> the rollout engine.

With LoRA the base weights never change during training, so after each step only the adapter
travels (Tinker, miles and SGLang all serve base + adapter this way; a peer reports 2.5 s vs
49.4 s for a full sync on a large MoE). The interchange format is HF PEFT (DESIGN.md, issue 13):

- train side (:mod:`ferrule.lora`): ``hf_adapter_state_dict(engine)`` -> full, TP-gathered tensors
  under PEFT's saved names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
  ``[r, in]``, ``...lora_B.weight`` ``[out, r]``) and ``peft_config(engine)`` -> the
  ``adapter_config.json`` dict; both collective (every rank gets the whole adapter);
- rollout side: ``rollout_engine.update_lora_adapter(tensors, peft_config, version)`` (the
  embedded engine serves it unmerged through PEFT's LoRA layers; SGLang loads it with
  ``/load_lora_adapter``).

The base is never merged *and* sent: the rollout engine applies the adapter exactly once on top
of the base it already holds (the boot weights, or the last full :func:`~ferrule.sync.sync_weights`).

:func:`check_lora_adapter_equal` verifies the rollout engine's adapter against the sent tensors
(exact via ``get_lora_state_dict()``, or sha256 via ``lora_checksums()``), including adapter
tensors the engine holds that were not sent.
"""

from __future__ import annotations

import fnmatch
import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrule.sync.buckets import WeightSyncError, _agree_errors, tensor_bytes
from ferrule.sync.direct import log_once
from ferrule.sync.strides import joint_strides
from ferrule.sync.weight_sync import SENDER_RANK, SyncStats, WeightCheckReport, _rank, compare_served_tensor
from ferrule.lora.peft_format import adapter_index_map

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["check_lora_adapter_equal", "send_lora_adapter", "sync_lora_adapter"]


def _train_adapter(train_engine: Any) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
    """``(hf_adapter_state_dict(engine), peft_config(engine))`` from :mod:`ferrule.lora` (collective)."""
    try:
        from ferrule.lora import hf_adapter_state_dict, peft_config
    except ImportError as exc:
        raise WeightSyncError("sync_lora_adapter needs ferrule.lora (hf_adapter_state_dict / peft_config: the train "
                              "side of LoRA, issue 13), which this installation lacks; update ferrule, or sync the "
                              f"full weights with ferrule.sync.sync_weights ({exc}).") from exc
    if getattr(train_engine, "lora", None) is None:
        raise WeightSyncError(f"sync_lora_adapter: {type(train_engine).__name__} trains no LoRA adapter (.lora is "
                              "None); build it with lora=LoraSettings(...) or use ferrule.sync.sync_weights.")
    # no per-tensor copy: update_lora_adapter copies into the served adapter before we return
    return hf_adapter_state_dict(train_engine, copy=False), peft_config(train_engine)


def _allocated_bytes() -> int | None:
    """CUDA bytes allocated by tensors now (the device abstraction's ``allocated_bytes``: no device
    synchronisation, which would wait for the copies); None on CPU."""
    from ferrule.megatron.device import get_backend

    return get_backend().allocated_bytes()


# ---------------------------------------------------------------------------------------
# Direct path: train adapter parameters -> the served adapter, in one process
# ---------------------------------------------------------------------------------------


@dataclass
class _DirectLoraPlan:
    """The (source view, destination view) pairs of one train engine's adapter into one served adapter.

    Built once from :func:`ferrule.lora.peft_format.adapter_index_map` (each PEFT tensor as a strided
    view of a live ``lora_A`` / ``lora_B`` parameter) and the rollout engine's
    ``direct_lora_targets``; each sync is then a pointer check and ``torch._foreach_copy_`` calls (one
    per device/dtype group of contiguous pairs, one for the strided ones: the q/k/v parts of Megatron's
    fused ``lora_B``) instead of the export (per-module ``to_hf`` re-layouts and copies), the name and
    shape checks and a stream synchronisation.
    """

    targets: Any
    sources: list  # the live parameters, whose data_ptr()s are checked every sync
    ptrs: tuple
    copies: list  # [(dsts, srcs)] for torch._foreach_copy_
    ntensors: int
    nbytes: int
    verified: bool = False
    keys: list = field(default_factory=list, repr=False)
    config: dict = field(default_factory=dict, repr=False)


#: rollout engine -> (the train engine, its _DirectLoraPlan or False: do not use)
_LORA_PLANS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _build_direct_plan(train_engine: Any, targets: Mapping[str, Any]) -> "_DirectLoraPlan | str":
    """The plan, or why the direct path cannot serve this engine pair."""
    import torch

    index, why = adapter_index_map(train_engine)
    if index is None:
        return why
    names = [k for k, _, _ in index]
    if len(set(names)) != len(names) or set(names) != set(targets):
        missing, extra = sorted(set(targets) - set(names)), sorted(set(names) - set(targets))
        return f"the exported tensors differ from the served adapter's (not exported: {missing[:3]}, not served: {extra[:3]})"
    groups: dict[tuple, tuple[list, list]] = {}
    strided: tuple[list, list] = ([], [])
    nbytes = 0
    for name, param, idx in index:
        dst = targets[name].detach()
        if tuple(dst.shape) != tuple(idx.shape) or not dst.is_contiguous():
            return f"{name}: served as {tuple(dst.shape)} (contiguous: {dst.is_contiguous()}), exported as {tuple(idx.shape)}"
        if dst.device != param.device:
            return f"{name}: served on {dst.device}, trained on {param.device}"
        js = joint_strides(idx.reshape(-1), torch.arange(idx.numel(), dtype=torch.int64))
        if js is None:
            return f"{name}: not one strided view of its parameter"
        shape, s_st, s_off, d_st, d_off = js
        src = param.detach().as_strided(shape, s_st, param.detach().storage_offset() + s_off)
        dview = dst.as_strided(shape, d_st, dst.storage_offset() + d_off)
        contiguous = src.is_contiguous() and dview.is_contiguous() and src.dtype == dst.dtype
        g = groups.setdefault((src.device, src.dtype, dst.dtype), ([], [])) if contiguous else strided
        g[0].append(dview)
        g[1].append(src)
        nbytes += param.element_size() * idx.numel()
    sources = list({id(p): p for _, p, _ in index}.values())
    copies = list(groups.values()) + ([strided] if strided[0] else [])
    return _DirectLoraPlan(targets, sources, tuple(p.data_ptr() for p in sources), copies, len(index), nbytes,
                           keys=names)


def _direct_lora_sync(train_engine: Any, rollout_engine: Any, version: int) -> tuple[int, int] | None:
    """Sync through the cached :class:`_DirectLoraPlan`; ``(tensors, bytes)`` sent, or None where
    :func:`send_lora_adapter` must run (the reason logged once). The first direct sync of a plan is
    compared element for element with the export; a mismatch drops the plan for good (logged).

    Raises:
        ValueError: ``version`` lower than the rollout engine's (nothing written).
    """
    import torch

    from ferrule.lora import peft_config

    if not callable(getattr(rollout_engine, "direct_lora_targets", None)):
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return None
    except ImportError:  # pragma: no cover
        return None
    held = _LORA_PLANS.get(rollout_engine)
    plan = held[1] if held is not None and held[0] is train_engine else None
    if plan is False:
        return None
    # the adapter's config is fixed once the train engine is built: asked for once per plan
    config = plan.config if plan is not None else peft_config(train_engine)
    targets = rollout_engine.direct_lora_targets(config)
    if targets is None:  # no adapter served yet, another config, asleep: update_lora_adapter handles it
        return None
    if version < rollout_engine.weights_version:
        raise ValueError(f"sync_lora_adapter(version={version}) is older than the rollout engine's weights_version="
                         f"{rollout_engine.weights_version}; versions must not go backwards.")
    if plan is not None and (plan.targets is not targets
                             or tuple(p.data_ptr() for p in plan.sources) != plan.ptrs):
        plan = None  # the served adapter or a train parameter moved: plan again
    if plan is None:
        plan = _build_direct_plan(train_engine, targets)
        if isinstance(plan, str):
            _LORA_PLANS[rollout_engine] = (train_engine, False)
            log_once(f"direct LoRA adapter sync not used: {plan}; update_lora_adapter runs.", logging.INFO)
            return None
        plan.config = config
        _LORA_PLANS[rollout_engine] = (train_engine, plan)
    with torch.no_grad():
        for dsts, srcs in plan.copies:
            torch._foreach_copy_(dsts, srcs)
    if not plan.verified:
        from ferrule.lora import hf_adapter_state_dict

        exported = hf_adapter_state_dict(train_engine, copy=False)
        bad = [n for n in plan.keys if not torch.equal(targets[n].detach(), exported[n].to(targets[n].dtype))]
        if bad:
            _LORA_PLANS[rollout_engine] = (train_engine, False)
            log_once(f"direct LoRA adapter sync disabled for this engine pair: {len(bad)} tensors differ from the "
                     f"export after a direct sync (first: {bad[0]}); update_lora_adapter runs.")
            return None
        plan.verified = True
    rollout_engine.set_weights_version(version)
    return plan.ntensors, plan.nbytes


def send_lora_adapter(tensors: Mapping[str, "torch.Tensor"], peft_config: Mapping[str, Any], rollout_engine: Any,
                      version: int) -> tuple[int, int]:
    """Hand one full adapter to ``rollout_engine.update_lora_adapter`` (no collectives; the sender's part).

    Args:
        tensors: PEFT saved name -> full tensor (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``).
        peft_config: the ``adapter_config.json`` dict.
        rollout_engine: anything with ``update_lora_adapter(tensors, peft_config, version)``.
        version: the weight version.

    Returns:
        ``(tensors sent, bytes sent)`` (bytes: ``numel * element_size`` of the given tensors).

    Raises:
        WeightSyncError: no tensors, names that are not PEFT ``lora_A`` / ``lora_B`` weights, or an
            engine without ``update_lora_adapter``. The engine's own errors pass through.
    """
    if not callable(getattr(rollout_engine, "update_lora_adapter", None)):
        raise WeightSyncError(f"{type(rollout_engine).__name__} has no update_lora_adapter(); it cannot serve a LoRA "
                              "adapter (use the embedded or sglang engine).")
    bad = [n for n in tensors if not fnmatch.fnmatchcase(n, "*.lora_[AB].weight")]
    if not tensors or bad:
        raise WeightSyncError(f"send_lora_adapter: expected PEFT lora_A / lora_B tensors, got {len(tensors)} tensors; "
                              f"not adapter tensors: {bad[:8]}. Only the adapter travels in a LoRA sync.")
    rollout_engine.update_lora_adapter(dict(tensors), dict(peft_config), version)
    return len(tensors), sum(tensor_bytes(t) for t in tensors.values())


def sync_lora_adapter(train_engine: Any, rollout_engine: Any, version: int, *, check_equal: bool = False,
                      direct: bool | None = None) -> SyncStats:
    """Send the train engine's LoRA adapter (only the adapter) to the rollout engine.

    Collective: call on every rank (``hf_adapter_state_dict`` gathers TP/PP shards); global rank
    0 (:data:`~ferrule.sync.weight_sync.SENDER_RANK`) calls ``rollout_engine.update_lora_adapter``,
    other ranks may pass None. The exported copies are dropped before returning, so device
    memory is back at its baseline (``SyncStats.device_memory_before`` / ``_after``, bytes
    allocated on CUDA; None on CPU).

    Args:
        train_engine: a :class:`~ferrule.megatron.engine.TrainEngine` built with ``lora=``.
        rollout_engine: the engine to update (on global rank 0).
        version: the weight version (e.g. the optimizer step count).
        check_equal: then verify with :func:`check_lora_adapter_equal` (raises on mismatch).
        direct: None (default): where the train engine and an embedded rollout engine that already
            serves this adapter share one process and device (world size 1), copy the adapter
            parameters straight into the served ones: one cached plan of strided views, a few
            ``torch._foreach_copy_`` launches, no export, no host synchronisation (the first such sync
            is compared with the export; ``SyncStats.direct`` says which path ran). False: always
            through the export and ``update_lora_adapter``. The served adapter is equal bit for bit
            either way (tests/test_lora_sync.py).

    Returns:
        :class:`~ferrule.sync.SyncStats` (``buckets`` is 1 on the sender: one adapter call).

    Raises:
        WeightSyncError: ferrule.lora is missing, the engine has no LoRA, the sender has no
            rollout engine that serves adapters, or the check fails (on every rank).
    """
    t0 = time.perf_counter()
    mem_before = _allocated_bytes()
    sender = _rank() == SENDER_RANK
    errors = []
    if sender and not callable(getattr(rollout_engine, "update_lora_adapter", None)):
        errors.append(f"rank {SENDER_RANK} talks to the rollout engine but got {type(rollout_engine).__name__} without "
                      "update_lora_adapter(); pass the embedded or sglang engine on global rank 0.")
    _agree_errors(errors)
    done = None
    if sender and direct is not False:
        if getattr(train_engine, "lora", None) is None:
            _train_adapter(train_engine)  # raises the WeightSyncError naming the missing LoRA
        done = _direct_lora_sync(train_engine, rollout_engine, version)
    tensors = None
    if done is not None:
        n_tensors, n_bytes = done
        if check_equal:
            tensors, _ = _train_adapter(train_engine)
    else:
        tensors, config = _train_adapter(train_engine)
        n_tensors = n_bytes = 0
        if sender:
            n_tensors, n_bytes = send_lora_adapter(tensors, config, rollout_engine, version)
    checked = False
    if check_equal:
        problems = []
        if sender:
            try:
                check_lora_adapter_equal(tensors, rollout_engine)
            except WeightSyncError as exc:
                problems.append(str(exc))
        _agree_errors(problems)
        checked = True
    del tensors
    mem_after = _allocated_bytes()
    return SyncStats(version=version, buckets=int(sender), bytes=n_bytes, tensors=n_tensors,
                     seconds=time.perf_counter() - t0, sender=sender, checked=checked,
                     device_memory_before=mem_before, device_memory_after=mem_after, direct=done is not None)


def _engine_adapter(rollout_engine: Any) -> tuple[str, dict[str, Any]]:
    if callable(getattr(rollout_engine, "get_lora_state_dict", None)):
        return "exact", dict(rollout_engine.get_lora_state_dict())
    if callable(getattr(rollout_engine, "lora_checksums", None)):
        return "checksum", dict(rollout_engine.lora_checksums())
    raise WeightSyncError(f"check_lora_adapter_equal: {type(rollout_engine).__name__} offers neither "
                          "get_lora_state_dict() (exact compare) nor lora_checksums() (sha256 compare); its adapter "
                          "cannot be verified.")


def check_lora_adapter_equal(sent: Mapping[str, "torch.Tensor"], rollout_engine: Any) -> WeightCheckReport:
    """Verify that the rollout engine serves exactly the adapter ``sent`` (not collective).

    Engine side: ``get_lora_state_dict() -> {PEFT name: tensor}`` (``torch.equal`` after casting
    the sent tensor to the engine's dtype and device, which is what the engine did on load), or
    ``lora_checksums() -> {PEFT name: tensor_checksum(t)}`` (the sent tensor is cast to the dtype
    named in the checksum and hashed).

    Returns:
        ``WeightCheckReport(compared, skipped=(), mode)``.

    Raises:
        WeightSyncError: naming every differing tensor (with its max abs diff), every adapter
            tensor the engine holds that was not sent (it would stay stale), every sent tensor the
            engine lacks, or an engine that cannot be read.
    """
    mode, engine = _engine_adapter(rollout_engine)
    mismatched, missing_in_engine = [], []
    for name, t in sent.items():
        if name not in engine:
            missing_in_engine.append(name)
            continue
        problem = compare_served_tensor(name, t, engine[name], mode, "sent")
        if problem:
            mismatched.append(problem)
    never_sent = sorted(n for n in engine if n not in sent)
    problems = []
    if mismatched:
        problems.append(f"adapter tensors differing between the rollout engine and the sent adapter "
                        f"({len(mismatched)}):\n" + "\n".join(f"  - {m}" for m in mismatched))
    if never_sent:
        problems.append(f"rollout-engine adapter tensors that were not sent ({len(never_sent)}):\n"
                        + "\n".join(f"  - {n}" for n in never_sent) + "\nThey would stay stale; export every adapter "
                        "tensor (hf_adapter_state_dict) in each sync.")
    if missing_in_engine:
        problems.append(f"sent adapter tensors the rollout engine does not serve ({len(missing_in_engine)}):\n"
                        + "\n".join(f"  - {n}" for n in missing_in_engine))
    if problems:
        raise WeightSyncError(f"check_lora_adapter_equal failed ({mode} compare):\n" + "\n".join(problems))
    return WeightCheckReport(compared=len(sent), skipped=(), mode=mode)
