"""The Megatron train engine: decoupled ``forward_backward`` / ``optim_step``, exact resume.

One :class:`TrainEngine` per model per process (every rank of the job constructs it with the
same arguments and makes the same calls in the same order; rank-local work is planned from
the full batch, which every rank receives). It is what the RL launcher and the
Tinker-compatible service drive::

    engine = TrainEngine.from_hf("Qwen3-0.6B/", ParallelLayout(tp=2))
    out = engine.forward_backward(batch, "ppo", {"clip_low_threshold": 0.8})   # grads accumulate
    out = engine.forward_backward(more, "cross_entropy")                         # same window
    engine.optim_step(learning_rate=1e-6)   # {"success": True, "grad_norm": ...}
    engine.save("ckpt/step_10"); engine.load("ckpt/step_10")

Semantics (DESIGN.md §5; issue 4):

- ``forward_backward`` runs megatron's ``forward_backward_func`` (no pipelining or 1F1B) over
  micro-batches planned by :mod:`ferrule.megatron.batching`, with every DDP chunk in
  ``no_sync`` and ``config.finalize_model_grads_func`` swapped for a no-op (restored afterwards,
  also on error). Nothing is reduced across data-parallel ranks, no optimizer step, no
  ``zero_grad``: gradients accumulate in the DDP grad buffers across calls.
- ``optim_step`` runs megatron's ``finalize_model_grads`` once (DP all-reduce as a **sum**:
  the model config has ``calculate_per_token_loss=True``, so DDP's gradient scaling factor is
  1 and normalisation stays in the loss weights, :mod:`ferrule.losses`), clips, steps, zeroes.
- Per-token logprobs use vocab-parallel cross entropy on fp32 logits with the padded
  vocabulary columns masked out, so they equal HF's ``log_softmax`` of the unpadded logits. On
  CUDA (``fused_logprobs``) the same quantity comes from the last hidden states chunk by chunk
  (:mod:`.fused_logprob`), and mixed-length micro-batches are packed (``packed_sequences``,
  megatron's ``thd`` format): docs/engine.md "GPU fast paths".
- Split invariance: the k-th datum of an accumulation window goes to the same DP rank in the
  same order however the window is split into calls (:func:`~ferrule.megatron.batching.assign_dp_ranks`);
  with one datum per micro-batch (``max_tokens_per_microbatch=None``, the default) the summed
  gradient is bit-identical for any split.

Deferred / not supported here: virtual pipeline stages (vpp), ``overlap_grad_reduce`` (an
asynchronous reduce launched inside one fb call would see only part of the window), entropy
metrics under TP.

LoRA (``lora=LoraSettings(...)``, :mod:`ferrule.lora`, docs/lora.md): adapters are attached through
the family's appliers before DDP wraps the model, the base is frozen, so DDP's grad buffers and
the optimizer hold adapter factors only; fb/step semantics are unchanged. Checkpoints keep the
base in torch_dist and the adapters per global rank (``lora/``), plus the full PEFT adapter.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from ferrule.engine_settings import TrainEngineSettings
from ferrule.losses import SEQUENCE_LEVEL, finalize_metrics, get_loss, sum_metrics
from . import routing_replay, parallel
from .batching import Datum, FBOutput, PreparedDatum, assign_dp_ranks, pack_microbatches, prepare_batch
from .fused_logprob import linear_logprobs
from .gpu_fusions import (enable_cuda_fusions, enable_grad_accum_fusion, enable_lean_activations,
                          use_foreach_optimizer_helpers, use_fused_adam)
from .offload import TrainOffload
from .optim import (OptimizerSettings, adam_step_count, apply_step, build_optimizer, build_scheduler,
                    _check_adam_params, inner_optimizers)
from .parallel import ParallelLayout, init_distributed
from .towers import embed_with_media, towers_of
from ..contract.registry import family_for_hf_config, get_converter
from .checkpoint import ENGINE_STATE_FILE, load_training_state, save_training_state
from .gpu_fusions import set_compile_dynamic
from .provider import provider_build
from ferrule.megatron.weights import export_mcore_to_hf, load_hf_into_mcore

__all__ = ["TrainEngine", "Datum", "FBOutput", "OptimizerSettings", "TrainEngineSettings", "PACK_ALIGN",
           "vocab_parallel_entropy"]

#: packed (``thd``) rows are padded to a multiple of this many tokens on CUDA.
PACK_ALIGN = 1024


def _no_finalize(*args: Any, **kwargs: Any) -> None:
    """Stand-in for ``config.finalize_model_grads_func`` during ``forward_backward``."""
    return None


def _unwrap_gpt(model: Any) -> Any:
    """The megatron ``GPTModel`` inside a DDP / Float16Module wrapper (``.module`` chain)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return model


