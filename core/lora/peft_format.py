"""Adapters <-> HF PEFT tensors (``adapter_model.safetensors``) and ``adapter_config.json``.

PEFT's saved key of a module's factors is ``base_model.model.<HF module path>.lora_A.weight``
``[r, in]`` / ``...lora_B.weight`` ``[out, r]`` (``peft.utils.save_and_load.get_peft_model_state_dict``
drops the adapter name). The HF module paths come from the family's mapping table: a Megatron
module ``M`` maps to the HF modules of ``M.weight``'s row, e.g. ``linear_qkv`` ->
``q_proj, k_proj, v_proj`` (:class:`~ferrule.mapping.FuseQKV`), ``linear_fc1`` -> ``gate_proj,
up_proj`` (:class:`~ferrule.mapping.FuseGateUp`).

- Fused column-parallel modules: ``y_fused = W_fused x + s B_fused A x`` and the HF parts are
  row blocks of ``y_fused``, so each part's ``lora_B`` is the same row block of ``B_fused`` that
  its weight is of ``W_fused`` (the row's :meth:`~ferrule.mapping.ParamMapping.to_hf` applied
  to ``B`` ``[out, r]`` as to a ``[out, in]`` weight) and every part shares ``A``.
- Row-parallel modules (``linear_proj``, ``linear_fc2``) map one to one (``A`` on the input
  dim, ``B`` on the output dim, both in HF layout already).
- The output layer's ``B`` drops megatron's padded vocabulary rows (``to_hf``), and gets zero
  rows on import.

Import needs the parts of a fused module to share ``A`` (an adapter exported by ferrule does;
one trained by PEFT on separate ``q_proj`` / ``k_proj`` / ``v_proj`` generally does not and is
refused, naming the module).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ferrule.mapping import MappingError, TPSplit

from .peft_base import (PEFT_PREFIX, AdapterFormatError, ExportContext, _factor_mappings, _hf_modules,
                        copy_factor_plans, peft_naming_table)
from .appliers import appliers_for
from .model import adapter_entries
from .peft_experts import EXPERT_PARAMS
from ferrule.contract.specs import LORA_KINDS, resolve_ref
from ferrule.megatron.param_gather import (BoundParam, ParallelRanks, agree_padded_vocab, agreed_errors,
                                           all_gather_objects, bind_params, iter_full, mapping_context, model_chunks,
                                           plan_gather)

__all__ = ["export_linear", "load_linear", "hf_adapter_state_dict", "peft_config", "load_hf_adapter", "adapter_index_map"]

def _linear_plan(entries: Sequence[Any], ctx: ExportContext) -> tuple[dict, dict, list]:
    """``(bound factors, per-module mapping meta, gather steps)`` of :func:`export_linear`, memoised in
    ``ctx.cache`` (collective the first time: :func:`~ferrule.megatron.param_gather.plan_gather`)."""
    key = ("linear", tuple((e.global_name, id(e.adapter.lora_A), id(e.adapter.lora_B)) for e in entries))
    if key in ctx.cache:
        return ctx.cache[key]
    params: dict[str, BoundParam] = {}
    meta: dict[str, tuple[Any, tuple[str, ...], list[str], str]] = {}
    for e in entries:
        mapping, wild, hf = _hf_modules(e, ctx)
        ma, mb = _factor_mappings(e, mapping)
        params[e.global_name + ".lora_A"] = BoundParam(e.global_name + ".lora_A", e.adapter.lora_A, ma, wild)
        params[e.global_name + ".lora_B"] = BoundParam(e.global_name + ".lora_B", e.adapter.lora_B, mb, wild)
        meta[e.global_name] = (mapping, wild, hf, e.adapter.parallel)
    steps = plan_gather(params, [(e.global_name, [e.global_name + ".lora_A", e.global_name + ".lora_B"])
                                 for e in entries], ctx.ranks, with_experts=False)
    ctx.cache[key] = (params, meta, steps)
    return params, meta, steps


def export_linear(entries: Sequence[Any], ctx: ExportContext) -> Iterator[tuple[str, Any]]:
    """Full PEFT tensors of column/row-parallel linear adapters (collective over TP and PP).

    Yields ``(peft key, tensor)`` on every rank in the same order; tensors are detached, on the
    adapter's device, in its dtype (they may alias live parameters when nothing is split).
    """
    params, meta, steps = _linear_plan(entries, ctx)
    # other pipeline stages' modules arrive through iter_full; their mapping rows come from the table
    for key, _, (a, b) in iter_full(steps, params, ctx.ranks):
        if key in meta:
            mapping, wild, hf, parallel = meta[key]
        else:
            mapping, wild = ctx.table.resolve(key + ".weight")
            hf = [k.removesuffix(".weight") for k in mapping.hf_keys(key + ".weight", ctx.mapping)]
            parallel = "row" if mapping.tp is TPSplit.ROW else "column"
            meta[key] = (mapping, wild, hf, parallel)
        bs = mapping.to_hf(b, ctx.mapping, wild)
        if parallel == "row" and len(hf) != 1:
            raise MappingError(f"{key}: a row-parallel adapter maps to one HF module, the table gives {hf}.")
        for module, b_part in zip(hf, bs):
            yield f"{PEFT_PREFIX}{module}.lora_A.weight", a
            yield f"{PEFT_PREFIX}{module}.lora_B.weight", b_part


def load_linear(entries: Sequence[Any], tensors: Mapping[str, Any], ctx: ExportContext, *,
                dry_run: bool = False) -> tuple[set[str], list[str]]:
    """Copy full PEFT tensors into this rank's column/row-parallel adapter shards (not collective).

    Nothing is copied unless every entry fits (checked first, on all entries), nor with ``dry_run``.

    Returns:
        ``(PEFT keys used, problems)``; with problems nothing was copied.
    """
    import torch

    used: set[str] = set()
    problems: list[str] = []
    plans = []
    rank, size = ctx.ranks.tp_rank, ctx.ranks.tp
    for e in entries:
        mapping, wild, hf = _hf_modules(e, ctx)
        keys_a = [f"{PEFT_PREFIX}{m}.lora_A.weight" for m in hf]
        keys_b = [f"{PEFT_PREFIX}{m}.lora_B.weight" for m in hf]
        missing = [k for k in keys_a + keys_b if k not in tensors]
        if missing:
            problems.append(f"{e.global_name}: missing {missing}")
            continue
        used.update(keys_a + keys_b)
        a_parts = [tensors[k] for k in keys_a]
        if any(not torch.equal(a_parts[0], a) for a in a_parts[1:]):
            problems.append(f"{e.global_name}: Megatron fuses {hf} into one module with one shared lora_A, but the "
                            f"adapter's lora_A differ between them (an adapter trained on separate modules cannot be "
                            f"imported exactly; retrain it with ferrule or merge it into the base weights).")
            continue
        try:
            b_full = mapping.to_mcore([tensors[k] for k in keys_b], ctx.mapping, wild)
            ma, mb = _factor_mappings(e, mapping)
            a_local = ma.shard(a_parts[0], rank, size)
            b_local = mb.shard(b_full, rank, size)
        except MappingError as exc:
            problems.append(f"{e.global_name}: {exc}")
            continue
        for name, have, want in (("lora_A", a_local, e.adapter.lora_A), ("lora_B", b_local, e.adapter.lora_B)):
            if tuple(have.shape) != tuple(want.shape):
                problems.append(f"{e.global_name}.{name}: the adapter gives a local shard of shape "
                                f"{tuple(have.shape)}, this model's adapter has {tuple(want.shape)} (rank or "
                                f"model size differ).")
        plans.append((e.adapter, a_local, b_local))
    return copy_factor_plans(plans, used, problems, dry_run=dry_run)


# ---------------------------------------------------------------------------------------
# Engine-level API
# ---------------------------------------------------------------------------------------


def _export_context(engine: Any) -> ExportContext:
    ranks = ParallelRanks.current()
    params = bind_params(engine.model, engine.mapping_table)
    mctx = agree_padded_vocab(mapping_context(params, ranks, hf_config=engine.hf_config), ranks)
    return ExportContext(peft_naming_table(engine.mapping_table), mctx, ranks)


def _by_kind(engine: Any) -> list[tuple[Any, list]]:
    entries = adapter_entries(engine.model)
    specs = {s.kind: s for s in appliers_for(engine.family)}
    return [(specs[k], [e for e in entries if e.kind == k]) for k in LORA_KINDS if k in specs]


@dataclasses.dataclass
class _EnginePlan:
    """What every export / load of one engine's adapters starts from, built once per engine.

    Walking the model (``bind_params``, ``adapter_entries``, mapping-table lookups) costs about
    30 ms per call for a 24-layer model, more than the adapter's own gather and copy; the
    adapters' structure is fixed once the engine is built (checkpoint loads copy in place).
    """

    key: tuple
    ctx: ExportContext
    by_kind: list
    config: dict | None = None  # peft_config without base_model_name_or_path, once computed


def _engine_plan(engine: Any) -> _EnginePlan:
    """The engine's :class:`_EnginePlan`, rebuilt when its chunks or the parallel layout changed.

    Collective the first time (every rank builds it in the same call, so caches stay in step).
    """
    key = (tuple(id(c) for c in model_chunks(engine.model)), dataclasses.astuple(ParallelRanks.current()))
    plan = getattr(engine, "_lora_export_plan", None)
    if plan is None or plan.key != key:
        plan = _EnginePlan(key, _export_context(engine), _by_kind(engine))
        engine._lora_export_plan = plan
    return plan


def _require_lora(engine: Any) -> None:
    if getattr(engine, "lora", None) is None:
        raise ValueError("this TrainEngine has no LoRA adapters; build it with lora=LoraSettings(...).")


def hf_adapter_state_dict(engine: Any, *, copy: bool = True) -> dict[str, Any]:
    """``{PEFT key: full tensor}`` of the engine's adapters (HF PEFT saved names, TP/PP gathered).

    Collective: every rank calls it and gets the whole dict. Tensors are detached copies on the
    adapters' device, in their dtype; with ``copy=False`` they may alias the live adapter
    parameters (no per-tensor copy: for a consumer that copies them at once, such as
    :func:`ferrule.sync.sync_lora_adapter`; they change with the next ``optim_step``). Save with ``safetensors.torch.save_file`` next to
    :func:`peft_config` and ``peft.PeftModel.from_pretrained`` loads them on the HF model.

    Raises:
        ValueError: the engine has no LoRA.
    """
    _require_lora(engine)
    plan = _engine_plan(engine)
    out: dict[str, Any] = {}
    for spec, entries in plan.by_kind:
        for key, t in resolve_ref(spec.export)(entries, plan.ctx):
            out[key] = t.detach().clone() if copy else t.detach()
    return out


def adapter_index_map(engine: Any) -> tuple[list[tuple[str, Any, Any]] | None, str]:
    """Where each tensor of :func:`hf_adapter_state_dict` comes from, element by element, for a writer
    in this process (:func:`ferrule.sync.sync_lora_adapter`'s direct path).

    Returns:
        ``([(PEFT key, live parameter, index), ...], "")`` in the export's order: ``index`` is an int64
        CPU tensor of the PEFT tensor's shape holding, per element, the flat (row-major) index of the
        parameter element it is (the mapping row's ``to_hf`` run on an index probe); or ``(None, reason)``
        where the export is no fixed re-layout of this rank's parameters: model parallelism (TP, PP or EP
        > 1: the export gathers), an applier whose export is not :func:`export_linear` (routed experts),
        or a ``to_hf`` that rejects or changes an index probe (it computes values, not a layout).
        Not collective (the first call builds the engine's export plan, as the export does).
    """
    import torch

    _require_lora(engine)
    plan = _engine_plan(engine)
    r = plan.ctx.ranks
    if (r.tp, r.pp, r.ep, r.etp) != (1, 1, 1, 1):
        return None, f"model parallelism (tp={r.tp}, pp={r.pp}, ep={r.ep}, etp={r.etp}): the export gathers"
    out: list[tuple[str, Any, Any]] = []
    for spec, entries in plan.by_kind:
        if entries and resolve_ref(spec.export) is not export_linear:
            return None, f"the {spec.kind!r} adapters export through {spec.export}, not a fixed re-layout"
        for e in entries:
            mapping, wild, hf = _hf_modules(e, plan.ctx)
            a, b = e.adapter.lora_A, e.adapter.lora_B
            probe_a = torch.arange(a.numel(), dtype=torch.int64).view(tuple(a.shape))
            probe_b = torch.arange(b.numel(), dtype=torch.int64).view(tuple(b.shape))
            try:
                parts = mapping.to_hf(probe_b, plan.ctx.mapping, wild)
            except Exception as exc:  # a row that cannot take an integer probe: no fixed layout known
                return None, f"{e.global_name}: to_hf rejects an index probe ({type(exc).__name__}: {exc})"
            if len(parts) != len(hf):
                return None, f"{e.global_name}: to_hf gives {len(parts)} parts for the HF modules {hf}"
            for module, part in zip(hf, parts):
                flat = part.reshape(-1) if isinstance(part, torch.Tensor) else None
                if flat is None or part.dtype != torch.int64 or (
                        flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= b.numel())):
                    return None, f"{e.global_name}: to_hf changes the values of an index probe of lora_B"
                out.append((f"{PEFT_PREFIX}{module}.lora_A.weight", a, probe_a))
                out.append((f"{PEFT_PREFIX}{module}.lora_B.weight", b, part))
    return out, ""


def peft_config(engine: Any, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` dict (``peft.LoraConfig(...).to_dict()`` keys PEFT needs to load it).

    ``target_modules`` are the HF leaf module names of every adapted module (gathered over ranks); the
    full module paths instead where the engine's settings name full paths (an imported adapter whose
    regular expression picked some layers only: a leaf would select every layer in PEFT); or
    an adapter's ``peft_target`` attribute where a family sets one because the leaf alone would
    pick other modules too (Inkling-2: ``q_proj.linear``, not ``linear``, which also names
    ``k_proj.linear`` ... ``o_proj.linear``).
    ``target_parameters`` are the HF parameters PEFT adapts with ``ParamWrapper``: the routed
    experts' fused 3-D parameters, plus those a family adapter lists in its ``peft_parameters``
    attribute (parameter paths below the decoder layer, e.g. Inkling's
    ``mlp.shared_experts.gate_proj``); such adapters add nothing to ``target_modules``.
    ``base_model_name_or_path`` defaults to the engine's source folder (``engine.hf_files_dir``).
    """
    _require_lora(engine)
    plan = _engine_plan(engine)
    if plan.config is None:
        leaves, paths, expert_leaves, param_targets = set(), set(), set(), set()
        for _, entries in plan.by_kind:
            for e in entries:
                if e.kind == "routed_experts":
                    expert_leaves.add(e.global_name.rsplit(".", 1)[-1])
                elif getattr(e.adapter, "peft_parameters", None):
                    param_targets.update(e.adapter.peft_parameters)
                elif getattr(e.adapter, "peft_target", None):  # a family's name where the HF leaf is ambiguous
                    leaves.add(e.adapter.peft_target)
                else:
                    paths.update(_hf_modules(e, plan.ctx)[2])
                    leaves.update(m.rsplit(".", 1)[-1] for m in _hf_modules(e, plan.ctx)[2])
        leaves = sorted(set().union(*all_gather_objects(sorted(leaves))))
        paths = sorted(set().union(*all_gather_objects(sorted(paths))))
        named = engine.lora.target_modules
        if isinstance(named, tuple) and named and set(named) <= set(paths):
            leaves = paths  # full module paths (a resolved regex, a subset of layers): PEFT's list rule keeps them exact
        expert_leaves = set().union(*all_gather_objects(sorted(expert_leaves)))
        param_targets = sorted(set().union(*all_gather_objects(sorted(param_targets))))
        s = engine.lora
        plan.config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": s.rank,
            "lora_alpha": s.alpha, "lora_dropout": s.dropout, "use_rslora": s.use_rslora, "target_modules": leaves,
            "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True, "revision": None,
            # routed experts: transformers' fused 3-D expert parameters, in PEFT's nesting order
            "target_parameters": [f"mlp.experts.{EXPERT_PARAMS[k]}" for k in EXPERT_PARAMS if k in expert_leaves]
            + param_targets or None}
    base = base_model_name_or_path if base_model_name_or_path is not None else (
        str(engine.hf_files_dir) if getattr(engine, "hf_files_dir", None) else None)
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in plan.config.items()}
    out["base_model_name_or_path"] = base
    return out


