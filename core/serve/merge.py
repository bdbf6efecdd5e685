"""Sampler weights of a LoRA training client: the base with its adapters merged, as PEFT merges them.

ferrule exports a LoRA engine's adapters in HF PEFT's saved format
(:func:`ferrule.lora.hf_adapter_state_dict`, :func:`ferrule.lora.peft_config`). Two kinds of keys
appear there (peft 0.21.2, ``peft/tuners/lora/layer.py``):

- a linear module ``M`` (``target_modules``): ``M.lora_A.weight`` ``[r, in]`` and
  ``M.lora_B.weight`` ``[out, r]``; ``Linear.get_delta_weight`` is ``scaling * B @ A`` added to
  ``M.weight`` ``[out, in]``.
- a parameter ``P`` of a module ``M`` (``target_parameters``: routed experts' fused
  ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``, Inkling's stacked shared experts):
  ``ParamWrapper``. PEFT wraps the targeted parameters of one module in nested wrappers, the first
  registered innermost, so the factors of the ``k``-th of ``n`` targeted parameters (registration
  order) sit under ``n - 1 - k`` ``base_layer.`` segments. ``lora_A.weight`` is ``[E * r, in]``
  (expert-major), ``lora_B.weight`` ``[out, r * E]`` (expert-minor) and
  ``ParamWrapper.get_delta_weight`` is ``einsum("o r e, e r i -> e o i", B.reshape(out, r, E),
  A.reshape(E, r, in)) * scaling`` for a ``[E, out, in]`` parameter (``"-> e i o"`` when the
  module says ``is_transposed``); a 2-D parameter gets ``B @ A``.

:func:`merged_hf_state` resolves every key against the transformers model's own modules and
parameters (the module layout PEFT sees), computes the deltas there in float64 on the engine's device
(a GPU's float64 GEMM: the same sums as the CPU's up to their order, ~1e-16 relative, far below one
unit in the last place of the float32 / bfloat16 weights they are rounded to), and carries them
into the checkpoint names and layout the sampler weights use through the same view mapping as the
rollout engine's weights (:mod:`ferrule.rollout._checkpoint_names`). A key that cannot be placed is
an error naming it, raised before anything is returned (so nothing is written).
"""

from __future__ import annotations

import math
from typing import Any, Mapping
from ferrule.contract import registry

__all__ = ["merged_hf_state", "MergeError"]

PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class MergeError(KeyError):
    """LoRA adapter keys that cannot be merged into the base (message lists every offender)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def merged_hf_state(engine: Any, hf_model: Any = None, layout: Mapping[str, Any] | None = None,
                    device: Any = None) -> dict:
    """The engine's full model under HF checkpoint names (CPU copies), adapters merged.

    Args:
        engine: a :class:`~ferrule.megatron.engine.TrainEngine` (world size 1); without LoRA
            its :meth:`export_hf_state` is returned as is.
        hf_model: a transformers model of the same config (its module tree and parameter layout
            are what PEFT adapts; its values are not read); default: one built on the meta device
            (:func:`meta_model`, no memory).
        layout: checkpoint name -> :class:`ferrule.rollout._checkpoint_names.CheckpointTensor`
            of ``hf_model`` (``EmbeddedEngine.checkpoint_layout()``); computed when omitted.
        device: where the merge is computed (None: where the engine's weights are, so a GPU client's
            merge runs on the GPU, unless its free memory cannot hold the float64 deltas: then the CPU;
            on a CPU the float64 products of a 0.5B model's rank-16 adapter take ~5 s and the float64
            adds and copies ~7 s on one core, measured); the result is copied to the CPU.

    Returns:
        ``{checkpoint name: tensor}`` in each weight's dtype; deltas are computed in float64
        (``W + scaling * delta``, ``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).

    Raises:
        MergeError: an adapter key with no module / parameter to merge into, factors whose shapes
            do not fit it, or a delta no checkpoint tensor holds (every offender listed).
    """
    if getattr(engine, "lora", None) is None:
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in engine.export_hf_state()}
    import torch

    from ferrule.lora import hf_adapter_state_dict, peft_config

    tensors = {k: v.detach() for k, v in engine.export_hf_state()}
    if device is None:
        device = _merge_device(tensors)

    if hf_model is None:
        hf_model, layout = meta_model(engine.hf_config), None
    cfg = peft_config(engine)
    scaling = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    adapters = {k: v.detach().to(device) for k, v in hf_adapter_state_dict(engine).items()}
    deltas, problems = module_deltas(hf_model, adapters, list(cfg.get("target_parameters") or []), scaling)
    if layout is None:
        from ferrule.rollout._checkpoint_names import checkpoint_tensors

        layout = checkpoint_tensors(hf_model)
    placed: set[str] = set()
    updates: dict[str, Any] = {}
    for name, ct in layout.items():
        sources = [p for p in _param_names(ct) if p in deltas]
        if not sources:
            continue
        if name not in tensors:
            problems.append(f"{name} (holds the merged {sources}) is not among the exported weights")
            continue
        updates[name] = _checkpoint_delta(ct, deltas, hf_model, device)
        placed.update(sources)
    problems += [f"{p}: no checkpoint tensor holds this parameter" for p in sorted(set(deltas) - placed)]
    if problems:
        raise MergeError("cannot merge the LoRA adapters into the sampler weights: " + "; ".join(problems)
                         + ". Nothing was written.")
    out = {}
    for name, w in tensors.items():   # CPU tensors owning their storage (the engine's may be views of parameters)
        if name in updates:
            out[name] = (w.to(device, torch.float64) + updates.pop(name)).to(w.dtype).to("cpu").contiguous()
        else:
            out[name] = w.to("cpu").contiguous().clone() if w.device.type == "cpu" else w.to("cpu").contiguous()
    return out


def _merge_device(tensors: Mapping[str, Any]) -> Any:
    """Where the engine's weights are, if that device has room for the float64 deltas (at most 8 bytes per
    weight, all held until the adds: 4 GB for a 0.5B model, 56 GB for a 7B one) with a quarter to spare;
    else the CPU (the weights are copied there anyway)."""
    import torch

    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 8 * sum(t.numel() for t in tensors.values()) * 1.25 > free:
            return torch.device("cpu")
    return device


def meta_model(hf_config: Mapping[str, Any]) -> Any:
    """The family's transformers model (``registry.hf_model_class``) for ``hf_config``, on the meta device."""
    import torch
    from transformers import AutoConfig

    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return registry.hf_model_class(config)(config)


