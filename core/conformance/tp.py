"""The conformance kit's numeric cases at tensor parallelism 2: one ``torchrun`` launch, every family.

Run by :class:`ferrule.conformance.kit.FamilyConformance` (or by hand)::

    python -m torch.distributed.run --nproc-per-node 2 -m ferrule.conformance.tp \
        --work DIR --out results.json FAMILY [FAMILY ...]

Each rank initializes megatron with ``ParallelLayout(tp=2)`` (gloo on CPU) once (re-initialized at
``etp=1`` for a family whose ``ModelFamilySpec.layouts`` refuses expert TP 2: :func:`kit_layout`); then, for each
family: rank 0 saves the tiny random HF model (:func:`ferrule.conformance.numeric.tiny_hf_dir`,
with the family's optional ``TINY_TP2_OVERRIDES`` applied, e.g. 2 KV heads for an MQA config),
both ranks build the provider at TP=2, load the HF tensors through the mapping table (so a
wrong ``TPSplit`` shows up as a shape error or wrong numbers), export them back
(:func:`ferrule.megatron.weights.export_mcore_to_hf`, which gathers the TP shards) and run the
kit's test batch (and, for a family with towers and ``tiny_media``, the media prompt of
:mod:`ferrule.conformance.media`). Rank 0 compares the gathered logits with HF transformers (fp32, ``atol``
1e-5) and the exported tensors with the source files (bit-exact), and writes
``{family: {"ok": bool, "logits_max_abs_diff": float | None, "error": str | None, "train": {...}}}`` to
``--out``; ``train`` is the training step at the same layout (every parameter's gradient vs HF's after megatron's
TP gradient finalization, and a weight sync through the update groups delivering every checkpoint tensor:
:func:`check_family_tp`), ``{"error": text}`` when it fails. One failing family does not stop the others (errors are raised on every rank at the
same point, so the ranks stay in step).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from ferrule import envs
from ferrule.conformance import numeric as cn
from ferrule.conformance.grads import (
    check_update_groups_reach_rollout, compare_grads, gradient_problem, mcore_grads,
)
from ferrule.conformance.media import mcore_media_logits, media_prompt, tiny_media_of
from ferrule.conformance.numeric import _variant_module
from ferrule.contract import registry
from ferrule.formats.safetensors_io import SafetensorsReader
from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed
from ferrule.megatron.provider import provider_build
from ferrule.megatron.weights import export_mcore_to_hf, load_hf_into_mcore

__all__ = ["check_family_tp", "main"]

TP = 2


def tp2_overrides(family: str) -> dict | None:
    """The family's ``TINY_TP2_OVERRIDES`` (HF keys applied over ``TINY_HF_CONFIG`` for the TP=2 run), or None.

    For a tiny config TP cannot split, e.g. one KV head (MQA) at TP=2.
    """
    value = getattr(_variant_module(family), "TINY_TP2_OVERRIDES", None)
    return dict(value) if value is not None else None


def kit_layout(family: str, tc_kwargs: dict | None = None):
    """The ``ParallelLayout`` the kit checks ``family`` at: ``tp=2``, with the expert TP size the family's
    ``ModelFamilySpec.layouts`` allows (megatron's default ``etp = tp`` when it allows it, else the largest
    allowed divisor of ``tp``; a biased-MoE family that declares ``etp=(1,)`` is checked at ``etp=1``). A MoE
    model with biases (``tc_kwargs``: ``num_moe_experts`` and ``add_bias_linear``) is checked at ``etp=1``, the
    only expert TP size megatron-core builds it at."""
    support = registry.get_family(family).layouts
    allowed = support.etp if support is not None else None
    if tc_kwargs and tc_kwargs.get("num_moe_experts") and tc_kwargs.get("add_bias_linear"):
        allowed = tuple(v for v in (allowed or (1,)) if v == 1) or allowed
    if allowed is None or TP in allowed:
        return ParallelLayout(tp=TP)
    fits = [v for v in allowed if TP % v == 0]
    return ParallelLayout(tp=TP, etp=max(fits)) if fits else ParallelLayout(tp=TP)


def _use_layout(layout) -> None:
    """Re-initialize megatron's model-parallel groups at ``layout`` when it differs (same process group)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_expert_tensor_parallel_world_size() != (layout.etp or layout.tp)):
        destroy_distributed(keep_process_group=True)
    init_distributed(layout)


