"""``ferrule check``: does ferrule reproduce an HF checkpoint? (convert, round trip, logits, divergence).

For a plugin author or a user with a real checkpoint. :func:`run_check` runs, in order:

1. **config**: the family's config translation of ``config.json`` (as transformers parses it;
   untranslated keys are refused by name), and whether the tensor-parallel size fits the model;
2. **reach**: a warning row when a declared feature cannot bind at the test length (a
   ``sliding_window`` >= the sequence length; a soft-cap that changes HF's logits by no more than
   ``atol`` on the test tokens, measured in step 4): such a plugin could pass with the feature
   mistranslated, so the row names the ``--seq-len`` that reaches the window;
3. **convert**: ``hf_to_torch_dist`` at ``tp`` (``tp`` processes; a quantized source (MXFP8 / FP8 /
   NVFP4) at fp32, dequantized as step 5's fp32 HF model dequantizes it);
4. **round trip**: ``torch_dist_to_hf`` at ``tp`` and a bit-exact comparison with the source
   safetensors (every key, dtype and value);
5. **logits** at ``tp``: HF transformers (fp32) vs the megatron model built at
   ``ParallelLayout(tp=tp)`` on ``tp`` processes and loaded from the converted checkpoint (fp32,
   gathered logits), on random token ids (fixed seed) or the user's text tokenized by the
   checkpoint's tokenizer; max abs difference vs ``atol``;
6. **divergence** (only when the logits differ): the per-layer capture points of
   :mod:`ferrule.converters.check_points` (embedding, input norm, attention, pre-MLP norm, MLP,
   layer output, final norm), captured during the same forward passes; the report names the
   first layer and op whose max abs difference exceeds ``atol`` (a point one side lacks is not
   compared and never chosen).

Each step gives a :class:`CheckRow`; later steps are skipped after a failure they depend on.
Row statuses: ``ok``, ``FAIL`` (the plugin computes something else), ``CRASH`` (plugin code
raised), ``WARN`` (passes, but a declared feature was not exercised), ``skipped``.

Exit codes of ``ferrule check`` (:attr:`CheckReport.exit_code`): :data:`EXIT_OK` 0,
:data:`EXIT_MISMATCH` 1 (a step failed: the plugin is wrong), :data:`EXIT_BAD_INPUT` 2 (no HF
directory, no family for it, the family refuses the config, a TP size the model cannot split;
raised by :func:`run_check`), :data:`EXIT_PLUGIN_CRASH` 3 (plugin code raised an unexpected
exception, e.g. an ``AttributeError`` in a provider).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrule.contract import registry
from ferrule.contract.specs import DEFAULT_PROVIDER_BUILD

__all__ = ["CheckRow", "CheckReport", "run_check", "EXIT_OK", "EXIT_MISMATCH", "EXIT_BAD_INPUT",
           "EXIT_PLUGIN_CRASH"]

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_PLUGIN_CRASH = 0, 1, 2, 3


@dataclass
class CheckRow:
    """One step of the check: ``status`` is ``ok``, ``FAIL``, ``CRASH``, ``WARN`` or ``skipped``."""

    step: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class CheckReport:
    """The rows of one check and, when the logits differ, the per-point divergence
    ``(layer, op, max abs diff or None, note)`` in forward order."""

    family: str
    rows: list[CheckRow] = field(default_factory=list)
    divergence: list[tuple[Any, str, float | None, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status not in ("FAIL", "CRASH") for r in self.rows)

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_PLUGIN_CRASH` if a step crashed, else :data:`EXIT_MISMATCH` if one failed, else 0."""
        if any(r.status == "CRASH" for r in self.rows):
            return EXIT_PLUGIN_CRASH
        return EXIT_OK if self.ok else EXIT_MISMATCH


def _token_ids(hf_dir: Path, vocab: int, seqs: int, seq_len: int, text: str | None):
    from ferrule.conformance import numeric as cn

    if text is None:
        import torch

        return torch.randint(0, vocab, (seqs, seq_len), generator=torch.Generator().manual_seed(cn.SEED))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    return cn.test_token_ids(vocab, len(ids), ids=[ids])


def _failure_status(exc: BaseException) -> str:
    """``FAIL`` for the errors ferrule raises about a plugin's tables or a checkpoint, ``CRASH`` otherwise."""
    from ferrule.formats.safetensors_io import CheckpointError
    from ferrule.mapping import MappingError

    return "FAIL" if isinstance(exc, (MappingError, CheckpointError, ValueError)) else "CRASH"


_SITE = re.compile(r"\((layer \d+ \w+|embedding|final_norm|output_layer)\)")


