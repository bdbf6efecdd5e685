"""Numeric conformance cases for families with a converter (called from :mod:`ferrule.conformance.kit`).

A family opts in by defining ``TINY_HF_CONFIG`` (a dict of HF config keys, ``model_type``
included) in the module its ``ProviderSpec.build`` points to (for a provider with the default
build: the module of its ``ConverterSpec.config_translation`` reference). :func:`tiny_hf_dir` builds a
random transformers model from it (``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``, or the
family's ``hf_model_class`` for a model_type that class does not cover (a multimodal one); fixed seed) and saves it with ``save_pretrained``; the cases then check

- :func:`check_round_trip`: HF -> torch_dist -> HF is bit-exact (same keys, dtypes, values);
- :func:`check_mapping_covers_provider`: the mapping table maps every parameter the provider
  builds, every table entry is used, and the HF keys produced equal the keys transformers saved;
- :func:`check_logits_parity`: Megatron logits match HF transformers logits (fp32, TP=1);
- :func:`check_training_step`: every parameter's gradient matches HF's (fp32, TP=1), and a weight sync through
  the update groups delivers every checkpoint tensor to a rollout engine;
- :func:`check_update_groups_cover_parameters`: every parameter of the tiny model lands in
  exactly one update unit, every unit names only existing parameters, and every suffix of a
  non-optional update group matches a parameter (so a mistyped suffix fails, named).

Each function runs in the calling process on one gloo/NCCL rank (it initializes and tears down
megatron's parallel state unless it is already initialized with TP=PP=EP=1) and raises
``AssertionError`` with the offending names/values on failure.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ferrule.conformance.fields import (  # noqa: F401  (re-exported: the kit's public names)
    hf_model_class, rotary_tables_by_layer, rotary_tables_hf, rotary_tables_mcore, text_vocab_size,
    translated_fields_vs_hf,
)
from ferrule.conformance.grads import check_update_groups_reach_rollout, compare_grads, gradient_problem, mcore_grads
from ferrule.contract import registry
from ferrule.formats.safetensors_io import SafetensorsReader
from ferrule.mapping import MappingContext
from ferrule.megatron import parallel
from ferrule.megatron.parallel import ParallelLayout
from ferrule.megatron.provider import provider_build
from ferrule.megatron.weights import export_mcore_to_hf, load_hf_into_mcore
from ferrule.megatron.param_gather import global_param_names, unwrap
from ferrule.sync.groups import UpdateGroupError, as_group_table, build_update_units

__all__ = ["tiny_hf_config", "tiny_hf_dir", "check_round_trip", "check_mapping_covers_provider",
           "check_logits_parity", "check_training_step", "check_update_groups_cover_parameters",
           "check_translation_matches_hf",
           "rotary_tables_hf", "rotary_tables_mcore", "rotary_tables_by_layer", "translated_fields_vs_hf", "check_features_reached",
           "test_token_ids", "update_unit_problems", "tiny_test_seq_len", "kit_feature_keys", "single_rank", "LOGITS_ATOL_FP32",
           "hf_model_class", "text_vocab_size"]

#: fp32 logits tolerance (max abs diff) between Megatron and HF transformers.
LOGITS_ATOL_FP32 = 1e-5
SEED = 1234


def _variant_module(family: str):
    ref = registry.get_provider(family).build
    if ref is None:  # the default build: the family's variant module is where its config rows live
        conv = registry.get_converter(family)
        ref = next((r for r in (conv.config_translation, conv.mapping) if isinstance(r, str)), None)
        if ref is None:
            raise LookupError(f"family {family!r} names no module (ProviderSpec.build is the default and "
                              "ConverterSpec holds objects, not 'module:attr' references); cannot find TINY_HF_CONFIG.")
    return importlib.import_module(ref.partition(":")[0])


def tiny_hf_config(family: str) -> dict[str, Any] | None:
    """The family's ``TINY_HF_CONFIG`` (a copy), or None if it declares none."""
    cfg = getattr(_variant_module(family), "TINY_HF_CONFIG", None)
    return dict(cfg) if cfg is not None else None


DEFAULT_TEST_SEQ_LEN = 12

