"""Weight sync from the Megatron train engine to a rollout engine, and its verification mode.

:func:`sync_weights` walks the family's update-group table over the train engine's
parameters, gathers full tensors collectively (TP all-gather, EP collection, PP broadcast:
:mod:`ferrule.sync.buckets`), converts them to HF names and layouts through the family's
mapping table, and sends byte-bounded buckets with
``rollout_engine.update_weights(bucket, version)``. In one process (world size 1) with an
engine offering ``direct_weight_targets()`` (the embedded engine, awake, on the train engine's
device) it takes the direct path instead (:mod:`ferrule.sync.direct`): strided copies straight
into the served weights, planned once from the same tables; the served weights are the same
bit for bit.

Which rank talks to the rollout engine: **global rank 0** (:data:`SENDER_RANK`; it lies in
data-parallel replica 0, expert-data-parallel replica 0 and pipeline stage 0). Every rank of
the job must call :func:`sync_weights` (collectives); on the other ranks ``rollout_engine``
is ignored (pass None). Ranks outside replica 0 take part only in the small metadata
exchange.

:func:`check_weight_update_equal` (the RL launcher's ``--check-weight-update-equal``) compares,
after a sync, every tensor the rollout engine holds with the train engine's HF export:
exactly (engines with ``get_hf_state_dict()``, e.g. the embedded engine) or by checksums
(engines with ``weight_checksums() -> {hf_name: tensor_checksum(...)}``). Tensors the engine
derives itself are named in an explicit skip list (:data:`DEFAULT_CHECK_SKIP` plus the tied
``lm_head.weight``); any other engine tensor that the export does not produce, any exported
tensor the engine lacks and any value mismatch is an error naming the tensors.

Preconditions: the train engine's parameters hold the current weights (after
``optim_step``; with a distributed optimizer the parameter all-gather must have completed);
the rollout engine is not generating during the sync (the engine's own session framing:
pause / flush cache belongs to the engine client).
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.mapping import MappingContext, MappingTable
from ferrule.contract.specs import UpdateGroup, UpdateGroupTable
from ferrule.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    WeightSyncError,
    _agree_errors,
    hf_unit_tensors,
    iter_full_units,
    iter_hf_buckets,
    plan_sync,
    tensor_bytes,
)
from ferrule.engine_settings import WeightSyncSettings
from ferrule.sync.direct import direct_sync, direct_unavailable, log_once
from ferrule.sync.groups import as_group_table

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEFAULT_CHECK_SKIP",
    "SENDER_RANK",
    "SyncStats",
    "WeightCheckReport",
    "check_weight_update_equal",
    "resolve_sync_tables",
    "sync_weights",
    "tensor_checksum",
]

#: The global rank that calls the rollout engine.
SENDER_RANK = 0

#: HF tensors an engine derives itself and that are never synced (``fnmatch`` patterns).
#: Rotary inverse frequencies are recomputed from ``rope_theta`` (older checkpoints store them
#: as ``model.layers.N.self_attn.rotary_emb.inv_freq``). The tied ``lm_head.weight`` is
#: added when the HF config ties embeddings (it aliases ``model.embed_tokens.weight``).
DEFAULT_CHECK_SKIP: tuple[str, ...] = ("*.rotary_emb.inv_freq",)


@dataclass(frozen=True)
class SyncStats:
    """What one :func:`sync_weights` call did on this rank.

    Attributes:
        version: the weight version sent.
        buckets: ``update_weights`` calls made (0 on ranks other than the sender).
        bytes: bytes of HF tensors sent (``numel * element_size``; 0 on other ranks).
        tensors: HF tensors sent (0 on other ranks).
        seconds: wall-clock seconds of the whole call on this rank (verification included).
        sender: True on the rank that called the rollout engine.
        checked: True if :func:`check_weight_update_equal` ran and passed.
        device_memory_before / device_memory_after: CUDA bytes allocated at the start and at the
            end of the call (:func:`ferrule.sync.sync_lora_adapter` records them; equal when the
            export left nothing behind); None on CPU or where not measured.
        direct: True if the direct path (:mod:`ferrule.sync.direct`) moved the weights (then
            ``buckets`` is 0).
    """

    version: int
    buckets: int
    bytes: int
    tensors: int
    seconds: float
    sender: bool
    checked: bool = False
    device_memory_before: int | None = None
    device_memory_after: int | None = None
    direct: bool = False


@dataclass(frozen=True)
class WeightCheckReport:
    """Result of a passed :func:`check_weight_update_equal` (on the sender; None elsewhere).

    Attributes:
        compared: HF tensors compared.
        skipped: engine tensors left out by the skip list (sorted).
        mode: ``"exact"`` (element-wise equality) or ``"checksum"`` (sha256 of the bytes).
    """

    compared: int
    skipped: tuple[str, ...]
    mode: str


def tensor_checksum(t: "torch.Tensor") -> str:
    """``"<dtype>:<shape>:<sha256 hex>"`` of a tensor's bytes (contiguous, on CPU).

    The dtype and shape are part of the string so that an engine can tell the verifier which
    dtype to cast the trainer's tensor to before hashing (see :func:`check_weight_update_equal`).
    """
    import torch

    c = t.detach().to("cpu").contiguous()
    if c.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
        data = c.view(torch.int16).numpy().tobytes()
    else:
        data = c.numpy().tobytes()
    dtype = str(c.dtype).removeprefix("torch.")
    shape = "x".join(str(s) for s in c.shape)
    return f"{dtype}:{shape}:{hashlib.sha256(data).hexdigest()}"


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------


def resolve_sync_tables(family: str, mapping: MappingTable | None = None,
                        update_groups: UpdateGroupTable | Sequence[UpdateGroup] | None = None
                        ) -> tuple[MappingTable, UpdateGroupTable]:
    """The family's mapping table and update-group table (from the registry unless given).

    Raises:
        ferrule.contract.registry.IncompleteFamilyError / UnknownModelError: the family lacks them.
    """
    if mapping is None or update_groups is None:
        from ferrule.contract import registry
        if mapping is None:
            mapping = registry.get_converter(family).resolved_mapping()
        if update_groups is None:
            update_groups = registry.get_update_groups(family)
    return mapping, as_group_table(update_groups, family)


_OLD_FORM = ("sync_weights / check_weight_update_equal no longer take the family beside the engine: call "
             "sync_weights(train_engine, rollout_engine, version) (the train engine holds its family, mapping "
             "table and update groups), or pass family=... (or mapping= and update_groups=) with bare model chunks.")


def _sync_inputs(source: Any, family: str | None, mapping: MappingTable | None,
                 update_groups: UpdateGroupTable | Sequence[UpdateGroup] | None, hf_config: Any
                 ) -> tuple[list, Mapping[str, Any], str, MappingTable, UpdateGroupTable]:
    """Model chunks, HF config dict, family, mapping table and update-group table of a sync.

    From a :class:`~ferrule.megatron.engine.TrainEngine` everything is what the engine holds
    (``.model``, ``.hf_config``, ``.family``, ``.mapping_table``, ``.update_groups``); explicit
    arguments win. With bare model chunks (a list, or one module) ``hf_config`` is required,
    and the tables come from ``mapping`` / ``update_groups`` or else the registry by ``family``.

    Raises:
        TypeError: ``source`` holds no model chunks.
        ValueError: bare chunks without ``hf_config``, or without ``family`` and the tables.
    """
    if isinstance(source, (list, tuple)):
        chunks = list(source)
    elif isinstance(getattr(source, "model", None), (list, tuple)):
        chunks = list(source.model)
        hf_config = hf_config if hf_config is not None else getattr(source, "hf_config", None)
        family = family or getattr(source, "family", None)
        mapping = mapping if mapping is not None else getattr(source, "mapping_table", None)
        update_groups = update_groups if update_groups is not None else getattr(source, "update_groups", None)
    elif callable(getattr(source, "named_parameters", None)):
        chunks = [source]
    else:
        raise TypeError(f"cannot find model chunks on {type(source).__name__}; pass the TrainEngine (its .model "
                        "list is used) or this rank's list of GPTModel chunks.")
    if hf_config is None:
        raise ValueError("pass hf_config= (the parsed HF config.json) together with bare model chunks.")
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    if family is None and (mapping is None or update_groups is None):
        raise ValueError("bare model chunks need family= (tables from the registry) or both mapping= and "
                         "update_groups=.")
    table, groups = resolve_sync_tables(family or getattr(mapping, "family", "unnamed"), mapping, update_groups)
    return chunks, hf_config, family or table.family, table, groups


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_sender(rollout_engine: Any, need: str) -> None:
    errors = []
    if _rank() == SENDER_RANK and (rollout_engine is None or not callable(getattr(rollout_engine, need, None))):
        errors.append(f"rank {SENDER_RANK} talks to the rollout engine but got {type(rollout_engine).__name__} "
                      f"without a callable .{need}; pass the rollout engine on global rank {SENDER_RANK}.")
    _agree_errors(errors)


# ---------------------------------------------------------------------------------------
# Sync
# ---------------------------------------------------------------------------------------


def sync_weights(train_engine_or_model_chunks: Any, rollout_engine: Any, version: int, *old_form: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_equal: bool = False, skip: Iterable[str] = (),
                 family: str | None = None, hf_config: Mapping[str, Any] | None = None,
                 mapping: MappingTable | None = None,
                 update_groups: UpdateGroupTable | Sequence[UpdateGroup] | None = None,
                 dtype: "torch.dtype | None" = None, direct: bool | None = None,
                 settings: WeightSyncSettings | None = None) -> SyncStats:
    """Send the train engine's weights to the rollout engine as HF-named buckets.

    Collective: call on every rank of the training job. Global rank 0 calls
    ``rollout_engine.update_weights(bucket, version)`` once per bucket; other ranks ignore
    ``rollout_engine``.

    Args:
        train_engine_or_model_chunks: the :class:`~ferrule.megatron.engine.TrainEngine` (its
            ``.model`` chunks, ``.hf_config``, ``.family``, ``.mapping_table`` and
            ``.update_groups`` are used) or this rank's list of GPTModel chunks (then
            ``hf_config`` and ``family`` (or ``mapping`` and ``update_groups``) are required).
        rollout_engine: the engine to update (on global rank 0).
        version: the weight version (e.g. the optimizer step count).
        old_form: empty in a correct call; it only catches the old positional form
            ``(engine, family, rollout, version)`` to raise a TypeError saying how to call.
        bucket_bytes: most bytes of HF tensors per ``update_weights`` call; a unit larger
            than this goes alone in its own bucket (units are never split).
        check_equal: after the sync, run :func:`check_weight_update_equal` (raises on mismatch).
        skip: extra ``fnmatch`` patterns of engine tensors the check leaves out.
        family: family name, for bare model chunks: its tables come from the registry unless
            ``mapping`` / ``update_groups`` are given.
        hf_config: the parsed HF config (required with bare model chunks).
        dtype: cast floating tensors before sending (default: parameter dtype; the engine
            casts to its own dtype anyway).
        direct: the direct path (:mod:`ferrule.sync.direct`: in one process on one device,
            strided copies from the parameters straight into the served weights, resolved once;
            no buckets, no host synchronisation). None (default): used where it applies, unless
            ``settings.direct`` is false (the reason it does not apply logged once, INFO); False:
            never (always buckets); True: as None, the reason logged as a WARNING.
            The rollout weights are equal bit for bit either way (tests/test_direct_sync.py).
        settings: :class:`~ferrule.engine_settings.WeightSyncSettings` (None: its defaults, deprecated
            ``FERRULE_DIRECT_SYNC*`` variables applied with a FutureWarning).

    Returns:
        :class:`SyncStats` for this rank.

    Raises:
        TypeError: the old call form ``sync_weights(engine, family, rollout, version)``.
        WeightSyncError: on every rank, before any tensor moves, if the parameters do not fit
            the mapping / update-group tables or the sender has no rollout engine; from the
            check, naming mismatched tensors. An error raised by the engine part-way leaves it
            with a mix of versions: sync again before generating.
    """
    t0 = time.perf_counter()
    if old_form or isinstance(rollout_engine, str):
        raise TypeError(_OLD_FORM)
    chunks, cfg, family, table, groups = _sync_inputs(train_engine_or_model_chunks, family, mapping, update_groups,
                                                      hf_config)
    _check_sender(rollout_engine, "update_weights")
    settings = (settings or WeightSyncSettings()).with_env()
    done = None
    if direct is not False and _rank() == SENDER_RANK:
        why = direct_unavailable(rollout_engine, dtype, settings)
        if why is None:
            done = direct_sync(chunks, rollout_engine, version, table, groups, cfg, settings)
        else:  # by design (another process, several ranks, switched off): INFO, unless direct=True asked for it
            log_once(f"direct weight sync not used: {why}; the bucketed path runs.",
                     logging.WARNING if direct else logging.INFO)
    if done is not None:
        n_tensors, n_bytes = done
        return _finish(t0, version, 0, n_bytes, n_tensors, True, check_equal, chunks, rollout_engine, skip, family,
                       cfg, table, groups, direct=True)
    plan = plan_sync(chunks, table, groups, cfg)
    sender = _rank() == SENDER_RANK
    n_buckets = n_bytes = n_tensors = 0
    units = iter_full_units(plan)
    if sender:
        for bucket in iter_hf_buckets(units, table, plan.ctx, bucket_bytes, dtype):
            rollout_engine.update_weights(bucket, version)
            n_buckets += 1
            n_tensors += len(bucket)
            n_bytes += sum(tensor_bytes(t) for _, t in bucket)
    else:
        for _ in units:  # take part in the collectives, drop the tensors
            pass
    return _finish(t0, version, n_buckets, n_bytes, n_tensors, sender, check_equal, chunks, rollout_engine, skip,
                   family, cfg, table, groups, direct=False)


def _finish(t0: float, version: int, n_buckets: int, n_bytes: int, n_tensors: int, sender: bool, check_equal: bool,
            chunks: list, rollout_engine: Any, skip: Iterable[str], family: str, cfg: Mapping[str, Any],
            table: MappingTable, groups: UpdateGroupTable, *, direct: bool) -> SyncStats:
    checked = False
    if check_equal:
        check_weight_update_equal(chunks, rollout_engine, skip=skip, family=family, hf_config=cfg, mapping=table,
                                  update_groups=groups)
        checked = True
    return SyncStats(version=version, buckets=n_buckets, bytes=n_bytes, tensors=n_tensors,
                     seconds=time.perf_counter() - t0, sender=sender, checked=checked, direct=direct)


# ---------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------


def _skip_patterns(skip: Iterable[str], ctx: MappingContext) -> tuple[str, ...]:
    pats = list(DEFAULT_CHECK_SKIP) + [s for s in skip]
    if ctx.tie_word_embeddings:
        pats.append("lm_head.weight")
    bad = [p for p in pats if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"check_weight_update_equal: skip patterns must be non-empty strings, got {bad!r}.")
    return tuple(pats)


def _engine_view(rollout_engine: Any) -> tuple[str, dict[str, Any]]:
    if callable(getattr(rollout_engine, "get_hf_state_dict", None)):
        return "exact", dict(rollout_engine.get_hf_state_dict())
    if callable(getattr(rollout_engine, "weight_checksums", None)):
        return "checksum", dict(rollout_engine.weight_checksums())
    raise WeightSyncError(f"check_weight_update_equal: {type(rollout_engine).__name__} offers neither "
                          "get_hf_state_dict() (exact compare) nor weight_checksums() (sha256 compare); "
                          "the engine cannot be verified.")


def _max_abs_diff(a: "torch.Tensor", b: "torch.Tensor") -> str:
    if not (a.is_floating_point() and b.is_floating_point()):
        return "values differ"
    d = (a.double() - b.double()).abs()
    return f"max |diff| {float(d.max()):.3e} over {int((d > 0).sum())}/{d.numel()} elements"


def check_weight_update_equal(train_engine_or_model_chunks: Any, rollout_engine: Any, *old_form: Any,
                              skip: Iterable[str] = (), family: str | None = None,
                              hf_config: Mapping[str, Any] | None = None,
                              mapping: MappingTable | None = None,
                              update_groups: UpdateGroupTable | Sequence[UpdateGroup] | None = None
                              ) -> WeightCheckReport | None:
    """Verify that the rollout engine holds exactly the train engine's weights.

    Collective (call on every rank, like :func:`sync_weights`, with the same arguments: a
    train engine, or bare chunks with ``family`` / tables and ``hf_config``); the comparison runs on global
    rank 0. The train side is the same HF export that :func:`sync_weights` sends, cast to the
    engine tensor's dtype (the engine casts on load, so a correct sync compares equal
    bit for bit). Engine side:

    - ``get_hf_state_dict() -> {hf_name: tensor}``: element-wise ``torch.equal``;
    - else ``weight_checksums() -> {hf_name: tensor_checksum(t)}``: the trainer's tensor is
      cast to the dtype named in the checksum, hashed with :func:`tensor_checksum`, compared.

    Engine tensors matching ``skip`` / :data:`DEFAULT_CHECK_SKIP` (and ``lm_head.weight`` for
    tied embeddings) are not compared; every other engine tensor must be produced by the export.

    Returns:
        A :class:`WeightCheckReport` on rank 0, None on other ranks.

    Raises:
        WeightSyncError: (on every rank) naming every mismatched tensor (with its max abs diff),
            every engine tensor the export never produces, and every exported tensor the
            engine lacks; the engine offers no way to read its weights.
    """

    if old_form or isinstance(rollout_engine, str):
        raise TypeError(_OLD_FORM)
    chunks, cfg, family, table, groups = _sync_inputs(train_engine_or_model_chunks, family, mapping, update_groups,
                                                      hf_config)
    sender = _rank() == SENDER_RANK
    errors: list[str] = []
    mode, engine = "exact", {}
    if sender:
        try:
            mode, engine = _engine_view(rollout_engine)
        except WeightSyncError as exc:
            errors.append(str(exc))
    _agree_errors(errors)
    plan = plan_sync(chunks, table, groups, cfg)
    patterns = _skip_patterns(skip, plan.ctx)
    units = iter_full_units(plan)
    if not sender:
        for _ in units:
            pass
        _agree_errors([])  # rank 0's verdict is raised on every rank
        return None
    mismatched, missing_in_engine, seen = [], [], set()
    for hf in hf_unit_tensors(units, table, plan.ctx):
        for name, t in hf:
            seen.add(name)
            if name not in engine:
                missing_in_engine.append(name)
                continue
            problem = compare_served_tensor(name, t, engine[name], mode, "train")
            if problem:
                mismatched.append(problem)
    skipped = sorted(n for n in engine if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    never_sent = sorted(n for n in engine if n not in seen and n not in skipped)
    problems = []
    if mismatched:
        problems.append(f"tensors differing between the rollout engine and the train engine ({len(mismatched)}):\n"
                        + "\n".join(f"  - {m}" for m in mismatched))
    if never_sent:
        problems.append(f"rollout-engine tensors the train engine never sends ({len(never_sent)}):\n"
                        + "\n".join(f"  - {n}" for n in never_sent)
                        + "\nThey would stay stale; map them, or add them to the skip list if the engine derives them.")
    if missing_in_engine:
        problems.append(f"exported tensors the rollout engine does not have ({len(missing_in_engine)}):\n"
                        + "\n".join(f"  - {n}" for n in missing_in_engine))
    _agree_errors([f"check_weight_update_equal failed ({mode} compare, family {family!r}):\n" + "\n".join(problems)]
                  if problems else [])
    return WeightCheckReport(compared=len(seen), skipped=tuple(skipped), mode=mode)


def compare_served_tensor(name: str, sent: "torch.Tensor", served: Any, mode: str, side: str) -> str | None:
    """Compare one tensor with what the rollout engine serves; None if equal, else a one-line reason.

    Args:
        sent: the tensor on the sending side. served: the engine's tensor (``mode == "exact"``)
            or its :func:`tensor_checksum` string (``mode == "checksum"``).
        side: word for the sending side in messages (``"train"``, ``"sent"``).
    """
    import torch

    if mode == "exact":
        ref = served.detach()
        if tuple(ref.shape) != tuple(sent.shape):
            return f"{name}: engine shape {tuple(ref.shape)} != {side} {tuple(sent.shape)}"
        mine = sent.detach().to(device=ref.device, dtype=ref.dtype)
        return None if torch.equal(mine, ref) else f"{name}: {_max_abs_diff(mine, ref)}"
    target = getattr(torch, str(served).split(":", 1)[0], None)
    if not isinstance(target, torch.dtype):
        return f"{name}: engine checksum {served!r} does not name a torch dtype"
    mine = tensor_checksum(sent.detach().to(target))
    if mine == served:
        return None
    return (f"{name}: checksum {mine.split(':', 2)[2][:12]}... != engine {str(served).split(':')[-1][:12]}... "
            f"({side} shape/dtype {mine.rsplit(':', 1)[0]}, engine {str(served).rsplit(':', 1)[0]})")
