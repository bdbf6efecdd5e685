"""The model seam of ``ferrule serve``: training clients on the train engine, sampling on the
embedded rollout engine, checkpoints on disk.

:class:`EngineBackend` keeps **one** :class:`~ferrule.megatron.engine.TrainEngine` **per
training client** (model id), each built from the served base checkpoint. Clients therefore
never share gradients, Adam moments, step counters or LR-scheduler state: two clients whose
requests interleave get exactly what each gets alone (tests/test_serve.py checks it bit for bit).
A Tinker ``lora_config`` makes the engine a LoRA engine (``TrainEngine(lora=...)``,
:meth:`EngineBackend.lora_settings`): the base is frozen, the adapters and their Adam state are
the client's trained state, and the frozen base tensors of all LoRA clients are one copy in
memory (:meth:`EngineBackend._share_frozen_base`: each new LoRA engine's frozen parameters are
pointed at the storage of an existing LoRA engine's identical ones). A LoRA client's sampler weights are its
PEFT adapter, served unmerged on the shared base (several tenants' adapters in one decode batch); where the
batched decode cannot serve the adapter unmerged (routed-expert / stacked parameters, PEFT's
``target_parameters``) and under ``--sampler-checkpoints merged``, they are the base with the adapters merged
(:func:`merged_hf_state`), which the embedded rollout engine serves like any full model
(:meth:`EngineBackend.sampler_format` decides, and says why).

Sampling runs on one :class:`~ferrule.rollout.embedded.EmbeddedEngine`, on the training device in
the sampler dtype (:mod:`ferrule.serve.placement`: bfloat16 on CUDA, float32 on CPU, or
``--sampler-dtype``; :attr:`EngineBackend.placement`). Before a request it
holds the weights the sampling session names (the base model, or a ``save_weights_for_sampler``
snapshot, written as HF-named safetensors) and swaps them in place when another session
samples (``update_weights``; the last-loaded weights are remembered so consecutive requests of
one session swap nothing). A sampler checkpoint is identified by its directory *and* the id of
the save that wrote it (:class:`SavedWeights`), so a checkpoint saved again under its name is
loaded again; unnamed snapshots are kept per tenant (:meth:`EngineBackend.snapshot`).

Every method is called from the service's single worker thread (:mod:`ferrule.serve.scheduler`),
except :meth:`check_forward_backward`, a pure input check the HTTP handlers run on submission.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .media_chunks import hf_inputs
from .merge import merged_hf_state
from .lora_clients import build_engine, lora_settings
from .multi_target import expand, regroup
from .placement import sampler_placement
from .sampling_params import to_sampling_params
from ferrule.contract import registry
from ferrule.rollout.base import GenerateRequest

__all__ = ["EngineBackend", "SampleSpec", "SavedWeights", "merged_hf_state", "SAMPLER_CHECKPOINTS"]

log = logging.getLogger("ferrule.serve")
#: ``--sampler-checkpoints`` values -> what they make of a LoRA client's sampler weights (``get_server_capabilities``)
SAMPLER_CHECKPOINTS = {
    "auto": "a LoRA client's PEFT adapter, served unmerged on the base (batched with other tenants' adapters); "
            "merged into a full copy only where the adapter adapts routed-expert or stacked parameters (PEFT "
            "target_parameters), which batched decode does not serve unmerged; each such save is logged with why",
    "adapter": "a LoRA client's PEFT adapter, served unmerged on the base; an adapter with routed-expert or stacked "
               "parameters (PEFT target_parameters) is refused",
    "merged": "the full model with the LoRA adapters merged (a full copy per snapshot, swapped in per request)",
}

#: unnamed sampler snapshots (``save_weights_and_get_sampling_client``) kept in memory per tenant
MAX_SNAPSHOTS = 4
#: the PEFT adapter file of an adapter sampler checkpoint (``--sampler-checkpoints adapter``)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: file in a sampler-weights directory naming the save that wrote it (a fresh id per save)
GENERATION_FILE = "GENERATION"
#: files of the base's HF folder an external-weights export copies besides ``tokenizer*`` (the weights are new)
_HF_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "chat_template.jinja", "added_tokens.json")
#: evicted snapshot keys remembered, so a request for one is told what evicted it
_EVICTED_KEPT = 4096


@dataclass(frozen=True)
class SavedWeights:
    """A ``save_weights_for_sampler`` checkpoint as it was when a request was admitted: its
    directory and the id of the save that wrote it (:data:`GENERATION_FILE`)."""

    directory: Path
    generation: str

    def __str__(self) -> str:
        return f"{self.directory}@{self.generation}"


class AdapterWeights:
    """A LoRA client's adapter held in memory as an unnamed sampler snapshot (``--sampler-checkpoints
    adapter``): PEFT saved names -> tensors (CPU) and its ``adapter_config.json`` dict; sampled on the
    base with batched multi-adapter decode (:mod:`ferrule.rollout._multi_lora`)."""

    def __init__(self, tensors: dict, config: dict):
        self.tensors, self.config = tensors, config

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


#: source prefix of a training client's inflight sampler weights (:meth:`EngineBackend.publish_inflight`)
INFLIGHT = "inflight:"
#: ``EngineBackend._loaded`` while the rollout engine holds adapters by name (batched multi-adapter decode)
_MULTI = "<multi-adapter>"


class SampleSpec:
    """One ``asample`` request, validated: prompt token ids, n, ferrule ``SamplingParams``,
    whether prompt logprobs are wanted, the top-k / target / alternative-token extras
    (:class:`ferrule.serve.logprobs.Extras`, or None), and the prompt's media (``{modality:
    [item, ...]}``, placeholders already in ``prompt``: :mod:`ferrule.serve.media_chunks`; None: text)."""

    def __init__(self, prompt: list[int], n: int, params: Any, prompt_logprobs: bool, extras: Any = None,
                 media: dict | None = None):
        self.prompt, self.n, self.params, self.prompt_logprobs = prompt, n, params, prompt_logprobs
        self.extras, self.media = extras, media


class EngineBackend:
    """Train engines per model id + one embedded rollout engine, for one served base model (a server
    of several bases holds one per base: :class:`ferrule.serve.registry.BaseRegistry`).

    Args:
        base_model: an HF checkpoint directory (``config.json`` + safetensors) or a ferrule
            torch_dist checkpoint (``hf/config.json`` inside).
        model_name: the name clients pass as ``base_model`` (default: the directory name).
        optimizer: :class:`~ferrule.megatron.optim.OptimizerSettings` for every client's engine
            (the per-step Adam hyper-parameters come from each ``optim_step`` request).
        eager: load the rollout engine now (the first base of a server); otherwise the weights
            load on first use (:attr:`on_load` is called first, so the registry can make room).
        engine_settings: ``{"train_engine": TrainEngineSettings, "rollout_engine": RolloutEngineSettings}``
            (:mod:`ferrule.engine_settings`; ``ferrule serve --engine-setting``); a missing one: its defaults.
        sampler_dtype: ``--sampler-dtype`` (:func:`ferrule.serve.placement.sampler_placement`:
            ``auto`` = bfloat16 on CUDA, float32 on CPU); the device is the training device.
        sampler_checkpoints: ``--sampler-checkpoints`` (:data:`SAMPLER_CHECKPOINTS`): ``auto`` (a LoRA
            client's PEFT adapter, merged only where batched decode cannot serve it: :meth:`sampler_format`),
            ``adapter`` (the adapter, or refused) or ``merged`` (the full model); :meth:`save_sampler_weights`.

    Raises:
        FileNotFoundError: ``base_model`` is neither kind of checkpoint.
        ValueError: an unknown ``sampler_dtype`` or ``sampler_checkpoints``.
    """

    def __init__(self, base_model: str | Path, *, model_name: str | None = None, optimizer: Any = None,
                 max_snapshots: int = MAX_SNAPSHOTS, eager: bool = True, sampler_dtype: str | None = "auto",
                 sampler_checkpoints: str = "auto", engine_settings: Mapping[str, Any] | None = None):
        if sampler_checkpoints not in SAMPLER_CHECKPOINTS:
            raise ValueError(f"--sampler-checkpoints {sampler_checkpoints!r}: use auto (the default: a LoRA client's "
                             "adapter, merged only where batched decode cannot serve it), adapter or merged.")
        #: what ``save_weights_for_sampler`` writes for a LoRA client (:meth:`save_sampler_weights`)
        self.sampler_checkpoints = sampler_checkpoints
        #: the sampler's device and dtype (:mod:`ferrule.serve.placement`)
        self.placement = sampler_placement(sampler_dtype)
        self.base_dir = Path(base_model).absolute()
        self.engine_settings = dict(engine_settings or {})
        if (self.base_dir / "config.json").is_file():
            self.kind = "hf"
            self.hf_config = json.loads((self.base_dir / "config.json").read_text())
        elif (self.base_dir / "hf" / "config.json").is_file():
            self.kind = "torch_dist"
            self.hf_config = json.loads((self.base_dir / "hf" / "config.json").read_text())
        else:
            raise FileNotFoundError(f"--base-model {base_model}: neither an HF checkpoint (config.json) nor a ferrule "
                                    "torch_dist checkpoint (hf/config.json); pass one of those directories.")
        self.model_name = model_name or self.base_dir.name
        text = self.hf_config if "vocab_size" in self.hf_config else self.hf_config.get("text_config") or {}
        # a multimodal config (Inkling) keeps it in text_config; a padded unembedding (Inkling-2) has logits over
        # unpadded_vocab_size ids only (HF's lm_head rows): prompts, targets and sampled ids stay below it
        self.vocab_size = int(text.get("unpadded_vocab_size") or text["vocab_size"])
        self.max_positions = int(text.get("max_position_embeddings") or 0) or None
        self.optimizer = optimizer
        self.engines: dict[str, Any] = {}
        self.lora_ranks: dict[str, int | None] = {}
        self._rollout = None
        self._tokenizer = None
        self._base_state: dict | None = None
        self._loaded: str | None = None  # which weights the rollout engine serves: None = base
        self._params: str | None = None  # which full weights its parameters hold (an adapter is served on the base)
        #: adapters the rollout engine holds for batched decode (``str(source)``), least recently used first
        self._resident: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.max_snapshots = max_snapshots
        self._snapshots: dict[str, dict] = {}   # key -> tensors
        self._tenant_snapshots: dict[str, collections.OrderedDict[str, None]] = {}  # tenant -> its keys, oldest first
        self._evicted: collections.OrderedDict[str, str] = collections.OrderedDict()  # key -> what evicted it
        self._snap_counter = 0
        #: training client -> the key of its ``inflight`` sampler weights (the latest inflight save)
        self._inflight: dict[str, str] = {}
        self._merge_layout: tuple | None = None
        self._version = 0
        #: why the family's LoRA appliers refused ``output_layer`` (``train_unembed`` is then not applied), or None
        self.unembed_refused: str | None = None
        #: hooks of :class:`ferrule.serve.registry.BaseRegistry`: ``on_load(self)`` before weights load
        #: while none are held (may raise to refuse), ``on_use(self)`` on every use (LRU order)
        self.on_load: Any = None
        self.on_use: Any = None
        if eager:
            _ = self.rollout  # transformers' modeling modules load before megatron's CPU patches (cpu_compat)

    # ---------------------------------------------------------------- memory estimates (ferrule.serve.memory)
    @property
    def sampler_dtype_bytes(self) -> int:
        """Bytes per element of the sampler's dtype (its KV cache and activations)."""
        return 4 if self.placement.dtype == "float32" else 2

    @property
    def train_dtype_bytes(self) -> int:
        """Bytes per activation element of a training client: 4 on the CPU (float32), 2 on a GPU (bfloat16)."""
        return 4 if self.placement.device == "cpu" else 2

    def param_count(self) -> int | None:
        """Parameters of the base: from its safetensors headers (nothing loaded), else the loaded sampler's;
        None when neither can tell (a torch_dist base not loaded yet)."""
        if getattr(self, "_param_count", None) is None:
            files = sorted((self.base_dir if self.kind == "hf" else self.base_dir / "hf").glob("*.safetensors"))
            if files:
                from safetensors import safe_open

                count = 0
                for f in files:
                    with safe_open(str(f), "pt") as handle:
                        for key in handle.keys():
                            count += math.prod(handle.get_slice(key).get_shape())
                self._param_count = count
            elif self._rollout is not None:
                self._param_count = sum(p.numel() for p in self._rollout.model.parameters())
        return getattr(self, "_param_count", None)

    @property
    def loaded(self) -> bool:
        """Whether this base holds weights in memory: a rollout engine, a training client's engine or
        an unnamed sampler snapshot."""
        return self._rollout is not None or bool(self.engines) or bool(self._snapshots)

    def _using(self) -> None:
        if not self.loaded and self.on_load is not None:
            self.on_load(self)
        if self.on_use is not None:
            self.on_use(self)

    def unload(self, why: str) -> None:
        """Drop the rollout engine, the base copy and the unnamed snapshots (``why`` is what a
        request for a dropped snapshot is told); a later request loads the base again.

        Raises:
            RuntimeError: a training client of this base is live (its engine is its state).
        """
        if self.engines:
            raise RuntimeError(f"base model {self.model_name!r} has live training clients {sorted(self.engines)}; "
                               "unload_model them first.")
        for key in self._snapshots:
            self._evicted[key] = why
        for model_id in self._inflight:
            self._evicted[INFLIGHT + model_id] = why
        self._inflight.clear()
        self._snapshots.clear()
        self._tenant_snapshots.clear()
        self._rollout = self._base_state = self._loaded = self._params = self._merge_layout = None
        self._resident.clear()

    # ---------------------------------------------------------------- training clients
    def _new_engine(self, lora: Any = None) -> Any:
        """A fresh engine of the base, with ``lora``'s adapters (:func:`ferrule.serve.lora_clients.build_engine`:
        an output layer the family's appliers refuse is dropped, the refusal kept in :attr:`unembed_refused`)."""
        self._using()
        return build_engine(self, lora)

    def lora_settings(self, lora_config: Mapping[str, Any] | None) -> Any:
        """Tinker ``lora_config`` -> ``LoraSettings`` or None (:func:`ferrule.serve.lora_clients.lora_settings`;
        raises ValueError: no module to train, or a bad rank)."""
        return lora_settings(self.hf_config, lora_config)

    def create(self, model_id: str, lora: Any = None) -> None:
        """Build the training client's engine: the base weights plus, with ``lora``
        (:meth:`lora_settings`), fresh adapters on the frozen base."""
        engine = self._new_engine(lora)
        self._share_frozen_base(engine, exclude=model_id)
        self.engines[model_id] = engine
        self.lora_ranks[model_id] = None if lora is None else lora.rank

    def _share_frozen_base(self, engine: Any, exclude: str | None = None) -> int:
        """Point ``engine``'s frozen (``requires_grad=False``) parameters at the storage of another
        LoRA client's engine where name, shape, dtype and values are identical, so N LoRA clients
        hold one base copy. Nothing writes a frozen parameter (no gradient, no optimizer state;
        ``load`` of a checkpoint with the same base writes equal values), and a tensor that
        differs (a checkpoint of another base) keeps its own storage. Full-parameter engines are
        never shared. Returns the number of shared tensors.
        """
        import torch

        if getattr(engine, "lora", None) is None:
            return 0
        donor = next((e for mid, e in self.engines.items() if mid != exclude and getattr(e, "lora", None) is not None
                      and e is not engine), None)
        if donor is None:
            return 0
        theirs = {n: p for n, p in donor.model[0].named_parameters() if not p.requires_grad}
        shared = 0
        with torch.no_grad():
            for name, p in engine.model[0].named_parameters():
                q = theirs.get(name)
                if (p.requires_grad or q is None or q.shape != p.shape or q.dtype != p.dtype or q.device != p.device
                        or p.data_ptr() == q.data_ptr() or not torch.equal(p, q)):
                    continue
                p.data = q.data
                shared += 1
        return shared

    def drop(self, model_id: str) -> None:
        key = self._inflight.pop(model_id, None)
        if key is not None:   # its inflight weights go with it: nothing can update them any more
            self._snapshots.pop(key, None)
            self._evicted[INFLIGHT + model_id] = (f"training client {model_id} was unloaded at "
                                                  f"{time.strftime('%H:%M:%S')}, and its inflight weights with it")
        self.engines.pop(model_id, None)
        self.lora_ranks.pop(model_id, None)

    def engine(self, model_id: str) -> Any:
        if self.on_use is not None and model_id in self.engines:
            self.on_use(self)
        try:
            return self.engines[model_id]
        except KeyError:
            raise LookupError(f"model {model_id!r} has no engine in this server process (it was created before a "
                              "restart, unloaded, or its session finished); create a training client from a saved "
                              "state.") from None

    def check_forward_backward(self, model_id: str, data: Sequence[Any], loss_fn: str,
                               loss_fn_config: Mapping[str, Any] | None) -> None:
        """The engine's own input checks (loss name and config, token ids within the vocabulary,
        token-aligned lengths, finite inputs, known keys), without touching any state.

        Raises:
            ValueError / TypeError: the first problem, naming the datum and key.
            LookupError: no engine for ``model_id``.
        """
        self.engine(model_id).check_batch(expand(data, loss_fn)[0], loss_fn, loss_fn_config)

    def forward_backward(self, model_id: str, data: Sequence[Any], loss_fn: str,
                         loss_fn_config: Mapping[str, Any] | None, forward_only: bool):
        """:meth:`TrainEngine.forward_backward`, or a gradient-free forward for ``forward_only``
        (same outputs and metrics, no accumulation). Returns an ``FBOutput``. A ``cross_entropy``
        datum with rank-2 ``target_tokens`` / ``weights`` ``[N, K]`` runs as ``K`` rank-1 data and
        gets ``[N, K]`` outputs (:mod:`ferrule.serve.multi_target`)."""
        import dataclasses

        engine = self.engine(model_id)
        flat, plan = expand(data, loss_fn)
        run = engine.forward if forward_only else engine.forward_backward
        out = run(flat, loss_fn, loss_fn_config)
        if len(flat) == len(data):
            return out
        return dataclasses.replace(out, loss_fn_outputs=regroup(out.loss_fn_outputs, plan))

    def optim_step(self, model_id: str, adam_params: Mapping[str, float]) -> dict:
        """One step with the request's Tinker ``AdamParams``; ``grad_clip_norm`` 0 = no clipping."""
        params = dict(adam_params)
        clip = params.pop("grad_clip_norm", None)
        engine = self.engine(model_id)
        saved = engine.settings.clip_grad
        if clip is not None:
            import dataclasses

            engine.settings = dataclasses.replace(engine.settings, clip_grad=float(clip))
        try:
            return engine.optim_step(adam_params=params)
        finally:
            import dataclasses

            engine.settings = dataclasses.replace(engine.settings, clip_grad=saved)

    # ---------------------------------------------------------------- checkpoints
    def save_state(self, model_id: str, directory: Path) -> int:
        """Model + optimizer + scheduler + RNG (torch_dist) into ``directory``; returns bytes. A LoRA
        client's checkpoint stores what changed: the adapter, its Adam state, scheduler and RNG, and
        the frozen base's fingerprint instead of the base (``TrainEngine.save(omit_frozen_base=True)``;
        :meth:`load_state` builds the engine from this base and checks the fingerprint)."""
        engine = self.engine(model_id)
        engine.save(directory, overwrite=True, omit_frozen_base=getattr(engine, "lora", None) is not None)
        return _du(directory)

    def load_state(self, model_id: str, directory: Path, optimizer: bool) -> None:
        """Replace the client's engine by a fresh one holding a :meth:`save_state` checkpoint:
        with ``optimizer`` also Adam's moments and step, the scheduler and RNG (an exact
        continuation); without it the weights only, the optimizer starting from zero (Tinker's
        ``load_state``). A failed load leaves the client's previous engine in place."""
        from ferrule.megatron.checkpoint import ENGINE_STATE_FILE

        saved = json.loads((directory / ENGINE_STATE_FILE).read_text()).get("lora") \
            if (directory / ENGINE_STATE_FILE).is_file() else None
        lora = None
        if saved:
            from ferrule.lora import LoraSettings

            tm = saved.get("target_modules")
            lora = LoraSettings(**dict(saved, target_modules=tuple(tm) if isinstance(tm, list) else tm))
        fresh = self._new_engine(lora)
        fresh.load(directory, load_optimizer=optimizer)
        self._share_frozen_base(fresh, exclude=model_id)  # after the load: only values equal to a live base are shared
        self.engines[model_id] = fresh
        self.lora_ranks[model_id] = None if lora is None else lora.rank

    def sampler_format(self, model_id: str) -> tuple[str, str | None]:
        """What the client's sampler weights (checkpoint, snapshot, inflight) are: ``("adapter", None)`` (its
        PEFT adapter, served unmerged on the base) or ``("merged", why)``; ``why`` is None where merged is what
        was asked for (``--sampler-checkpoints merged``, or a full-parameter client: its weights), else the
        reason ``auto`` merges (the adapter adapts PEFT ``target_parameters``: routed experts' fused 3-D
        parameters, Inkling's stacked shared experts; batched multi-adapter decode serves ``nn.Linear``
        adapters only, and the single-adapter path is unverified under CUDA-graph decode).

        Raises:
            ValueError: ``--sampler-checkpoints adapter`` and such an adapter (names the option to use).
            LookupError: no engine for ``model_id``.
        """
        return self._sampler_format(self.engine(model_id))

    def snapshot_holds_adapter(self, model_id: str) -> bool:
        """Whether an unnamed snapshot of ``model_id`` would hold its adapter (not a merged copy); False when
        unknown (no engine yet). Reads no hook: the HTTP handlers call it for the memory estimate."""
        engine = self.engines.get(model_id)
        try:
            return engine is not None and self._sampler_format(engine)[0] == "adapter"
        except ValueError:
            return False

    def _sampler_format(self, engine: Any) -> tuple[str, str | None]:
        if getattr(engine, "lora", None) is None or self.sampler_checkpoints == "merged":
            return "merged", None
        from ferrule.lora.peft_format import peft_config

        targets = peft_config(engine, self.model_name).get("target_parameters")
        if not targets:
            return "adapter", None
        why = (f"its adapter adapts parameters {list(targets)} (PEFT target_parameters: routed experts or stacked "
               "parameters), which batched multi-adapter decode does not serve unmerged")
        if self.sampler_checkpoints == "adapter":
            raise ValueError(f"--sampler-checkpoints adapter: {why}. Start the server with --sampler-checkpoints auto "
                             "(merged sampler weights for such clients only) or merged, or train without those "
                             "parameters (train_mlp=False).")
        return "merged", why

    def _adapter_weights(self, model_id: str, what: str) -> AdapterWeights | None:
        """The client's adapter as :class:`AdapterWeights` (CPU copies) where :meth:`sampler_format` says
        adapter; else None (logging why ``auto`` merges ``what``)."""
        engine = self.engine(model_id)
        fmt, why = self._sampler_format(engine)
        if fmt == "merged":
            if why is not None:
                log.info("sampler weights of %s (base %s, %s): merged, not the adapter: %s", model_id,
                         self.model_name, what, why)
            return None
        from ferrule.lora.peft_format import hf_adapter_state_dict, peft_config

        return AdapterWeights(
            {k: v.detach().to("cpu", copy=True).contiguous() for k, v in hf_adapter_state_dict(engine).items()},
            peft_config(engine, self.model_name))

    def sampler_tensors(self, model_id: str) -> dict:
        """The client's full model under HF names, adapters merged (:func:`merged_hf_state`, on a
        meta-device copy of the transformers model built once).

        Raises:
            MergeError: an adapter key that cannot be merged (nothing is written then).
        """
        engine = self.engine(model_id)
        if getattr(engine, "lora", None) is None:
            return merged_hf_state(engine)
        if self._merge_layout is None:
            from ferrule.rollout._checkpoint_names import checkpoint_tensors

            from .merge import meta_model

            model = meta_model(self.hf_config)
            self._merge_layout = (model, checkpoint_tensors(model))
        return merged_hf_state(engine, *self._merge_layout)

    def save_sampler_weights(self, model_id: str, directory: Path) -> int:
        """Sampler weights for ``model_id``; returns bytes. Where :meth:`sampler_format` says adapter (a
        LoRA client, by default) its PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``,
        what ``PeftModel.from_pretrained`` reads) and ``base.json`` naming this base; sampling serves it on
        the base, unmerged (:meth:`_hold_adapters`). Merged: the full model as HF-named safetensors
        (``model.safetensors``)."""
        from safetensors.torch import save_file

        adapter = self._adapter_weights(model_id, f"checkpoint {directory.name}")
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if adapter is not None:
                save_file(adapter.tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
                (tmp / "adapter_config.json").write_text(json.dumps(adapter.config, indent=2))
                (tmp / "base.json").write_text(json.dumps({"base_model": self.model_name}) + "\n")
            else:
                save_file(self.sampler_tensors(model_id), str(tmp / "model.safetensors"))
            (tmp / GENERATION_FILE).write_text(uuid.uuid4().hex)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        return _du(directory)

    def save_external_weights(self, model_id: str, directory: Path) -> int:
        """The client's model as an HF checkpoint folder that ``transformers`` loads as it is
        (``save_weights_external``, what ``tinker checkpoint download`` fetches): ``model.safetensors``
        (the full model under HF names, LoRA adapters merged as PEFT merges them: :meth:`sampler_tensors`),
        the base's ``config.json``, ``generation_config.json`` and tokenizer files; written to a
        temporary folder and renamed when complete. Returns bytes."""
        from safetensors.torch import save_file

        source = self.base_dir if self.kind == "hf" else self.base_dir / "hf"
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_file({k: v.contiguous() for k, v in self.sampler_tensors(model_id).items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for f in source.iterdir():
                if f.is_file() and (f.name in _HF_FILES or f.name.startswith("tokenizer")):
                    shutil.copy2(f, tmp / f.name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        return _du(directory)

    @staticmethod
    def saved_weights(directory: Path) -> SavedWeights:
        """The sampler checkpoint in ``directory`` as it is now (its save's id; a checkpoint of an
        older server without :data:`GENERATION_FILE` is named by its file's modification time)."""
        gen = directory / GENERATION_FILE
        if gen.is_file():
            return SavedWeights(directory, gen.read_text().strip())
        weights = directory / "model.safetensors"
        return SavedWeights(directory, f"mtime-{weights.stat().st_mtime_ns if weights.is_file() else 0}")

    # ---------------------------------------------------------------- sampling
    # ---------------------------------------------------------------- text (OpenAI-compatible routes)
    def tokenizer(self) -> Any:
        """The base's HF tokenizer (its checkpoint's tokenizer files; the rollout engine's when it
        holds one), loaded once.

        Raises:
            LookupError: the checkpoint has no tokenizer files.
        """
        if self._tokenizer is None:
            engine = self._rollout
            if engine is not None and engine.tokenizer is not None:
                self._tokenizer = engine.tokenizer
            else:
                folder = self.base_dir if self.kind == "hf" else self.base_dir / "hf"
                if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                    raise LookupError(f"base model {self.model_name!r} has no tokenizer files in {folder} "
                                      "(tokenizer.json / tokenizer_config.json), which text requests need; add them, "
                                      "or sample with token ids through the Tinker routes.")
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(folder)
        return self._tokenizer

    def chat_template(self) -> Any:
        """The chat template of this base's family (its first registered :class:`~ferrule.contract.specs.ChatTemplateSpec`,
        as ``ferrule train`` picks it), or None when the family registers none."""
        templates = registry.chat_templates_for(registry.family_for_hf_config(self.hf_config).name)
        return templates[0] if templates else None

    def sampler_info(self) -> dict:
        """The sampler as ``/api/v1/healthz`` and ``get_server_capabilities`` report it:
        ``{"device", "dtype", "loaded", "checkpoints", "checkpoints_rule"}`` (``--sampler-checkpoints`` and what
        it makes of a LoRA client's sampler weights: :data:`SAMPLER_CHECKPOINTS`), plus ``fast_decode`` /
        ``cuda_graph`` once it is loaded (the engine's own attributes)."""
        engine = self._rollout   # read once: the worker may unload it meanwhile
        info: dict = {**self.placement.as_json(), "loaded": engine is not None,
                      "checkpoints": self.sampler_checkpoints,
                      "checkpoints_rule": SAMPLER_CHECKPOINTS[self.sampler_checkpoints]}
        if engine is not None:  # attributes only: health() walks state the worker may be changing
            info.update(device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                        fast_decode=engine.fast_decode, cuda_graph=engine.cuda_graph)
        return info

    @property
    def rollout(self) -> Any:
        """The embedded rollout engine of this base on :attr:`placement`'s device and dtype (built on first use)."""
        if self._rollout is None:
            self._using()

            from ferrule.rollout.embedded import EmbeddedEngine

            place = dict(device=self.placement.device, dtype=self.placement.torch_dtype)
            if self.kind == "hf":
                self._rollout = EmbeddedEngine(hf_dir=self.base_dir, **place,
                                               settings=self.engine_settings.get("rollout_engine"))
            else:
                from transformers import AutoConfig, AutoTokenizer

                cfg = AutoConfig.from_pretrained(self.base_dir / "hf")
                state = dict(self._new_engine().export_hf_state())
                tok = None
                if (self.base_dir / "hf" / "tokenizer_config.json").is_file():
                    tok = AutoTokenizer.from_pretrained(self.base_dir / "hf")
                self._rollout = EmbeddedEngine(hf_config=cfg, state_dict=state, tokenizer=tok, **place,
                                               settings=self.engine_settings.get("rollout_engine"))
            self._base_state = {k: v.clone() for k, v in self._rollout.get_hf_state_dict().items()}
        return self._rollout

    def snapshot(self, model_id: str, tenant: str = "") -> str:
        """Keep the client's current weights in memory for sampling (``save_weights_and_get_sampling_client``:
        Tinker's ephemeral sampler weights, never written to disk); returns the snapshot key.

        Each tenant keeps its :attr:`max_snapshots` most recent snapshots (one tenant's snapshots
        never evict another's); a request for an evicted one fails naming the snapshot that evicted it.
        """
        self._snap_counter += 1
        key = f"ephemeral:{model_id}:{self._snap_counter}"
        # the adapter only (sampled on the base, batched with other tenants' adapters), else a merged copy
        adapter = self._adapter_weights(model_id, "snapshot")
        self._snapshots[key] = adapter if adapter is not None else self.sampler_tensors(model_id)
        mine = self._tenant_snapshots.setdefault(tenant, collections.OrderedDict())
        mine[key] = None
        while len(mine) > self.max_snapshots:
            old, _ = mine.popitem(last=False)
            self._snapshots.pop(old, None)
            self._evicted[old] = (f"evicted at {time.strftime('%H:%M:%S')} by {key}: the server keeps the "
                                  f"{self.max_snapshots} latest unnamed sampler snapshots per tenant")
            while len(self._evicted) > _EVICTED_KEPT:
                self._evicted.popitem(last=False)
        return key

    def publish_inflight(self, model_id: str) -> str:
        """Publish the client's current weights as its ``inflight`` sampler weights (the tinker SDK's
        ``save_weights_and_get_sampling_client(kind="inflight")``): every inflight sampling session of the
        client samples the latest published weights from its next request on; the previous ones are dropped
        (one copy per client, not counted against ``max_snapshots``). Returns the source every such session
        names, ``inflight:<model_id>`` (:meth:`resolve`)."""
        self._snap_counter += 1
        key = f"{INFLIGHT}{model_id}#{self._snap_counter}"
        adapter = self._adapter_weights(model_id, "inflight weights")
        weights: Any = adapter if adapter is not None else self.sampler_tensors(model_id)
        old = self._inflight.get(model_id)
        self._snapshots[key] = weights
        self._inflight[model_id] = key
        if old is not None:
            self._snapshots.pop(old, None)
        return INFLIGHT + model_id

    def resolve(self, source: SavedWeights | str | None) -> SavedWeights | str | None:
        """``source`` with an ``inflight:<model_id>`` source replaced by the key of that client's latest
        published weights (:meth:`publish_inflight`); other sources unchanged.

        Raises:
            LookupError: the client's inflight weights are gone (it was unloaded, or the base was).
        """
        if not (isinstance(source, str) and source.startswith(INFLIGHT)) or "#" in source:
            return source
        key = self._inflight.get(source[len(INFLIGHT):])
        if key is None:
            why = self._evicted.get(source, "not in this server process (inflight weights are kept in memory only)")
            raise LookupError(f"the inflight weights of this sampling client ({source}) are gone: {why}. Create a "
                              "training client from a saved state and publish again.")
        return key

    def _snapshot_tensors(self, key: str) -> dict:
        if key in self._snapshots:
            return self._snapshots[key]
        why = self._evicted.get(key, "not in this server process (snapshots are kept in memory only, none across "
                                     "restarts)")
        raise LookupError(f"the weights of this sampling client ({key}) are gone: {why}. Call "
                          "save_weights_and_get_sampling_client again, or save_weights_for_sampler(name) for weights "
                          "that stay.")

    def _hold(self, source: SavedWeights | str | None) -> Any:
        """The rollout engine holding ``source``'s weights: None = base, a sampler checkpoint as
        admitted (:class:`SavedWeights`), or a :meth:`snapshot` key (swapped in place when it
        differs from the last).

        Raises:
            LookupError: the snapshot was evicted, or the checkpoint was saved again under its
                name after the request was admitted (the request never runs on other weights).
        """
        engine = self.rollout
        if self.on_use is not None:
            self.on_use(self)
        key = None if source is None else str(source)
        if isinstance(source, SavedWeights):
            now = self.saved_weights(source.directory)
            if now.generation != source.generation:
                raise LookupError(f"sampler checkpoint {source.directory.name} was saved again (same name) after this "
                                  "request was admitted, so the weights it was admitted for are gone; resubmit it to "
                                  "sample the new weights.")
        if key != self._loaded and engine.lora_adapters:  # adapters held for batched decode: the single path
            for name in engine.lora_adapters:
                engine.remove_lora_adapter(name)
            self._resident.clear()
        if key != self._loaded:
            adapter = isinstance(source, SavedWeights) and (source.directory / ADAPTER_WEIGHTS).is_file()
            if adapter:   # an adapter checkpoint: the base weights plus the adapter, served unmerged
                from ferrule.lora.peft_format import read_peft_dir

                self._hold_params(engine, None)
                tensors, config = read_peft_dir(source.directory)
                self._version += 1
                try:
                    engine.update_lora_adapter(tensors, config, version=self._version)
                except ValueError:   # another rank / targets than the served adapter: inject it afresh
                    if engine.lora_config is None:
                        raise
                    engine.unload_lora_adapter()
                    engine.update_lora_adapter(tensors, config, version=self._version)
            else:
                if engine.lora_config is not None:
                    engine.unload_lora_adapter()
                self._hold_params(engine, key, source)
            self._loaded = key
        return engine

    def _hold_params(self, engine: Any, key: str | None, source: Any = None) -> None:
        """Swap the rollout engine's parameters to ``key``'s full weights (None: the base) unless they hold them."""
        if key == self._params:
            return
        if key is None:
            tensors = self._base_state
        elif isinstance(source, str):
            tensors = self._snapshot_tensors(source)
        else:
            from safetensors.torch import load_file

            tensors = load_file(str(source.directory / "model.safetensors"))
        targets = engine.get_hf_state_dict()
        self._version += 1
        engine.update_weights([(k, v) for k, v in tensors.items() if k in targets], version=self._version)
        self._params = key

    def sampling_params(self, body: Mapping[str, Any], prompt_len: int, n: int) -> Any:
        """Tinker ``SamplingParams`` JSON -> ferrule ``SamplingParams`` for this base's context
        (:func:`ferrule.serve.sampling_params.to_sampling_params`).

        Raises:
            ValueError: a field out of range, or prompt + ``max_tokens`` beyond the context.
        """
        return to_sampling_params(body, prompt_len, n, self.max_positions)

    def check_prompt(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise ValueError("prompt is empty; send at least one token.")
        bad = [t for t in tokens if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt holds token ids {bad[:5]} outside [0, {self.vocab_size}); the tokens do not "
                             "belong to this model's tokenizer.")

    def batchable(self, source: SavedWeights | str | None) -> bool:
        """True if ``source`` samples as the base plus a LoRA adapter, or the base itself: such sources of
        several sampling sessions share one decode batch (:meth:`sample_many`)."""
        if source is None:
            return True
        if isinstance(source, SavedWeights):
            return (source.directory / ADAPTER_WEIGHTS).is_file()
        try:
            source = self.resolve(source)
        except LookupError:
            return False   # the request fails when it runs, naming why
        return isinstance(self._snapshots.get(source), AdapterWeights)

    def _check_generation(self, source: Any) -> None:
        if isinstance(source, SavedWeights) and self.saved_weights(source.directory).generation != source.generation:
            raise LookupError(f"sampler checkpoint {source.directory.name} was saved again (same name) after this "
                              "request was admitted, so the weights it was admitted for are gone; resubmit it to "
                              "sample the new weights.")

    def _hold_adapters(self, sources: Sequence[Any]) -> tuple[Any, list[str | None]]:
        """The rollout engine on the base weights holding each adapter of ``sources`` by name (batched
        multi-adapter decode, :mod:`ferrule.rollout._multi_lora`); returns ``(engine, name per source)``.

        Adapters are held up to the engine's ``rollout_engine.max_lora_adapters``; one more evicts the least
        recently used one this batch does not use (reloaded from its checkpoint or snapshot when needed again).
        ``sources`` hold at most that many distinct adapters (:meth:`sample_many` splits).

        Raises:
            LookupError: an evicted snapshot, or a checkpoint saved again since it was admitted.
        """
        engine = self.rollout
        if self.on_use is not None:
            self.on_use(self)
        for src in sources:
            self._check_generation(src)
        if self._loaded != _MULTI:
            if engine.lora_config is not None:
                engine.unload_lora_adapter()
            self._hold_params(engine, None)
            self._loaded = _MULTI
        names = [None if src is None else str(src) for src in sources]
        need = set(names) - {None}
        limit = int(engine.settings.max_lora_adapters)
        for name, src in dict(zip(names, sources)).items():
            if name is None:
                continue
            if name in self._resident and name in engine.lora_adapters:
                self._resident.move_to_end(name)
                continue
            while len(engine.lora_adapters) >= limit:
                victim = next(k for k in self._resident if k not in need)
                engine.remove_lora_adapter(victim)
                del self._resident[victim]
            if isinstance(src, SavedWeights):
                from ferrule.lora.peft_format import read_peft_dir

                tensors, config = read_peft_dir(src.directory)
            else:
                snap = self._snapshot_tensors(src)
                tensors, config = snap.tensors, snap.config
            engine.add_lora_adapter(name, tensors, config)
            self._resident[name] = None
        return engine, names

    def sample_many(self, items: Sequence[tuple[SavedWeights | str | None, SampleSpec]]) -> list[tuple]:
        """Sample each ``(source, spec)`` (see :meth:`sample`; all specs share ``params``). Where every
        source is the base or a LoRA adapter (:meth:`batchable`), the rows of all of them are decoded in
        one batch, each applying its own adapter on the shared base (no merge, no weight swap); else
        one ``generate`` per distinct source, in turn (full weights swapped in).

        Returns:
            One :meth:`sample` result per item, in order.
        """
        params = items[0][1].params
        items = [(self.resolve(src), spec) for src, spec in items]   # inflight: the latest published weights
        if any(spec.params != params for _, spec in items):
            raise ValueError("internal: one sample batch needs one SamplingParams.")
        out: list = [None] * len(items)
        if all(self.batchable(src) for src, _ in items):
            limit = int(self.rollout.settings.max_lora_adapters)
            group: list[int] = []
            for i in range(len(items) + 1):  # groups of at most `limit` distinct adapters
                names = {str(items[k][0]) for k in group if items[k][0] is not None}
                if i == len(items) or (items[i][0] is not None and str(items[i][0]) not in names
                                       and len(names) >= limit):
                    engine, held = self._hold_adapters([items[k][0] for k in group])
                    for k, res in zip(group, self._generate(engine, held, [items[k][1] for k in group])):
                        out[k] = res
                    group = []
                if i < len(items):
                    group.append(i)
            return out
        by_source: dict[str, list[int]] = {}
        for i, (src, _) in enumerate(items):
            by_source.setdefault(str(src), []).append(i)
        for ks in by_source.values():
            engine = self._hold(items[ks[0]][0])
            for k, res in zip(ks, self._generate(engine, [None] * len(ks), [items[k][1] for k in ks])):
                out[k] = res
        return out

    def sample(self, source: SavedWeights | str | None, specs: Sequence[SampleSpec]) -> list[tuple[list, list | None]]:
        """Sample ``spec.n`` continuations of each prompt with the weights of ``source`` (see
        :meth:`_hold`), all prompts in one ``generate`` call (they must share ``params``).

        Returns:
            Per spec ``([(tokens, logprobs, "stop"|"length")] * n, prompt_logprobs or None, extras)``;
            ``prompt_logprobs[0]`` is NaN (no context), ``[i]`` = log p(prompt[i] | prompt[:i])
            from float32 ``log_softmax`` of the untempered logits; ``extras`` is
            :func:`ferrule.serve.logprobs.compute_extras`' dict (empty when none were asked).
        """
        return self.sample_many([(source, s) for s in specs])

    def _generate(self, engine: Any, adapters: Sequence[str | None], specs: Sequence[SampleSpec]) -> list[tuple]:
        """One ``generate`` call over ``specs`` (spec ``i`` with held adapter ``adapters[i]``, None: as the
        engine's weights are), then each spec's prompt logprobs and extras under its own adapter."""
        import torch

        params = specs[0].params
        results = engine.generate([GenerateRequest(tuple(s.prompt), media=s.media, lora_adapter=a)
                                   for s, a in zip(specs, adapters)], params)
        out = []
        for i, spec in enumerate(specs):
            rows = results[i * params.n:(i + 1) * params.n]
            seqs = [(list(r.token_ids), list(r.logprobs), r.finish_reason) for r in rows]
            prompt_lp = None
            media_kw = hf_inputs(self.hf_config, spec.media, engine.device)
            if spec.prompt_logprobs:
                with torch.inference_mode(), engine.lora_rows([adapters[i]]):
                    ids = torch.tensor([spec.prompt], device=engine.device)
                    logits = engine.model(input_ids=ids, **media_kw).logits[0].float()
                    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                prompt_lp = [math.nan] + lp.cpu().tolist()
            extras = {}
            if spec.extras is not None and spec.extras.any:
                from .logprobs import compute_extras

                with engine.lora_rows([adapters[i]]):
                    extras = compute_extras(engine.model, engine.device, spec.prompt, seqs, spec.extras,
                                            params.temperature, params.seed, media_kw)
            out.append((seqs, prompt_lp, extras))
        return out


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