#: HF config keys of features a tiny test model can hide (a window longer than the test
#: sequence, a cap that random weights never reach) -> the value that switches them off for
#: :func:`check_features_reached` (None: the key's "off" value; "seq": longer than the sequence).
FEATURE_KEYS = {"sliding_window": "seq", "attn_logit_softcapping": None, "final_logit_softcapping": None}


def kit_feature_keys(family: str) -> dict:
    """The features :func:`check_features_reached` switches off: the family's ``KIT_FEATURE_KEYS``
    (same form as :data:`FEATURE_KEYS`) or :data:`FEATURE_KEYS`. A family whose feature keys also
    shape its parameters (Inkling's window sizes its relative-position projection) declares the
    subset that can be switched off on the same weights, and tests the rest in its own suite."""
    return dict(getattr(_variant_module(family), "KIT_FEATURE_KEYS", FEATURE_KEYS))


def tiny_test_seq_len(family: str) -> int:
    """Tokens per kit test sequence: the family's ``TINY_TEST_SEQ_LEN`` or :data:`DEFAULT_TEST_SEQ_LEN`."""
    return int(getattr(_variant_module(family), "TINY_TEST_SEQ_LEN", DEFAULT_TEST_SEQ_LEN))


def test_token_ids(vocab_size: int, seq_len: int, *, batch: int = 2, ids=None):
    """``[batch, seq_len]`` int64 token ids: random in ``[0, vocab_size)`` (fixed seed), or ``ids`` checked.

    Raises:
        ValueError: a given id outside ``[0, vocab_size)``, naming it and the vocabulary size
            (e.g. text tokenized with a full tokenizer fed to a tiny test model).
    """
    import torch

    if ids is None:
        return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(SEED))
    ids = torch.as_tensor(ids, dtype=torch.long)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(f"token ids {sorted(set(bad.tolist()))[:10]} are outside the model's vocabulary "
                         f"[0, {vocab_size}); tokenize with the checkpoint's own tokenizer, or use random ids.")
    return ids


test_token_ids.__test__ = False  # a helper, not a pytest test