#: ``adapter_config.json`` options that change what the adapter computes and that ferrule's LoRA does
#: not train, each with the reason the refusal gives (PEFT ``LoraConfig`` field names).
_UNSUPPORTED = {
    "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained extra modules", "use_dora": "DoRA", "lora_bias": "a bias on lora_B",
    "exclude_modules": "modules excluded from target_modules", "layers_to_transform": "a subset of layers",
    "layers_pattern": "a subset of layers", "layer_replication": "replicated layers",
    "trainable_token_indices": "trainable embedding rows", "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA", "megatron_config": "PEFT's own Megatron layers",
}
#: ``init_lora_weights`` values that rewrite the base weights (the adapter is a residual of a
#: modified base, so it cannot be loaded onto the original one)
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def unsupported_peft_options(config: Mapping[str, Any]) -> list[str]:
    """``"key=value (what it is)"`` for every option of an ``adapter_config.json`` dict that ferrule's
    LoRA does not compute (not a LoRA, :data:`_UNSUPPORTED`, a bias, a base-rewriting init)."""
    bad = []
    if config.get("peft_type", "LORA") != "LORA":
        bad.append(f"peft_type={config.get('peft_type')!r} (only LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            bad.append(f"{key}={config[key]!r} ({what})")
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config['bias']!r} (biases; only 'none')")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        bad.append(f"init_lora_weights={init!r} (it rewrites the base weights; convert the adapter to a plain LoRA "
                   f"with PEFT's path_initial_model_for_weight_conversion first)")
    return bad


