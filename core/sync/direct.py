"""Direct weight sync: train engine -> embedded rollout engine in one process on one device, without buckets.

When the Megatron train engine and the rollout engine live in one process (world size 1, so TP =
PP = EP = DP = 1) on the same device, every HF tensor the bucketed path would build is a fixed
re-layout of one live mcore parameter, and its destination in the rollout engine is a fixed
strided view of the served weights (for the fast decode path, of the fused q/k/v and gate/up
buffers). :class:`DirectPlan` resolves those pairs **once**; each sync is then a few
``torch._foreach_copy_`` calls from strided views of the mcore parameters into strided views of
the rollout weights: no bucket, no ``contiguous()`` copy, no host synchronisation, no
per-tensor Python beyond one pointer check.

How a pair is found (the family's own tables, so every mapping is honoured: QKV interleave,
gate/up, tied or padded vocabulary, stacked experts, custom rows):

1. :func:`~ferrule.sync.buckets.plan_sync` binds the parameters and builds the update units
   exactly as the bucketed path does (same errors, same order).
2. Each parameter's mapping row is run once on an *index probe*: ``to_hf`` of an int64 tensor
   holding each element's flat index (what :mod:`ferrule.rollout._checkpoint_names` does with
   transformers' reverse conversion). The result says, element by element, which parameter
   element each HF element is. The rollout side says, element by element, where each HF
   element lives in the served weights (a strided alias, a flat index or per-parameter parts).
3. Both index arrays are ordered by destination and factored together into one strided shape
   (:func:`ferrule.sync.strides.joint_strides`; e.g. Qwen2's ``q_proj`` from Megatron's ``linear_qkv`` is
   ``[groups, q_rows_per_group * hidden]`` with source strides ``[(q+2kv rows per group) *
   hidden, 1]``). Adjacent contiguous pairs are merged (``gate_proj`` + ``up_proj`` into the
   fused buffer is one copy).
4. After the first direct sync the rollout engine's tensors are compared with the bucketed
   path's HF export (``torch.equal``, every element ``update_weights`` would write); a mismatch (a mapping whose ``to_hf``
   changes values, which the probe cannot see) is logged, the plan is dropped for good and
   this sync is redone through the bucketed path.

Where a tensor cannot be planned (a row whose ``to_hf`` rejects an integer probe or changes
values, a stacked-expert row with its own ``assemble``, a destination that is no strided view
after ordering) only that tensor goes through the old conversion and
``rollout_engine.update_weights`` every sync; where the whole path cannot apply (world size > 1,
the rollout engine asleep or on another device, a ``dtype=`` cast, ``weight_sync.direct: false``)
the bucketed path runs. Each reason is logged once (logger ``ferrule.sync``: WARNING where
tensors or a plan fall back, INFO where the path does not apply by design).

Copies, not aliases: the rollout weights are a snapshot of the train weights at the sync, so
``optim_step`` may run while the rollout engine generates (asynchronous RL) and colocation's
sleep / offload of either engine keeps working. Aliasing the identical layouts instead (norms,
``o_proj``, ``down_proj``, embedding, and ``linear_fc1`` = the fused ``[gate; up]`` buffer;
q/k/v differ: Megatron interleaves them per KV group) would save the ~0.7 GB of copies but
would need the contract "the rollout engine never generates while the optimizer writes" and
would couple the two engines' storages (offloading one would free the other's weights); it is
not done.

Ordering: the copies run on the current CUDA stream; the rollout engine's ``generate`` and the
train engine's next ``optim_step`` run on the same stream, so they see the copies completed
without a host synchronisation. Importing this module imports no torch.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrule.mapping import MappingContext, MappingTable, StackExperts
from ferrule.contract.specs import UpdateGroupTable
from ferrule.sync.buckets import SyncPlan, WeightSyncError, plan_sync
from ferrule.sync.strides import flat_index, joint_strides, strided_index
from ferrule.engine_settings import WeightSyncSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DirectPlan", "build_plan", "direct_sync", "direct_unavailable", "log_once"]

log = logging.getLogger("ferrule.sync")

_LOGGED: set[str] = set()


def log_once(msg: str, level: int = logging.WARNING) -> None:
    """Log ``msg`` (logger ``ferrule.sync``) the first time it occurs in this process. WARNING for
    tensors or plans that fall back; INFO where the direct path does not apply by design (another
    process, several ranks, a sleeping engine)."""
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.log(level, msg)


# ---------------------------------------------------------------------------------------
# Destinations
# ---------------------------------------------------------------------------------------


def _dst_pieces(entry: Any) -> list[tuple["torch.Tensor", "torch.Tensor | None", "torch.Tensor"]] | None:
    """``[(base, HF flat positions or None for all, flat indices into base)]`` of a rollout checkpoint tensor."""
    if entry.view is not None:
        idx = flat_index(entry.view, entry.param)
        return None if idx is None else [(entry.param, None, idx)]
    if entry.parts:
        return [(p, pos.reshape(-1), local.reshape(-1)) for p, pos, local in entry.parts]
    if not entry.param.is_contiguous():
        return None
    return [(entry.param, None, entry.index.reshape(-1))]


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


@dataclass
class _Copy:
    """One strided copy: ``dst_base.as_strided(shape, dst_strides, dst_offset) <- src_param[as_strided...]``."""

    src: Any  # the live mcore Parameter (its .data is read at bind time; offsets relative to it)
    src_name: str
    dst: "torch.Tensor"  # a tensor on the rollout engine's storage (a detached alias of a parameter)
    hf_name: str
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    src_offset: int
    dst_strides: tuple[int, ...]
    dst_offset: int  # absolute, in elements of the destination storage

    def contiguous(self) -> bool:
        return len(self.shape) == 1 and self.src_strides == (1,) and self.dst_strides == (1,)


def _same_storage(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    return a.dtype == b.dtype and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _merge(copies: list[_Copy]) -> list[_Copy]:
    """Join copies whose source and destination blocks are both contiguous and adjacent (gate then up)."""
    out: list[_Copy] = []
    for c in copies:
        p = out[-1] if out else None
        if (p is not None and p.contiguous() and c.contiguous() and p.src is c.src and _same_storage(p.dst, c.dst)
                and p.src_offset + p.shape[0] == c.src_offset and p.dst_offset + p.shape[0] == c.dst_offset):
            out[-1] = _Copy(p.src, p.src_name, p.dst, f"{p.hf_name}+{c.hf_name}", (p.shape[0] + c.shape[0],), (1,),
                            p.src_offset, (1,), p.dst_offset)
        else:
            out.append(c)
    return out


@dataclass
class DirectPlan:
    """The resolved (mcore source view -> rollout destination view) pairs of one (train, rollout) pair.

    Attributes:
        copies: the planned strided copies, in update-unit order (adjacent contiguous ones merged).
        fallback: global mcore names converted and sent through ``update_weights`` every sync,
            with the reason for each (empty for every in-tree family on one device).
        fallback_hf: the HF names those parameters produce that are not planned.
        targets: the rollout engine's checkpoint-tensor table the plan was resolved against
            (identity: a new table means the served weights moved, e.g. re-fused).
        nbytes / ntensors: bytes and count of the HF tensors a bucketed sync sends (its
            :class:`~ferrule.sync.SyncStats`), fallback included except rows whose ``to_hf``
            rejects the probe.
        verified: the first direct sync was compared with the bucketed export and matched.
    """

    sync_plan: SyncPlan
    copies: list[_Copy]
    fallback: dict[str, str]
    fallback_hf: set[str]
    targets: Any
    nbytes: int
    ntensors: int
    verified: bool = False
    gathers: list["_Gather"] = field(default_factory=list, repr=False)
    rest: list[_Copy] = field(default_factory=list, repr=False)
    _bound: dict = field(default_factory=dict, repr=False)
    _sources: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._sources = list({id(c.src): c.src for c in self.copies}.values())
        self.gathers, self.rest = _row_gathers(self.copies)

    # -- binding ------------------------------------------------------------------------
    def _key(self) -> tuple:
        return tuple(p.data_ptr() for p in self._sources)

    def bind(self, rows: bool) -> tuple[list[tuple[list, list]], list[tuple]]:
        """``([(dsts, srcs)] for torch._foreach_copy_, [(src rows, index, dst rows)] for index_select)``
        over the current parameter memory (re-bound when it moved); ``rows``: the row gathers of
        :func:`_row_gathers` replace the copies they cover."""
        key = self._key()
        hit = self._bound.get(rows)
        if hit is not None and hit[0] == key:
            return hit[1]
        if any(k == 0 for k in key):
            raise WeightSyncError("direct weight sync: a train-engine parameter has no memory (offloaded?); "
                                  "onload the train engine before syncing.")
        groups: dict[tuple, tuple[list, list]] = {}
        strided: tuple[list, list] = ([], [])
        for c in (self.rest if rows else self.copies):
            src = c.src.detach().as_strided(c.shape, c.src_strides, c.src.detach().storage_offset() + c.src_offset)
            dst = c.dst.as_strided(c.shape, c.dst_strides, c.dst_offset)
            if c.contiguous() and src.dtype == dst.dtype:
                g = groups.setdefault((src.device, src.dtype), ([], []))
            else:
                g = strided
            g[0].append(dst)
            g[1].append(src)
        copies = [g for g in groups.values()] + ([strided] if strided[0] else [])
        gathers = [(g.src.detach().view(-1, g.width), g.rows, g.dst.as_strided((g.rows.numel(), g.width), (g.width, 1),
                                                                               g.dst_offset))
                   for g in (self.gathers if rows else ())]
        self._bound = {rows: (key, (copies, gathers))}
        return copies, gathers

    def run(self, settings: Any = None) -> None:
        """The copies (asynchronous on CUDA, ordered on the current stream); ``settings``: a
        :class:`~ferrule.engine_settings.WeightSyncSettings` (None: its defaults).

        The strided copies of one parameter into one destination buffer (Megatron's ``linear_qkv``
        into the fused q/k/v buffer) run as one ``index_select`` of rows each
        (``row_gathers`` false: as strided copies; H200, Qwen2-0.5B shape: 1.15 ms vs
        1.49 ms per sync); ``foreach_copies`` false: one ``copy_`` per copy instead of
        ``torch._foreach_copy_`` (2.65 ms; both switches for measurements, bench/bench_sync.py).
        """
        import torch

        settings = settings or WeightSyncSettings()
        copies, gathers = self.bind(settings.row_gathers)
        loop = not settings.foreach_copies
        for dsts, srcs in copies:
            if loop:
                for d, s in zip(dsts, srcs):
                    d.copy_(s)
            else:
                torch._foreach_copy_(dsts, srcs)
        for src, index, dst in gathers:
            torch.index_select(src, 0, index, out=dst)


@dataclass
class _Gather:
    """Rows of one parameter (viewed ``[-1, width]``) into consecutive rows of one destination buffer."""

    src: Any
    dst: "torch.Tensor"
    width: int
    rows: "torch.Tensor"  # source row per destination row (int64, on the parameter's device)
    dst_offset: int  # absolute element offset of the first destination row in its storage
    hf_names: str


def _row_gathers(copies: list[_Copy]) -> tuple[list[_Gather], list[_Copy]]:
    """Strided copies of one parameter into one destination storage that move whole rows, as row gathers
    (``index_select``), and the copies left; e.g. q, k and v of a layer from ``linear_qkv`` into the fused
    ``[q; k; v]`` buffer are one gather of rows."""
    import torch

    by_pair: dict[tuple, list[int]] = {}
    for i, c in enumerate(copies):
        if not c.contiguous():
            by_pair.setdefault((id(c.src), c.dst.untyped_storage().data_ptr(), c.dst.dtype), []).append(i)
    gathers: list[_Gather] = []
    used: set[int] = set()
    for idxs in by_pair.values():
        cs = [copies[i] for i in idxs]
        src = cs[0].src.detach()
        if len(cs) < 2 or src.dtype != cs[0].dst.dtype:
            continue
        width = src.shape[-1] if src.dim() >= 2 else 1
        step = torch.arange(width, dtype=torch.int64, device=src.device)
        src_rows, dst_rows = [], []
        for c in cs:
            s_idx = strided_index(c.shape, c.src_strides, c.src_offset, src.device)
            d_idx = strided_index(c.shape, c.dst_strides, c.dst_offset, src.device)
            if s_idx.numel() % width:
                break
            s2, d2 = s_idx.view(-1, width), d_idx.view(-1, width)
            if not (torch.equal(s2, s2[:, :1] + step) and torch.equal(d2, d2[:, :1] + step)
                    and bool((s2[:, 0] % width == 0).all()) and bool((d2[:, 0] % width == 0).all())):
                break
            src_rows.append(s2[:, 0] // width)
            dst_rows.append(d2[:, 0] // width)
        else:
            sr, dr = torch.cat(src_rows), torch.cat(dst_rows)
            order = torch.argsort(dr)
            sr, dr = sr[order], dr[order]
            lo = int(dr[0])
            if torch.equal(dr, torch.arange(lo, lo + dr.numel(), dtype=torch.int64, device=dr.device)):
                gathers.append(_Gather(cs[0].src, cs[0].dst, width, sr.contiguous(), lo * width,
                                       "+".join(c.hf_name for c in cs)))
                used.update(idxs)
    return gathers, [c for i, c in enumerate(copies) if i not in used]


def _probe(shape: tuple[int, ...], device: Any) -> "torch.Tensor":
    import torch

    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64, device=device).view(shape)


def build_plan(chunks: Sequence[Any], table: MappingTable, groups: UpdateGroupTable, hf_config: Mapping[str, Any],
               targets: Mapping[str, Any]) -> DirectPlan:
    """Resolve the direct copies for this train engine's parameters and the rollout ``targets``
    (``{hf checkpoint name: CheckpointTensor}``, :meth:`EmbeddedEngine.direct_weight_targets`).

    Raises:
        WeightSyncError: the tables do not fit the parameters (as :func:`plan_sync`).
    """
    import torch

    sp = plan_sync(chunks, table, groups, hf_config)
    ctx: MappingContext = sp.ctx
    copies: list[_Copy] = []
    fallback: dict[str, str] = {}
    fallback_hf: set[str] = set()
    hf_bytes: dict[str, int] = {}
    with torch.no_grad():
        for step in (s for stage in sp.steps for s in stage):
            for name in step.local or ():
                bp = sp.params[name]
                m, wild = bp.mapping, bp.wildcards
                if not m.exports(ctx):
                    continue
                keys = m.hf_keys(name, ctx)
                param = bp.param.detach()
                why = None
                planned: list[_Copy] = []
                try:
                    outs = m.to_hf(_probe(tuple(param.shape), param.device), ctx, wild)
                except Exception as exc:  # noqa: BLE001  (any failure: this row cannot be probed)
                    outs, why = (), f"{type(m).__name__}.to_hf does not run on an index probe ({type(exc).__name__}: {exc})"
                stack = isinstance(m, StackExperts)
                if stack and type(m).assemble is not StackExperts.assemble:
                    why = f"{type(m).__name__} assembles its stack itself"
                if not param.is_contiguous():  # the probe's flat indices are row-major offsets into the parameter
                    why = "the parameter is not contiguous"
                if why is None:
                    for key, out in zip(keys, outs):
                        why = _plan_one(param, bp.param, name, key, out, targets, m.expert_index(wild) if stack else None,
                                        planned)
                        if why is not None:
                            break
                for key, out in zip(keys, outs):  # what the bucketed path would send (SyncStats)
                    hf_bytes[key] = hf_bytes.get(key, 0) + out.numel() * param.element_size()
                if why is None:
                    copies += planned
                else:
                    fallback[name] = why
                    fallback_hf.update(keys)
    if stack_keys := {k for n in fallback for k in sp.params[n].mapping.hf_keys(n, ctx)
                      if isinstance(sp.params[n].mapping, StackExperts)}:
        # a stacked HF tensor is written whole: every expert of a falling-back stack falls back with it
        for n, bp in sp.params.items():
            if isinstance(bp.mapping, StackExperts) and n not in fallback and bp.mapping.hf_keys(n, ctx)[0] in stack_keys:
                fallback[n] = "another expert of its stacked HF tensor falls back"
        names_left = set(fallback)
        copies = [c for c in copies if c.src_name not in names_left]
    by_reason: dict[str, list[str]] = {}
    for n, why in fallback.items():
        by_reason.setdefault(why, []).append(n)
    for why, names in by_reason.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log_once(f"direct weight sync: {shown} go(es) through update_weights every sync: {why}.")
    return DirectPlan(sp, _merge(copies), fallback, fallback_hf, targets, sum(hf_bytes.values()), len(hf_bytes))


def _plan_one(param: "torch.Tensor", live: Any, name: str, key: str, out: Any, targets: Mapping[str, Any],
              expert: int | None, planned: list[_Copy]) -> str | None:
    """Plan HF tensor ``key`` (``out``: its index probe) into ``planned``; None, or why it cannot be."""
    import torch

    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64:
        return "to_hf changes the dtype of an index probe (it computes values, not a layout)"
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= param.numel()):
        return "to_hf changes the values of an index probe (it computes values, not a layout)"
    entry = targets.get(key)
    if entry is None:
        return f"the rollout engine has no tensor {key!r}"  # update_weights raises, naming it
    pieces = _dst_pieces(entry)
    if pieces is None:
        return f"the rollout engine's {key!r} is not addressable in place"
    src_flat = out.reshape(-1)
    if expert is None:
        if tuple(out.shape) != tuple(entry.shape):
            return f"shape {tuple(out.shape)} != the rollout engine's {tuple(entry.shape)}"
        lo = 0
    else:
        if tuple(entry.shape[1:]) != tuple(out.shape) or not 0 <= expert < entry.shape[0]:
            return f"expert {expert} of shape {tuple(out.shape)} does not fit the rollout engine's {tuple(entry.shape)}"
        lo = expert * src_flat.numel()
    hi = lo + src_flat.numel()
    for base, pos, local in pieces:
        if pos is None:
            a_dst, a_src = local[lo:hi], src_flat
        else:
            keep = (pos >= lo) & (pos < hi)
            if not bool(keep.any()):
                continue
            a_dst, a_src = local[keep], src_flat[pos[keep] - lo]
        if a_dst.numel() > 1 and not bool((torch.diff(a_dst) > 0).all()):
            order = torch.argsort(a_dst)
            a_dst, a_src = a_dst[order], a_src[order]
        js = joint_strides(a_src.to(torch.int64), a_dst.to(torch.int64))
        if js is None:
            return f"{key!r} is no strided copy of {name} (source or destination not strided in one shape)"
        if base.device != param.device:
            return f"the rollout engine's {key!r} is on {base.device}, the parameter on {param.device}"
        shape, s_st, s_off, d_st, d_off = js
        planned.append(_Copy(live, name, base, key, shape, s_st, s_off, d_st, base.storage_offset() + d_off))
    return None


# ---------------------------------------------------------------------------------------
# Entry point (called by ferrule.sync.sync_weights)
# ---------------------------------------------------------------------------------------

#: rollout engine -> (key, DirectPlan or False (do not use), the key's objects); the plan (and through it
#: the train engine's parameters) lives as long as the rollout engine or until another train engine syncs
_PLANS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def direct_unavailable(rollout_engine: Any, dtype: Any, settings: Any = None) -> str | None:
    """Why the direct path cannot serve this sync (None: it can); ``settings``: a
    :class:`~ferrule.engine_settings.WeightSyncSettings` (None: its defaults)."""
    import torch.distributed as dist

    if settings is not None and not settings.direct:
        return "weight_sync.direct is false"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "the job has more than one rank (the direct path is for one process, TP = PP = EP = DP = 1)"
    if not callable(getattr(rollout_engine, "direct_weight_targets", None)):
        return f"{type(rollout_engine).__name__} has no direct_weight_targets() (another process, e.g. SGLang)"
    if dtype is not None and dtype != getattr(rollout_engine, "dtype", None):
        return f"sync_weights(dtype={dtype}) casts to another dtype than the rollout engine's"
    return None


def direct_sync(chunks: Sequence[Any], rollout_engine: Any, version: int, table: MappingTable,
                groups: UpdateGroupTable, hf_config: Mapping[str, Any], settings: Any = None) -> tuple[int, int] | None:
    """Sync through the cached :class:`DirectPlan`; ``(tensors, bytes)`` sent, or None if the
    bucketed path must run (reason logged once). The caller checked :func:`direct_unavailable`.

    Raises:
        ValueError: ``version`` lower than the rollout engine's (nothing written).
        WeightSyncError: as :func:`plan_sync`; a parameter without memory.
    """
    targets = rollout_engine.direct_weight_targets()
    if targets is None:
        log_once(f"direct weight sync: {type(rollout_engine).__name__} is asleep (its weights are on the host); "
                 "syncs while asleep go through update_weights.", logging.INFO)
        return None
    if version < rollout_engine.weights_version:
        raise ValueError(f"sync_weights(version={version}) is older than the rollout engine's weights_version="
                         f"{rollout_engine.weights_version}; versions must not go backwards.")
    first = next((p for c in chunks for p in c.parameters()), None)
    if first is None or first.device != getattr(rollout_engine, "device", first.device):
        log_once(f"direct weight sync not used: the rollout engine is on {getattr(rollout_engine, 'device', '?')}, the "
                 f"train engine on {None if first is None else first.device}; the bucketed path runs.")
        return None
    # one plan per rollout engine, for the last train engine / tables synced into it (their ids are the key;
    # the plan holds them, so an id cannot be reused while it lives)
    key = (tuple(id(c) for c in chunks), id(table), id(groups))
    held = _PLANS.get(rollout_engine)
    plan = held[1] if held is not None and held[0] == key else None
    if plan is False:
        return None
    if plan is None or plan.targets is not targets:
        plan = build_plan(chunks, table, groups, hf_config, targets)
        _PLANS[rollout_engine] = (key, plan, (tuple(chunks), table, groups))
        if not plan.copies:
            _PLANS[rollout_engine] = (key, False, (tuple(chunks), table, groups))
            log_once("direct weight sync not used: no tensor could be planned (see above); the bucketed path runs.")
            return None
    plan.run(settings)
    if plan.fallback:
        _send_fallback(plan, rollout_engine, version)
    if not plan.verified:
        problem = _verify(plan, rollout_engine)
        if problem:
            _PLANS[rollout_engine] = (key, False, (tuple(chunks), table, groups))
            log_once(f"direct weight sync disabled for this engine pair: {problem}; every sync goes through buckets.")
            return None
        plan.verified = True
    rollout_engine.set_weights_version(version)
    return plan.ntensors, plan.nbytes


def _converted(plan: DirectPlan, names: set[str] | None):
    """HF ``(name, tensor)`` pairs of the bucketed conversion (of the mcore ``names`` only, if given)."""
    from ferrule.sync.buckets import hf_unit_tensors, iter_full_units

    sp = plan.sync_plan
    units = iter_full_units(sp)
    if names is not None:
        units = (u for u in units if any(n in names for n in u.names))
    for hf in hf_unit_tensors(units, sp.table, sp.ctx):
        yield from hf


def _send_fallback(plan: DirectPlan, rollout_engine: Any, version: int) -> None:
    """The tensors the plan does not cover, converted and sent in buckets of at most DEFAULT_BUCKET_BYTES."""
    from ferrule.sync.buckets import DEFAULT_BUCKET_BYTES, tensor_bytes

    bucket, used = [], 0
    for k, t in _converted(plan, set(plan.fallback)):
        if k not in plan.fallback_hf:
            continue
        if bucket and used + tensor_bytes(t) > DEFAULT_BUCKET_BYTES:
            rollout_engine.update_weights(bucket, version)
            bucket, used = [], 0
        bucket.append((k, t))
        used += tensor_bytes(t)
    if bucket:
        rollout_engine.update_weights(bucket, version)


def _verify(plan: DirectPlan, rollout_engine: Any) -> str | None:
    """Compare every served tensor with the bucketed export once; None if all equal."""
    import torch

    served = plan.targets
    bad = []
    for name, t in _converted(plan, None):
        entry = served.get(name)
        if entry is None:
            continue
        if tuple(entry.shape) != tuple(t.shape):
            bad.append(name)
            continue
        flat = t.reshape(-1)
        if entry.view is not None:
            pairs = [(entry.view, t)]
        elif entry.parts:  # what update_weights writes: the parts' positions (padding the conversion adds is dropped)
            pairs = [(param.reshape(-1)[local], flat[pos]) for param, pos, local in entry.parts]
        else:
            pairs = [(entry.param.reshape(-1)[entry.index.reshape(-1)], flat)]
        if not all(torch.equal(a, b.to(a.dtype)) for a, b in pairs):
            bad.append(name)
    return f"after the first direct sync {len(bad)} tensor(s) differ from the bucketed export, e.g. {bad[:3]}" \
        if bad else None