def tiny_hf_dir(family: str, out_dir: str | os.PathLike, *, seed: int = SEED,
                overrides: Mapping[str, Any] | None = None, dtype: str = "float32") -> Path:
    """Save a tiny random HF model of ``family`` (from ``TINY_HF_CONFIG`` + ``overrides``) to ``out_dir``.

    Weights are drawn with ``torch.manual_seed(seed)`` and then perturbed (norm weights are not
    all ones) so that a mapping that swaps two norms would be caught.

    Raises:
        LookupError: the family declares no ``TINY_HF_CONFIG``.
    """
    import torch
    from transformers import AutoConfig

    cfg = tiny_hf_config(family)
    if cfg is None:
        raise LookupError(f"family {family!r} declares no TINY_HF_CONFIG in its provider module.")
    cfg.update(overrides or {})
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    cls = hf_model_class(family, model_type)
    model = (cls.from_config if hasattr(cls, "from_config") else cls._from_config)(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Megatron parallel state with TP=PP=EP=1 on one process for the duration of the block."""
    if parallel.is_initialized():
        if (parallel.tp_size(), parallel.pp_size(), parallel.ep_size()) != (1, 1, 1):
            raise RuntimeError("single_rank(): megatron is initialized with a parallel layout; run in a fresh process.")
        yield
        return
    parallel.init_distributed(parallel.ParallelLayout())
    try:
        yield
    finally:
        parallel.destroy_distributed()


def _build(family: str, hf_config: dict, **options) -> list:
    return provider_build(family)(hf_config, ParallelLayout(), **options)


def check_round_trip(family: str, work_dir: str | os.PathLike) -> None:
    """HF -> torch_dist -> HF on the tiny model is bit-exact (keys, dtypes, values).

    Uses the primitives ``ferrule convert`` is made of, in this process at TP=1: load the HF
    files into a freshly built model (:func:`ferrule.megatron.weights.load_hf_into_mcore`),
    save its sharded state dict with ``megatron.core.dist_checkpointing`` as the converter does
    (:func:`ferrule.megatron.checkpoint.save_sharded`: in this process's threads, so the check runs
    from a plain script without a ``__main__`` guard), load that into a second model, and export it (:func:`ferrule.megatron.weights.export_mcore_to_hf`). The
    converters' file handling around them (config, temp dirs, shards) is tested in
    ``tests/test_convert.py``; the kit itself imports nothing of ``ferrule.converters``.
    """
    import json

    import torch
    from megatron.core import dist_checkpointing

    from ferrule.megatron.checkpoint import model_sharded_state_dict, save_sharded

    work = Path(work_dir)
    src = tiny_hf_dir(family, work / "hf")
    hf_config = json.loads((src / "config.json").read_text())
    table = registry.get_converter(family).resolved_mapping()
    ckpt = work / "torch_dist"
    with single_rank():
        chunks = _build(family, hf_config, config_overrides={"perform_initialization": False})
        load_hf_into_mcore(chunks, src, table, hf_config=hf_config)
        ckpt.mkdir(parents=True)
        save_sharded(model_sharded_state_dict(chunks), ckpt)
        fresh = _build(family, hf_config, config_overrides={"perform_initialization": False})
        loaded = dist_checkpointing.load(model_sharded_state_dict(fresh), str(ckpt), strict="raise_all")
        for key, chunk in zip(sorted(loaded), fresh):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        back = dict(export_mcore_to_hf(fresh, table, hf_config=hf_config))
    a = SafetensorsReader(src)
    keys = {k for k in a.keys() if not table.is_ignored(k)}
    assert keys == set(back), f"{family}: keys differ after the round trip: {sorted(keys ^ set(back))}"
    bad = [k for k in sorted(keys) if back[k].dtype != a.get(k).dtype or not torch.equal(back[k].cpu(), a.get(k))]
    assert not bad, f"{family}: round trip changed {bad}"


def check_mapping_covers_provider(family: str, work_dir: str | os.PathLike) -> None:
    """Table entries == provider parameters, and table HF keys == keys transformers saved."""
    import json

    table = registry.get_converter(family).resolved_mapping()
    src = tiny_hf_dir(family, Path(work_dir) / "hf_cover")
    hf_config = json.loads((src / "config.json").read_text())
    with single_rank():
        chunks = _build(family, hf_config)
        names = [g for c in chunks for g in global_param_names(c).values()]
    table.check_mcore_names(names)
    unused = [m.mcore for m in table.mappings if not any(m.match(n) is not None for n in names)
              and not (m.mcore == "output_layer.weight" and hf_config.get("tie_word_embeddings"))]
    assert not unused, f"{family}: mapping entries match no provider parameter: {unused}"
    ctx = MappingContext.from_hf_config(hf_config)
    table.check_hf_keys(SafetensorsReader(src).keys(), names, ctx)


def logits_max_diff(family: str, out, ref) -> float:
    """Max |Megatron - HF| logits over HF's columns (``out`` ``[..., vocab_size]``, ``ref`` ``[..., width]``).

    An HF head narrower than ``vocab_size`` (a padded unembedding: Inkling-2's ``unpadded_vocab_size``)
    compares its ``width`` columns; Megatron's columns past it must be masked (<= -1e30: no softmax mass).

    Raises:
        AssertionError: an unmasked column past HF's width (naming the family).
    """
    width = ref.shape[-1]
    extra = out[..., width:]
    if extra.numel() and extra.max().item() > -1e30:
        raise AssertionError(f"{family}: HF logits have {width} columns but Megatron's columns {width}..{out.shape[-1] - 1} "
                             f"are not masked (max {extra.max().item():.3g}); mask logits past the HF head's width.")
    return (out[..., :width].float() - ref.float()).abs().max().item()


def check_logits_parity(family: str, work_dir: str | os.PathLike, *, atol: float = LOGITS_ATOL_FP32,
                        seq_len: int | None = None, train: dict | None = None) -> float:
    """Max |Megatron logits - HF logits| over a random batch at TP=1, fp32; returns it.

    ``seq_len`` defaults to the family's ``TINY_TEST_SEQ_LEN`` (else 12 tokens). ``train``: a dict that receives
    :func:`check_training_step`'s result on the same two models (the kit's TP=1 run: one HF load and one megatron
    build for both cases), ``{"error": "Type: message"}`` when it fails; filled before the logits are asserted.

    Raises:
        AssertionError: the difference exceeds ``atol``.
    """
    seq_len = seq_len or tiny_test_seq_len(family)
    import json

    import torch

    src = tiny_hf_dir(family, Path(work_dir) / "hf_parity")
    hf_config = json.loads((src / "config.json").read_text())
    vocab = text_vocab_size(hf_config)
    ids = test_token_ids(vocab, seq_len)
    table = registry.get_converter(family).resolved_mapping()
    hf = hf_model_class(family, hf_config["model_type"]).from_pretrained(src, use_kernels=False, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    with single_rank():
        # TRAIN_STEP_OVERRIDES: no random init (the weights are loaded), no auxiliary loss (the logits are the same)
        (model,) = _build(family, hf_config, config_overrides=dict(TRAIN_STEP_OVERRIDES))
        load_hf_into_mcore([model], src, table, hf_config=hf_config)
        model.eval()
        pos = torch.arange(seq_len).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            out = model(ids, pos, attention_mask=None)[..., :vocab]
        if train is not None:
            try:
                train.update(_training_step(family, model, hf, hf_config, src, ids, table))
            except Exception as exc:  # noqa: BLE001 - the training case's result; the logits are asserted below
                train.update(error=f"{type(exc).__name__}: {exc}")
    diff = logits_max_diff(family, out, ref)
    assert diff <= atol, f"{family}: Megatron vs HF logits max abs diff {diff:.3g} > {atol}"
    return diff


#: model options of the training-step case's build: no auxiliary (load-balancing / z) loss, so the gradient compared
#: is the logits' alone (the logits are unchanged), as ``ferrule check --grads`` builds it
TRAIN_STEP_OVERRIDES = {"perform_initialization": False, "moe_aux_loss_coeff": 0.0}


def check_training_step(family: str, work_dir: str | os.PathLike, *, src: str | os.PathLike | None = None,
                        seq_len: int | None = None, groups: Any = None) -> dict[str, Any]:
    """One training step's worth at TP=1, fp32: every parameter's gradient vs HF's, and the update groups carrying
    every trained tensor to a rollout engine (:mod:`ferrule.conformance.grads`).

    The family's model is built (:data:`TRAIN_STEP_OVERRIDES`) and loaded from the tiny checkpoint ``src`` (default:
    a fresh :func:`tiny_hf_dir` under ``work_dir``); one backward pass of ``sum(logits * w)`` on the kit's test batch
    on both sides; megatron's gradients, exported to HF names through the mapping table, must equal HF's (written
    back to checkpoint names by ``save_pretrained``) within :data:`ferrule.conformance.grads.GRAD_RTOL` relative,
    every HF tensor; then a real weight sync through the update groups
    (:func:`ferrule.conformance.grads.check_update_groups_reach_rollout`) must deliver every checkpoint tensor
    exactly once, bit for bit.

    Args:
        groups: an update-group table to sync with instead of the family's (tests pass a broken one).

    Returns:
        ``{"grad_max_rel": float, "grad_worst": str, "grad_tensors": int, "synced_tensors": int}``.

    Raises:
        AssertionError: naming the worst gradient (and any HF tensor megatron gives no gradient), or the tensors a
            sync loses, repeats or changes; ``WeightSyncError`` for update groups that do not fit the parameters.
    """
    import json

    import torch

    seq_len = seq_len or tiny_test_seq_len(family)
    src = Path(src) if src is not None else tiny_hf_dir(family, Path(work_dir) / "hf_train")
    hf_config = json.loads((src / "config.json").read_text())
    ids = test_token_ids(text_vocab_size(hf_config), seq_len)
    table = registry.get_converter(family).resolved_mapping()
    hf = hf_model_class(family, hf_config["model_type"]).from_pretrained(src, use_kernels=False, dtype=torch.float32).eval()
    with single_rank():
        (model,) = _build(family, hf_config, config_overrides=dict(TRAIN_STEP_OVERRIDES))
        load_hf_into_mcore([model], src, table, hf_config=hf_config)
        model.eval()
        return _training_step(family, model, hf, hf_config, src, ids, table, groups=groups)


def _training_step(family: str, model, hf, hf_config: dict, src: Path, ids, table, *, groups: Any = None) -> dict:
    """:func:`check_training_step` on a loaded megatron ``model`` (TP=1, inside :func:`single_rank`) and HF model."""
    mc_grads = mcore_grads(model, family, hf_config, ids, table=table)
    synced = check_update_groups_reach_rollout([model], family, hf_config, src, groups=groups)
    result = compare_grads(hf, ids, mc_grads)
    problem = gradient_problem(result)
    assert problem is None, (f"{family}: gradients (TP=1, fp32) differ from HF's: {problem}. The logits case checks "
                             f"the forward pass; suspect a detached or frozen computation, or a custom op's backward.")
    return {"grad_max_rel": result["max_rel"], "grad_worst": result["worst"], "grad_tensors": result["compared"],
            "synced_tensors": synced}


def check_update_groups_cover_parameters(family: str, *, groups: Any = None) -> int:
    """The family's update groups fit the parameters of its tiny model (TP=PP=EP=1, one rank).

    Builds the tiny model from ``TINY_HF_CONFIG`` (``AutoConfig.for_model`` fills the HF
    defaults; no weights are drawn) and splits its global parameter names into update units
    (:func:`ferrule.sync.groups.build_update_units`). Checks that every parameter lands in
    exactly one unit, that every unit names only parameters the model has, and that every
    suffix of a non-optional group matches at least one parameter (an optional group, e.g. a
    tied ``output_layer``, may match none).

    Args:
        groups: the update groups to check (default: the family's registered table); tests pass
            a deliberately broken table here.

    Returns:
        The number of update units.

    Raises:
        AssertionError: naming the family and every offending parameter, unit or suffix.
        LookupError: the family declares no ``TINY_HF_CONFIG``.
    """
    from transformers import AutoConfig

    table = registry.get_update_groups(family) if groups is None else as_group_table(groups, family)
    cfg = tiny_hf_config(family)
    if cfg is None:
        raise LookupError(f"family {family!r} declares no TINY_HF_CONFIG in its provider module.")
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg).to_dict()
    with single_rank():
        chunks = _build(family, hf_config)
        names = [g for c in chunks for g in global_param_names(c).values()]
    units, problems = update_unit_problems(names, table)
    assert not problems, f"{family}: " + "; ".join(problems)
    return len(units)


def update_unit_problems(names: list[str], table: Any) -> tuple[list, list[str]]:
    """``(units, problems)`` of an update-group table on a model's global parameter ``names``: every parameter in
    exactly one unit, no unit naming a parameter the model lacks, every suffix of a non-optional group used
    (:func:`check_update_groups_cover_parameters`'s rules; ``ferrule check`` runs them on the checkpoint's model)."""
    import collections

    try:
        units = build_update_units(names, table)
    except UpdateGroupError as exc:
        return [], [f"the update groups do not fit the model's parameters: {' '.join(str(exc).split())}"]
    counts = collections.Counter(n for u in units for n in u.names)
    problems = []
    not_once = sorted(f"{n} (in {counts[n]} units)" for n in names if counts[n] != 1)
    if not_once:
        problems.append("parameters not in exactly one update unit: " + ", ".join(not_once))
    unknown = sorted(set(counts) - set(names))
    if unknown:
        problems.append("update units naming parameters the model does not have: " + ", ".join(unknown))
    unused = [f"{g.key}: {s!r}" for g in table.groups if not g.optional for s in g.suffixes
              if not any(n == s or n.endswith("." + s) for n in names)]
    if unused:
        problems.append("suffixes of non-optional update groups that match no parameter (typo?): " + ", ".join(unused))
    return units, problems


# ---------------------------------------------------------------------------------------------
# What HF's model actually uses vs what ferrule built (rotary frequencies and translated fields).
# ---------------------------------------------------------------------------------------------

def check_translation_matches_hf(family: str, work_dir: str | os.PathLike, *, seq_len: int = 64,
                                 overrides: Mapping[str, Any] | None = None, atol: float = 1e-6) -> float | None:
    """Rotary ``cos``/``sin`` and translated fields of ferrule's model equal what HF's model uses.

    Builds HF's model and the family's megatron model from the same ``config.json`` (the tiny
    config plus ``overrides``) and compares :func:`rotary_tables_mcore` with
    :func:`rotary_tables_hf` over ``seq_len`` positions, and every row of
    :func:`translated_fields_vs_hf`. Returns the max rotary difference, or None when the check
    does not apply: the family's megatron model has no rotary embedding (``GPTModel.rotary_pos_emb``)
    or HF's model is not Llama-shaped (no ``model.rotary_emb``), e.g. Inkling's relative-position
    attention; such a family tests its translation against its HF config class itself
    (``plugins/inkling/tests/test_inkling_config.py``).

    Raises:
        AssertionError: naming the rotary table or each field that differs.
    """
    import json

    import torch

    src = tiny_hf_dir(family, Path(work_dir) / "hf_fields", overrides=overrides)
    hf_config = json.loads((src / "config.json").read_text())
    hf = hf_model_class(family, hf_config["model_type"]).from_pretrained(src, use_kernels=False, dtype=torch.float32).eval()
    if getattr(getattr(hf, "model", None), "rotary_emb", None) is None:
        return None
    with single_rank():
        (model,) = _build(family, hf_config)
        if getattr(model, "rotary_pos_emb", None) is None:
            return None
        tables = rotary_tables_by_layer(hf, model, seq_len)
        rows = translated_fields_vs_hf(hf, model)
    diff = 0.0
    for label, (cos_m, sin_m), (cos_h, sin_h) in tables:
        assert cos_m.shape == cos_h.shape, (
            f"{family}: {label}: megatron rotates {cos_m.shape[-1]} channels per head, HF {cos_h.shape[-1]} "
            f"(partial_rotary_factor / rotary_percent translation)")
        d = max((cos_m - cos_h).abs().max().item(), (sin_m - sin_h).abs().max().item())
        assert d <= atol, (f"{family}: {label}: rotary cos/sin differ from HF's by {d:.3g} (rope_theta / rope "
                           f"scaling translation{', per layer type: layer_rope' if label != 'model' else ''})")
        diff = max(diff, d)
    bad = [f"{name}: ferrule {ours!r} vs HF {theirs!r}" for name, ours, theirs in rows if ours != theirs]
    assert not bad, f"{family}: translated fields differ from what HF's model uses: " + "; ".join(bad)
    return diff


def check_features_reached(family: str, work_dir: str | os.PathLike, *, seq_len: int | None = None,
                           min_effect: float = 1e-4) -> dict[str, float]:
    """Each feature of :data:`FEATURE_KEYS` set in ``TINY_HF_CONFIG`` changes HF's logits on the kit's sequence.

    For each such key, HF's model is loaded twice from the tiny checkpoint, with the feature on
    and switched off; the returned ``{key: max |logit difference|}`` must exceed ``min_effect``,
    otherwise the parity cases could not see a wrong translation of it.

    Raises:
        AssertionError: naming each feature the test sequence does not reach, and the fix.
    """
    import torch
    from transformers import AutoConfig

    seq_len = seq_len or tiny_test_seq_len(family)
    src = tiny_hf_dir(family, Path(work_dir) / "hf_features")
    config = AutoConfig.from_pretrained(src)
    cls = hf_model_class(family, config.model_type)
    ids = test_token_ids(int(config.get_text_config().vocab_size), seq_len)
    with torch.no_grad():
        ref = cls.from_pretrained(src, use_kernels=False, dtype=torch.float32).eval()(input_ids=ids).logits
    effects, unreached = {}, []
    for key, off in kit_feature_keys(family).items():
        if getattr(config, key, None) is None:
            continue
        cfg_off = AutoConfig.from_pretrained(src)
        setattr(cfg_off, key, seq_len + 1 if off == "seq" else off)
        with torch.no_grad():
            out = cls.from_pretrained(src, config=cfg_off, use_kernels=False, dtype=torch.float32).eval()(input_ids=ids).logits
        effects[key] = (out - ref).abs().max().item()
        if effects[key] <= min_effect:
            fix = (f"make TINY_TEST_SEQ_LEN (now {seq_len}) longer than the window" if off == "seq"
                   else "lower the cap in TINY_HF_CONFIG until random weights reach it")
            unreached.append(f"{key}={getattr(config, key)!r} changes the logits by only {effects[key]:.2g}: {fix}")
    assert not unreached, (f"{family}: the kit's test sequence does not exercise declared features, so a wrong "
                           f"translation would pass: " + "; ".join(unreached) + " (docs/plugins.md, test config checklist).")
    return effects
