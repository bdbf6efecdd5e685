"""The LoRA applier contract and the core appliers for Llama-shaped Megatron decoders.

An applier (:class:`~ferrule.contract.specs.LoRAApplierSpec`, hook ``register_lora_appliers``) serves one
module kind of :data:`~ferrule.contract.specs.LORA_KINDS` and names three callables:

- ``apply(chunk, settings, ctx) -> list[str]``: attach adapters to the modules of its kind in one
  model chunk (an unwrapped ``GPTModel``) that ``ctx.selects(...)`` picks, using
  :func:`ferrule.lora.layers.attach_adapter` (or a module of its own); return the global mcore
  names of the modules it adapted.
- ``export(entries, ctx) -> Iterator[tuple[str, Tensor]]``: full (TP/EP/PP-gathered) HF PEFT
  tensors of its adapters (collective: every rank iterates to the end).
- ``load(entries, tensors, ctx, *, dry_run) -> (set[str], list[str])``: copy full PEFT tensors
  into this rank's adapter shards (only if all fit, never with ``dry_run``); return the PEFT keys
  it used and the problems found (every offender; nothing copied when there are any).

``entries`` are the :class:`~ferrule.lora.peft_format.AdapterEntry` of that kind on this rank.
The core serves ``attention`` (``self_attention.linear_qkv`` / ``linear_proj``), ``dense_mlp``
(``mlp.linear_fc1`` / ``linear_fc2``), ``shared_experts`` (``mlp.shared_experts.linear_fc1`` /
``linear_fc2``: regular TP parameters) and ``lm_head`` (``output_layer``, refused on tied
embeddings) for megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``; a family's own spec
(or a plugin's ``"*"`` spec) for a kind replaces the core one (:func:`appliers_for`).
``routed_experts`` (megatron ``SequentialMLP``: ``mlp.experts.local_experts.E.linear_fc1`` /
``linear_fc2``) shares one ``A`` per layer and linear across all experts and gives every expert
its own ``B`` (memory grows with experts through ``B`` only); it is exported in PEFT's 3-D
expert-parameter format (``target_parameters``, :func:`ferrule.lora.peft_experts.export_routed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ferrule.contract.specs import LORA_KINDS, LoRAApplierSpec
from .peft_experts import EXPERT_PARAMS, expert_module
from ferrule.contract import registry

__all__ = ["CORE_APPLIERS", "ApplyContext", "appliers_for", "apply_attention", "apply_dense_mlp",
           "apply_shared_experts", "apply_lm_head", "LoraTargetError", "peft_name_matches"]

_PEFT = "ferrule.lora.peft_format"
#: The core's applier per kind (used when no plugin registers one for the family or ``"*"``).
CORE_APPLIERS: dict[str, LoRAApplierSpec] = {
    kind: LoRAApplierSpec(kind=kind, family="*", apply=f"ferrule.lora.appliers:apply_{kind}",
                          export=f"{_PEFT}:export_linear", load=f"{_PEFT}:load_linear")
    for kind in ("attention", "dense_mlp", "shared_experts", "lm_head")
}
CORE_APPLIERS["routed_experts"] = LoRAApplierSpec(
    kind="routed_experts", family="*", apply="ferrule.lora.appliers:apply_routed_experts",
    export="ferrule.lora.peft_experts:export_routed", load="ferrule.lora.peft_experts:load_routed")

_KIND_PATTERNS = {
    "attention": re.compile(r"^decoder\.layers\.\d+\.self_attention\.(linear_qkv|linear_proj)$"),
    "dense_mlp": re.compile(r"^decoder\.layers\.\d+\.mlp\.(linear_fc1|linear_fc2)$"),
    "shared_experts": re.compile(r"^decoder\.layers\.\d+\.mlp\.shared_experts\.(linear_fc1|linear_fc2)$"),
    "lm_head": re.compile(r"^(output_layer)$"),
}
#: HF name of the output layer (PEFT target ``lm_head``)
_LM_HEAD = ("output_layer", "lm_head")


class LoraTargetError(ValueError):
    """``LoraSettings.target_modules`` names something that cannot be adapted (the message says why)."""


@dataclass
class ApplyContext:
    """What an applier needs besides the chunk and the settings.

    Attributes:
        table: the family's :class:`~ferrule.mapping.MappingTable`; mapping: its
            :class:`~ferrule.mapping.MappingContext` (tied embeddings, head counts).
        global_names: ``{local module name: global module name}`` of the chunk.
        tp_rank / tp_size: this rank's tensor-parallel coordinates.
        matched: target names that selected at least one module (filled by :meth:`selects`).
    """

    table: Any
    mapping: Any
    global_names: dict[str, str]
    tp_rank: int
    tp_size: int
    settings: Any
    matched: set[str] = field(default_factory=set)

    #: HF module paths / HF parameter paths offered to :meth:`selects` (for the "matches nothing" hints)
    seen_modules: set[str] = field(default_factory=set)
    seen_params: set[str] = field(default_factory=set)
    matched_params: set[str] = field(default_factory=set)
    #: the target names that made the last :meth:`selects` call pick its module
    last_named: tuple[str, ...] = ()

    def hf_modules(self, global_module: str) -> tuple[str, ...]:
        """HF module paths of a module (``model.layers.0.self_attn.q_proj``, ... for ``linear_qkv``)."""
        mapping, _ = self.table.resolve(global_module + ".weight")
        return tuple(k.removesuffix(".weight") for k in mapping.hf_keys(global_module + ".weight", self.mapping))

    def hf_leaves(self, global_module: str) -> tuple[str, ...]:
        """HF module leaf names of a module (``('q_proj', 'k_proj', 'v_proj')`` for ``linear_qkv``)."""
        return tuple(k.rsplit(".", 1)[-1] for k in self.hf_modules(global_module))

    def selects(self, global_module: str, kind: str, *, hf_params: tuple[str, ...] | None = None) -> bool:
        """Whether the settings pick this module (the one rule of docs/lora.md "Target names").

        - ``"all"``: every module but the output layer.
        - a Megatron leaf in ``target_modules`` (``linear_fc2``) picks every module with that leaf.
        - otherwise, as PEFT matches (``peft.tuners.tuners_utils.check_target_module_exists``): a
          module that transformers keeps as ``nn.Linear`` (``hf_params`` None; its HF module paths
          come from the table) is picked by ``target_modules`` entries equal to its path or a
          dotted suffix of it; one that transformers keeps as 3-D parameters (routed or stacked
          shared experts: the applier passes their full HF parameter paths as ``hf_params``) is
          picked by ``target_parameters`` entries, matched the same way.

        Raises:
            LoraTargetError: only some HF parts of a fused module are named.
        """
        s = self.settings
        leaf = global_module.rsplit(".", 1)[-1]
        if s.target_modules == "all":
            return kind != "lm_head"
        paths = tuple(hf_params) if hf_params is not None else self.hf_modules(global_module)
        (self.seen_params if hf_params is not None else self.seen_modules).update(paths)
        if leaf in s.target_modules:
            self.matched.add(leaf)
            self.last_named = (leaf,)
            return True
        names = s.target_parameters if hf_params is not None else s.target_modules
        if leaf == "output_layer" and "lm_head" in names:  # HF's name of it, also where the table ties it
            paths = ("lm_head",)
        hit = {p: [t for t in names if peft_name_matches(p, t)] for p in paths}
        named = {t for ts in hit.values() for t in ts}
        if not named:
            return False
        if not all(hit.values()):
            parts = [p.rsplit(".", 1)[-1] for p in paths]
            missing = sorted(p.rsplit(".", 1)[-1] for p, ts in hit.items() if not ts)
            field_name = "target_parameters" if hf_params is not None else "target_modules"
            raise LoraTargetError(
                f"{field_name} names {sorted(named)} but not {missing}: Megatron fuses {', '.join(parts)} of "
                f"{global_module} into one {leaf} whose adapter is shared; name all of them or {leaf!r}.")
        (self.matched_params if hf_params is not None else self.matched).update(named)
        self.last_named = tuple(sorted(named))
        return True


def peft_name_matches(path: str, name: str) -> bool:
    """PEFT's list rule for ``target_modules`` / ``target_parameters``: ``path == name`` or
    ``path.endswith("." + name)`` (``peft.tuners.tuners_utils.check_target_module_exists``)."""
    return path == name or path.endswith("." + name)


def _apply_kind(chunk: Any, settings: Any, ctx: ApplyContext, kind: str) -> list[str]:
    from .layers import attach_adapter

    done = []
    for local, module in chunk.named_modules():
        if not _KIND_PATTERNS[kind].match(local):
            continue
        name = ctx.global_names.get(local, local)
        if not ctx.selects(name, kind):
            continue
        if kind == "lm_head" and (getattr(chunk, "share_embeddings_and_output_weights", False)
                                  or ctx.mapping.tie_word_embeddings):
            other = [t for t in ctx.last_named if t not in _LM_HEAD]
            if other:
                raise LoraTargetError(f"target_modules names {other}: on this model the input embedding "
                                      f"(embed_tokens) is tied to the output layer, and ferrule's LoRA adapts no "
                                      f"embedding (no applier serves nn.Embedding); drop {other[0]!r}, or merge the "
                                      f"adapter into the base weights (PEFT merge_and_unload) and train from that.")
            raise LoraTargetError("target_modules names the output layer (lm_head), but this model ties it to the "
                                  "input embedding (tie_word_embeddings=True): an lm_head adapter would also change "
                                  "the embedding and PEFT cannot load it; drop 'lm_head' / 'output_layer'.")
        attach_adapter(module, global_name=name, kind=kind, settings=settings, tp_rank=ctx.tp_rank,
                       tp_size=ctx.tp_size)
        done.append(name)
    return done


def apply_attention(chunk: Any, settings: Any, ctx: ApplyContext) -> list[str]:
    """Core ``attention`` applier: ``self_attention.linear_qkv`` (column) and ``linear_proj`` (row)."""
    return _apply_kind(chunk, settings, ctx, "attention")


def apply_dense_mlp(chunk: Any, settings: Any, ctx: ApplyContext) -> list[str]:
    """Core ``dense_mlp`` applier: ``mlp.linear_fc1`` (column, SwiGLU ``[gate; up]``) and ``mlp.linear_fc2`` (row)."""
    return _apply_kind(chunk, settings, ctx, "dense_mlp")


def apply_shared_experts(chunk: Any, settings: Any, ctx: ApplyContext) -> list[str]:
    """Core ``shared_experts`` applier: ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` (regular TP)."""
    return _apply_kind(chunk, settings, ctx, "shared_experts")


def apply_lm_head(chunk: Any, settings: Any, ctx: ApplyContext) -> list[str]:
    """Core ``lm_head`` applier: the untied ``output_layer`` (vocab-parallel column); only when named."""
    return _apply_kind(chunk, settings, ctx, "lm_head")


_EXPERTS_RE = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts$")


def apply_routed_experts(chunk: Any, settings: Any, ctx: ApplyContext) -> list[str]:
    """Core ``routed_experts`` applier for megatron's ``SequentialMLP`` (expert TP 1).

    Per MoE layer and linear (``linear_fc1``, ``linear_fc2``): one ``A`` ``[r, in]`` shared by
    every expert (a dense parameter, seeded by the layer-level name
    ``decoder.layers.L.mlp.experts.linear_fc1``), one ``B`` ``[out, r]`` per local expert (an
    expert-parallel parameter).

    Raises:
        LoraTargetError: expert tensor parallelism > 1, dropout > 0 (PEFT's expert LoRA has no
            dropout, so the adapter could not be loaded there), or grouped-GEMM experts.
    """
    from .layers import attach_adapter

    done = []
    for local, module in chunk.named_modules():
        if not _EXPERTS_RE.match(local):
            continue
        experts = list(getattr(module, "local_experts", []) or [])
        if not experts:
            raise LoraTargetError(f"{local} is a {type(module).__name__}; the core routed-experts applier adapts "
                                  f"megatron's SequentialMLP (moe_grouped_gemm=False) only.")
        # the global layer-level name (layer index with the pipeline offset)
        layer = ctx.global_names.get(f"{local}.local_experts.0.linear_fc1", local).split(".local_experts.")[0]
        etp = _tp_size(experts[0].linear_fc1)
        for leaf in ("linear_fc1", "linear_fc2"):
            first = ctx.global_names.get(f"{local}.local_experts.0.{leaf}", f"{local}.local_experts.0.{leaf}")
            hf_param = f"{expert_module(ctx.table, ctx.mapping, layer, leaf)}.{EXPERT_PARAMS[leaf]}"
            if not ctx.selects(first, "routed_experts", hf_params=(hf_param,)):
                continue
            if etp != 1:
                raise LoraTargetError(f"{layer}: LoRA on routed experts needs expert tensor parallelism 1, this model "
                                      f"splits them over etp={etp} (megatron's default etp is tp); build with "
                                      f"ParallelLayout(etp=1), or leave the routed experts out of target_modules.")
            if settings.dropout > 0:
                raise LoraTargetError(f"{layer}: LoRA dropout on routed experts is refused (PEFT's expert-parameter "
                                      f"LoRA has none, so the adapter could not be loaded there); use dropout=0.")
            shared = None
            for j, expert in enumerate(experts):
                name = ctx.global_names.get(f"{local}.local_experts.{j}.{leaf}", f"{local}.local_experts.{j}.{leaf}")
                ad = attach_adapter(getattr(expert, leaf), global_name=f"{layer}.{leaf}" if shared is None else name,
                                    kind="routed_experts", settings=settings, tp_rank=0, tp_size=1,
                                    shared_a=shared, expert=True)
                shared = ad.lora_A
                done.append(name)
    return done


def _tp_size(linear: Any) -> int:
    """Size of the TP group a megatron linear is split over (the expert-TP group for experts)."""
    from megatron.core.utils import get_pg_size

    group = getattr(linear, "tp_group", None)
    return get_pg_size(group) if group is not None else 1


def appliers_for(family: str) -> list[LoRAApplierSpec]:
    """The applier per kind for ``family``: the family's own spec, else a plugin's ``"*"`` spec,
    else the core one (:data:`CORE_APPLIERS`); kinds in :data:`~ferrule.contract.specs.LORA_KINDS` order."""
    registered = {s.kind: s for s in registry.get_registry().iter_lora_appliers(family)}
    return [registered.get(k) or CORE_APPLIERS[k] for k in LORA_KINDS if k in registered or k in CORE_APPLIERS]