def _sited(detail: str) -> str:
    """``detail`` led by the first (in forward order) layer and op it names (``layer 0 mlp: ...``): a structural
    mistake (a parameter without a mapping row, an HF key nothing reads, a parameter in no update group; the
    messages name each offender's site, :func:`ferrule.mapping.vocabulary.parameter_site`) is blamed as a
    numeric one is."""
    from .check_points import POINT_OPS

    def order(site: str) -> tuple:  # forward order: embedding, layer by layer (op by op), final norm, output layer
        parts = site.split()
        if parts[0] != "layer":
            return ({"embedding": -1, "final_norm": 1 << 30, "output_layer": 1 << 31}[site], 0)
        return int(parts[1]), POINT_OPS.index(parts[2]) if parts[2] in POINT_OPS else len(POINT_OPS)

    sites = _SITE.findall(detail)
    return f"{min(sites, key=order)}: {detail}" if sites else detail


def _step(report: CheckReport, name: str, fn) -> Any:
    """Run ``fn()``; on an exception add a FAIL / CRASH row for ``name`` and return None."""
    t0 = time.time()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        status = _failure_status(exc)
        detail = f"{type(exc).__name__}: {exc}"
        report.rows.append(CheckRow(name, status, _sited(detail) if status == "FAIL" else detail, time.time() - t0))
        return None


def _window_reach(values: dict, seq_len: int) -> str | None:
    """Why the test sequence cannot reach the config's sliding window, or None."""
    window = values.get("sliding_window")
    layer_types = values.get("layer_types")
    slides = layer_types is None or "sliding_attention" in layer_types
    if isinstance(window, int) and slides and seq_len <= window:
        return (f"sliding_window={window} >= the {seq_len}-token test sequence: the window never binds, so a "
                f"mistranslated window would pass; rerun with --seq-len {window + 1} or longer")
    return None


def _round_trip(hf_dir: Path, back: Path, dtype: str | None = None) -> tuple[bool, str]:
    import torch

    from ferrule.converters import SafetensorsReader
    from ferrule.formats.quantized_weights import open_hf_weights

    # an MXFP8 / FP8 / NVFP4 source is compared as transformers reads it: dequantized (the export's default), in the
    # dtype it was converted at (float32 for a quantized source: _convert_and_compare)
    a, b = open_hf_weights(hf_dir, dtype=dtype), SafetensorsReader(back)
    missing = sorted(set(a.keys()) - set(b.keys()))
    changed = [k for k in sorted(set(a.keys()) & set(b.keys()))
               if a.get(k).dtype != b.get(k).dtype or not torch.equal(a.get(k), b.get(k))]
    ok = not missing and not changed
    return ok, (f"{len(a.keys())} tensors bit-exact" if ok else f"missing {missing[:5]}, changed {changed[:5]}")


def _layout_label(layout_kw: dict) -> str:
    """``tp=2``, or ``tp=2, ep=2, etp=1`` when the expert degrees are set."""
    return ", ".join(f"{k}={v}" for k, v in layout_kw.items() if k == "tp" or (k == "ep" and v != 1) or k == "etp")


def _config_step(hf_dir: Path, family: str | None, layout_kw: dict):
    """Family, translation and layout check; raises for bad input (exit 2)."""
    from ferrule.config_translation import parse_hf_config
    from ferrule.megatron.gpt_config import check_family_layout
    from ferrule.megatron.parallel import ParallelLayout

    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json; pass an HF checkpoint directory.")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    spec = registry.get_family(family) if family else registry.family_for_hf_config(hf_config)
    tc_kwargs, opts = registry.get_converter(spec.name).resolved_config_translation().to_mcore(hf_config)
    layout = ParallelLayout(**layout_kw)
    layout.validate(layout.tp * layout.ep)
    check_family_layout(spec.name, tc_kwargs, layout)
    if registry.get_provider(spec.name).build in (None, DEFAULT_PROVIDER_BUILD):
        # the default build's model options, checked here: an option it does not know was reported as a build
        # failure (exit 1 at tp=1, a crash, exit 3, at tp=2) after a config row that said "ok"
        import warnings

        from ferrule.megatron.gpt_builder import _model_kwargs, migrate_model_options

        translation = registry.get_converter(spec.name).resolved_config_translation()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the build warns, once, for a deprecated option
            _model_kwargs(translation, migrate_model_options(translation.name, tc_kwargs, opts))
    values, _ = parse_hf_config(hf_config, spec.name)
    return spec, hf_config, values, tc_kwargs, opts