def check_family_tp(family: str, work: Path, *, atol: float, train: dict | None = None) -> float:
    """Numeric cases for ``family`` at the current TP layout; returns the logits max abs diff (rank 0).

    ``train``: a dict that receives the training step's result on rank 0 (also when a logits case then fails):
    ``{"grad_max_rel", "grad_worst", "grad_tensors", "synced_tensors"}`` or ``{"error": text}``: every parameter's
    gradient (after megatron's TP gradient finalization, gathered) vs HF's within
    :data:`ferrule.conformance.grads.GRAD_RTOL`, and a weight sync through the update groups at this layout
    delivering every checkpoint tensor (:func:`ferrule.conformance.grads.check_update_groups_reach_rollout`)."""
    import torch
    import torch.distributed as dist

    from ferrule.media import hf_media_inputs, towers_for_config
    from ferrule.megatron.gpt_config import check_family_layout

    rank = dist.get_rank()
    src = work / family / "hf"
    if rank == 0:
        cn.tiny_hf_dir(family, src, overrides=tp2_overrides(family))
    dist.barrier()
    hf_config = json.loads((src / "config.json").read_text())
    converter = registry.get_converter(family)
    tc_kwargs, _ = converter.resolved_config_translation().to_mcore(hf_config)
    layout = kit_layout(family, tc_kwargs)
    try:
        check_family_layout(family, tc_kwargs, layout)
    except ValueError as exc:
        raise ValueError(f"TINY_HF_CONFIG cannot be split at TP={TP} ({exc}); set TINY_TP2_OVERRIDES in the "
                         f"provider module (e.g. more KV heads) so the kit can check the TP split.") from None
    table = converter.resolved_mapping()
    build = provider_build(family)
    _use_layout(layout)
    # the training step's build (no auxiliary loss; the logits are the same): TRAIN_STEP_OVERRIDES
    (model,) = build(hf_config, layout, parallel_output=False, config_overrides=dict(cn.TRAIN_STEP_OVERRIDES))
    load_hf_into_mcore([model], src, table, hf_config=hf_config)
    exported = {name: t.cpu() for name, t in export_mcore_to_hf([model], table, hf_config=hf_config)}
    model.eval()
    vocab = cn.text_vocab_size(hf_config)
    seq_len = cn.tiny_test_seq_len(family)
    ids = cn.test_token_ids(vocab, seq_len)
    with torch.no_grad():
        out = model(ids, torch.arange(seq_len).unsqueeze(0).expand_as(ids), attention_mask=None)[..., :vocab]
    grads_error = mc_grads = None
    try:  # collectives on every rank (the TP finalization, the gradient export's gathers, the sync's)
        mc_grads = mcore_grads(model, family, hf_config, ids, table=table)
        synced = check_update_groups_reach_rollout([model], family, hf_config, src)
    except Exception as exc:  # noqa: BLE001 - the training case's result; the logits cases go on
        grads_error = f"{type(exc).__name__}: {exc}"
    media = tiny_media_of(family, hf_config) if registry.get_towers(family) else None
    if media:  # the towers at TP=2: replicated, their outputs scattered into the vocab-parallel embedding
        towers = towers_for_config(hf_config)
        media_ids = media_prompt(hf_config, media, towers)
        with torch.no_grad():
            media_out = mcore_media_logits(model, media_ids, media)[..., :vocab]
    if rank != 0:
        return float("nan")
    hf = cn.hf_model_class(family, hf_config["model_type"]).from_pretrained(src, use_kernels=False, dtype=torch.float32).eval()
    if train is not None:
        train.update(_train_result(family, hf, ids, mc_grads, synced if grads_error is None else None, grads_error,
                                   _layout_label(layout)))
    reader = SafetensorsReader(src)
    changed = sorted(k for k in reader.keys() if k not in exported or not torch.equal(reader.get(k), exported[k]))
    extra = sorted(set(exported) - set(reader.keys()))
    assert not changed and not extra, (
        f"{family}: HF -> megatron (TP={TP}) -> HF changed {changed[:8]} and added {extra[:8]}: the mapping table's "
        f"TP split (tp= of those rows) or the provider does not round-trip at TP={TP}.")
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        if media:
            media_ref = hf(input_ids=media_ids, **hf_media_inputs(towers, media, 1, "cpu", hf_config)).logits
    diff = cn.logits_max_diff(family, out, ref)
    assert diff <= atol, (f"{family}: Megatron (TP={TP}) vs HF logits max abs diff {diff:.3g} > {atol} while the "
                          f"weights round-trip: suspect the plugin's TP split of a row (tp=) or the provider.")
    if media:
        media_diff = cn.logits_max_diff(family, media_out, media_ref)
        assert media_diff <= atol, (f"{family}: Megatron (TP={TP}) + towers vs HF logits with media max abs diff "
                                    f"{media_diff:.3g} > {atol} (text-only logits match: suspect the towers' TP handling)")
        diff = max(diff, media_diff)
    return diff


def _layout_label(layout) -> str:
    etp = layout.etp if layout.etp is not None else layout.tp
    return f"TP={layout.tp}" + (f", expert TP={etp}" if etp != layout.tp else "")


def _train_result(family: str, hf, ids, mc_grads: dict | None, synced: int | None, error: str | None,
                  label: str) -> dict:
    """Rank 0's training-step result (:func:`check_family_tp`'s ``train``): HF's gradients vs ``mc_grads``."""
    if error is not None:
        return {"error": error}
    try:
        result = compare_grads(hf, ids, mc_grads)
    except Exception as exc:  # noqa: BLE001 - HF's backward failing is the case's result
        return {"error": f"HF backward: {type(exc).__name__}: {exc}"}
    problem = gradient_problem(result)
    if problem:
        return {"error": f"AssertionError: {family}: gradients ({label}, fp32) differ from HF's: {problem}. The logits "
                         f"match at this layout only if the forward is right; suspect a detached or frozen computation, "
                         f"a custom op's backward, or a gradient reduction over TP (docs/plugins.md, section 6)."}
    return {"grad_max_rel": result["max_rel"], "grad_worst": result["worst"], "grad_tensors": result["compared"],
            "synced_tensors": synced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrule.conformance.tp")
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("families", nargs="+")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # megatron's deprecation chatter is not part of the report

    import torch.distributed as dist

    init_distributed(ParallelLayout(tp=TP))
    results: dict[str, dict] = {}
    for family in args.families:
        train: dict = {}
        try:
            diff = check_family_tp(family, Path(args.work), atol=args.atol, train=train)
            results[family] = {"ok": True, "logits_max_abs_diff": diff, "error": None}
        except Exception as exc:  # noqa: BLE001 - reported per family; the launch goes on
            results[family] = {"ok": False, "logits_max_abs_diff": None, "error": f"{type(exc).__name__}: {exc}"}
        results[family]["train"] = train or {"error": "not reached: " + str(results[family]["error"])}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=2))
    destroy_distributed()
    return 0


if __name__ == "__main__":  # pragma: no cover
    envs.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
