"""Typed settings of the engines' fast paths: train engine, rollout engine, weight sync.

Each switch is a field with its default and the reason for it; nothing here is read from the
environment except the deprecated variables :meth:`EngineSettingsBase.with_env` still honours for
one release (:data:`ferrule.envs.DEPRECATED`). The three classes are the ``train_engine``,
``rollout_engine`` and ``weight_sync`` sections of a ``ferrule train`` config (docs/train.md's
generated reference), written into the run's ``config.yaml`` and printed at start-up;
``ferrule serve`` takes the rollout engine's as flags. Python users pass them to the engines::

    TrainEngine.from_hf(hf_dir, layout, settings=TrainEngineSettings(fused_adam=False))
    EmbeddedEngine(hf_dir=hf_dir, settings=RolloutEngineSettings(kv_bucket=128))
    sync_weights(engine, rollout, version, settings=WeightSyncSettings(direct=False))

A switch typed ``bool | 'auto'`` is on with ``"auto"`` where it is verified: on CUDA (where the
exactness tests in ``tests/test_gpu.py`` / ``tests/test_rollout_fast_decode.py`` ran green on a lent
H200, docs/benchmarks.md) and off on CPU, where the plain path is the bit-exact reference the CPU
tests pin. :meth:`resolve` turns it into a bool for a device. No torch import here (the config loads
without it).
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from ferrule import envs

__all__ = ["Switch", "TrainEngineSettings", "RolloutEngineSettings", "WeightSyncSettings", "LEAN_ACTIVATION_KINDS",
           "ATTENTION_KINDS", "DEFAULT_BATCH_LADDER"]

#: a fast-path switch: true, false, or "auto" (on with CUDA, off on CPU)
Switch = bool | Literal["auto"]
#: what ``train_engine.lean_activations`` may name (:func:`ferrule.megatron.gpu_fusions.enable_lean_activations`)
LEAN_ACTIVATION_KINDS = ("swiglu", "norms", "compact_v")
#: ``rollout_engine.attention`` choices (:mod:`ferrule.rollout._decode_attn`)
ATTENTION_KINDS = ("fp32", "eager", "triton", "triton_rope")
#: ``rollout_engine.batch_ladder`` default: decode batch sizes prepared per process
DEFAULT_BATCH_LADDER = [8, 16, 32, 64, 128, 256, 512]


def _f(default: Any, doc: str, unit: str = "") -> Any:
    md = {"doc": doc, "unit": unit}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md)
    return field(default=default, metadata=md)


def _parse_env(raw: str, tp: Any, key: str) -> Any:
    """A deprecated variable's text as the field type ``tp`` (``0``/``1`` for switches)."""
    text = raw.strip()
    low = text.lower()
    args = typing.get_args(tp)
    if tp is int:
        return int(text)
    if tp is bool or bool in args:
        if low in ("0", "false", "no", "off"):
            return False
        if low in ("1", "true", "yes", "on"):
            return True
        if "auto" in args and low == "auto":
            return "auto"
        if any(typing.get_origin(a) is list for a in args):  # a comma list of kinds
            return [w.strip() for w in text.split(",") if w.strip()]
        raise ValueError(f"{key}: cannot read {raw!r} as a switch (0 or 1)")
    return text