def check_peft_config(engine: Any, config: Mapping[str, Any]) -> None:
    """Raise :class:`AdapterFormatError` when an ``adapter_config.json`` dict disagrees with the
    engine's :class:`~ferrule.lora.LoraSettings` (r, alpha, rsLoRA) or is not a LoRA adapter."""
    s = engine.lora
    bad = unsupported_peft_options(config)
    for key, want in (("r", s.rank), ("lora_alpha", s.alpha), ("use_rslora", s.use_rslora)):
        if key in config and config[key] != want and not (key == "lora_alpha" and float(config[key]) == float(want)):
            bad.append(f"{key}={config[key]!r} (engine: {want!r})")
    if bad:
        raise AdapterFormatError("adapter_config.json does not fit this engine's LoRA settings: " + "; ".join(bad)
                                 + ". Build the engine with matching LoraSettings.")


#: PEFT's key suffix of a base weight it saves next to the factors (``save_embedding_layers``)
_SAVED_BASE = ".base_layer.weight"


def _check_saved_base_weights(engine: Any, saved: Mapping[str, Any], plan: "_EnginePlan") -> tuple[set[str], list[str]]:
    """Verify the base weights PEFT saved beside the factors against this rank's base (not collective).

    ``PeftModel.save_pretrained`` (``save_embedding_layers="auto"``, peft 0.21) also writes
    ``base_model.model.lm_head.base_layer.weight`` ``[vocab, hidden]`` when ``lm_head`` is
    targeted. It is accepted when it equals this model's output layer (the rows of this rank's
    vocabulary shard, padding excluded, compared after casting to the parameter's dtype); keys of
    modules this rank does not hold are left to the other ranks (unknown if none uses them).

    Returns:
        ``(keys verified, problems)``.
    """
    import torch

    used: set[str] = set()
    problems: list[str] = []
    ctx = plan.ctx
    heads = [e for _, entries in plan.by_kind for e in entries if e.kind == "lm_head"]
    for key, t in saved.items():
        module = key.removeprefix(PEFT_PREFIX).removesuffix(_SAVED_BASE)
        entry = next((e for e in heads if module in _hf_modules(e, ctx)[2]), None)
        if entry is None:
            continue
        used.add(key)
        weight = model_chunks(engine.model)[entry.chunk].get_submodule(entry.local_name).weight.detach()
        row, wild = ctx.table.resolve(entry.global_name + ".weight")
        try:
            local = row.shard(row.to_mcore([t], ctx.mapping, wild), ctx.ranks.tp_rank, ctx.ranks.tp)
        except MappingError as exc:
            problems.append(f"{key}: {exc}")
            continue
        rows = max(0, min(local.shape[0], ctx.mapping.vocab_size - ctx.ranks.tp_rank * local.shape[0]))
        want = local[:rows].to(weight.device, weight.dtype)
        if tuple(want.shape) != tuple(weight[:rows].shape) or not torch.equal(want, weight[:rows]):
            diff = (f"max abs diff {float((want.double() - weight[:rows].double()).abs().max()):.3g}"
                    if want.shape == weight[:rows].shape else f"shape {tuple(t.shape)}")
            problems.append(f"{key}: PEFT saved {module}'s base weight (save_embedding_layers, its default when lm_head "
                            f"is targeted) and it differs from this base model's ({diff}): the adapter belongs to "
                            f"another base (or a resized / trained lm_head); import it onto that base, or drop the "
                            f"key if this base is right (PeftModel.save_pretrained(..., save_embedding_layers=False)).")
    return used, problems


