"""Apply LoRA to a Megatron model (all chunks of this rank) and list its adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from .appliers import ApplyContext, LoraTargetError, appliers_for, peft_name_matches
from .peft_base import peft_naming_table
from ferrule.contract.specs import resolve_ref
from ferrule.mapping import MappingContext
from ferrule.megatron.param_gather import agreed_errors, all_gather_objects, global_param_names, model_chunks

__all__ = ["AdapterEntry", "apply_lora", "adapter_entries", "adapter_params"]


@dataclass
class AdapterEntry:
    """One adapted module on this rank.

    Attributes:
        global_name: global mcore module name (``decoder.layers.3.self_attention.linear_qkv``).
        local_name: its name inside ``chunk`` (layer index local to the pipeline stage).
        chunk: index of the model chunk (virtual pipeline stage) that holds it.
        adapter: the :class:`~ferrule.lora.layers.LoraAdapter` (or a family module with
            ``lora_A`` / ``lora_B`` and ``kind``).
    """

    global_name: str
    local_name: str
    chunk: int
    adapter: Any

    @property
    def kind(self) -> str:
        return self.adapter.kind


def _global_module_names(chunk: Any) -> dict[str, str]:
    out = {}
    for local, glob in global_param_names(chunk).items():
        if local.endswith(".weight"):
            out[local.removesuffix(".weight")] = glob.removesuffix(".weight")
    return out


def apply_lora(chunks: Sequence[Any], settings: Any, *, family: str, table: Any,
               hf_config: Mapping[str, Any]) -> list[str]:
    """Freeze every base parameter and attach adapters through the family's appliers.

    Call before the model is wrapped in megatron's DDP (which allocates grad buffers for the
    parameters that require grad only) and before the optimizer is built (megatron's
    ``get_megatron_optimizer`` skips parameters without ``requires_grad``): only the adapter
    factors get gradients and optimizer state.

    Args:
        chunks: this rank's unwrapped ``GPTModel`` chunks.
        settings: :class:`~ferrule.lora.LoraSettings`.
        family / table / hf_config: the family name, its mapping table and the HF config. Target
            names and PEFT names come from ``table.peft_table`` when the table has one
            (:func:`~ferrule.lora.peft_base.peft_naming_table`).

    Returns:
        Global mcore names of the adapted modules on this rank.

    Raises:
        ferrule.lora.appliers.LoraTargetError: a target name matches no module of any applier
            (the message lists the names that exist), only part of a fused module is named, or
            ``lm_head`` is named on a tied model. Checked across ranks and raised on every rank; the chunks
            may then hold some adapters already and must be discarded (``TrainEngine`` builds them
            afresh for every engine).
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    tp_size = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    mctx = MappingContext.from_hf_config(hf_config)
    table = peft_naming_table(table)
    specs = appliers_for(family)
    done: list[str] = []
    seen = {"matched": set(), "matched_params": set(), "seen_modules": set(), "seen_params": set()}
    errors: list[str] = []
    for chunk in chunks:
        ctx = ApplyContext(table=table, mapping=mctx, global_names=_global_module_names(chunk), tp_rank=tp_rank,
                           tp_size=tp_size, settings=settings)
        for spec in specs:
            try:
                done += resolve_ref(spec.apply)(chunk, settings, ctx)
            except LoraTargetError as exc:
                errors.append(str(exc))
        for key, have in seen.items():
            have |= getattr(ctx, key)
    if settings.target_modules != "all":
        everywhere = {k: set().union(*all_gather_objects(sorted(v))) for k, v in seen.items()}
        errors += _unmatched_targets(settings, everywhere, family)
    errors = agreed_errors(errors)
    if errors:
        raise LoraTargetError("\n".join(errors))
    if not set().union(*all_gather_objects(done)):
        raise LoraTargetError(f"LoRA adapted no module of family {family!r}; check target_modules.")
    for chunk in chunks:
        for p in chunk.parameters():
            if not getattr(p, "is_lora_adapter", False):
                p.requires_grad_(False)
    return done


#: HF leaf names of input embeddings (PEFT ``EMBEDDING_LAYER_NAMES`` and the usual module names)
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embeddings")


def _unmatched_targets(settings: Any, seen: dict[str, set[str]], family: str) -> list[str]:
    """One error per ``target_modules`` / ``target_parameters`` entry that picked nothing, with the
    hint that fits (an HF name listed in the wrong field, e.g. ``gate_up_proj`` as a module)."""
    errors = []
    for t in settings.target_modules:
        if t in seen["matched"]:
            continue
        params = sorted(p for p in seen["seen_params"] if peft_name_matches(p, t))
        if t.rsplit(".", 1)[-1] in _EMBEDDINGS:
            errors.append(f"target_modules entry {t!r} is the input embedding: ferrule's LoRA adapts no embedding "
                          f"(no applier serves nn.Embedding); drop it, or merge the adapter into the base weights "
                          f"(PEFT merge_and_unload) and train from that.")
        elif params:
            errors.append(f"target_modules entry {t!r} names HF parameters, not modules ({params[0]}, ...: transformers "
                          f"keeps these experts as 3-D parameters, which PEFT adapts through target_parameters); move it "
                          f"to target_parameters, e.g. {params[0].split('.layers.', 1)[-1].split('.', 1)[-1]!r}.")
        else:
            errors.append(f"target_modules entry {t!r} matches no module that a LoRA applier of family {family!r} "
                          f"adapts; use Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2, output_layer), "
                          f"the HF module names they map to (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                          f"down_proj, lm_head), target_parameters for expert parameters, or 'all'.")
    for t in settings.target_parameters:
        if t in seen["matched_params"]:
            continue
        known = sorted({p.split(".layers.", 1)[-1].split(".", 1)[-1] for p in seen["seen_params"]})
        hint = (f"this model's expert parameters are {known}" if known else "this model has no expert parameters")
        if any(peft_name_matches(m, t) for m in seen["seen_modules"]):
            hint = "it names a module: list it in target_modules"
        errors.append(f"target_parameters entry {t!r} matches no HF parameter that a LoRA applier of family {family!r} "
                      f"adapts ({hint}).")
    return errors


def adapter_entries(chunks: Sequence[Any]) -> list[AdapterEntry]:
    """Every adapted module of this rank's (possibly DDP-wrapped) chunks, in chunk and module order."""
    from .layers import adapters_of

    out = []
    for i, chunk in enumerate(model_chunks(list(chunks))):
        names = _global_module_names(chunk)
        out += [AdapterEntry(names.get(local, local), local, i, ad) for local, ad in adapters_of(chunk)]
    return out


def adapter_params(chunks: Sequence[Any]) -> dict[str, Any]:
    """``{global module name + '.lora_A' / '.lora_B': parameter}`` of this rank (local shards)."""
    out = {}
    for e in adapter_entries(chunks):
        out[f"{e.global_name}.lora_A"] = e.adapter.lora_A
        out[f"{e.global_name}.lora_B"] = e.adapter.lora_B
    return out
