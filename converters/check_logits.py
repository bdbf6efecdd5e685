"""The logits and divergence step of ``ferrule check``, run on ``tp`` ranks (one process per rank).

:func:`logits_worker` is started by :func:`ferrule.converters.checkpoint._run` exactly like the
conversion workers: in-process at TP=1, ``tp`` spawned gloo/NCCL processes otherwise. Every rank
builds the family's provider at ``ParallelLayout(tp=tp)`` (``parallel_output=False``: gathered
logits), loads the converted torch_dist checkpoint and runs the test batch with forward hooks on
the capture points (:mod:`ferrule.converters.check_points`); rank 0 also runs HF transformers
(fp32) with hooks, compares, and writes one JSON file::

    {"logits_diff": float, "shape": [b, s], "divergence": [[layer, op, diff|null, note], ...],
     "diagnostic_error": str|null, "feature_effects": {hf_key: float}}

A failure of the diagnostics (hooks, capture modules) is written as ``diagnostic_error`` and never
stops the logits comparison. ``feature_effects`` holds, for each soft-cap the config declares,
the max change of HF's logits when that cap is switched off on the same tokens (a cap whose
effect is within ``atol`` never binds at this test length).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from .check_points import POINT_OPS, _max_diff, capture, compare, hf_layer_points, mcore_layer_points
from ferrule.conformance.fields import hf_model_class
from ferrule.conformance.grads import compare_grads, mcore_grads
from ferrule.conformance.numeric import update_unit_problems
from ferrule.contract import registry
from ferrule.megatron.parallel import ParallelLayout, init_distributed
from ferrule.megatron.provider import provider_build
from ferrule.megatron.param_gather import global_param_names
from ferrule.rollout._quantized import dequantized_source

__all__ = ["logits_worker", "SOFTCAP_KEYS"]

#: HF config keys of soft-caps whose reach the check measures.
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")


def _capture_overrides(family: str) -> dict | None:
    try:
        from ferrule.conformance.numeric import _variant_module

        return dict(getattr(_variant_module(family), "CHECK_HF_CAPTURE", None) or {}) or None
    except Exception:  # noqa: BLE001 - no variant module: the default capture choice
        return None


def _mcore_points(model) -> tuple[dict, list]:
    points = {("embedding", ""): model.embedding, ("final_norm", ""): model.decoder.final_layernorm}
    order = []
    for i, layer in enumerate(model.decoder.layers):
        for op, module in mcore_layer_points(layer).items():
            points[(i, op)] = module
    return points, order


def _hf_points(hf, family: str) -> tuple[dict, list]:
    inner = hf.model
    overrides = _capture_overrides(family)
    points = {("embedding", ""): inner.embed_tokens, ("final_norm", ""): inner.norm}
    order = [("embedding", "")]
    for i, layer in enumerate(inner.layers):
        for op, module in hf_layer_points(layer, overrides).items():
            points[(i, op)] = module
        order += [(i, op) for op in POINT_OPS]
    return points, order + [("final_norm", "")]


def _feature_effects(hf_dir: Path, ids, ref, attn_impl: str | None) -> dict[str, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    effects = {}
    for key in SOFTCAP_KEYS:
        if getattr(config, key, None) is None:
            continue
        off = AutoConfig.from_pretrained(hf_dir)
        setattr(off, key, None)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, config=off, use_kernels=False, dtype=torch.float32,
                                                     attn_implementation=attn_impl).eval()
        with torch.no_grad():
            effects[key] = (model(input_ids=ids).logits.double() - ref.double()).abs().max().item()
        del model
    return effects


def _dequantized_copy(hf_dir: Path, out: Path) -> str:
    """``hf_dir`` with its quantized tensors dequantized (:func:`ferrule.rollout._quantized.dequantized_source`) and
    ``quantization_config`` dropped, written to ``out`` (config, tokenizer files and one ``model.safetensors``)."""
    import shutil

    from safetensors.torch import save_file

    config, tensors = dequantized_source(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _update_groups(model, family: str) -> dict:
    """The family's update-group table on this model's parameters (:func:`ferrule.conformance.numeric.
    update_unit_problems`): ``{"units": n, "problems": [...]}``; a wrong group (a parameter in no unit, so a
    weight sync would never send it) fails the check, not only the kit."""
    try:
        names = list(global_param_names(model).values())
        units, problems = update_unit_problems(names, registry.get_update_groups(family))
        return {"units": len(units), "problems": problems}
    except Exception as exc:  # noqa: BLE001 - reported as the update-groups row
        return {"units": 0, "problems": [f"{type(exc).__name__}: {exc}"]}


def logits_worker(rank: int, hf_dir: str, td_dir: str, out_file: str, family: str, tp: int, ids: list,
                  attn_impl: str | None, layout_kw: dict | None = None, grads: bool = False) -> None:
    """One rank of the logits step (module docs); ``ids`` is the ``[b, s]`` test batch as lists; ``layout_kw``
    the ``ParallelLayout`` keywords (default ``{"tp": tp}``); ``grads``: also the gradient step (every
    parameter's gradient of ``sum(logits * w)`` vs HF's, written as ``"gradients"``)."""
    import torch

    from .checkpoint import load_torch_dist_into_mcore

    layout = ParallelLayout(**(layout_kw or {"tp": tp}))
    init_distributed(layout)
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    ids_t = torch.tensor(ids, dtype=torch.long)
    # no auxiliary losses: the gradient step compares the logits' gradient alone with HF's (the logits are unchanged)
    overrides = {"perform_initialization": False, "moe_aux_loss_coeff": 0.0}
    (model,) = provider_build(family)(hf_config, layout, params_dtype=torch.float32, parallel_output=False,
                                      config_overrides=overrides)
    load_torch_dist_into_mcore([model], td_dir)
    model.eval()
    mc_store: dict = {}
    diag_error = None
    handles: list = []
    try:
        mc_points, _ = _mcore_points(model)
        handles = capture(mc_points, mc_store, layout="sbh")
    except Exception as exc:  # noqa: BLE001 - a diagnostic failure never hides the logits
        diag_error = f"megatron capture points: {type(exc).__name__}: {exc}"
    device = next(model.parameters()).device
    pos = torch.arange(ids_t.shape[1]).unsqueeze(0).expand_as(ids_t)
    try:
        with torch.no_grad():
            out = model(ids_t.to(device), pos.to(device), attention_mask=None)
    finally:
        for h in handles:
            h.remove()
    grad_error = mc_grads = None
    if grads:
        try:  # every rank: the gradient export gathers TP shards (collectives)
            mc_grads = mcore_grads(model, family, hf_config, ids_t)
        except Exception as exc:  # noqa: BLE001 - reported as the gradient row
            grad_error = f"megatron backward: {type(exc).__name__}: {exc}"
    if rank != 0:
        return
    update_groups = _update_groups(model, family)

    # AutoModelForCausalLM, or the family's hf_model_class for a multimodal model_type (text logits only)
    cls = hf_model_class(family, hf_config["model_type"])
    hf, info = cls.from_pretrained(hf_dir, use_kernels=False, dtype=torch.float32, attn_implementation=attn_impl,
                                   output_loading_info=True)
    referee_note = None
    if hf_config.get("quantization_config") and (info.get("missing_keys") or info.get("unexpected_keys")):
        # transformers' CPU load of this quantized folder is not the model (Inkling-2's MXFP8 experts: the scales
        # come back unexpected and the FP8 values unscaled, docs/families/inkling2.md): the referee is then
        # transformers' load of the same weights dequantized as the converters read them (transformers'
        # Fp8Dequantize arithmetic, tests/test_convert_mxfp8.py), written to a bf16 / fp32 folder beside
        del hf
        hf_dir = _dequantized_copy(Path(hf_dir), Path(out_file).parent / "dequantized_hf")
        hf, info = cls.from_pretrained(hf_dir, use_kernels=False, dtype=torch.float32, attn_implementation=attn_impl,
                                       output_loading_info=True)
        referee_note = "HF reference: transformers' load of the folder dequantized as the converters read it"
    hf = hf.eval()
    hf_store: dict = {}
    handles, order = [], []
    try:
        hf_points, order = _hf_points(hf, family)
        handles = capture(hf_points, hf_store, layout="bsh")
    except Exception as exc:  # noqa: BLE001
        diag_error = diag_error or f"HF capture points: {type(exc).__name__}: {exc}"
    try:
        with torch.no_grad():
            ref = hf(input_ids=ids_t).logits
    finally:
        for h in handles:
            h.remove()
    vocab = ref.shape[-1]
    result: dict[str, Any] = {"logits_diff": _max_diff(out[..., :vocab].double().cpu(), ref.double()),
                              "shape": list(ids_t.shape), "divergence": [], "diagnostic_error": diag_error,
                              "feature_effects": {}, "referee_note": referee_note, "update_groups": update_groups}
    if diag_error is None:
        try:
            result["divergence"] = [list(r) for r in compare(order, hf_store, mc_store)]
        except Exception as exc:  # noqa: BLE001
            result["diagnostic_error"] = f"comparison: {type(exc).__name__}: {exc}"
    if grads and grad_error is None:
        try:
            result["gradients"] = compare_grads(hf, ids_t, mc_grads)
        except Exception as exc:  # noqa: BLE001
            grad_error = f"HF backward: {type(exc).__name__}: {exc}"
    result["gradient_error"] = grad_error
    del hf
    try:
        result["feature_effects"] = _feature_effects(Path(hf_dir), ids_t, ref, attn_impl)
    except Exception as exc:  # noqa: BLE001
        result["feature_error"] = f"{type(exc).__name__}: {exc}"
    Path(out_file).write_text(json.dumps(result))