def vocab_parallel_entropy(logits: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    """Entropy (nats) of the softmax over the full vocabulary, from this TP rank's logits
    ``[..., v_local]`` (fp32) -> ``[...]`` fp32, with autograd history (the entropy bonus).

    ``H = log S - T / S`` with ``S = sum exp(z - m)``, ``T = sum exp(z - m) (z - m)`` and ``m`` the
    global max: ``S`` and ``T`` are summed over the tensor-parallel group with megatron's
    ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), as
    ``VocabParallelCrossEntropy`` sums its softmax denominator. ``pad``: ``[v_local]`` bool, the
    padded vocabulary columns (:func:`pad_mask`), left out of both sums.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits if pad is None else logits.masked_fill(pad, float("-inf"))
    m = z.detach().amax(dim=-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = z - m
    e = shifted.exp()
    t_part = torch.where(e > 0, e * shifted, torch.zeros_like(e))  # exp(-inf) * -inf would be nan
    sums = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), t_part.sum(-1)]))
    return sums[0].log() - sums[1] / sums[0]


class TrainEngine:
    """Megatron-Core model + DDP + optimizer + scheduler with Tinker-style training calls.

    Build it with :meth:`from_hf` or :meth:`from_torch_dist`; the constructor takes already
    built (and loaded) model chunks. Every rank must make the same calls with the same data.

    Attributes:
        model: DDP-wrapped model chunks (``list``, one per virtual pipeline stage).
        optimizer: megatron optimizer; ``scheduler``: ``OptimizerParamScheduler``.
        hf_config: the HF ``config.json`` dict; ``family``: family name; ``vocab_size``: HF vocab
            (``unpadded_vocab_size`` where the config pads the embedding: the ids HF logits cover).
        mapping_table: the family's mapping table; ``update_groups``: its update-group table
            (what weight sync needs; taken from the registry at build time unless given).
        step: number of applied optimizer steps (skipped steps not counted).
        hf_files_dir: the folder whose generation config and tokenizer files every :meth:`save`
            copies into the checkpoint's ``hf/`` (set by :meth:`from_hf` / :meth:`from_torch_dist`
            to the source; None: only ``config.json`` is written).
    """

    hf_files_dir: Path | None = None

    def __init__(self, model_chunks: Sequence[Any], *, hf_config: Mapping[str, Any], family: str,
                 mapping_table: Any, layout: ParallelLayout, optimizer: OptimizerSettings | None = None,
                 params_dtype: torch.dtype = torch.float32, max_tokens_per_microbatch: int | None = None,
                 update_groups: Any = None, lora: Any = None, settings: TrainEngineSettings | None = None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.utils import get_model_config

        if layout.vpp is not None:
            raise NotImplementedError("TrainEngine does not support virtual pipeline stages (vpp) yet; use vpp=None.")
        self.layout = layout
        self.settings = optimizer or OptimizerSettings()
        #: the :class:`~ferrule.engine_settings.TrainEngineSettings` in force (deprecated FERRULE_* variables
        #: applied, with a FutureWarning); ``fused_logprobs`` etc. below are what they resolved to here
        self.fast_paths = (settings or TrainEngineSettings()).with_env()
        self.params_dtype = params_dtype
        self.hf_config = dict(hf_config)
        self.family = family
        self.mapping_table = mapping_table
        self._update_groups = update_groups
        self._towers: dict | None = None
        # multimodal configs (e.g. inkling_mm_model) keep the language model's fields in text_config
        text = self.hf_config if "vocab_size" in self.hf_config else dict(self.hf_config.get("text_config") or {})
        if "vocab_size" not in text:
            raise ValueError("the HF config has no vocab_size (nor text_config.vocab_size); is it a causal LM config?")
        # a padded embedding (Inkling-2: ``unpadded_vocab_size`` rows of HF's lm_head, ``vocab_size`` embedding rows)
        # has logits, targets and token ids over the unpadded vocabulary only, as HF's log-softmax
        self.vocab_size = int(text.get("unpadded_vocab_size") or text["vocab_size"])
        self.max_positions = int(text.get("max_position_embeddings") or 0) or None
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        chunks = list(model_chunks)
        #: the :class:`~ferrule.lora.LoraSettings` of this engine's adapters, or None (full-parameter training)
        self.lora = lora
        if lora is not None:
            # the adapters come in through the settings object (ferrule.lora sits above this layer)
            if not all(callable(getattr(lora, m, None)) for m in ("apply_to", "save_payload", "load_payload")):
                raise TypeError(f"lora={lora!r}; expected ferrule.lora.LoraSettings or None.")
            if self.settings.use_distributed_optimizer:
                raise ValueError("LoRA uses the non-distributed optimizer (adapter state is small and is saved per "
                                 "rank); set OptimizerSettings(use_distributed_optimizer=False).")
            from .param_gather import unwrap

            lora.apply_to([unwrap(c) for c in chunks], family=family, table=mapping_table, hf_config=self.hf_config)
        config = get_model_config(chunks[0])
        if not config.calculate_per_token_loss:
            raise ValueError("the model config needs calculate_per_token_loss=True (sum-reduced DP gradients); "
                             "build it with config_overrides={'calculate_per_token_loss': True}.")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.settings.grad_reduce_in_fp32, overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.use_distributed_optimizer, check_for_nan_in_grad=False)
        self.model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                              disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        self.config = config
        if layout.pp > 1:
            # micro-batches differ in [batch, seq] shape (planned per call): the pipeline stages exchange
            # each activation's shape before it (megatron's p2p `_communicate_shapes`) instead of
            # assuming the fixed seq_length x micro_batch_size of the schedule call
            config.variable_seq_lengths = True
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = None
        self.optimizer = build_optimizer(self.model, self.settings, params_dtype)
        self.scheduler = build_scheduler(self.optimizer, self.settings)
        self.dp_size = parallel.dp_size()
        self.dp_rank = parallel.dp_rank()
        self.step = 0
        self._offload: TrainOffload | None = None  # the offload state, from the first offload() on
        self._window_loads = [0] * self.dp_size
        self._padded_vocab = None
        self._set_fast_paths(chunks, lora)

    def _set_fast_paths(self, chunks: Sequence[Any], lora: Any) -> None:
        """The GPU fast paths of :attr:`fast_paths` (docs/engine.md "GPU fast paths"): fused logprobs,
        megatron's CUDA fusions, packed sequences, gradient-accumulation fusion, lean activations, the
        logprob chunk size, the one-pass logprob reduction and fused Adam (issue 25's train step)."""
        s, config = self.fast_paths, self.config
        on_cuda = next(chunks[0].parameters()).device.type == "cuda"
        set_compile_dynamic(s.compile_dynamic)
        #: logprobs straight from the last hidden states (:mod:`.fused_logprob`), never holding fp32
        #: ``[tokens, vocab]`` logits (``fused_logprobs``; off with an adapter on the output layer)
        self.fused_logprobs = s.resolve("fused_logprobs", on_cuda)
        if self.fused_logprobs and lora is not None and any(
                hasattr(getattr(_unwrap_gpt(c), "output_layer", None), "lora") for c in self.model):
            self.fused_logprobs = False  # the fused path reads output_layer.weight and would skip its adapter
        #: megatron's fused SwiGLU / RoPE paths switched on for CUDA (:mod:`.gpu_fusions`)
        self.cuda_fusions = enable_cuda_fusions(config, s.resolve("cuda_fusions", on_cuda)) if on_cuda else []
        #: with a micro-batch budget, data are concatenated into one row (megatron's ``thd``
        #: packed format; attention stays within each datum, see :mod:`.attention`) instead of
        #: padded to the longest: RL batches of mixed lengths pay for real tokens only
        self.packed_sequences = s.resolve("packed_sequences", on_cuda)
        if self.packed_sequences:
            self._check_packable(chunks, forced=s.packed_sequences is True)
        #: weight gradients accumulated in fp32 straight into DDP's ``main_grad`` buffers by one GEMM
        #: (megatron's ``gradient_accumulation_fusion`` with :func:`.gpu_fusions.wgrad_accumulate`
        #: in Apex's slot; the fused logprobs' output-weight gradient likewise); CUDA, full-parameter only
        self.grad_accum_fusion = bool(on_cuda and lora is None and s.resolve("grad_accum_fusion", on_cuda))
        if self.grad_accum_fusion:
            enable_grad_accum_fusion(self.model)
        #: the activations recomputed bit-identically in backward instead of saved
        #: (:func:`.gpu_fusions.enable_lean_activations`; CUDA)
        which = s.lean_kinds(on_cuda)
        self.lean_activations = enable_lean_activations(self.model, which) if which else []
        #: rows per chunk of the fused logprobs (transient logits are ``chunk x vocab`` in the parameter
        #: dtype, twice in backward)
        self.logprob_chunk_tokens = int(s.logprob_chunk_tokens)
        #: each logprob chunk's max and sum of exponentials in one compiled kernel (CUDA)
        self.logprob_one_pass = s.resolve("logprob_one_pass", on_cuda)
        #: torch Adam with ``fused=True`` over the fp32 masters, and multi-tensor grad-norm / clip /
        #: master-to-model copy in place of megatron's per-tensor no-Apex fallbacks (CUDA)
        self.fused_adam = bool(on_cuda and s.resolve("fused_adam", on_cuda) and use_fused_adam(self.optimizer) > 0)
        if self.fused_adam:
            use_foreach_optimizer_helpers()

    def _check_packable(self, chunks: Sequence[Any], forced: bool) -> None:
        """Packed sequences need ferrule's SDPAttention as every layer's core attention."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from .attention import SDPAttention

        cores = [m for c in chunks for m in c.modules() if isinstance(m, DotProductAttention)]
        # a model with no megatron core attention (e.g. Inkling's own attention module, which refuses
        # packed_seq_params) is not packable
        if cores and all(isinstance(m, SDPAttention) for m in cores) and not self.config.sequence_parallel:
            return
        if forced:
            raise ValueError("train_engine.packed_sequences: true needs SDPAttention as the core attention of every "
                             "layer (core_attention='sdpa') and no sequence parallelism; set it to auto or false to "
                             "pad instead.")
        self.packed_sequences = False

    @property
    def towers(self) -> dict:
        """``{modality: (TowerSpec, module, placeholder id)}`` of the towers on this rank's first
        stage (:mod:`.towers`); the same specs on every rank (empty for a text-only family)."""
        if self._towers is None:
            found = [towers_of(_unwrap_gpt(c)) for c in self.model]
            local = next((t for t in found if t), {})
            if not local and self.layout.pp > 1:
                from ..contract.registry import get_towers

                local = {s.modality: (s, None, s.placeholder_id(self.hf_config)) for s in get_towers(self.family)}
            self._towers = local
        return self._towers

    @property
    def moe_routers(self) -> list:
        """This rank's MoE routers in layer order (empty for a dense model; routing replay drives them,
        :mod:`.routing_replay`)."""
        if getattr(self, "_moe_routers", None) is None:
            from .routing_replay import moe_routers

            self._moe_routers = moe_routers(self.model)
        return self._moe_routers

    @property
    def update_groups(self) -> Any:
        """The family's :class:`~ferrule.contract.specs.UpdateGroupTable` (groups resolved; weight sync reads it)."""
        if self._update_groups is None:
            from ..contract.registry import get_update_groups

            self._update_groups = get_update_groups(self.family)
        return self._update_groups

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _family_parts(hf_config: Mapping[str, Any]):
        family = family_for_hf_config(hf_config)
        return family.name, provider_build(family.name), get_converter(family.name).resolved_mapping()

    @classmethod
    def _build(cls, hf_config: dict, layout: ParallelLayout, seed: int, params_dtype: torch.dtype,
               provider_options: Mapping[str, Any] | None):
        init_distributed(layout, seed=seed)
        family, build, table = cls._family_parts(hf_config)
        options = dict(provider_options or {})
        overrides = dict(options.pop("config_overrides", {}) or {})
        overrides.update(calculate_per_token_loss=True, perform_initialization=False)
        chunks = build(hf_config, layout, params_dtype=params_dtype, config_overrides=overrides, **options)
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        return family, table, chunks

    @classmethod
    def from_hf(cls, hf_dir: str | Path, layout: ParallelLayout | None = None, *,
                optimizer: OptimizerSettings | None = None, params_dtype: torch.dtype = torch.float32,
                seed: int = 1234, max_tokens_per_microbatch: int | None = None,
                provider_options: Mapping[str, Any] | None = None, lora: Any = None,
                settings: TrainEngineSettings | None = None) -> "TrainEngine":
        """Build the family's model at ``layout`` and load an HF safetensors checkpoint into it.

        Initializes the process group and megatron's parallel state if needed
        (:func:`ferrule.megatron.parallel.init_distributed`). ``provider_options`` go to the
        family provider (e.g. ``core_attention='local'``). ``lora``: a
        :class:`~ferrule.lora.LoraSettings` to train adapters on the frozen checkpoint. ``settings``:
        the fast paths (:class:`~ferrule.engine_settings.TrainEngineSettings`; default: its defaults).

        Raises:
            ferrule.contract.registry.UnknownModelError: no plugin supports the ``model_type``.
            ferrule.mapping.MappingError: checkpoint keys / shapes do not fit (all listed).
        """
        layout = layout or ParallelLayout()
        hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
        family, table, chunks = cls._build(hf_config, layout, seed, params_dtype, provider_options)
        load_hf_into_mcore(chunks, hf_dir, table, hf_config=hf_config)
        engine = cls(chunks, hf_config=hf_config, family=family, mapping_table=table, layout=layout,
                     optimizer=optimizer, params_dtype=params_dtype, max_tokens_per_microbatch=max_tokens_per_microbatch,
                     lora=lora, settings=settings)
        engine.hf_files_dir = Path(hf_dir).absolute()
        return engine

    @classmethod
    def from_torch_dist(cls, ckpt_dir: str | Path, layout: ParallelLayout | None = None, *,
                        optimizer: OptimizerSettings | None = None, params_dtype: torch.dtype = torch.float32,
                        seed: int = 1234, max_tokens_per_microbatch: int | None = None,
                        load_optimizer: bool | None = None,
                        provider_options: Mapping[str, Any] | None = None, lora: Any = None,
                        settings: TrainEngineSettings | None = None) -> "TrainEngine":
        """Build from a torch_dist checkpoint: a converter output (``ferrule convert``, weights
        only) or a :meth:`save` directory (with ``load_optimizer`` None/True also optimizer,
        scheduler, counters and RNG). Reads the HF config from ``ckpt_dir/hf/config.json``.

        ``lora``: adapters on the checkpoint's base weights. A LoRA checkpoint (``lora/``) resumes
        adapters and optimizer (``load_optimizer`` None/True); a full-parameter checkpoint gives
        the base weights only (``load_optimizer`` None means False then)."""
        ckpt_dir = Path(ckpt_dir)
        cfg_file = ckpt_dir / "hf" / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} is missing; {ckpt_dir} is not a ferrule torch_dist checkpoint.")
        hf_config = json.loads(cfg_file.read_text())
        layout = layout or ParallelLayout()
        family, table, chunks = cls._build(hf_config, layout, seed, params_dtype, provider_options)
        engine = cls(chunks, hf_config=hf_config, family=family, mapping_table=table, layout=layout,
                     optimizer=optimizer, params_dtype=params_dtype, max_tokens_per_microbatch=max_tokens_per_microbatch,
                     lora=lora, settings=settings)
        if load_optimizer is None:
            load_optimizer = (ckpt_dir / ENGINE_STATE_FILE).is_file() and (lora is None or (ckpt_dir / "lora").is_dir())
        engine.load(ckpt_dir, load_optimizer=load_optimizer)
        engine.hf_files_dir = cfg_file.parent.absolute()
        return engine

    # ------------------------------------------------------------------ core loop (micro-batches, schedule, gather)

    def _prepare(self, batch: Sequence[Any], loss_fn: str | None,
                 loss_fn_config: Mapping[str, Any] | None) -> tuple[list[PreparedDatum], dict]:
        """Checked CPU tensors of ``batch`` (:func:`ferrule.megatron.batching.prepare_batch`)."""
        return prepare_batch(self, batch, loss_fn, loss_fn_config)

    def _pad_mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Boolean ``[v_local]`` mask of padded vocabulary columns on this TP rank (None if none)."""
        from megatron.core import parallel_state as ps

        v_local = logits.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * v_local
        if start + v_local <= self.vocab_size:
            return None
        return torch.arange(start, start + v_local, device=logits.device) >= self.vocab_size

    def _microbatch(self, data: list[PreparedDatum], idx: list[int] | None) -> dict:
        """Device tensors of one micro-batch. ``spans[k] = (row, start, n)`` locates datum
        ``idx[k]``'s tokens: padded layout ``[b, max_len]`` (row k, start 0), or with
        :attr:`packed_sequences` one row of concatenated data (``thd``: row 0, start at the
        datum's offset, per-document positions and ``cu_seqlens``)."""
        device = next(self.model[0].parameters()).device
        lengths = [1] if idx is None else [data[i].tokens.numel() for i in idx]  # None: EP lock-step filler
        toks = [torch.zeros(1, dtype=torch.int64)] if idx is None else [data[i].tokens for i in idx]
        labs = [torch.zeros(1, dtype=torch.int64)] if idx is None else [data[i].inputs["target_tokens"] for i in idx]
        out = {"idx": idx, "lengths": lengths, "packed_seq_params": None,
               "media": [] if idx is None else [data[i].media for i in idx]}
        if self.packed_sequences and len(set(lengths)) > 1:  # equal lengths: padding costs nothing
            from megatron.core.packed_seq_params import PackedSeqParams

            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            # on CUDA the row is padded to a multiple of PACK_ALIGN tokens (the padding is one
            # more document, never selected), so FlexAttention compiles for a few lengths only
            align = PACK_ALIGN if device.type == "cuda" else 1
            pad = -offsets[-1] % align
            docs = lengths + ([pad] if pad else [])
            if pad:
                offsets.append(offsets[-1] + pad)
                toks, labs = toks + [torch.zeros(pad, dtype=torch.int64)], labs + [torch.zeros(pad, dtype=torch.int64)]
            cu = torch.tensor(offsets, dtype=torch.int32, device=device)
            out.update(tokens=torch.cat(toks).unsqueeze(0).to(device), labels=torch.cat(labs).unsqueeze(0).to(device),
                       position_ids=torch.cat([torch.arange(n) for n in docs]).unsqueeze(0).to(device),
                       spans=[(0, offsets[k], n) for k, n in enumerate(lengths)],
                       packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                         max_seqlen_q=max(docs), max_seqlen_kv=max(docs)))
            return self._with_routes(out, data, idx, 1, offsets[-1], device)
        tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        labels = torch.zeros_like(tokens)
        for row, (t, y) in enumerate(zip(toks, labs)):
            tokens[row, : t.numel()] = t
            labels[row, : t.numel()] = y
        b, s = tokens.shape
        out.update(tokens=tokens.to(device), labels=labels.to(device), spans=[(k, 0, n) for k, n in enumerate(lengths)],
                   position_ids=torch.arange(s, device=device).unsqueeze(0).expand(b, s))
        return self._with_routes(out, data, idx, b, s, device)

    @staticmethod
    def _with_routes(out: dict, data: list[PreparedDatum], idx: list[int] | None, b: int, s: int,
                     device: torch.device) -> dict:
        """``out["routes"]``: the data's replayed experts in router token order ``[s * b, layers, top_k]``
        (:func:`ferrule.megatron.routing_replay.microbatch_routes`), or None without routing replay."""
        with_routes = idx is not None and data[idx[0]].routes is not None
        out["routes"] = (routing_replay.microbatch_routes([data[i].routes for i in idx], out["spans"], b, s, device)
                         if with_routes else None)
        return out

    def _forward_step_func(self, data: list[PreparedDatum], loss_fn: str | None, loss: Any, loss_cfg: dict,
                           records: list, metric_list: list) -> Any:
        """megatron's ``forward_step_func`` for one fb call: runs the model on a micro-batch (media
        scattered in; on the last stage with ``fused_logprobs`` the hidden states, whose logprobs come
        from the output weight chunk by chunk) and returns the loss function that appends each datum's
        ``(index, logprobs, elementwise loss)`` to ``records`` and its metrics to ``metric_list``."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # the entropy bonus needs every position's full logits: the fused path never forms them
        with_entropy = loss is not None and float(loss_cfg.get("entropy_coef", 0.0)) > 0
        fused = self.fused_logprobs and not self.config.sequence_parallel and not with_entropy
        grad_accum = self.grad_accum_fusion
        replaying = bool(data) and data[0].routes is not None

        def forward_step(data_iterator: Iterator[dict], model: Any):
            mb = next(data_iterator)
            gpt = _unwrap_gpt(model)
            if replaying:  # in force until the next micro-batch (a recomputation in the backward replays too)
                routing_replay.replay(self.moe_routers, mb["routes"])
            extra = {"packed_seq_params": mb["packed_seq_params"]} if mb["packed_seq_params"] is not None else {}
            if gpt.pre_process and any(mb["media"]):
                extra["decoder_input"] = embed_with_media(gpt, mb["tokens"], mb["position_ids"], mb["media"])
            if fused and gpt.post_process:
                # the last stage returns final-norm hidden states [s, b, h]; logprobs come from
                # them and the output weight, chunk by chunk (fused_logprob)
                weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
                    else gpt.output_layer.weight
                gpt.post_process = False
                try:
                    output = model(mb["tokens"], mb["position_ids"], attention_mask=None, **extra)
                finally:
                    gpt.post_process = True
            else:
                weight = None
                output = model(mb["tokens"], mb["position_ids"], attention_mask=None, **extra)

            def select(x: torch.Tensor) -> torch.Tensor:
                """``[b, s, ...]`` -> the data's tokens concatenated, ``[T, ...]``."""
                return torch.cat([x[row, a:a + n] for row, a, n in mb["spans"]])

            entropy: list[torch.Tensor] = []  # with_entropy: the valid tokens' entropy [T], filled by row_logprobs

            def row_logprobs(out: torch.Tensor, expected_grad: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
                """(logprobs of the valid tokens, concatenated [T] fp32; a [b, s] view or None).
                ``expected_grad``: the loss's known d loss / d logprobs (cross entropy), fused path only."""
                if weight is not None:
                    main_grad = getattr(weight, "main_grad", None) if grad_accum and weight.requires_grad else None
                    return linear_logprobs(select(out.transpose(0, 1)), weight, select(mb["labels"]), self.vocab_size,
                                           tp_group=ps.get_tensor_model_parallel_group(),
                                           chunk_tokens=self.logprob_chunk_tokens,
                                           main_grad=main_grad, one_pass=self.logprob_one_pass,
                                           expected_grad=expected_grad if main_grad is not None else None), None
                logits = out.float()
                mask = self._pad_mask(logits)
                if with_entropy:
                    entropy.append(select(vocab_parallel_entropy(logits, mask)))
                if mask is not None:
                    logits = logits.masked_fill(mask, float("-inf"))
                full = -vocab_parallel_cross_entropy(logits, mb["labels"])  # [b, s]
                return select(full), full

            def loss_func(out: torch.Tensor):
                n_tokens = torch.tensor(sum(mb["lengths"]), dtype=torch.int)
                if mb["idx"] is None or loss is None:
                    t, full = row_logprobs(out)
                    if mb["idx"] is None:
                        return (full if full is not None else t).sum() * 0.0, n_tokens, {}
                    for i, lp in zip(mb["idx"], t.detach().cpu().split(mb["lengths"])):
                        records.append((i, lp, None))
                    return t.sum().detach() * 0.0, n_tokens, {}
                inputs = {}
                for key in data[mb["idx"][0]].inputs:
                    parts = []
                    for i, n in zip(mb["idx"], mb["lengths"]):
                        v = data[i].inputs[key]
                        parts.append(v.reshape(1).expand(n) if v.numel() == 1 and n != 1 else v.reshape(n))
                    inputs[key] = torch.cat(parts).to(out.device)
                # cross entropy is linear in the logprobs (l = -weights * t): its gradient is known up front
                expected = -inputs["weights"].float() if loss_fn == "cross_entropy" and "weights" in inputs else None
                t, full = row_logprobs(out, expected)
                if loss_fn in SEQUENCE_LEVEL:  # the loss couples each datum's tokens: say where data start
                    inputs["segment_ids"] = torch.repeat_interleave(
                        torch.arange(len(mb["idx"])), torch.tensor(mb["lengths"])).to(t.device)
                per_token, metrics = loss(t, inputs, loss_cfg, entropy=entropy[0] if entropy else None)
                pieces = per_token.detach().float().cpu().split(mb["lengths"])
                tp = t.detach().float().cpu().split(mb["lengths"])
                for i, lp, el in zip(mb["idx"], tp, pieces):
                    records.append((i, lp, el))
                metric_list.append({k: float(v) for k, v in metrics.items()})
                return per_token.sum(), n_tokens, {}

            return output, loss_func

        return forward_step

    def _run(self, data: list[PreparedDatum], loss_fn: str | None, loss_cfg: dict, forward_only: bool) -> FBOutput:
        """One fb (or forward-only) call over prepared ``data``: plan DP ranks and micro-batches, run
        megatron's schedule with the DDP chunks in ``no_sync`` and gradient finalization swapped for a
        no-op (restored afterwards, also on error; a failed fb discards the window), gather outputs."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._check_onloaded("forward" if forward_only else "forward_backward")
        lengths = [p.tokens.numel() for p in data]
        ranks = assign_dp_ranks(lengths, self.dp_size, None if forward_only else self._window_loads)
        per_rank = [pack_microbatches([i for i, r in enumerate(ranks) if r == d], lengths,
                                      self.max_tokens_per_microbatch, packed=self.packed_sequences)
                    for d in range(self.dp_size)]
        mbs: list[list[int] | None] = list(per_rank[self.dp_rank])
        if ps.get_expert_model_parallel_world_size() > 1:  # expert all-to-alls need lock-step ranks
            mbs += [None] * (max(len(m) for m in per_rank) - len(mbs))
        loss = get_loss(loss_fn) if loss_fn else None
        records: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        metric_list: list[dict[str, float]] = []
        microbatches = [self._microbatch(data, idx) for idx in mbs]

        forward_step = self._forward_step_func(data, loss_fn, loss, loss_cfg, records, metric_list)
        if data[0].routes is not None:
            routing_replay.check_layout(self.layout)
            routing_replay.attach(self.moe_routers)

        config = self.config
        saved = config.finalize_model_grads_func
        config.finalize_model_grads_func = _no_finalize
        try:
            if microbatches:
                with contextlib.ExitStack() as stack:
                    for chunk in self.model:
                        stack.enter_context(chunk.no_sync())
                    if forward_only:
                        stack.enter_context(torch.no_grad())
                    get_forward_backward_func()(
                        forward_step_func=forward_step, data_iterator=iter(microbatches), model=self.model,
                        num_microbatches=len(microbatches),
                        seq_length=max(mb["tokens"].shape[1] for mb in microbatches),
                        micro_batch_size=max(mb["tokens"].shape[0] for mb in microbatches), forward_only=forward_only)
        except BaseException:
            if not forward_only:
                self.zero_grad()  # a partial micro-batch set would corrupt the window: discard it
            raise
        finally:
            config.finalize_model_grads_func = saved
            routing_replay.clear(self.moe_routers)
        return _gather(len(data), records, metric_list, forward_only)

    # ------------------------------------------------------------------ public training API

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> FBOutput:
        """Forward + backward over ``batch``; gradients accumulate (no step, no zero_grad, no DP reduce).

        Args:
            batch: data (:class:`Datum`, a ``{"model_input", "loss_fn_inputs"}`` dict, or a
                ``tinker.Datum``), each with ``N`` input tokens and ``[N]`` loss inputs.
            loss_fn: a :mod:`ferrule.losses` name (``cross_entropy``, ``importance_sampling``,
                ``ppo``, ``cispo``, ``dro``), chosen per call.
            loss_fn_config: that loss's config (e.g. ``clip_low_threshold``).

        Returns:
            :class:`FBOutput`: per datum in the caller's order ``logprobs`` and
            ``elementwise_loss`` (``[N]`` float32, pre-step weights), and the batch's metrics.

        Raises:
            ValueError / TypeError: bad input (empty batch, unknown loss, token id outside the
                vocabulary, mismatched lengths, non-finite inputs, unknown keys) — raised before
                any gradient is touched; the engine stays usable.
        """
        data, cfg = self._prepare(batch, loss_fn, loss_fn_config)
        return self._run(data, loss_fn, cfg, forward_only=False)

    def forward(self, batch: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None) -> FBOutput:
        """:meth:`forward_backward` without the backward: same outputs and metrics, no gradient
        touched (Tinker's ``forward``). Raises as :meth:`forward_backward`."""
        data, cfg = self._prepare(batch, loss_fn, loss_fn_config)
        return self._run(data, loss_fn, cfg, forward_only=True)

    def check_batch(self, batch: Sequence[Datum], loss_fn: str | None,
                    loss_fn_config: Mapping[str, float] | None = None) -> None:
        """Run :meth:`forward_backward`'s input checks only (no compute, no state touched), so a
        service can refuse a bad request when it arrives. ``loss_fn`` None checks what
        :meth:`forward_logprobs` needs. Raises as :meth:`forward_backward`."""
        self._prepare(batch, loss_fn, loss_fn_config)

    def forward_logprobs(self, batch: Sequence[Datum]) -> list[torch.Tensor]:
        """Per-token logprobs ``[N]`` float32 of each datum's ``target_tokens`` (no grad), caller's order."""
        data, _ = self._prepare(batch, None, None)
        out = self._run(data, None, {}, forward_only=True)
        return [o["logprobs"] for o in out.loss_fn_outputs]

    def zero_grad(self) -> None:
        """Drop the accumulated gradients and start a new accumulation window."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._window_loads = [0] * self.dp_size

    def optim_step(self, learning_rate: float | None = None,
                   adam_params: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Finalize the accumulated gradients (DP sum-reduce), clip, step, zero.

        Args:
            learning_rate: lr for this step only; the LR scheduler is then *not* stepped.
                None: the scheduler's lr, and the scheduler advances after a successful step.
            adam_params: Tinker ``AdamParams`` for this step (``learning_rate``, ``beta1``,
                ``beta2``, ``eps``, ``weight_decay``, ``grad_clip_norm``; 0 = no clipping).
                ``adam_params["learning_rate"]`` counts as an explicit lr.

        Returns:
            ``{"success": bool, "grad_norm": float (before clipping), "learning_rate": float, "step": int}``.
            ``success`` is False when the gradient norm is not finite: nothing is applied, the
            gradients are zeroed, the scheduler and step counters do not move.

        Raises:
            ValueError: an unknown / out-of-range ``adam_params`` entry (nothing changed).
        """
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        self._check_onloaded("optim_step")
        checked = _check_adam_params(adam_params)
        explicit_lr = learning_rate is not None or "learning_rate" in checked
        try:
            finalize_model_grads(self.model)
            success, grad_norm, lr = apply_step(self.optimizer, clip_grad=self.settings.clip_grad,
                                                learning_rate=learning_rate, adam_params=checked)
        finally:
            self.zero_grad()
        if success:
            self.step += 1
            if not explicit_lr:
                self.scheduler.step(1)
        return {"success": bool(success), "grad_norm": float(grad_norm),
                "learning_rate": float(lr) if lr is not None else math.nan, "step": self.step}

    # ------------------------------------------------------------------ colocation (state: .offload.TrainOffload)

    @property
    def offloaded(self) -> bool:
        """True between :meth:`offload` and :meth:`onload`."""
        return self._offload is not None and self._offload.offloaded

    def offload(self, *, weights: bool = False) -> dict[str, float]:
        """Release this engine's device memory for another engine on the same device (colocation).

        Optimizer state (Adam moments, fp32 master weights) goes to page-locked host memory, the
        gradient buffers are freed (their bytes travel only inside an open accumulation window),
        and with ``weights`` the model weights go too (:mod:`ferrule.megatron.offload`). Until
        :meth:`onload`, training calls raise; :meth:`save` still works (it onloads around the save).

        Returns:
            ``{"offload_s": seconds, "offload_bytes": bytes copied}``.

        Raises:
            RuntimeError: already offloaded.
        """
        if self._offload is None:
            self._offload = TrainOffload(self)
        return self._offload.offload(weights=weights, window_open=any(self._window_loads))

    def onload(self) -> dict[str, float]:
        """Bring back everything :meth:`offload` released, bit for bit.

        Returns:
            ``{"onload_s": seconds, "onload_bytes": bytes copied}``.

        Raises:
            RuntimeError: the engine is not offloaded.
        """
        if self._offload is None:
            raise RuntimeError("TrainEngine.onload(): the engine is not offloaded.")
        return self._offload.onload()

    @contextlib.contextmanager
    def _temporarily_onloaded(self) -> Iterator[None]:
        """Onload for the duration of a ``with`` block (a save or load while offloaded), then offload again."""
        if not self.offloaded:
            yield
            return
        weights = self._offload.weights
        self.onload()
        try:
            yield
        finally:
            self.offload(weights=weights)

    def _check_onloaded(self, what: str) -> None:
        if self._offload is not None:
            self._offload.check_onloaded(what)

    # ------------------------------------------------------------------ checkpoints and export

    def _engine_state(self) -> dict:
        import torch.distributed as dist

        return {"step": self.step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "dp_size": self.dp_size, "layout": asdict(self.layout), "optimizer": asdict(self.settings),
                "params_dtype": str(self.params_dtype).removeprefix("torch.")}

    def save(self, path: str | Path, *, overwrite: bool = True, omit_frozen_base: bool = False) -> Path:
        """Save model, optimizer (incl. Adam's step), scheduler, RNG and counters atomically
        (torch_dist; :mod:`ferrule.megatron.checkpoint`), with the source's generation config and
        tokenizer files (:attr:`hf_files_dir`) under ``hf/``, so ``ferrule export`` /
        ``torch_dist_to_hf`` make a complete HF folder of it. Gradients of an open accumulation
        window are not saved. All ranks call it. Returns the absolute path.

        ``omit_frozen_base`` (LoRA engines): leave the frozen base out, keeping the adapter, its
        optimizer state, scheduler and RNG, plus the base's fingerprint; :meth:`load` then needs an
        engine of the same base (``ferrule serve``'s ``save_state``; such a folder is no complete
        model for ``ferrule export``).

        Raises:
            ValueError: ``omit_frozen_base`` on a full-parameter engine."""
        meta = {"format": "ferrule-torch_dist-v1", "family": self.family, "model_type": self.hf_config.get("model_type"),
                "dtype": str(self.params_dtype).removeprefix("torch."), "saved_layout": asdict(self.layout),
                "contents": "engine (model, optimizer, scheduler, rng)"}
        lora_state = lora_files = None
        engine_state = self._engine_state()
        if self.lora is not None:
            with self._temporarily_onloaded():
                lora_state, lora_files = self.lora.save_payload(self)
            meta["contents"] = "engine (frozen base model, scheduler, rng) + LoRA adapter and optimizer (lora/)"
            meta["lora"] = engine_state["lora"] = asdict(self.lora)
            if omit_frozen_base:
                meta["contents"] = ("LoRA adapter and optimizer (lora/), scheduler, rng; the frozen base is not stored "
                                    "(engine_state.json frozen_base: its fingerprint): load into an engine of that base")
        elif omit_frozen_base:
            raise ValueError("omit_frozen_base: a full-parameter engine has no frozen base to leave out.")
        with self._temporarily_onloaded():  # a save while offloaded (colocation) reads the real bytes
            return save_training_state(path, model_chunks=self.model, optimizer=self.optimizer,
                                       scheduler=self.scheduler, engine_state=engine_state, checkpoint_meta=meta,
                                       hf_config=self.hf_config, overwrite=overwrite, hf_files_dir=self.hf_files_dir,
                                       lora_state=lora_state, lora_files=lora_files, omit_frozen=omit_frozen_base)

    def load(self, path: str | Path, *, load_optimizer: bool = True) -> dict:
        """Load a :meth:`save` checkpoint (any TP/PP/DP for the weights; the distributed
        optimizer's state needs the same TP/PP). Discards accumulated gradients.

        With ``load_optimizer`` the Adam moments, Adam's step, the scheduler's step count and
        the RNG states are restored, while this engine's :class:`OptimizerSettings` stay in force
        (lr, min_lr, warmup, decay steps and style, weight decay, betas, eps): a resume with
        ``lr_decay_steps`` 6 instead of the saved run's 4 decays over 6 steps from the saved
        step on. megatron's own scheduler load would silently keep the checkpoint's settings.

        Returns:
            The saved engine state (step, layout, optimizer settings, ...) plus
            ``"settings_changed"``: ``{name: [saved value, value in force now]}`` for every
            :class:`OptimizerSettings` field that differs from the checkpoint (empty when none
            do, or for a weights-only load), so callers can report the change.
        """
        with self._temporarily_onloaded():
            return self._load(path, load_optimizer)

    def _load(self, path: str | Path, load_optimizer: bool) -> dict:
        self.zero_grad()
        lora_load = None
        if self.lora is not None:
            def lora_load(ckpt: Path, with_optimizer: bool) -> dict | None:
                return self.lora.load_payload(self, ckpt, with_optimizer)
        state = load_training_state(path, model_chunks=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, load_optimizer=load_optimizer, lora_load=lora_load)
        changed: dict[str, list] = {}
        if load_optimizer:
            self.step = int(state.get("step", 0))
            saved = state.get("optimizer") or {}
            changed = {k: [saved[k], v] for k, v in asdict(self.settings).items() if k in saved and saved[k] != v}
        return dict(state, settings_changed=changed)

    def refresh_optimizer_params(self) -> None:
        """Copy the live parameters into the optimizer's fp32 master copies (mixed precision;
        a no-op for fp32 parameters, which are their own masters). Called after parameters were
        overwritten outside the optimizer (e.g. :func:`ferrule.lora.load_hf_adapter`), so the next
        step starts from the new values rather than the old masters."""
        for sub in inner_optimizers(self.optimizer):
            sub.reload_model_params()

    def adam_step(self) -> int:
        """torch Adam's shared ``step`` count (equals :attr:`step` unless state was loaded from elsewhere)."""
        return adam_step_count(self.optimizer)

    def export_hf_state(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` for the whole model (weight sync / HF export).

        Collective: iterate to the end on every rank. Tensors are full (TP gathered, vocab
        padding removed) via :func:`ferrule.megatron.weights.export_mcore_to_hf`."""
        self._check_onloaded("export_hf_state")
        return export_mcore_to_hf(self.model, self.mapping_table, hf_config=self.hf_config, dtype=dtype)


def _gather(n: int, records: list, metric_list: list, forward_only: bool) -> FBOutput:
    """Every rank's ``(index, logprobs, elementwise loss)`` records and metrics of one call, gathered
    over data-parallel ranks and broadcast from the last pipeline stage, as one :class:`FBOutput`
    in the caller's order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    payload = (records, metric_list)
    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        gathered: list = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, payload, group=ps.get_data_parallel_group())
    else:
        gathered = [payload]
    if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        box = [gathered]
        last = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
        gathered = box[0]
    outputs: list[dict[str, torch.Tensor] | None] = [None] * n
    metrics_all: list[dict[str, float]] = []
    for recs, mets in gathered:
        for i, lp, el in recs:
            outputs[i] = {"logprobs": lp} if el is None else {"logprobs": lp, "elementwise_loss": el}
        metrics_all += mets
    if any(o is None for o in outputs):
        raise RuntimeError("internal error: some data produced no output (batch plan mismatch across ranks).")
    metrics = finalize_metrics(sum_metrics(metrics_all)) if metrics_all else {}
    return FBOutput(loss_fn_outputs=outputs, metrics=metrics)  # type: ignore[arg-type]
