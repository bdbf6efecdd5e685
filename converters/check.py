"""``ferrule check``: does ferrule reproduce an HF checkpoint? (convert, round trip, logits, divergence).

For a plugin author or a user with a real checkpoint. :func:`run_check` runs, in order:

1. **config**: the family's config translation of ``config.json`` (as transformers parses it;
   untranslated keys are refused by name);
2. **convert**: ``hf_to_torch_dist`` at ``tp`` (``tp`` processes);
3. **round trip**: ``torch_dist_to_hf`` at ``tp`` and a bit-exact comparison with the source
   safetensors (every key, dtype and value);
4. **logits**: HF transformers (fp32) vs the megatron model loaded from the converted
   checkpoint (fp32, TP=1) on a few sequences: random token ids (fixed seed) or the user's text
   tokenized by the checkpoint's tokenizer; max abs difference vs ``atol``;
5. **divergence** (only when the logits differ): forward hooks capture, per decoder layer, the
   input-norm output, the attention output and the layer output on both sides; the report names
   the first layer and op whose max abs difference exceeds ``atol``.

Each step gives a :class:`CheckRow`; later steps are skipped after a failure they depend on.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CheckRow", "CheckReport", "run_check", "layer_divergence"]


@dataclass
class CheckRow:
    """One step of the check: ``status`` is ``"ok"``, ``"FAIL"`` or ``"skipped"``."""

    step: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class CheckReport:
    family: str
    rows: list[CheckRow] = field(default_factory=list)
    divergence: list[tuple[int | str, str, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status != "FAIL" for r in self.rows)


def _capture(module, store: dict, key, *, layout: str):
    """Forward hook storing the first output tensor as ``[batch, seq, hidden]`` fp64."""

    def hook(_m, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        out = out.detach().double()
        store[key] = out.transpose(0, 1) if layout == "sbh" else out

    return module.register_forward_hook(hook)


def layer_divergence(hf_model, mcore_model, ids, *, atol: float) -> list[tuple[int | str, str, float]]:
    """``(layer, op, max abs diff)`` for every captured point, in forward order.

    Points: ``embedding``; per layer ``input_norm``, ``attention`` (attention block output before
    the residual add), ``output`` (hidden states after the layer); ``final_norm``. HF modules:
    ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn}``, ``model.layers[i]``,
    ``model.norm``; megatron: ``embedding``, ``decoder.layers[i].{input_layernorm,
    self_attention}``, ``decoder.layers[i]``, ``decoder.final_layernorm``. Families that
    normalise inside the attention block (post-attention norms) differ at ``attention`` by
    design; read their ``output`` rows.
    """
    import torch

    hf_store: dict = {}
    mc_store: dict = {}
    handles = [_capture(hf_model.model.embed_tokens, hf_store, ("embedding", ""), layout="bsh"),
               _capture(hf_model.model.norm, hf_store, ("final_norm", ""), layout="bsh"),
               _capture(mcore_model.embedding, mc_store, ("embedding", ""), layout="sbh"),
               _capture(mcore_model.decoder.final_layernorm, mc_store, ("final_norm", ""), layout="sbh")]
    for i, (hl, ml) in enumerate(zip(hf_model.model.layers, mcore_model.decoder.layers)):
        handles += [_capture(hl.input_layernorm, hf_store, (i, "input_norm"), layout="bsh"),
                    _capture(hl.self_attn, hf_store, (i, "attention"), layout="bsh"),
                    _capture(hl, hf_store, (i, "output"), layout="bsh"),
                    _capture(ml.input_layernorm, mc_store, (i, "input_norm"), layout="sbh"),
                    _capture(ml.self_attention, mc_store, (i, "attention"), layout="sbh"),
                    _capture(ml, mc_store, (i, "output"), layout="sbh")]
    try:
        with torch.no_grad():
            hf_model(input_ids=ids)
            mcore_model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), attention_mask=None)
    finally:
        for h in handles:
            h.remove()
    order = [("embedding", "")] + [(i, op) for i in range(len(hf_model.model.layers))
                                   for op in ("input_norm", "attention", "output")] + [("final_norm", "")]
    rows = []
    for key in order:
        if key in hf_store and key in mc_store and hf_store[key].shape == mc_store[key].shape:
            rows.append((key[0], key[1], (hf_store[key] - mc_store[key]).abs().max().item()))
        else:
            rows.append((key[0], key[1], float("nan")))
    return rows


def _token_ids(hf_dir: Path, vocab: int, seqs: int, seq_len: int, text: str | None):
    from ferrule import conformance_numeric as cn

    if text is None:
        import torch

        return torch.randint(0, vocab, (seqs, seq_len), generator=torch.Generator().manual_seed(cn.SEED))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    return cn.test_token_ids(vocab, len(ids), ids=[ids])


def run_check(hf_dir: str | Path, *, tp: int = 1, family: str | None = None, seqs: int = 2, seq_len: int = 32,
              text: str | None = None, atol: float = 1e-5, work_dir: str | Path | None = None) -> CheckReport:
    """Run the check steps (module docs) on ``hf_dir``; returns the report (never raises for a
    numeric mismatch; raises for unusable input).

    Raises:
        FileNotFoundError: no ``config.json`` in ``hf_dir``.
        ferrule.registry.UnknownModelError: no family for the config (or ``family``).
        ferrule.config_translation.ConfigTranslationError: the family cannot translate the config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from ferrule import registry
    from ferrule.megatron.provider import provider_build
    from ferrule.conformance_numeric import single_rank
    from ferrule.converters import SafetensorsReader, hf_to_torch_dist, torch_dist_to_hf
    from ferrule.converters.checkpoint import load_torch_dist_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json; pass an HF checkpoint directory.")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    spec = registry.get_family(family) if family else registry.family_for_hf_config(hf_config)
    report = CheckReport(spec.name)
    translation = registry.get_converter(spec.name).resolved_config_translation()
    t0 = time.time()
    tc_kwargs, opts = translation.to_mcore(hf_config)
    report.rows.append(CheckRow("config", "ok", f"{len(tc_kwargs)} TransformerConfig fields, {len(opts)} model options",
                                time.time() - t0))
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        try:
            hf_to_torch_dist(hf_dir, tmp / "td", tp=tp)
            report.rows.append(CheckRow(f"convert (tp={tp})", "ok", "hf -> torch_dist", time.time() - t0))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            report.rows.append(CheckRow(f"convert (tp={tp})", "FAIL", f"{type(exc).__name__}: {exc}", time.time() - t0))
            return report
        t0 = time.time()
        try:
            torch_dist_to_hf(tmp / "td", tmp / "back", tp=tp)
            a, b = SafetensorsReader(hf_dir), SafetensorsReader(tmp / "back")
            missing = sorted(set(a.keys()) - set(b.keys()))
            changed = [k for k in sorted(set(a.keys()) & set(b.keys()))
                       if a.get(k).dtype != b.get(k).dtype or not torch.equal(a.get(k), b.get(k))]
            ok = not missing and not changed
            detail = (f"{len(a.keys())} tensors bit-exact" if ok else
                      f"missing {missing[:5]}, changed {changed[:5]}")
            report.rows.append(CheckRow(f"round trip (tp={tp})", "ok" if ok else "FAIL", detail, time.time() - t0))
        except Exception as exc:  # noqa: BLE001
            report.rows.append(CheckRow(f"round trip (tp={tp})", "FAIL", f"{type(exc).__name__}: {exc}",
                                        time.time() - t0))
        t0 = time.time()
        vocab = int(hf_config.get("vocab_size") or opts["vocab_size"])
        ids = _token_ids(hf_dir, vocab, seqs, seq_len, text)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                  attn_implementation=spec.attn_implementation).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        with single_rank():
            build = provider_build(spec.name)
            (model,) = build(hf_config, ParallelLayout(), params_dtype=torch.float32,
                             config_overrides={"perform_initialization": False})
            load_torch_dist_into_mcore([model], tmp / "td")
            model.eval()
            with torch.no_grad():
                out = model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), attention_mask=None)
            diff = (out[..., :vocab].double() - ref.double()).abs().max().item()
            ok = diff <= atol
            report.rows.append(CheckRow("logits (tp=1, fp32)", "ok" if ok else "FAIL",
                                        f"max |megatron - HF| = {diff:.3g} over {tuple(ids.shape)} tokens "
                                        f"(atol {atol:g})", time.time() - t0))
            if not ok:
                report.divergence = layer_divergence(hf, model, ids, atol=atol)
                first = next(((layer, op, d) for layer, op, d in report.divergence if not d <= atol), None)
                detail = (f"first departure: layer {first[0]} {first[1]} (max diff {first[2]:.3g})".replace(" ()", "")
                          if first else "no captured point departs; suspect the output layer / logits")
                report.rows.append(CheckRow("divergence", "FAIL", detail))
    return report