class EngineSettingsBase:
    """What the three settings classes share: :meth:`resolve`, :meth:`with_env`, :meth:`describe`."""

    def resolve(self, name: str, on_cuda: bool) -> bool:
        """The switch ``name`` for a device: ``"auto"`` is ``on_cuda``, a bool is itself."""
        value = getattr(self, name)
        return on_cuda if value == "auto" else bool(value)

    def with_env(self) -> Any:
        """A copy with each deprecated environment variable that is set applied to its field,
        with a ``FutureWarning`` naming the setting that replaces it (:data:`ferrule.envs.DEPRECATED`).

        Raises:
            ValueError: a set variable whose text does not parse (naming the variable and the setting).
        """
        section = self.section
        hints = typing.get_type_hints(type(self))
        changes = {}
        for env_name, setting in envs.DEPRECATED.items():
            sec, _, key = setting.partition(".")
            raw = envs.get(env_name)
            if sec != section or raw is None:
                continue
            try:
                changes[key] = _parse_env(raw, hints[key], f"{env_name} ({setting})")
            except ValueError as exc:
                raise ValueError(f"{env_name}={raw!r}: {exc}; set {setting} instead") from None
            warnings.warn(f"{env_name} is deprecated and goes in the next release; set {setting} instead (a "
                          f"`ferrule train` config key, or {type(self).__name__}({key}=...)); applied as "
                          f"{key}={changes[key]!r}", FutureWarning, stacklevel=3)
        return dataclasses.replace(self, **changes) if changes else self

    def describe(self) -> str:
        """``"key=value, ..."`` of every field, for the start-up report."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


@dataclass(frozen=True, kw_only=True)
class TrainEngineSettings(EngineSettingsBase):
    """Fast paths of the Megatron train engine (docs/engine.md "GPU fast paths"). auto: on with CUDA, off on
    CPU; each CUDA path was checked bit-identical to, or closer to fp32 than, the plain bf16 path on a lent H200
    (tests/test_gpu.py::test_train_fusions_bf16_exact_or_closer_to_fp32, docs/benchmarks.md, 2026-12-02/03)."""

    section: typing.ClassVar[str] = "train_engine"

    fused_logprobs: Switch = _f("auto", "Logprobs straight from the last hidden states chunk by chunk "
                                        "(ferrule.megatron.fused_logprob), never holding fp32 [tokens, vocab] logits; "
                                        "true also on CPU; off with a LoRA adapter on the output layer.")
    cuda_fusions: Switch = _f("auto", "Megatron's fused SwiGLU and RoPE paths (ferrule.megatron.gpu_fusions); "
                                      "CUDA only.")
    packed_sequences: Switch = _f("auto", "With a micro-batch token budget, data packed into one row (megatron's "
                                          "thd format) instead of padded to the longest; needs SDPAttention in every "
                                          "layer (true refuses a model without it; auto falls back to padding).")
    grad_accum_fusion: Switch = _f("auto", "Weight gradients accumulated in fp32 straight into DDP's main_grad by "
                                           "one GEMM (megatron's gradient_accumulation_fusion); CUDA, full-parameter "
                                           "training only. Verified: closer to fp32 than the plain path (0.01118 vs "
                                           "0.01131 relative gradient error, H200).")
    lean_activations: Switch | list[str] = _f(
        "auto", "Cheaply recomputable activations dropped from the saved tensors and recomputed bit-identically in "
                "backward: true/auto = all of swiglu, norms, compact_v, or a list of them; CUDA only. Verified "
                "bit-identical on an H200; 28.0 -> 19.0 GiB peak at 8 x 2048.")
    logprob_chunk_tokens: int = _f(1024, "Rows per chunk of the fused logprobs (transient logits are chunk x vocab "
                                         "in the parameter dtype, twice in backward); 1024 measured on an H200 "
                                         "(0.62 GB of transients vs 3.58 GB at 4096, same speed).", "tokens")
    logprob_one_pass: Switch = _f("auto", "Max and sum of exponentials of the fused logprobs in one compiled "
                                          "kernel (CPU: the same two eager ops either way).")
    fused_adam: Switch = _f("auto", "torch Adam with fused=True over the fp32 masters, and multi-tensor grad-norm / "
                                    "clip / copy in place of megatron's per-tensor no-Apex fallbacks; CUDA only. "
                                    "Verified bit-identical on an H200 (4.0 ms per step).")
    compile_dynamic: Literal["all", "auto"] = _f(
        "all", "torch.compile's dynamic shapes for ferrule's compiled train kernels (RoPE, fused logprob "
               "reductions): all (every dimension symbolic, one compile) or auto (torch's automatic dynamic "
               "shapes; the logprob gradient got faster, RoPE slower on an H200, so not the default).")

    def lean_kinds(self, on_cuda: bool) -> tuple[str, ...]:
        """The lean activations to switch on for a device (empty off CUDA or when false)."""
        v = self.lean_activations
        if not on_cuda or v is False:
            return ()
        return LEAN_ACTIVATION_KINDS if v in (True, "auto") else tuple(v)


@dataclass(frozen=True, kw_only=True)
class RolloutEngineSettings(EngineSettingsBase):
    """Decode paths of the embedded rollout engine (ferrule.rollout.embedded). auto: on with CUDA, off on CPU,
    which keeps the exact eager path; the CUDA paths were checked against the plain path and an fp32 forward on a
    lent H200 (tests/test_rollout_fast_decode.py, docs/benchmarks.md "Embedded decode")."""

    section: typing.ClassVar[str] = "rollout_engine"

    cuda_graph: Switch = _f("auto", "Capture the decode step as a CUDA graph (CUDA only).")
    compile_decode: Switch = _f("auto", "Run the decode forward through torch.compile and sample with the fused "
                                        "sampler (CUDA only).")
    fast_decode: Switch = _f("auto", "Our own decode forward over fused q/k/v and gate/up weights with sampler and "
                                     "bookkeeping in one CUDA graph per step (Qwen2/Qwen3/Llama-style models; needs "
                                     "compile_decode and cuda_graph). Verified on an H200: logprobs closer to fp32 "
                                     "than the plain path, greedy SmolLM2 identical up to near ties.")
    kv_bucket: int = _f(64, "The fast path attends over the filled key prefix rounded up to this many slots (one "
                            "graph per length); 0: the whole cache every step.", "slots")
    attention: Literal["fp32", "eager", "triton", "triton_rope"] = _f(
        "fp32", "Decode attention of the fast path: fp32 (q @ k^T kept in fp32, as SDPA's kernels), eager "
                "(transformers' eager formula, scores rounded to the model dtype), triton / triton_rope (one fused "
                "Triton kernel; exact on an H100 on 2026-12-07: its CUDA tests, fast decode against the plain path "
                "and the kernel inside a compiled + CUDA-graphed step, pass since the kernel pads head dims below "
                "16 and keeps its scaling fp32 (it failed to compile on the H200 on 2026-12-02 and on the H100 "
                "before); not measured faster, so not the default).")
    sampler_chunks: int = _f(0, "The fast step's sampler reduces each row in this many vocabulary chunks, then over "
                                "the chunks; 0: one pass per row (not measured faster, so off).", "chunks")
    decode_dynamic: Literal["all", "auto", "marked"] = _f(
        "marked", "torch.compile's dynamic shapes for the fast decode step. marked (default): the batch and length "
                  "dimensions of the step's inputs symbolic from the first compile (weights static), the attended "
                  "length passed as a tensor's length, one stop-id buffer size and no duck sizing: one compile (the "
                  "sampling kind, greedy or sampled, raw logprobs or not, is runtime data of it) serves every batch "
                  "rung, cache length and attended length, then a CUDA graph capture per rung and length (counted on CPU: tests/test_rollout_fast_decode.py). "
                  "Measured on an H100 (2026-12-06, docs/benchmarks.md): after the first call (95 s cold, 19.7 s "
                  "with the disk caches) the RL-shaped load's first call took 3.0 s and each new batch size "
                  "0.2-0.3 s with no new compile (auto: 62-137 s each), steady rates equal, the CUDA exactness "
                  "tests green. auto: torch's automatic dynamic shapes (a static compile, then a recompile for each "
                  "dimension that changes). all: every dimension symbolic, the weights' too (measured slower on an "
                  "H100: first 256 x 256 call 85.3 s vs 62.3 s, steady 5-7% lower, and the next rung still "
                  "recompiled).")
    compile_regions: bool = _f(False, "The fast decode step's decoder layer as one nested compile region "
                                     "(torch.compiler.nested_compile_region): torch.compile traces and compiles one "
                                     "layer and reuses it for every layer instead of unrolling all of them into the "
                                     "step. Applies with decode_dynamic marked (every batch and length dimension "
                                     "symbolic up front: a size specialised inside the first layer broke dynamo's "
                                     "region reuse on CPU) and without Triton attention. Measured on CPU (inductor, "
                                     "cold cache, 24 narrow Qwen2 layers, bench/bench_compile_regions.py, "
                                     "2026-12-06): first call 83 s vs 238 s wall, 95 s vs 149 s CPU for the whole "
                                     "process, tokens equal and logprobs within 1e-6 of the plain path. On an H100 "
                                     "(torch 2.11, 2026-12-07) its CUDA exactness test passed, but the cold first "
                                     "call (256 x 256) took 126.9 s against 86.6 s for the whole step in an earlier "
                                     "run (docs/benchmarks.md; no same-run comparison yet): exact, not shown faster "
                                     "on a GPU, so off by default; false: the whole step unrolled.")
    compile_step: bool = _f(True, "The fast decode step (and continuous_fast's) through torch.compile (inductor "
                                  "fuses norms, RoPE, softmax and the sampler's passes). false: the same step "
                                  "uncompiled, captured as CUDA graphs all the same (as SGLang serves by default): "
                                  "nothing compiles, so a first call costs the graph captures alone, at the unfused "
                                  "kernels' step time. H100, 0.5B, 2026-12-07 (docs/benchmarks.md): first calls "
                                  "of four shapes 13.7 s against 91.5 s compiled (cold process; 12.2 vs 20.9 s "
                                  "on warm disk caches), steady decode 0.45-0.50x the compiled step (43.5k vs "
                                  "97.5k tok/s at 256 x 256), so an RL run of more than ~30 rollouts is faster "
                                  "compiled; false suits one-off sampling and short evaluations. Same formulas: "
                                  "tokens and logprobs match the plain path (CUDA test passed on the H100; CPU "
                                  "test: tests/test_rollout_fast_decode.py).")
    lora_merged: bool = _f(True, "A served LoRA adapter is merged into a copy of the weights it targets once per "
                                 "version and the prefill runs on it too (false: merged every call, prefill through "
                                 "PEFT's unmerged layers). Verified on an H200, 2026-12-02.")
    prefill_once: bool = _f(True, "The n samples of a request prefill their prompt once: the prompt forward runs on "
                                  "one row per request and its keys, values and last logits are copied into the n "
                                  "rows (static batches, and continuous batching's fills and refills). "
                                  "Greedy tokens equal the per-row prefill's, logprobs within 1e-5 (CPU, fp32, "
                                  "tests/test_rollout_embedded.py). On an H100 (bench_targets, 2026-12-06) the seeded "
                                  "RL-shaped load's 512 rows came out with the per-row prefill's mean length "
                                  "(254.7 tokens) at 51.9k vs 46.2k real tok/s; its CUDA test passed on an H100 "
                                  "(2026-12-07).")
    max_lora_adapters: int = _f(16, "LoRA adapters held at once for batched multi-adapter decode (EmbeddedEngine."
                                    "add_lora_adapter, ferrule serve's sampler): one more is refused naming this "
                                    "setting (ferrule serve evicts the least recently used instead). Each held "
                                    "adapter costs its rank x sum(in + out) elements per targeted linear.", "adapters")
    max_batch: int = _f(0, "Rows decoded at once (continuous batching, ferrule.rollout._continuous); 0: all rows of "
                           "a call in one batch (up to the largest batch_ladder rung).", "rows")
    batch_ladder: list[int] = _f(DEFAULT_BATCH_LADDER, "Decode batch sizes where batches are padded (pad_batches): "
                                                       "a call's rows are padded to the next rung, so a new batch "
                                                       "size reuses a prepared decode state and its compiled step "
                                                       "instead of compiling; rows beyond the largest rung go "
                                                       "through continuous batching at that size.", "rows")
    continuous_fast: bool = _f(True, "Continuous batching (max_batch, or more rows than the largest batch_ladder "
                                     "rung) decodes each step through the fast path's decode forward (fused q/k/v "
                                     "and gate/up weights, attention over the filled key prefix rounded up to "
                                     "kv_bucket, one compiled step and one CUDA graph per bucket and attended "
                                     "length) where fast_decode applies to the call, instead of transformers' "
                                     "forward; the sampler and refills stay as they are. Matches the plain "
                                     "continuous path and an HF forward on CPU, and an fp32 HF forward within 1e-4 "
                                     "on an H100 (tests/test_rollout_continuous.py, 2026-12-07). Measured on an "
                                     "H100 (bench_targets, 2026-12-07, RL-shaped load): 23.1k vs 17.8k real tok/s at "
                                     "max_batch 128, 29.1k vs 19.5k at 256 (1.3-1.5x; still 0.46-0.58x the static "
                                     "batch's 49.7k); its first call 42.2 s vs 27.1 s cold (its own compile, once "
                                     "per process: the next max_batch took 4.6 s). false: transformers' forward.")
    pad_batches: Switch = _f("auto", "Pad a call's rows to the next batch_ladder rung (auto: with CUDA graphs; on CPU "
                                     "nothing is compiled, so rows are not padded).")


@dataclass(frozen=True, kw_only=True)
class WeightSyncSettings(EngineSettingsBase):
    """Weight sync from the train engine to the rollout engine (ferrule.sync)."""

    section: typing.ClassVar[str] = "weight_sync"

    direct: bool = _f(True, "In one process on one device, copy from the parameters straight into the served "
                            "weights (ferrule.sync.direct; 1.15 ms vs 16.5 ms bucketed for 0.99 GB on an H200) where "
                            "it applies; bit-identical to the bucketed path. With LoRA, the same for the adapter: "
                            "from the adapter parameters into the served adapter (ferrule.sync.sync_lora_adapter; "
                            "CPU, 24 layers: 0.47 ms vs 3.9 ms through the export), bit-identical too.")
    row_gathers: bool = _f(True, "The direct path's strided copies into one fused buffer run as one index_select of "
                                 "rows (1.15 ms vs 1.49 ms as strided copies).")
    foreach_copies: bool = _f(True, "The direct path copies with torch._foreach_copy_ (false: one copy_ per "
                                    "tensor, 2.65 ms).")
