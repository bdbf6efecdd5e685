"""The mapping table (a family's complete, immutable set of parameter mappings) and the HF assembler.

Builds on :mod:`ferrule.mapping.vocabulary` (:class:`~ferrule.mapping.Rename`,
:class:`~ferrule.mapping.FuseQKV`, ...) and imports nothing else of ferrule;
``ferrule.mapping`` re-exports both. Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrule.mapping.experts import StackExperts
from ferrule.mapping.vocabulary import Ignore, MappingContext, MappingError, ParamMapping, Passthrough, sited

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HFAssembler", "MappingTable"]


def _offenders(title: str, items: Iterable[str], fix: str, limit: int = 10_000) -> str:
    items = sorted(items)
    lines = "\n".join(f"  - {sited(x)}" for x in items[:limit])  # each named with its layer and op
    return f"{title} ({len(items)}):\n{lines}\n{fix}"


@dataclass(frozen=True)
class MappingTable:
    """A family's complete, immutable table of :class:`ParamMapping` entries plus :class:`Ignore` rules.

    Attributes:
        family: the family name (for messages).
        mappings: one entry per mcore parameter pattern (patterns must be unique).
        ignores: HF key patterns that are deliberately dropped.
        passthrough: HF key prefixes kept verbatim beside the Megatron checkpoint (not loaded).
        peft_table: the same mcore parameters named and laid out as the *transformers model in
            memory* (its module names, which HF PEFT adapter keys use), for a family whose
            checkpoint keys differ from them (transformers' ``conversion_mapping`` renames or
            splits them on load, e.g. Inkling's released ``model.llm.*`` -> ``model.language_model.*``);
            None: the checkpoint names are the module names. Read by :mod:`ferrule.lora` only.

    Names given to the table are *global* mcore names: layer index counted over the whole
    model (PP offset added) and expert index global (EP offset added); see
    :func:`ferrule.megatron.param_gather.global_param_names`.
    """

    family: str
    mappings: tuple[ParamMapping, ...]
    ignores: tuple[Ignore, ...] = ()
    passthrough: tuple[Passthrough, ...] = ()
    peft_table: "MappingTable | None" = None

    def __post_init__(self) -> None:
        if not isinstance(self.mappings, tuple) or not isinstance(self.ignores, tuple):
            raise MappingError(f"MappingTable({self.family}): mappings and ignores must be tuples (tables are immutable).")
        bad = [m for m in self.mappings if not isinstance(m, ParamMapping)]
        bad += [i for i in self.ignores if not isinstance(i, Ignore)]
        if not isinstance(self.passthrough, tuple):
            raise MappingError(f"MappingTable({self.family}): passthrough must be a tuple (tables are immutable).")
        bad += [p for p in self.passthrough if not isinstance(p, Passthrough)]
        if self.peft_table is not None and not isinstance(self.peft_table, MappingTable):
            bad.append(self.peft_table)
        if bad:
            raise MappingError(f"MappingTable({self.family}) holds non-mapping entries {bad!r}.")
        pats = [m.mcore for m in self.mappings]
        dupes = sorted({p for p in pats if pats.count(p) > 1})
        if dupes:
            raise MappingError(f"MappingTable({self.family}) maps {dupes} more than once; keep one entry each.")

    # -- resolution ---------------------------------------------------------------------
    def resolve(self, mcore_name: str) -> tuple[ParamMapping, tuple[str, ...]]:
        """The mapping and wildcard values for a global mcore name.

        Raises:
            MappingError: no entry, or more than one entry, matches.
        """
        hits = [(m, w) for m in self.mappings if (w := m.match(mcore_name)) is not None]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            raise MappingError(f"MappingTable({self.family}): no mapping for mcore parameter {mcore_name!r}; add one.")
        raise MappingError(
            f"MappingTable({self.family}): {mcore_name!r} matches several entries "
            f"{[m.mcore for m, _ in hits]}; make the patterns disjoint."
        )

    def hf_keys(self, mcore_name: str, ctx: MappingContext | None = None) -> tuple[str, ...]:
        """HF keys holding the given global mcore parameter."""
        m, _ = self.resolve(mcore_name)
        return m.hf_keys(mcore_name, ctx)

    def is_ignored(self, hf_key: str) -> bool:
        """True for HF keys Megatron does not load: keys of :class:`Ignore` and :class:`Passthrough` rows."""
        return any(i.match(hf_key) for i in self.ignores) or self.is_passthrough(hf_key)

    def is_passthrough(self, hf_key: str) -> bool:
        """True for HF keys a conversion keeps verbatim beside the Megatron checkpoint."""
        return any(p.match(hf_key) for p in self.passthrough)

    # -- completeness -------------------------------------------------------------------
    def check_mcore_names(self, mcore_names: Iterable[str]) -> None:
        """Every name resolves to exactly one mapping.

        Raises:
            MappingError: listing every unmapped or ambiguously mapped name.
        """
        unmapped, ambiguous = [], []
        for name in mcore_names:
            n = sum(1 for m in self.mappings if m.match(name) is not None)
            if n == 0:
                unmapped.append(name)
            elif n > 1:
                ambiguous.append(name)
        msgs = []
        if unmapped:
            msgs.append(_offenders(f"MappingTable({self.family}): mcore parameters without a mapping", unmapped,
                                   "Add an entry for each to the family's MAPPING."))
        if ambiguous:
            msgs.append(_offenders(f"MappingTable({self.family}): mcore parameters matched by several entries",
                                   ambiguous, "Make the patterns disjoint."))
        if msgs:
            raise MappingError("\n".join(msgs))

    def expected_hf_keys(self, mcore_names: Iterable[str], ctx: MappingContext | None) -> dict[str, str]:
        """``{hf_key: mcore_name}`` for every HF key the given mcore parameters read."""
        out: dict[str, str] = {}
        for name in mcore_names:
            for key in self.hf_keys(name, ctx):
                out.setdefault(key, name)
        return out

    def check_hf_keys(self, hf_keys: Iterable[str], mcore_names: Iterable[str], ctx: MappingContext | None) -> None:
        """HF keys present == HF keys the mcore parameters need, up to ignored keys.

        Raises:
            MappingError: listing every missing key (needed but absent, with the mcore
                parameter needing it) and every extra key (present, not mapped, not ignored).
        """
        mcore_names = list(mcore_names)
        self.check_mcore_names(mcore_names)
        present = set(hf_keys)
        expected = self.expected_hf_keys(mcore_names, ctx)
        missing = [f"{k}  (needed by {expected[k]})" for k in expected if k not in present]
        extra = [k for k in present if k not in expected and not self.is_ignored(k)]
        msgs = []
        if missing:
            msgs.append(_offenders(f"MappingTable({self.family}): HF keys missing from the checkpoint", missing,
                                   "The checkpoint is incomplete or belongs to another model/config."))
        if extra:
            msgs.append(_offenders(f"MappingTable({self.family}): HF keys neither mapped nor ignored", extra,
                                   "Map them, or add an Ignore(hf=..., reason=...) entry if they carry no weights."))
        if msgs:
            raise MappingError("\n".join(msgs))

    # -- whole state dicts (full, unsharded tensors) -------------------------------------
    def hf_to_mcore(self, hf_state: Mapping[str, "torch.Tensor"], mcore_names: Iterable[str],
                    ctx: MappingContext) -> dict[str, "torch.Tensor"]:
        """Full HF tensors -> full mcore tensors for the given global mcore names.

        Raises:
            MappingError: incompleteness in either direction (every offender listed) or a
                shape that does not fit the config.
        """
        mcore_names = list(mcore_names)
        self.check_hf_keys(hf_state.keys(), mcore_names, ctx)
        out = {}
        for name in mcore_names:
            m, wild = self.resolve(name)
            out[name] = m.to_mcore([hf_state[k] for k in m.hf_keys(name, ctx)], ctx, wild)
        return out

    def mcore_to_hf(self, mcore_state: Mapping[str, "torch.Tensor"], ctx: MappingContext) -> dict[str, "torch.Tensor"]:
        """Full mcore tensors (global names) -> full HF tensors (stacked experts assembled).

        The same assembly that export and weight sync use (:class:`HFAssembler`).

        Raises:
            MappingError: an unmapped name, or an incomplete expert stack.
        """
        self.check_mcore_names(mcore_state.keys())
        assembler = HFAssembler(self, ctx)
        out: dict[str, Any] = {}
        for name, full in mcore_state.items():
            out.update(assembler.add(name, full))
        assembler.finish()
        return out

    # -- tensor parallelism ---------------------------------------------------------------
    def shard(self, mcore_name: str, full: "torch.Tensor", rank: int, size: int) -> "torch.Tensor":
        """TP rank ``rank``'s local slice of the full mcore tensor (see :meth:`ParamMapping.shard`)."""
        return self.resolve(mcore_name)[0].shard(full, rank, size)

    def gather(self, mcore_name: str, shards: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """The full mcore tensor from all TP ranks' slices (see :meth:`ParamMapping.gather`)."""
        return self.resolve(mcore_name)[0].gather(shards)


class HFAssembler:
    """Assemble HF tensors from a stream of ``(global mcore name, full mcore tensor)`` pairs.

    The one place where full mcore tensors become HF-named tensors: export
    (:func:`ferrule.megatron.weights.export_mcore_to_hf`), weight sync
    (:mod:`ferrule.sync.buckets`) and :meth:`MappingTable.mcore_to_hf` all feed it.
    :meth:`add` converts one parameter through its mapping (:meth:`ParamMapping.to_hf`: names,
    layouts, vocabulary padding removed) and returns the HF tensors that are complete;
    :class:`~ferrule.mapping.StackExperts` pieces (one expert each) are held until all
    ``ctx.num_experts`` experts of the HF tensor have arrived, then stacked to ``[E, ...]``.
    Parameters whose mapping does not export (a tied output layer) produce nothing.

    Args:
        table: the family's mapping table.
        ctx: the mapping context (head counts, vocabulary, tying, experts).
        dtype: cast floating HF tensors to this dtype (None: keep the parameter dtype).
    """

    def __init__(self, table: MappingTable, ctx: MappingContext, dtype: "torch.dtype | None" = None):
        self.table, self.ctx, self.dtype = table, ctx, dtype
        self._stacks: dict[str, tuple[StackExperts, dict[int, Any]]] = {}

    def add(self, mcore_name: str, full: "torch.Tensor") -> list[tuple[str, "torch.Tensor"]]:
        """HF ``(name, tensor)`` pairs completed by this parameter (possibly none).

        Raises:
            MappingError: no (or more than one) mapping for ``mcore_name``; a shape that does
                not fit the context.
        """
        m, wild = self.table.resolve(mcore_name)
        if not m.exports(self.ctx):
            return []
        keys = m.hf_keys(mcore_name, self.ctx)
        tensors = m.to_hf(full, self.ctx, wild)
        if isinstance(m, StackExperts):
            if not self.ctx.num_experts:
                raise MappingError(f"{m.hf}: StackExperts needs the number of experts (MappingContext.num_experts, "
                                   "HF num_experts / num_local_experts); the context has none.")
            pieces = self._stacks.setdefault(keys[0], (m, {}))[1]
            pieces[m.expert_index(wild)] = tensors[0]
            if len(pieces) < self.ctx.num_experts:
                return []
            out = [(keys[0], m.assemble(self._stacks.pop(keys[0])[1], self.ctx))]
        else:
            out = list(zip(keys, tensors))
        if self.dtype is not None:
            out = [(k, t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t) for k, t in out]
        return out

    def finish(self) -> None:
        """Check that no stacked-expert tensor is left incomplete.

        Raises:
            MappingError: naming every HF tensor still missing experts.
        """
        if self._stacks:
            left = {k: sorted(p) for k, (_, p) in self._stacks.items()}
            self._stacks.clear()
            raise MappingError(f"MappingTable({self.table.family}): stacked-expert HF tensors incomplete at the end "
                               f"(HF name: experts received): {left}; every expert of a layer must be exported "
                               f"(ctx.num_experts={self.ctx.num_experts}).")