def load_hf_adapter(engine: Any, tensors: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
    """Load full PEFT adapter tensors (:func:`hf_adapter_state_dict`'s format) into the engine.

    Every rank calls it with the same tensors. The optimizer's fp32 master copies (mixed
    precision) are refreshed from the loaded values, so the next ``optim_step`` starts from them;
    Adam moments and step counters are left as they are.

    Raises:
        ValueError: the engine has no LoRA.
        AdapterFormatError: missing / unknown keys, shapes that do not fit, fused parts with
            different ``lora_A``, a saved ``lm_head.base_layer.weight`` that is not this base's
            (:func:`_check_saved_base_weights`; an equal one is accepted), or a ``config`` that
            disagrees with the engine's settings or uses an option ferrule does not train; every
            offender listed, checked on all ranks before anything is copied.
    """
    _require_lora(engine)
    if config is not None:
        check_peft_config(engine, config)
    plan = _engine_plan(engine)
    ctx = plan.ctx
    saved_base = {k: t for k, t in tensors.items() if k.endswith(_SAVED_BASE) and ".lora_" not in k}
    used, problems = _check_saved_base_weights(engine, saved_base, plan)
    for spec, entries in plan.by_kind:
        u, p = resolve_ref(spec.load)(entries, tensors, ctx, dry_run=True)
        used |= u
        problems += p
    everywhere = set().union(*all_gather_objects(sorted(used)))
    unknown = sorted(k for k in tensors if k not in everywhere)
    if unknown:
        problems.append(f"adapter keys that match no adapted module ({len(unknown)}): {unknown[:8]}"
                        + (" ..." if len(unknown) > 8 else "") + " (the adapter targets modules this engine does not "
                        "adapt: build it with matching target_modules / target_parameters"
                        + ("; a *.base_layer.weight is a base weight PEFT saved, which ferrule checks for an adapted "
                           "lm_head only" if any(k.endswith(_SAVED_BASE) for k in unknown) else "") + ")")
    problems = agreed_errors(problems)
    if problems:
        raise AdapterFormatError("cannot load the PEFT adapter:\n" + "\n".join(f"  - {p}" for p in problems))
    for spec, entries in plan.by_kind:
        resolve_ref(spec.load)(entries, tensors, ctx)
    engine.refresh_optimizer_params()


def read_peft_dir(path: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, adapter_config)`` of a PEFT adapter folder (``adapter_model.safetensors`` + json).

    Raises:
        FileNotFoundError: a file is missing (named).
    """
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    st, cfg = path / "adapter_model.safetensors", path / "adapter_config.json"
    for f in (st, cfg):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing; {path} is not a PEFT adapter folder "
                                    f"(adapter_model.safetensors + adapter_config.json).")
    return load_file(str(st)), json.loads(cfg.read_text())
