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
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ferrule.sync.buckets import WeightSyncError, _agree_errors, tensor_bytes
from ferrule.sync.weight_sync import SENDER_RANK, SyncStats, WeightCheckReport, _rank, compare_served_tensor

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
    """CUDA bytes allocated by tensors now (the device abstraction's ``memory_stats``); None on CPU."""
    from ferrule.megatron.device import get_backend

    backend = get_backend()
    if backend.kind != "cuda":
        return None
    backend.synchronize()
    return backend.memory_stats()["allocated"]


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


def sync_lora_adapter(train_engine: Any, rollout_engine: Any, version: int, *, check_equal: bool = False) -> SyncStats:
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
                     device_memory_before=mem_before, device_memory_after=mem_after)


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
