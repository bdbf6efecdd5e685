"""The embedded rollout engine: a transformers CausalLM in this process (CPU or one GPU).

Generation is our own batched loop, not ``model.generate``, so that sampling and logprobs are
ours (convention: :mod:`ferrule.rollout.base`):

1. the ``len(requests) * n`` rows are left-padded into one batch (``[batch, P]``) with position
   ids counting from 0 at each row's first real token;
2. one prompt forward fills a static KV cache (:mod:`ferrule.rollout._static_cache`);
3. each decode step samples one token per row (per-call ``torch.Generator`` seeded with
   ``seed``, or with fresh OS entropy when ``seed`` is None: torch's global RNG is never read
   or reseeded), records its logprob, and runs the model on ``[batch, 1]``. Finished rows keep
   their slot in the batch (static shapes) but their further tokens are discarded.

On CUDA the decode step is captured once per ``(batch, max_len)`` bucket as a CUDA graph
(``cuda_graph=True``, the default on CUDA; batch rounded up to a multiple of 8 and cache length
to a multiple of 128 so graphs are reused across calls). Weight updates copy into the
existing parameters, so captured graphs stay valid. On CPU the same code runs eagerly.

Weights go in and out under HF *checkpoint* names (``update_weights``, ``get_hf_state_dict``),
translated to transformers' in-memory layout (e.g. Qwen3-MoE's stacked experts) by
:mod:`ferrule.rollout._checkpoint_names`.

LoRA: ``update_lora_adapter`` serves the base plus one HF PEFT adapter, unmerged, through PEFT's
own LoRA layers (:mod:`ferrule.rollout._lora`); later updates copy the adapter in place. On the
fast decode path the decode steps run on a merged copy of the targeted weights
(:class:`ferrule.rollout._lora_merge.MergedLora`; the base weights are never written); the prefill
runs on it too and it is merged again only after a weight or adapter update
(``RolloutEngineSettings(lora_merged=False)``: merged on every call, prefill through PEFT's unmerged layers).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import secrets
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from safetensors.torch import load_file

from ferrule import envs
from ferrule.engine_settings import RolloutEngineSettings
from ferrule.rollout._fast_decode import (FastStatic, FusedLayout, base_ptrs, compiles, engine_layout, fuse_weights,
                                          supported)
from ferrule.rollout._fast_sampling import FusedSampler, fused_applies
from ferrule.rollout._checkpoint_names import CheckpointTensor, check_bucket, checkpoint_tensors
from ferrule.rollout._lora import ServedLoraAdapter, is_unset, structural_settings
from ferrule.rollout._multi_lora import HeldAdapters
from ferrule.rollout._quantized import check_hf_dir, dequantized_source
from ferrule.rollout._sleep import WeightSleep
from ferrule.rollout._sampling import StopStringMatcher, sample_next
from ferrule.rollout._routes import RouteRecorder
from ferrule.rollout._static_cache import OPAQUE_SDPA, DecodeState, layer_windows, use_opaque_sdpa
from ferrule.rollout.base import GenerateRequest, GenerateResult, SamplingParams, as_requests
from ferrule.contract import registry
from ferrule.media import check_requests, hf_media_inputs


_BATCH_BUCKET = 8
_LEN_BUCKET = 128
_MAX_GRAPH_STATES = 4
_SYNC_EVERY_CUDA = 8  # decode steps between "all rows finished?" host checks on CUDA


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _resolve_model_class(hf_config: Any) -> Any:
    """The transformers class the family registers (:func:`ferrule.contract.registry.hf_model_class`)."""
    return registry.hf_model_class(hf_config)


def family_attn_implementation(hf_config: Any, *, unregistered: str | None = None) -> str:
    """The ``attn_implementation`` the family of ``hf_config`` chose (``ModelFamilySpec.attn_implementation``).

    Args:
        unregistered: returned when no family claims the config (callers that were given the
            model class explicitly pass ``"sdpa"``); None raises.

    Raises:
        ferrule.contract.registry.UnknownModelError: no family claims the config and ``unregistered`` is None.
    """
    try:
        return registry.family_for_hf_config(hf_config.to_dict()).attn_implementation
    except registry.UnknownModelError:
        if unregistered is None:
            raise
        return unregistered


class EmbeddedEngine:
    """Rollout engine running a transformers CausalLM in-process.

    Build it from exactly one of:

    - ``model``: an already-built ``PreTrainedModel`` (moved to ``device``/``dtype`` if given);
    - ``hf_dir``: an HF checkpoint directory (``config.json`` + safetensors); the class comes
      from the family registry (``ModelFamilySpec.hf_model_class``) unless ``model_class``, loaded
      with the family's ``ModelFamilySpec.attn_implementation`` (``"sdpa"`` unless it chose
      ``"eager"``); an MXFP8 / FP8 folder is dequantized as the converters read it (:mod:`ferrule.rollout._quantized`);
    - ``hf_config`` (+ optional ``state_dict``, loaded strictly: either the model's own
      ``state_dict()`` names or the HF checkpoint names that :meth:`update_weights` takes; every
      tensor must be given, a tied alias such as ``lm_head.weight`` may be left out).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: the model's device, or CPU.
        dtype: parameter dtype (e.g. ``torch.bfloat16``); default: keep / config dtype.
        tokenizer: anything with ``decode(list[int]) -> str`` (needed for stop strings); for
            ``hf_dir`` an ``AutoTokenizer`` is loaded from the directory when it has tokenizer
            files.
        cuda_graph: capture the decode step as a CUDA graph; default True on CUDA. Ignored
            (False) on CPU.
        compile_decode: run the decode forward through ``torch.compile`` and sample with the
            fused sampler of :mod:`ferrule.rollout._fast_sampling` when no top-k/top-p/min-p is
            asked; default (None): ``settings.compile_decode``, on with CUDA. Ignored (False) on
            CPU, which keeps the exact eager path. The first call per bucket compiles (20-30 s
            for a 0.5B model on an H200). Only ``"sdpa"`` models are compiled; their
            ``config._attn_implementation`` becomes
            :data:`~ferrule.rollout._static_cache.OPAQUE_SDPA` (the same SDPA function, kept out of
            the compiled graph).
        fast_decode: decode supported dense models (:data:`ferrule.rollout._fast_decode.MODEL_TYPES`)
            through :mod:`ferrule.rollout._fast_decode` (fused q/k/v and gate/up weights, sampler and
            bookkeeping inside one CUDA graph per step) when no stop strings, media or
            top-k/top-p/min-p are involved (a served LoRA adapter is merged into a copy of the
            weights it targets, :mod:`ferrule.rollout._lora_merge`). Default on wherever it
            applies (CUDA) unless
            ``settings.fast_decode`` is false: faster on an H200 and matching the plain path there
            (docs/benchmarks.md "Embedded decode: fast path"; ``tests/test_rollout_fast_decode.py``,
            gpu marker). Needs ``compile_decode`` and ``cuda_graph`` (so never on CPU, which keeps
            the exact eager path), and falls back to the plain path for other families.
        max_batch: rows decoded at once (continuous batching). With more rows than this
            (``len(requests) * n``), finished rows free their slot for waiting prompts
            (:mod:`ferrule.rollout._continuous`; with ``settings.continuous_fast`` each step runs the fast
            decode forward where ``fast_decode`` applies); None (default): all rows in one batch.
        model_class: override the transformers class used for ``hf_dir`` / ``hf_config``.
        settings: the decode paths (:class:`~ferrule.engine_settings.RolloutEngineSettings`; default: its
            defaults, deprecated ``FERRULE_*`` variables applied with a FutureWarning); ``cuda_graph``,
            ``compile_decode``, ``fast_decode`` and ``max_batch`` given here override its fields.
            ``self.settings`` keeps what is in force.

    Raises:
        ValueError: not exactly one model source, or an unsupported attention implementation.
        ferrule.formats.safetensors_io.CheckpointError: ``hf_dir`` lacks weights the model needs (transformers' missing keys).
        NotImplementedError: layer types the engine cannot decode (see below).

    Multimodal families (``register_towers``): a request may carry ``media`` (prompt
    placeholders expanded, :mod:`ferrule.media`); it is passed to the model at prefill. The
    placeholder ids are never sampled (logprobs are still over the full vocabulary).

    Models whose layers are Inkling's ``"hybrid"`` / ``"hybrid_sliding"`` types (ShortConv state
    besides keys and values) decode through transformers' own cache instead of the static KV
    cache, one batch per prompt length (:mod:`ferrule.rollout._hf_cache_decode`): exact, without
    CUDA graphs. Any other layer type raises ``NotImplementedError``.
    """

    kind = "embedded"

    def __init__(self, model: torch.nn.Module | None = None, *, hf_dir: str | os.PathLike | None = None,
                 hf_config: Any = None, state_dict: dict[str, torch.Tensor] | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 tokenizer: Any = None, cuda_graph: bool | None = None, model_class: Any = None,
                 compile_decode: bool | None = None, max_batch: int | None = None,
                 fast_decode: bool | None = None, settings: RolloutEngineSettings | None = None):
        sources = [x is not None for x in (model, hf_dir, hf_config)]
        if sum(sources) != 1:
            raise ValueError("EmbeddedEngine needs exactly one of model=, hf_dir=, hf_config= "
                             f"(got model={model is not None}, hf_dir={hf_dir!r}, hf_config={hf_config is not None}).")
        if state_dict is not None and hf_config is None:
            raise ValueError("EmbeddedEngine: state_dict= goes with hf_config=; for a built model call update_weights().")
        if hf_dir is not None:
            check_hf_dir(hf_dir)
        if hf_dir is not None and (dequantized := dequantized_source(hf_dir)) is not None:  # MXFP8 / FP8 folder
            hf_config, state_dict = dequantized
            hf_config._attn_implementation = family_attn_implementation(hf_config, unregistered="sdpa")
            tokenizer = self._load_tokenizer(hf_dir, tokenizer)
            hf_dir = None
        if hf_dir is not None:
            model, tokenizer = self._load_dir(hf_dir, dtype, tokenizer, model_class)
        elif hf_config is not None:
            cls = model_class or _resolve_model_class(hf_config)
            model = cls(hf_config)
            if state_dict is not None and set(state_dict) == set(model.state_dict()):
                model.load_state_dict(state_dict, strict=True)
                state_dict = None
        self.model = model.eval()
        if device is not None or dtype is not None:
            self.model.to(device=device, dtype=dtype)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = tokenizer
        attn = getattr(self.model.config, "_attn_implementation", "sdpa")
        attn = "sdpa" if attn == OPAQUE_SDPA else attn
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"EmbeddedEngine supports attn_implementation 'sdpa' or 'eager', got {attn!r}; "
                             "build the model with attn_implementation='sdpa'.")
        self._additive_dtype = self.dtype if attn == "eager" else None
        try:
            self._windows: dict | None = layer_windows(self.model.config)
        except NotImplementedError:
            from ferrule.rollout._hf_cache_decode import uses_hf_cache

            if not uses_hf_cache(self.model.config):
                raise
            # Inkling-style layers (ShortConv states): transformers' own cache, exact (rows grouped by
            # prompt length, no CUDA graphs); see ferrule.rollout._hf_cache_decode
            self._windows = None
        given = {k: v for k, v in (("cuda_graph", cuda_graph), ("compile_decode", compile_decode),
                                   ("fast_decode", fast_decode), ("max_batch", max_batch)) if v is not None}
        if "max_batch" in given and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
            raise ValueError(f"EmbeddedEngine(max_batch={max_batch!r}): expected a positive int or None.")
        #: the :class:`~ferrule.engine_settings.RolloutEngineSettings` in force
        self.settings = dataclasses.replace((settings or RolloutEngineSettings()).with_env(), **given)
        on_cuda = self.device.type == "cuda"
        self.cuda_graph = bool(on_cuda and self.settings.resolve("cuda_graph", on_cuda) and self._windows is not None)
        self.compile_decode = bool(on_cuda and self.settings.resolve("compile_decode", on_cuda)
                                   and self._windows is not None and use_opaque_sdpa(self.model))
        self.fast_decode = bool(self.settings.resolve("fast_decode", on_cuda) and self.compile_decode
                                and self.cuda_graph and supported(self.model))
        self._fused: tuple | None = None  # (parameter addresses, FusedLayout) of the fast decode path
        if self.fast_decode:  # before any adapter or checkpoint-name view exists
            self._fuse_weights()
        self.max_batch = self.settings.max_batch or None
        #: batches padded to the rungs of ``settings.batch_ladder`` (on with CUDA graphs; ``pad_batches``)
        self._pad_batches = bool(self.settings.resolve("pad_batches", self.cuda_graph))
        self._counters = collections.Counter(decode_shapes=0, graph_captures=0, compiles=0)
        self._shapes_seen: set[tuple[int, int]] = set()
        if self.compile_decode:  # compiled kernels and autotune results on disk: a second process reuses them
            from ferrule.fs.util import default_cache_dir

            envs.set_compile_cache_dirs(default_cache_dir() / "compile")
        self._states: collections.OrderedDict[tuple[int, int], DecodeState] = collections.OrderedDict()
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.weights_version = 0
        #: count of writes to the weights or the served adapter through the engine's API (weight and adapter
        #: updates, direct writes (set_weights_version), wake); a merged adapter copy
        #: (:mod:`ferrule.rollout._lora_merge`) is merged again when it changed
        self._weights_serial = 0
        self._eos_ids = self._find_eos_ids()
        cfg = self.model.config.get_text_config(decoder=True) if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        self._pad_id = getattr(cfg, "pad_token_id", None)
        self._pad_id = 0 if self._pad_id is None else int(self._pad_id)
        self._max_positions = getattr(cfg, "max_position_embeddings", None)
        self._ck_tensors: dict[str, CheckpointTensor] | None = None
        self._lora = None  # ferrule.rollout._lora.ServedLoraAdapter while an adapter is served
        self._merged_lora = None  # ferrule.rollout._lora_merge.MergedLora of it on the fast decode path
        self._lora_name: str | None = None
        self._multi = HeldAdapters(self.model, self._drop_decode_states)  # adapters held by name, batched per row
        self._closed = False
        self._sleep = WeightSleep(self.device)  # asleep or not, the host copies of the weights while asleep
        if state_dict is not None:  # checkpoint names
            self._load_checkpoint_named(state_dict)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _load_dir(hf_dir: str | os.PathLike, dtype: torch.dtype | None, tokenizer: Any, model_class: Any):
        from transformers import AutoConfig

        hf_dir = os.fspath(hf_dir)
        config = AutoConfig.from_pretrained(hf_dir)
        cls = model_class or _resolve_model_class(config)
        attn = family_attn_implementation(config, unregistered="sdpa" if model_class is not None else None)
        # use_kernels=False: transformers >= 5.25 kernelizes with `kernels` hub kernels by default when that package
        # is installed (a download at run time, and other numerics than the model's own code)
        model, info = cls.from_pretrained(hf_dir, use_kernels=False, dtype=dtype, attn_implementation=attn,
                                          output_loading_info=True)
        if info.get("missing_keys"):  # transformers would initialise them at random and sample from that
            from ferrule.formats.safetensors_io import CheckpointError

            missing = sorted(info["missing_keys"])
            raise CheckpointError(
                f"{hf_dir}: {len(missing)} weight(s) the model needs are not in the checkpoint "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); transformers would initialise "
                "them at random. Pass a complete HF folder (re-export it with `ferrule convert torch-dist-to-hf`).")
        return model, EmbeddedEngine._load_tokenizer(hf_dir, tokenizer)

    @staticmethod
    def _load_tokenizer(hf_dir: str | os.PathLike, tokenizer: Any) -> Any:
        """``tokenizer`` if given, else the folder's own (None where it holds no tokenizer files)."""
        if tokenizer is None and any(os.path.isfile(os.path.join(hf_dir, f))
                                     for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.fspath(hf_dir))
        return tokenizer

    def _find_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.extend([eos] if isinstance(eos, int) else list(eos))
        return tuple(sorted(set(int(i) for i in ids)))

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerateRequest | Sequence[int]],
                 sampling_params: SamplingParams) -> list[GenerateResult]:
        """Sample ``sampling_params.n`` continuations per prompt.

        Returns:
            ``len(requests) * n`` results, prompt-major (result ``i * n + j`` = prompt ``i``,
            sample ``j``).

        Raises:
            ValueError: stop strings without a tokenizer; prompt + ``max_new_tokens`` longer
                than ``max_position_embeddings``; token ids outside the vocabulary.
            RuntimeError: the engine was shut down.
        """
        if self._closed:
            raise RuntimeError("EmbeddedEngine.generate after shutdown(); build a new engine.")
        if self.asleep:
            raise RuntimeError("EmbeddedEngine.generate while asleep; call wake() first.")
        reqs = as_requests(requests)
        params = sampling_params
        if params.return_routed_experts and self.cuda_graph:
            raise ValueError("return_routed_experts: decode steps replayed from CUDA graphs record no routes; "
                             "build the engine with cuda_graph=False (rollout settings) for routing replay.")
        matcher = None
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer to decode tokens; pass tokenizer= to "
                                 "EmbeddedEngine (or use stop_token_ids).")
            matcher = StopStringMatcher(params.stop, self.tokenizer.decode)
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, r in enumerate(reqs):
            bad = [t for t in r.prompt_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"Request {i} (id {r.request_id!r}) has token ids {bad[:5]} >= vocab size {vocab}.")
        media = self._check_media(reqs)
        # the n rows of a request hold one list object: _run_batch prefills it once (settings.prefill_once)
        unique_prompts = [list(r.prompt_token_ids) for r in reqs]
        prompts = [x for x in unique_prompts for _ in range(params.n)]
        # per row: the slot of its request's adapter (-1: the base; None: every row the base), ferrule.rollout._multi_lora
        slots = self._multi.request_slots([r.lora_adapter for r in reqs])
        row_slots = None if slots is None else [slots[k // params.n] for k in range(len(prompts))]
        longest = max(len(p) for p in prompts)
        if self._max_positions is not None and longest + params.max_new_tokens > self._max_positions:
            raise ValueError(f"Longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"max_position_embeddings={self._max_positions}; shorten the prompt or max_new_tokens.")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        if media and self._windows is not None:
            raise ValueError("media in a request: only models decoding through transformers' own cache "
                             "(ferrule.rollout._hf_cache_decode) take media in the embedded engine.")
        compiled_before = compiles()
        if self._windows is None:  # HF-cache path: one batch per prompt length (no padding)
            # a prompt with media is its own group (its n samples share the media)
            groups: dict[tuple, list[int]] = {}
            for k, toks in enumerate(prompts):
                i = k // params.n
                groups.setdefault((len(toks), i if i in media else -1), []).append(k)
            rows = [None] * len(prompts)
            for key in sorted(groups):
                ks = groups[key]
                extra = self._hf_media_inputs(media[key[1]], len(ks)) if key[1] >= 0 else None
                for k, row in zip(ks, self._run([prompts[k] for k in ks], params, sorted(stop_ids), matcher,
                                                extra, None if row_slots is None else [row_slots[k] for k in ks])):
                    rows[k] = row
        elif row_slots is not None and (limit := self.max_batch or self._largest_rung()) is not None \
                and len(prompts) > limit:  # adapters per row: static batches of at most `limit` rows
            rows = [row for i in range(0, len(prompts), limit)
                    for row in self._run(prompts[i:i + limit], params, sorted(stop_ids), matcher, None,
                                         row_slots[i:i + limit])]
        elif (limit := self.max_batch or self._largest_rung()) is not None and len(prompts) > limit:
            # more rows than max_batch (or than the largest prepared batch): continuous batching at that size
            from ferrule.rollout._continuous import run_continuous

            if params.return_routed_experts:
                raise ValueError(f"return_routed_experts: {len(prompts)} rows exceed the batch limit {limit}, and "
                                 "continuous batching records no routes; raise max_batch or send fewer requests.")

            rows = run_continuous(self, prompts, params, sorted(stop_ids), matcher, limit)
        else:
            rows = self._run(prompts, params, sorted(stop_ids), matcher, None, row_slots)
        self._counters["compiles"] += compiles() - compiled_before
        out = []
        for k, (tokens, lps, raw, reason, *routes) in enumerate(rows):
            i, j = divmod(k, params.n)
            out.append(GenerateResult(token_ids=tuple(tokens), logprobs=tuple(lps), finish_reason=reason,
                                      prompt_index=i, sample_index=j, request_id=reqs[i].request_id,
                                      raw_logprobs=None if raw is None else tuple(raw),
                                      weights_version=self.weights_version, routed_experts=(routes or [None])[0]))
        return out

    def _towers(self) -> dict:
        """``{modality: (TowerSpec, None, placeholder id)}`` of the served model's family (cached)."""
        if getattr(self, "_tower_specs", None) is None:
            from ferrule.media import towers_for_config

            self._tower_specs = towers_for_config(self.model.config.to_dict())
        return self._tower_specs

    def _check_media(self, reqs: Sequence[GenerateRequest]) -> dict[int, dict[str, list[torch.Tensor]]]:
        """``{request index: media}`` of the requests that carry media (:func:`ferrule.media.check_requests`)."""
        return check_requests(reqs, self._towers(), getattr(self.model.config, "model_type", "?"))

    def _hf_media_inputs(self, media: dict[str, list[torch.Tensor]], copies: int) -> dict[str, torch.Tensor]:
        return hf_media_inputs(self._towers(), media, copies, self.device, self.model.config.to_dict())

    def _state(self, batch: int, max_len: int) -> DecodeState:
        if self._windows is None:
            from ferrule.rollout._hf_cache_decode import HFCacheDecodeState

            return HFCacheDecodeState(self.model)
        key = (batch, max_len)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key]
        while len(self._states) >= _MAX_GRAPH_STATES:
            self._states.popitem(last=False)
        state = DecodeState(self.model, batch, max_len, self._windows, self.device, self._additive_dtype,
                            self.cuda_graph, graph_pool=self._graph_pool, compile_model=self.compile_decode)
        self._states[key] = state
        state.counters = self._counters  # DecodeState / FastStatic count their graph captures in it
        self._counters["decode_shapes"] += 1
        self._shapes_seen.add(key)
        return state

    def _bucket(self, rows: int, need: int) -> tuple[int, int]:
        """``(batch, max_len)`` of the decode state for ``rows`` rows of ``need`` slots: on CUDA (or with
        ``settings.pad_batches`` true) the batch is the next rung of ``settings.batch_ladder`` (a multiple of
        8 past the largest, which :meth:`generate` avoids by continuous batching) and the length a multiple
        of 128, so that a new batch size reuses a prepared decode state and its compiled step."""
        if self._pad_batches:
            rung = next((b for b in self.settings.batch_ladder if b >= rows), _round_up(rows, _BATCH_BUCKET))
            return rung, _round_up(need, _LEN_BUCKET)
        return rows, need

    def _largest_rung(self) -> int | None:
        """The largest batch of the ladder where batches are padded to it (None: no ladder)."""
        return self.settings.batch_ladder[-1] if self._pad_batches and self.settings.batch_ladder else None

    def _sampler(self, params: SamplingParams, batch: int) -> Callable:
        """``sampler(logits, generator) -> (tokens, logprobs, raw_logprobs)`` for ``[batch, vocab]`` logits."""
        towers = self._towers()  # a media placeholder in a response would need media nobody produced
        banned = torch.tensor(sorted(pid for _, _, pid in towers.values()), device=self.device) if towers else None
        if banned is None and self.compile_decode and fused_applies(params):
            vocab = self.model.get_output_embeddings().weight.shape[0]
            return FusedSampler(params, batch, vocab, self.device)
        return lambda logits, gen: sample_next(logits.float(), params, gen, banned)

    def _fast_layout(self, params: SamplingParams, stop_ids: list[int], matcher: StopStringMatcher | None,
                     media_inputs: Any) -> FusedLayout | None:
        """:func:`ferrule.rollout._fast_decode.engine_layout` for this call."""
        return engine_layout(self, params, stop_ids, matcher, media_inputs)

    def _fuse_weights(self) -> None:
        """Fuse q/k/v and gate/up (:func:`ferrule.rollout._fast_decode.fuse_weights`)."""
        layout = fuse_weights(self.model)
        self._ck_tensors = None  # views of the parameters taken before they moved
        self._fused = (base_ptrs(self.model), layout)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = torch.Generator(device=self.device)
        # unseeded: fresh OS entropy; torch.seed() would reseed (and so change) the global generator
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return gen

    def _run(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int],
             matcher: StopStringMatcher | None, media_inputs: dict[str, torch.Tensor] | None = None,
             row_slots: list[int] | None = None):
        """One static batch of ``prompts``; ``row_slots``: each row's adapter slot while adapters are held
        (:mod:`ferrule.rollout._multi_lora`; filler rows decode the base)."""
        if self._multi.pool is None:
            return self._run_batch(prompts, params, stop_ids, matcher, media_inputs)
        slots = list(row_slots) if row_slots is not None else [-1] * len(prompts)
        batch = self._bucket(len(prompts), 1)[0] if self._windows is not None else len(prompts)
        with self._multi.rows(slots + [-1] * (batch - len(prompts))):
            return self._run_batch(prompts, params, stop_ids, matcher, media_inputs)

    def _shared_prefill(self, rows: list[list[int]], params: SamplingParams,
                        media_inputs: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``DecodeState.prefill``'s ``share``: rows holding one list object (a request's ``n`` samples,
        the bucket's filler rows) prefill once; None where every row is its own (or ``prefill_once``
        is off, the model decodes through transformers' own cache, adapters are held per row, media go
        with the prompt, or routes are recorded)."""
        if (not self.settings.prefill_once or self._windows is None or self._multi.pool is not None
                or media_inputs or params.return_routed_experts):
            return None
        first: dict[int, int] = {}
        for b, x in enumerate(rows):
            first.setdefault(id(x), b)
        if len(first) == len(rows):
            return None
        pos = {key: i for i, key in enumerate(first)}
        source = [pos[id(x)] for x in rows]
        return (torch.tensor(list(first.values()), dtype=torch.long, device=self.device),
                torch.tensor(source, dtype=torch.long, device=self.device))

    def _run_batch(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int],
                   matcher: StopStringMatcher | None, media_inputs: dict[str, torch.Tensor] | None = None):
        dev = self.device
        real = len(prompts)
        p = max(len(x) for x in prompts)
        batch, max_len = self._bucket(real, p + params.max_new_tokens)
        rows = prompts + [[self._pad_id]] * (batch - real)  # bucket filler rows: 1 pad token, discarded
        input_ids = torch.full((batch, p), self._pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((batch, max_len), dtype=torch.bool)
        for r, toks in enumerate(rows):
            input_ids[r, p - len(toks):] = torch.tensor(toks, dtype=torch.long)
            prompt_mask[r, p - len(toks):p] = True
        prompt_len = prompt_mask.sum(-1)
        position_ids = (torch.cumsum(prompt_mask[:, :p].long(), -1) - 1).clamp_(min=0)
        input_ids, prompt_mask, position_ids, prompt_len = (t.to(dev) for t in
                                                            (input_ids, prompt_mask, position_ids, prompt_len))
        gen = self._generator(params)
        stop_t = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        n_new = params.max_new_tokens
        tokens_out = torch.zeros((batch, n_new), dtype=torch.long, device=dev)
        lp_out = torch.zeros((batch, n_new), dtype=torch.float32, device=dev)
        raw_out = torch.zeros_like(lp_out) if params.return_raw_logprobs else None
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        finished[real:] = True
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)

        share = self._shared_prefill(rows, params, media_inputs)
        state = self._state(batch, max_len)
        layout = self._fast_layout(params, stop_ids, matcher, media_inputs)
        if layout is not None:
            if params.return_routed_experts:
                raise ValueError("return_routed_experts: the fused decode path (fast_decode) records no routes; "
                                 "build the engine with fast_decode=False.")
            # one adapter serves every row: the prefill runs on the merged weights the decode steps use
            merged = self._merged_lora if self._lora is not None and self.settings.lora_merged else None
            with merged.merged_modules() if merged is not None else contextlib.nullcontext():
                logits = state.prefill(input_ids, position_ids, prompt_mask, share)
            fast = getattr(state, "fast", None)
            if fast is None:
                fast = state.fast = FastStatic(state, logits.shape[-1], dev)
            lora = self._multi.fast(len(layout.layer_idx))
            return fast.run(layout, logits, real, p, prompt_len, params, stop_ids, gen, self._graph_pool, self.settings,
                            lora)
        sampler = self._sampler(params, batch)
        recorder = RouteRecorder(self.model) if params.return_routed_experts else None
        with recorder if recorder is not None else contextlib.nullcontext():
            logits = (state.prefill(input_ids, position_ids, prompt_mask, media_inputs) if media_inputs
                      else state.prefill(input_ids, position_ids, prompt_mask, share))
            host_tokens: list[list[int]] = [[] for _ in range(real)] if matcher else []
            sync_every = _SYNC_EVERY_CUDA if dev.type == "cuda" and matcher is None else 1
            for t in range(n_new):
                tok, lp, raw = sampler(logits, gen)
                tokens_out[:, t] = tok
                lp_out[:, t] = lp
                if raw_out is not None:
                    raw_out[:, t] = raw
                alive = ~finished
                lengths += alive.long()
                hit = alive & torch.isin(tok, stop_t) if stop_ids else torch.zeros_like(alive)
                if matcher is not None:
                    hit = matcher.mark_hits(tok, alive, host_tokens, range(real), hit)
                stopped |= hit
                finished |= hit
                if t == n_new - 1 or ((t + 1) % sync_every == 0 and bool(finished.all())):
                    break
                state.set_step(tok, prompt_len + t, p + t)
                logits = state.step()
        lengths_h, stopped_h = lengths.tolist(), stopped.tolist()
        tok_h, lp_h = tokens_out.tolist(), lp_out.tolist()
        raw_h = raw_out.tolist() if raw_out is not None else None
        routes = (recorder.rows([len(x) for x in prompts], p, lengths_h[:real]) if recorder is not None
                  else [None] * real)
        result = []
        for r in range(real):
            n = lengths_h[r]
            result.append((tok_h[r][:n], lp_h[r][:n], None if raw_h is None else raw_h[r][:n],
                           "stop" if stopped_h[r] else "length", routes[r]))
        return result

    # ------------------------------------------------------------------ weights under HF checkpoint names
    def _checkpoint_tensors(self) -> dict[str, CheckpointTensor]:
        # Built once: the views alias the parameters, which update_weights only writes in place.
        if self._ck_tensors is None:
            self._ck_tensors = checkpoint_tensors(self.model)
        return self._ck_tensors

    def _load_checkpoint_named(self, state_dict: dict[str, torch.Tensor]) -> None:
        targets = self._checkpoint_tensors()
        given = {targets[k].alias_key() for k in state_dict if k in targets}
        missing = sorted(k for k, e in targets.items() if e.alias_key() not in given)
        if missing:
            raise KeyError(f"EmbeddedEngine(state_dict=...): {len(missing)} tensor(s) missing, e.g. {missing[:5]}; "
                           "pass the full model.state_dict() or every HF checkpoint tensor.")
        self.update_weights(state_dict.items(), version=0)

    @torch.inference_mode()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy checkpoint-named tensors into the model in place and set ``weights_version = version``.

        Names are the HF *checkpoint* names, what ``save_pretrained`` writes and what the family's
        mapping table, weight sync and SGLang use (for Qwen3-MoE one tensor per expert,
        ``model.layers.L.mlp.experts.E.gate_proj.weight`` ``[moe_intermediate, hidden]``), even where
        transformers keeps another layout in memory (stacked ``mlp.experts.gate_up_proj``); the
        translation is transformers' own reverse conversion (:mod:`ferrule.rollout._checkpoint_names`).

        All tensors of one call are validated before any is written, so a bad call changes
        nothing. Tied parameters (``lm_head.weight`` aliasing ``model.embed_tokens.weight``) can
        be sent under either name; sending both with different values is an error.

        Args:
            named_tensors: ``(hf_name, tensor)`` pairs, e.g. one update-group bucket. Floating
                tensors are cast to the parameter dtype; other dtypes must match.
            version: the trainer's weight version; must not be lower than ``weights_version``.

        Raises:
            KeyError: unknown names (each is listed with the closest known names).
            ValueError: shape / dtype mismatch, duplicate names, conflicting tied values,
                or a version going backwards.
        """
        if version < self.weights_version:
            raise ValueError(f"update_weights(version={version}) is older than the loaded weights_version="
                             f"{self.weights_version}; versions must not go backwards.")
        targets = self._checkpoint_tensors()
        items = list(named_tensors)
        check_bucket(targets, items)
        # Only host-to-device copies may be asynchronous: a non_blocking device-to-host copy into
        # pageable memory returns before the data has landed, and the source bucket can be freed
        # and reused by the caching allocator meanwhile (seen on an H200: a CPU rollout engine fed
        # from a CUDA train engine received garbage weights).
        async_ok = self.device.type == "cuda" and self._sleep.stash is None
        for name, tensor in items:
            dst = self._sleep.live(targets[name])
            if self._sleep.stash is not None and dst.view is not None:
                dst.write_(tensor)  # asleep: one (blocking) copy straight into the page-locked host copy
            else:
                dst.write_(tensor.to(dst.param.device, dst.param.dtype,
                                     non_blocking=async_ok and tensor.device.type == "cpu"))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._weights_serial += 1
        self.weights_version = version

    def direct_weight_targets(self) -> dict[str, CheckpointTensor] | None:
        """Where each HF checkpoint tensor lives in the served weights, for a writer in this process
        (:mod:`ferrule.sync.direct`), or None while asleep (the weights are on the host: use
        :meth:`update_weights`).

        The entries alias the served weights (for the fast decode path, the fused q/k/v and gate/up
        buffers); writing them in place is what :meth:`update_weights` does, without its validation,
        casts and stream synchronisation. The dict is replaced (a new object) whenever the weights
        move (re-fusing), so a writer that caches views compares it by identity. The writer must
        call :meth:`set_weights_version` after its copies.
        """
        if self.asleep or self._closed:
            return None
        return self._checkpoint_tensors()

    def direct_lora_targets(self, peft_config: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
        """The served adapter's parameters, PEFT saved name -> tensor (live, contiguous), for a writer in
        this process (:func:`ferrule.sync.sync_lora_adapter`'s direct path); None where
        :meth:`update_lora_adapter` must run instead: no adapter served (the first one is injected
        there), ``peft_config`` not the served adapter's config (a change is checked there), the engine
        asleep or shut down.

        Writing the tensors in place is what :meth:`update_lora_adapter` does for a served adapter,
        without its validation, casts and stream synchronisation; the dict is the same object for as
        long as the adapter is served (a writer caching views compares it by identity). The writer
        must call :meth:`set_weights_version` after its copies (a merged copy of the adapter is then
        merged again on the next ``generate``).
        """
        if self._lora is None or self._closed or self.asleep or dict(peft_config) != self._lora.config:
            return None
        return self._lora.targets

    def set_weights_version(self, version: int) -> None:
        """Record ``version`` after a direct write (:meth:`direct_weight_targets`).

        Raises:
            ValueError: ``version`` lower than ``weights_version``.
        """
        if version < self.weights_version:
            raise ValueError(f"set_weights_version({version}) is older than the loaded weights_version="
                             f"{self.weights_version}; versions must not go backwards.")
        self._weights_serial += 1  # the weights were written (a merged adapter copy is merged again)
        self.weights_version = version

    def get_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors under HF checkpoint names (what ``save_pretrained`` writes, tied names
        included), in checkpoint layout, detached. They alias the weights (in-place edits reach the
        model) except for a layout that is no strided view of a parameter (none among the ferrule
        families), which comes back as a copy.
        """
        return {k: self._sleep.live(e).read() for k, e in self._checkpoint_tensors().items()}

    # ------------------------------------------------------------------ one served LoRA adapter (ferrule.rollout._lora)
    def update_lora_adapter(self, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any],
                            version: int) -> None:
        """Serve the base model plus this HF PEFT LoRA adapter (unmerged); set ``weights_version = version``.

        The first call injects PEFT's LoRA layers into the targeted ``nn.Linear`` modules
        (:mod:`ferrule.rollout._lora`) and drops the captured decode states (the forward changed,
        so CUDA graphs are captured again on the next ``generate``). Later calls copy the values
        in place: no reallocation, captured graphs stay valid. The base weights are never
        merged or written, so they stay bit-identical and the adapter is applied exactly once.

        Args:
            tensors: the full adapter, PEFT saved names -> tensors
                (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ``[r, in]``,
                ``...lora_B.weight`` ``[out, r]``; any floating dtype and device, cast to the
                base layer's dtype). Every adapter tensor must be sent in every call.
            peft_config: ``peft.LoraConfig(...).to_dict()`` / ``adapter_config.json`` content.
            version: the trainer's weight version; must not be lower than ``weights_version``.

        Raises:
            KeyError: tensor names the adapter does not have (with the closest known names).
            ValueError: a version going backwards; an adapter tensor not sent; a shape mismatch;
                an unsupported PEFT feature; or ``peft_config`` changing a structural setting
                (rank, alpha, target modules, rsLoRA, ...) of the served adapter: such a change
                is refused, call :meth:`unload_lora_adapter` first. A refused call changes nothing.
            RuntimeError: the engine was shut down.
        """
        if self._closed:
            raise RuntimeError("EmbeddedEngine.update_lora_adapter after shutdown(); build a new engine.")
        if version < self.weights_version:
            raise ValueError(f"update_lora_adapter(version={version}) is older than the loaded weights_version="
                             f"{self.weights_version}; versions must not go backwards.")
        tensors = dict(tensors)
        if self._lora is None and self.cuda_graph and not is_unset(peft_config.get("target_parameters")):
            # H200, 2026-12-01: tests/test_rollout_lora.py::test_cuda_graph_decode_with_adapter_updates_in_place
            # [moe-experts-graph] failed (routed-expert adapters through PEFT's ParamWrapper inside a captured
            # decode graph); not diagnosed yet, so refuse rather than serve numbers nobody has checked
            raise NotImplementedError(
                "update_lora_adapter: serving a routed-expert adapter (peft_config target_parameters="
                f"{peft_config.get('target_parameters')!r}) under CUDA-graph decode is not verified; build the engine "
                "with EmbeddedEngine(..., cuda_graph=False), or adapt only attention / dense modules.")
        if self._lora is None and self._multi.pool is not None:
            raise ValueError("update_lora_adapter: this engine holds adapters for batched multi-adapter decode "
                             f"({', '.join(self._multi.names())}); remove_lora_adapter() them first to serve one "
                             "adapter to every row.")
        if self._lora is None and self.asleep:
            raise RuntimeError("update_lora_adapter: the first adapter cannot be injected while the engine is asleep; "
                               "call wake() first (later updates of a served adapter work asleep).")
        if self._lora is None:
            self._checkpoint_tensors()  # base names and views, taken before PEFT renames the wrapped linears
            self._lora = ServedLoraAdapter.inject(self.model, peft_config, tensors)
            self._drop_decode_states()  # decode states / CUDA graphs captured without the adapter
        else:
            old, new = self._lora.structural, structural_settings(peft_config)
            changed = {k: (old[k], new[k]) for k in old if old[k] != new[k]}
            if changed:
                raise ValueError(f"update_lora_adapter: peft_config changes {changed} (setting: (served, new)) of the "
                                 "served adapter; refused (nothing was written). Call unload_lora_adapter() first to "
                                 "serve an adapter of another shape (decode graphs are then captured again).")
            self._lora.load_(tensors)
            self._lora.config = dict(peft_config)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._weights_serial += 1
        self.weights_version = version

    def unload_lora_adapter(self, name: str | None = None) -> None:
        """Stop serving the adapter: the original ``nn.Linear`` modules (same parameters) go back in place.

        Args:
            name: ignored unless given, then it must be the name given to :meth:`load_lora_adapter`.

        Raises:
            ValueError: no adapter is served, or ``name`` is not the served adapter's.
        """
        if self._lora is None:
            raise ValueError("unload_lora_adapter: no LoRA adapter is served.")
        if name is not None and name != self._lora_name:
            raise ValueError(f"unload_lora_adapter({name!r}): the served adapter is {self._lora_name!r}.")
        self._lora.remove()
        self._lora, self._lora_name = None, None
        self._merged_lora = None  # its merged weight copies (fast decode path)
        self._drop_decode_states()

    def get_lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The served adapter's tensors under PEFT saved names (detached aliases); ``{}`` without an adapter."""
        return {} if self._lora is None else self._lora.state_dict()

    @property
    def lora_config(self) -> dict[str, Any] | None:
        """The served adapter's PEFT config dict, or None."""
        return None if self._lora is None else dict(self._lora.config)

    def load_lora_adapter(self, name: str, path: str, **kwargs: Any) -> None:
        """Serve the PEFT adapter saved in directory ``path`` (``adapter_config.json`` +
        ``adapter_model.safetensors``, what ``PeftModel.save_pretrained`` writes) under ``name``.

        Same semantics as :meth:`update_lora_adapter` at the current ``weights_version``; the engine
        serves one adapter, applied to every request.

        Raises:
            FileNotFoundError: a file is missing. TypeError: unknown keyword arguments.
            ValueError / KeyError: as :meth:`update_lora_adapter`.
        """
        if kwargs:
            raise TypeError(f"EmbeddedEngine.load_lora_adapter got unsupported arguments {sorted(kwargs)}.")
        files = [os.path.join(os.fspath(path), f) for f in ("adapter_config.json", "adapter_model.safetensors")]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"load_lora_adapter({name!r}, {path!r}): missing {absent}; pass a directory written "
                                    "by PeftModel.save_pretrained or `ferrule lora export`.")
        with open(files[0]) as f:
            config = json.load(f)
        self.update_lora_adapter(load_file(files[1]), config, self.weights_version)
        self._lora_name = name

    # ------------------------------------------------------------------ adapters held by name (ferrule.rollout._multi_lora)
    def _drop_decode_states(self) -> None:
        """Drop the decode states (their graphs hold the pool's old addresses or ran without the hooks) and
        take a fresh CUDA graph pool, as ``sleep`` does: capturing into a private pool whose graphs were all
        freed while blocks of it lived on failed an allocator assert on an H100 (torch 2.11)."""
        self._states.clear()
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None

    def add_lora_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any]) -> None:
        """Hold PEFT LoRA adapter ``name`` for batched multi-adapter decode (replacing the values of an
        adapter of that name); requests choose it with ``GenerateRequest(..., lora_adapter=name)``
        (:class:`ferrule.rollout._multi_lora.HeldAdapters`: each row applies its own adapter, unmerged).

        Args:
            name: the adapter's name (non-empty str).
            tensors: PEFT saved names -> factors (``base_model.model.<module>.lora_A.weight`` ``[r, in]``,
                ``.lora_B.weight`` ``[out, r]``), any floating dtype and device (kept in the model's).
            peft_config: ``adapter_config.json`` / ``LoraConfig.to_dict()`` (``r``, ``lora_alpha``,
                ``use_rslora``; plain LoRA only).

        Raises:
            ValueError: ``rollout_engine.max_lora_adapters`` adapters are held already (named in the
                message; nothing changes), a bad config or tensors, modules that do not fit, or a single
                adapter served through ``update_lora_adapter``.
            RuntimeError: the engine was shut down or is asleep.
        """
        if self._closed:
            raise RuntimeError("EmbeddedEngine.add_lora_adapter after shutdown(); build a new engine.")
        if self.asleep:
            raise RuntimeError("EmbeddedEngine.add_lora_adapter while asleep; call wake() first.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"add_lora_adapter: name must be a non-empty str, got {name!r}.")
        if self._lora is not None:
            raise ValueError("add_lora_adapter: this engine serves one adapter to every row (update_lora_adapter); "
                             "call unload_lora_adapter() first to hold adapters for batched multi-adapter decode.")
        self._multi.add(name, tensors, peft_config, max_adapters=int(self.settings.max_lora_adapters),
                        rows=self._largest_rung() or 0)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._weights_serial += 1

    def remove_lora_adapter(self, name: str) -> None:
        """Stop holding adapter ``name``; the last one removed takes the hooks out (the plain base again).

        Raises:
            KeyError: ``name`` is not held (the message lists the held ones).
        """
        self._multi.remove(name)
        self._weights_serial += 1

    @property
    def lora_adapters(self) -> list[str]:
        """Names of the adapters held for batched decode (:meth:`add_lora_adapter`), in slot order."""
        return self._multi.names()

    def lora_rows(self, adapters: Sequence[str | None]) -> Any:
        """Context for a direct forward of ``self.model`` (prompt logprobs): row ``i`` applies adapter
        ``adapters[i]`` (None: the base). A no-op context while no adapter is held and all are None.

        Raises:
            ValueError: an adapter that is not held.
        """
        return self._multi.rows_of(adapters)

    # ------------------------------------------------------------------ lifecycle
    # ------------------------------------------------------------------ sleep / wake (colocation)
    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`."""
        return self._sleep.asleep

    def sleep(self, *, weights: bool = True) -> dict[str, float]:
        """Release device memory while another engine uses the device (colocated training).

        Frees every decode state (KV caches, captured CUDA graphs and their memory pool) and, with
        ``weights``, moves the weights to page-locked host memory (:class:`ferrule.offload.HostStash`;
        a served LoRA adapter's factors stay on the device). While asleep, :meth:`update_weights`,
        :meth:`update_lora_adapter` (of an adapter already served) and :meth:`get_hf_state_dict`
        work on the host copies; :meth:`generate` raises. Decode graphs are captured again on the
        first ``generate`` after :meth:`wake` (their buffers get new addresses).

        Returns:
            ``{"sleep_s": seconds, "sleep_bytes": weight bytes moved to the host}``.

        Raises:
            RuntimeError: already asleep, or shut down.
        """
        if self._closed or self.asleep:
            raise RuntimeError(f"EmbeddedEngine.sleep(): the engine is {'shut down' if self._closed else 'asleep'}.")
        t0 = time.perf_counter()
        self._states.clear()
        self._merged_lora = None  # the fast path's merged adapter copy: rebuilt after wake
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        moved = self._sleep.sleep(self.model, weights=weights,
                                  keep=self._lora.targets.values() if self._lora is not None else ())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"sleep_s": time.perf_counter() - t0, "sleep_bytes": float(moved)}

    def wake(self) -> dict[str, float]:
        """Undo :meth:`sleep`: the weights (with every update made while asleep) back on the device.

        Returns:
            ``{"wake_s": seconds, "wake_bytes": weight bytes copied back}``.

        Raises:
            RuntimeError: not asleep.
        """
        t0 = time.perf_counter()
        moved = self._sleep.wake()
        self._weights_serial += 1
        return {"wake_s": time.perf_counter() - t0, "wake_bytes": float(moved)}

    def health(self) -> dict[str, Any]:
        """``{"status", "kind", "device", "dtype", "weights_version", "model_type", "cuda_graph", ...}``."""
        return {
            "status": "closed" if self._closed else "ok",
            "kind": self.kind,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "weights_version": self.weights_version,
            "model_type": getattr(self.model.config, "model_type", None),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "cuda_graph": self.cuda_graph,
            "compile_decode": self.compile_decode,
            "fast_decode": self.fast_decode,
            "max_batch": self.max_batch,
            "captured_buckets": [list(k) for k, st in self._states.items()
                                 if st.graph is not None or getattr(getattr(st, "fast", None), "graphs", None)],
            "lora": None if self._lora is None else {"name": self._lora_name, "r": self._lora.config.get("r"),
                                                     "lora_alpha": self._lora.config.get("lora_alpha"),
                                                     "tensors": len(self._lora.targets), "bytes": self._lora.nbytes()},
        }

    def info(self) -> dict[str, Any]:
        """What the engine prepared so far, for warm-up accounting (counts since construction):

        - ``decode_shapes``: decode states built, one per ``(batch, max_len)`` bucket (a rebuilt
          evicted one counts again); on CUDA each new one is a ``torch.compile`` of the decode step for
          its shape (or a cache hit where torch already compiled it) and its graph captures;
        - ``distinct_shapes``: the ``[batch, max_len]`` buckets seen, sorted;
        - ``graph_captures``: CUDA graphs captured (plain and fast paths; 0 on CPU);
        - ``compiles``: graphs ``torch.compile`` compiled during this engine's ``generate`` calls (every
          compiled decode function, recompiles included; one served from the on-disk caches counts too):
          with ``decode_dynamic: marked`` the fast step compiles once (adapters or not), not once per sampling
          kind (greedy or sampled, raw logprobs or not: runtime data of one graph), batch rung, cache or
          attended length;
        - ``batch_ladder``: the rungs a call's rows are padded to (empty: no padding, e.g. on CPU);
        - ``compile_cache``: ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` in force (compiled only).
        """
        return {"decode_shapes": self._counters["decode_shapes"],
                "distinct_shapes": sorted(list(k) for k in self._shapes_seen),
                "graph_captures": self._counters["graph_captures"],
                "compiles": self._counters["compiles"],
                "batch_ladder": list(self.settings.batch_ladder) if self._pad_batches else [],
                "compile_cache": {k: envs.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
                if self.compile_decode else {}}

    def shutdown(self) -> None:
        """Drop decode states (KV caches, CUDA graphs); further ``generate`` calls raise."""
        self._states.clear()
        self._multi.close()
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return f"EmbeddedEngine({json.dumps(self.health())})"