def run_check(hf_dir: str | Path, *, tp: int = 1, family: str | None = None, seqs: int = 2, seq_len: int = 32,
              text: str | None = None, atol: float = 1e-5, work_dir: str | Path | None = None, ep: int = 1,
              etp: int | None = None, grads: bool = False, round_trip: bool = True) -> CheckReport:
    """Run the check steps (module docs) on ``hf_dir``; returns the report (never raises for a
    numeric mismatch or a crashing plugin: those are rows).

    The layout is ``ParallelLayout(tp=tp, ep=ep, etp=etp)`` on ``tp * ep`` processes (``etp`` None: megatron's
    default, ``tp``); every step (convert, round trip, logits) runs at it. ``grads``: also a **gradients** row
    after the logits: every parameter's gradient of ``sum(logits * w)`` (fixed random ``w``) from megatron at the
    layout, exported to HF names through the mapping table, vs HF's (fp32), within :data:`GRAD_RTOL` relative.
    At ``tp`` > 1 the ranks' gradients get the TP reductions of megatron's gradient finalization first (the q/k
    norms' partial gradients summed, as a training step sums them) and are gathered as weights are. At ``ep`` > 1
    (``tp`` 1 only; ``ValueError`` otherwise) the routed-expert gradients get the scaling megatron's DDP gives them
    (:func:`ferrule.conformance.grads.scale_expert_grads`) and are collected from the EP ranks as weights are. ``round_trip=False`` leaves the
    round-trip step out (no export back to HF, no comparison; ~0.5 s of a ~1.5 s tiny-model check at tp 1, one
    of three 2-rank jobs at tp 2): for repeated checks of one family whose round trip another check already covers
    (the planted-mistake tests).

    Raises:
        FileNotFoundError: no ``config.json`` in ``hf_dir``.
        ferrule.contract.registry.UnknownModelError: no family for the config (or ``family``).
        ferrule.config_translation.ConfigTranslationError: the family cannot translate the config.
        ValueError: ``tp`` cannot split the model (heads / KV groups); the layout does not fit the model or
            the family's ``layouts`` (``ferrule.megatron.parallel.ParallelLayoutError``).
    """
    from ferrule.config_translation import ConfigTranslationError
    from ferrule.converters.checkpoint import layout_kwargs

    hf_dir = Path(hf_dir)
    t0 = time.time()
    layout_kw = layout_kwargs(tp, ep, 1, etp)
    if grads and ep != 1 and tp != 1:
        raise ValueError(f"grads=True at tp={tp}, ep={ep}: the gradient step runs at ep > 1 with tp=1 only (it "
                         f"reproduces megatron's DDP scaling of the expert gradients for ep ranks that each hold every "
                         f"token; at tp > 1 the dispatcher shares the TP ranks' tokens among the experts, which it does "
                         f"not reproduce); check gradients with --tp {tp} --ep 1 and with --tp 1 --ep {ep}.")
    try:
        spec, hf_config, values, tc_kwargs, opts = _config_step(hf_dir, family, layout_kw)
    except (FileNotFoundError, LookupError, ConfigTranslationError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - plugin code raised while translating: a crash, not bad input
        report = CheckReport(family or "?")
        report.rows.append(CheckRow("config", "CRASH", f"{type(exc).__name__}: {exc}", time.time() - t0))
        return report
    report = CheckReport(spec.name)
    report.rows.append(CheckRow("config", "ok", f"{len(tc_kwargs)} TransformerConfig fields, {len(opts)} model options",
                                time.time() - t0))
    vocab = int(hf_config.get("vocab_size") or opts["vocab_size"])
    ids = _token_ids(hf_dir, vocab, seqs, seq_len, text)
    reach = [w for w in (_window_reach(values, int(ids.shape[1])),) if w]
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        tmp = Path(tmp)
        _convert_and_compare(report, hf_dir, tmp, spec, layout_kw, ids, atol, reach, grads, round_trip)
    if reach:
        report.rows.insert(1, CheckRow("reach", "WARN", "; ".join(reach)))
    return report


def _convert_and_compare(report: CheckReport, hf_dir: Path, tmp: Path, spec, layout_kw: dict, ids, atol: float,
                         reach: list[str], grads: bool = False, round_trip: bool = True) -> None:
    from ferrule.converters import hf_to_torch_dist, torch_dist_to_hf
    from ferrule.converters.workers import _run

    from .check_logits import logits_worker

    from ferrule.formats.quantized_weights import DequantizingReader, open_hf_weights

    t0 = time.time()
    # a quantized source is converted at float32: the logits step's HF model dequantizes into float32
    # (from_pretrained(dtype=float32)), and NVFP4 values are not exact in bfloat16
    dtype = "float32" if isinstance(open_hf_weights(hf_dir), DequantizingReader) else None
    label = _layout_label(layout_kw)
    tp, ep, etp = layout_kw["tp"], layout_kw["ep"], layout_kw.get("etp")
    convert = lambda: hf_to_torch_dist(hf_dir, tmp / "td", tp=tp, ep=ep, etp=etp, family=spec.name,  # noqa: E731
                                       dtype=dtype)
    if _step(report, f"convert ({label})", convert) is None:
        return
    report.rows.append(CheckRow(f"convert ({label})", "ok", "hf -> torch_dist", time.time() - t0))
    t0 = time.time()
    export = lambda: torch_dist_to_hf(tmp / "td", tmp / "back", tp=tp, ep=ep, etp=etp, family=spec.name)  # noqa: E731
    back = None if not round_trip else _step(report, f"round trip ({label})",
                                             lambda: (export(), _round_trip(hf_dir, tmp / "back", dtype))[1])
    if back is not None:
        report.rows.append(CheckRow(f"round trip ({label})", "ok" if back[0] else "FAIL", back[1], time.time() - t0))
    t0 = time.time()
    step = f"logits ({label}, fp32)"
    out = tmp / "logits.json"
    done = _step(report, step, lambda: _run(tp * ep, logits_worker, (str(hf_dir), str(tmp / "td"), str(out), spec.name,
                                                                     tp, ids.tolist(), spec.attn_implementation,
                                                                     layout_kw, grads), tmp) or True)
    if done is None:
        return
    result = json.loads(out.read_text())
    diff = result["logits_diff"]
    ok = diff <= atol
    report.rows.append(CheckRow(step, "ok" if ok else "FAIL", f"max |megatron - HF| = {diff:.3g} over "
                                f"{tuple(result['shape'])} tokens (atol {atol:g})"
                                + (f"; {result['referee_note']}" if result.get("referee_note") else ""), time.time() - t0))
    groups = result.get("update_groups") or {}
    if groups.get("problems"):  # a row only when it fails (the weight sync would lose or repeat a tensor)
        report.rows.append(CheckRow("update groups", "FAIL", _sited("; ".join(groups["problems"]))))
    _gradient_row(report, result, label)
    for key, effect in result.get("feature_effects", {}).items():
        if effect <= atol:
            reach.append(f"{key} changes HF's logits by only {effect:.2g} on the test tokens: the cap never binds, so "
                         f"a mistranslated cap would pass; test with longer or real text (--text)")
    if ok:
        return
    _divergence_row(report, result, atol)


def _gradient_row(report: CheckReport, result: dict, label: str) -> None:
    """The ``gradients`` row: every parameter's gradient of ``sum(logits * w)`` vs HF's (fp32), within
    :data:`~ferrule.conformance.grads.GRAD_RTOL` relative (the train engine tests' bound; the conformance kit's
    training-step case uses the same comparison, :mod:`ferrule.conformance.grads`)."""
    # here, not at the top: `ferrule --help` imports this module, and the gradient module brings the sync and
    # LoRA packages (27 modules more at start)
    from ferrule.conformance.grads import GRAD_RTOL

    step = f"gradients ({label}, fp32)"
    if result.get("gradient_error"):
        report.rows.append(CheckRow(step, "FAIL", result["gradient_error"]))
        return
    g = result.get("gradients")
    if not g:
        return
    ok = g["max_rel"] <= GRAD_RTOL and not g["missing"]
    detail = (f"{g['compared']} parameters, max relative |megatron - HF| = {g['max_rel']:.3g} (rtol {GRAD_RTOL:g})"
              + ("" if ok or g["max_rel"] <= GRAD_RTOL else f"; worst: {g['worst']}")
              + (f"; no megatron gradient for {g['missing']}" if g["missing"] else ""))
    report.rows.append(CheckRow(step, "ok" if ok else "FAIL", detail))


def _divergence_row(report: CheckReport, result: dict, atol: float) -> None:
    from .check_points import first_departure

    if result.get("diagnostic_error"):
        report.rows.append(CheckRow("divergence", "FAIL", f"the per-layer report could not be made "
                                    f"({result['diagnostic_error']}); the logits differ all the same"))
        return
    report.divergence = [tuple(r) for r in result["divergence"]]
    first = first_departure(report.divergence, atol)
    if first is None:
        detail = ("no captured point departs; suspect the output layer / logits (output_layer mapping, tied "
                  "embeddings, final soft-cap)")
    else:
        where = f"layer {first[0]} {first[1]}" if first[1] else str(first[0])
        detail = f"first departure: {where} (max diff {first[2]:.3g})"
    report.rows.append(CheckRow("divergence", "FAIL", detail))