def module_deltas(hf_model: Any, adapters: Mapping[str, Any], target_parameters: list[str],
                  scaling: float) -> tuple[dict[str, Any], list[str]]:
    """``({HF parameter name: float64 delta in its shape}, problems)`` of PEFT-named adapters."""
    import torch

    params = dict(hf_model.named_parameters(remove_duplicate=False))
    deltas: dict[str, Any] = {}
    problems: list[str] = []
    for key in sorted(k for k in adapters if k.endswith(_A)):
        b_key = key[:-len(_A)] + _B
        if b_key not in adapters:
            problems.append(f"{key}: no {b_key}")
            continue
        a, b = adapters[key].double(), adapters[b_key].double()
        path = key.removeprefix(PEFT_PREFIX)[:-len(_A)]
        depth = 0
        while path.endswith(".base_layer"):
            path, depth = path[:-len(".base_layer")], depth + 1
        try:
            module = hf_model.get_submodule(path)
        except AttributeError:
            problems.append(f"{key}: the model has no module {path}")
            continue
        targeted = [n for n, _ in module.named_parameters(recurse=False)
                    if any(f"{path}.{n}" == t or f"{path}.{n}".endswith("." + t) for t in target_parameters)]
        if targeted:  # ParamWrapper: the k-th targeted parameter sits under n - 1 - k base_layer segments
            if depth >= len(targeted):
                problems.append(f"{key}: {depth} base_layer nesting(s) but {path} has {len(targeted)} targeted "
                                f"parameter(s) {targeted}")
                continue
            pname = f"{path}.{targeted[len(targeted) - 1 - depth]}"
        elif depth == 0 and f"{path}.weight" in params:
            pname = f"{path}.weight"
        else:
            problems.append(f"{key}: {path} is neither an adapted linear (no {path}.weight) nor holds a "
                            f"target_parameters entry ({target_parameters})")
            continue
        shape = tuple(params[pname].shape)
        r_total = a.shape[0]
        if len(shape) == 3:
            n_exp = shape[0]
            if a.dim() != 2 or b.dim() != 2 or r_total % n_exp or b.shape[1] != r_total:
                problems.append(f"{key}: factors {tuple(a.shape)}, {tuple(b.shape)} do not fit {pname} {shape}")
                continue
            a3 = a.reshape(n_exp, r_total // n_exp, a.shape[1])
            b3 = b.reshape(b.shape[0], r_total // n_exp, n_exp)
            eq = "o r e, e r i -> e i o" if getattr(module, "is_transposed", False) else "o r e, e r i -> e o i"
            delta = torch.einsum(eq, b3, a3) * scaling
        else:
            delta = (b @ a) * scaling if a.dim() == 2 and b.dim() == 2 and b.shape[1] == a.shape[0] else None
        if delta is None or tuple(delta.shape) != shape:
            problems.append(f"{key}: factors {tuple(a.shape)}, {tuple(b.shape)} give a delta of "
                            f"{None if delta is None else tuple(delta.shape)}, {pname} is {shape}")
            continue
        deltas[pname] = deltas[pname] + delta if pname in deltas else delta
    return deltas, problems


def _param_names(ct: Any) -> list[str]:
    return list(ct.part_names) if ct.parts else [ct.param_name]


def _checkpoint_delta(ct: Any, deltas: Mapping[str, Any], hf_model: Any, device: Any = "cpu") -> Any:
    """The delta of checkpoint tensor ``ct``: the module-layout deltas read through ``ct``'s mapping
    (the strided view, the flat index, or the per-parameter parts), zeros where a part has none."""
    import torch

    if ct.view is not None:
        d = deltas[ct.param_name].contiguous()
        return d.as_strided(tuple(ct.view.shape), tuple(ct.view.stride()),
                            ct.view.storage_offset() - ct.param.storage_offset())
    if not ct.parts:
        return deltas[ct.param_name].reshape(-1)[ct.index.reshape(-1).to(device)].view(ct.shape)
    out = torch.zeros(ct.shape, dtype=torch.float64, device=device).view(-1)
    for (_, pos, local), pname in zip(ct.parts, _param_names(ct)):
        if pname in deltas:
            out[pos.to(device)] = deltas[pname].reshape(-1)[local.to(device)]
    return out.view(ct.shape)
