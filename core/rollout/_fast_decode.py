"""The embedded engine's fast decode step on CUDA: our own decode forward over fused weights, with
the sampler and the per-step bookkeeping in the same compiled function and one CUDA graph.

Why (H200, Qwen2-0.5B shape, batch 64, bf16; docs/benchmarks.md "Embedded decode"): the HF
forward captured as a graph took 2.14 ms of the 2.55 ms step, with three q/k/v and two gate/up
GEMMs per layer, SDPA with a boolean mask over the whole cache (memory-efficient kernel: one
block per (row, kv head), so 128 blocks walk 384 keys each), and ~15 launches of sampling and
bookkeeping per step outside the graph.

What runs instead, for dense Llama-style decoders (``model_type`` in :data:`MODEL_TYPES`: RMSNorm,
RoPE from the model's own ``rotary_emb``, optional q/k biases and Qwen3's q/k norms, SwiGLU MLP,
full attention only):

- :func:`fuse_weights` makes ``q_proj``/``k_proj``/``v_proj`` (and their biases) views of one
  ``[q + 2 kv, hidden]`` buffer and ``gate_proj``/``up_proj`` views of one ``[2 inter, hidden]``
  buffer (``param.data`` re-pointed; the Parameter objects stay), so weight updates, which copy
  into the parameters in place, write the fused buffers directly and no step concatenates;
- :func:`decode_logits` computes one decode step as transformers' eager attention path does
  (``matmul`` scores, masked, ``softmax`` in fp32, ``matmul``; the scores kept in fp32 by
  default, see :data:`ATTN`) over the filled prefix (:data:`KV_BUCKET`), reading the same
  :class:`~ferrule.rollout._static_cache.StaticKVCache` that the HF prefill filled;
- :class:`FastStatic` compiles forward + sampling (:mod:`ferrule.rollout._fast_sampling`'s
  formulas) + bookkeeping (record token/logprob at column ``t``, stop ids, stage the next input)
  as one function and captures it as one CUDA graph per bucket and attended length; the sampling
  kind (greedy or sampled, raw logprobs or not) is runtime data of that one graph (a flag tensor,
  the temperature, the noise buffer). The exponential noise of a sampled call is drawn eagerly
  before each replay from the call's generator, exactly as the plain path draws it, so both
  consume a seed identically (greedy calls draw none).

The CPU path never comes here (the exact eager path stays); :func:`decode_logits` itself is
device-agnostic, which is how ``tests/test_rollout_fast_decode.py`` checks it against the HF
forward on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from ferrule.rollout._decode_attn import KINDS, attend, attend_rope, fuses_rope, uses_triton
from ferrule.rollout._fast_sampling import vocab_chunks, fused_applies
from ferrule.rollout._fast_sampling import sample_record as _sample_record
from ferrule.rollout._lora_merge import MergedLora

MODEL_TYPES = ("qwen2", "qwen3", "llama")
#: stop token ids the captured step takes (padded with -1 to a power of two >= 16); more falls
#: back to the plain path
MAX_STOP_IDS = 1024
#: key slots attended per step: the filled prefix rounded up to this many (one graph per length,
#: docs/benchmarks.md "Embedded decode: fast path"); 0: the whole cache every step
#: (``RolloutEngineSettings.kv_bucket``, whose default this is; "triton_rope" attention stops at each
#: row's slot: always 0)
KV_BUCKET = 64
#: decode attention (:mod:`ferrule.rollout._decode_attn`): "fp32" (default: ``q @ k^T`` kept in
#: fp32, as SDPA's kernels keep it), "eager" (transformers' eager formula: ``q @ k^T`` rounded to the
#: model dtype, then the fp32 softmax), "triton" (the fp32 formula as one fused kernel on CUDA) or
#: "triton_rope" (that kernel also doing RoPE and the cache write).
#: "fp32" and "eager": same speed on an H200; on SmolLM2 in bf16 (CPU, teacher-forced) fp32 scores put
#: the logprobs 8% closer to an fp32 forward (docs/benchmarks.md). ``RolloutEngineSettings.attention``
ATTN = "fp32"
ATTN_KINDS = KINDS
#: torch.compile recompile limit while the fast step compiles: one compile per (batch, cache)
#: bucket, stop-id buffer size and attended length, more than dynamo's default 8
RECOMPILE_LIMIT = 64
_PER_LAYER = 11  # tensors per layer in the flat weight list, see FusedLayout.weights
#: projection -> (index in a layer's weights, first row in the fused buffer as a function of the layout)
_PROJ_ROWS = {
    "q_proj": (1, lambda lay: 0), "k_proj": (1, lambda lay: lay.hq * lay.head_dim),
    "v_proj": (1, lambda lay: (lay.hq + lay.hkv) * lay.head_dim), "o_proj": (5, lambda lay: 0),
    "gate_proj": (8, lambda lay: 0), "up_proj": (8, lambda lay: lay.inter), "down_proj": (9, lambda lay: 0),
}


@dataclasses.dataclass
class FusedLayout:
    """Shapes of the decode forward and the flat weight list ``weights`` (per layer: ln1, qkv_w,
    qkv_b, q_norm, k_norm, o_w, o_b, ln2, gu_w, down_w, unused; then embed, final norm, lm_head;
    None where a model has no such tensor)."""

    weights: list[torch.Tensor | None]
    layer_idx: list[int]
    hq: int
    hkv: int
    head_dim: int
    inter: int
    eps: tuple[float, ...]  # per layer: ln1, q/k norm, ln2 (flattened), then final norm
    scaling: float
    rotary: Any

    def key(self) -> tuple[int, ...]:
        """Device addresses of every weight: a captured graph is valid while this is unchanged."""
        return tuple(0 if w is None else w.data_ptr() for w in self.weights)

    def block(self, layer: int, proj: str) -> tuple[int, int]:
        """Where projection ``proj`` (``q_proj`` ... ``down_proj``) of decoder layer ``layer`` lives:
        ``(index in weights, first row in that fused buffer)``; KeyError for another name."""
        w_index, first = _PROJ_ROWS[proj]
        return layer * _PER_LAYER + w_index, first(self)


def _adjacent(parts: list[torch.Tensor]) -> bool:
    """True if ``parts`` are consecutive row blocks of one contiguous buffer."""
    if not all(p.is_contiguous() for p in parts):
        return False
    s = parts[0].untyped_storage().data_ptr()
    off = parts[0].storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != s or p.storage_offset() != off:
            return False
        off += p.numel()
    return True


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One ``[sum rows, ...]`` buffer whose row blocks ``params`` now are (``param.data`` re-pointed)."""
    tensors = [p.data for p in params]
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows,) + tuple(tensors[0].shape[1:])
    if _adjacent(tensors):
        first = tensors[0]
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), shape, torch.empty(shape, device="meta").stride())
    fused = torch.cat(tensors)
    off = 0
    for p, t in zip(params, tensors):
        p.data = fused[off:off + t.shape[0]]
        off += t.shape[0]
    return fused


def supported(model: torch.nn.Module) -> bool:
    """True if :func:`fuse_weights` / :func:`decode_logits` cover this model (else the plain path)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in MODEL_TYPES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or not hasattr(model, "lm_head"):
        return False
    for layer in layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None or getattr(a, "sliding_window", None) is not None:
            return False
        if not all(isinstance(getattr(a, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if not all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        if m.gate_proj.bias is not None or m.up_proj.bias is not None or m.down_proj.bias is not None:
            return False
        if (a.q_proj.bias is None) != (a.k_proj.bias is None) or (a.q_proj.bias is None) != (a.v_proj.bias is None):
            return False
    return True


def fuse_weights(model: torch.nn.Module) -> FusedLayout:
    """Fuse q/k/v and gate/up of every layer (idempotent: already-fused layers are aliased, not
    copied) and return the layout :func:`decode_logits` takes. ``supported(model)`` must hold.

    Parameter values are unchanged; only where they live. Callers that cached views of the
    parameters (the engine's checkpoint-name table) must rebuild them when this moved anything.
    """
    cfg = model.config
    inner = model.model
    weights: list[torch.Tensor | None] = []
    eps: list[float] = []
    idx: list[int] = []
    with torch.no_grad():
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            qkv_b = None if a.q_proj.bias is None else _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu_w = _fuse([m.gate_proj.weight, m.up_proj.weight])
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            weights += [layer.input_layernorm.weight, qkv_w, qkv_b, None if qn is None else qn.weight,
                        None if kn is None else kn.weight, a.o_proj.weight, a.o_proj.bias,
                        layer.post_attention_layernorm.weight, gu_w, m.down_proj.weight, None]
            eps += [layer.input_layernorm.variance_epsilon, qn.variance_epsilon if qn is not None else 0.0,
                    layer.post_attention_layernorm.variance_epsilon]
            idx.append(a.layer_idx)
    weights += [inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight]
    eps.append(inner.norm.variance_epsilon)
    a0 = inner.layers[0].self_attn
    head_dim = a0.head_dim
    return FusedLayout(weights=[None if w is None else w.data for w in weights], layer_idx=idx,
                       hq=a0.q_proj.out_features // head_dim, hkv=a0.k_proj.out_features // head_dim,
                       head_dim=head_dim, inter=inner.layers[0].mlp.gate_proj.out_features, eps=tuple(eps),
                       scaling=float(a0.scaling), rotary=inner.rotary_emb)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Qwen2/Qwen3/Llama RMSNorm: fp32 statistics, cast back, then the weight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # transformers' rotate_half
    return x * cos + rot * sin


def _lora_delta(h: torch.Tensor, ab: tuple | None, mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row adapter term of one projection (:mod:`ferrule.rollout._multi_lora`): ``((h @ A^T) * mask) @ B^T``."""
    return None if ab is None else F.linear(F.linear(h, ab[0]) * mask, ab[1])


def _lora_cat(h: torch.Tensor, abs_: list, mask: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor | None:
    """The adapter terms of fused projections side by side (zeros where a projection has no adapter)."""
    parts = [_lora_delta(h, ab, mask) for ab in abs_]
    if all(p is None for p in parts):
        return None
    return torch.cat([h.new_zeros(h.shape[0], w) if p is None else p for p, w in zip(parts, widths)], dim=-1)


def _layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor,
           allowed: torch.Tensor, hidden: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lw: list,
           eps: tuple[float, float, float], shape: tuple, fac: tuple | None, mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer of :func:`decode_logits`: ``x [batch, hidden]`` -> the next layer's input; writes the
    layer's new key/value into ``kc``/``vc`` at ``slot``; attends over the first ``hidden.shape[-1]`` key
    slots (no int argument: a size passed into a nested region as a number failed dynamo's region reuse when
    it was specialised, ``KeyError`` in ``stamp_out_subgraph``, torch 2.13). ``lw``: the layer's first ten flat weights
    (:class:`FusedLayout`), ``eps``: its ln1, q/k norm and ln2 epsilons, ``shape``: ``(hq, hkv, head_dim,
    inter, scaling, attn, rope_in_attn)``. With ``rollout_engine.compile_regions`` it runs as
    :func:`torch.compiler.nested_compile_region` (:data:`_LAYER_REGION`): traced and compiled once for every layer."""
    ln1, qkv_w, qkv_b, qn, kn, o_w, o_b, ln2, gu_w, down_w = lw
    e1, eqk, e2 = eps
    hq, hkv, d, inter, scaling, attn, rope_in_attn = shape
    b, L = x.shape[0], hidden.shape[-1]
    h = _rms(x, ln1, e1)
    qkv = F.linear(h, qkv_w, qkv_b)
    if fac is not None and (extra := _lora_cat(h, fac[0:3], mask, (hq * d, hkv * d, hkv * d))) is not None:
        qkv = qkv + extra
    q = qkv[:, :hq * d].view(b, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
    if qn is not None:
        q, k = _rms(q, qn, eqk), _rms(k, kn, eqk)
    if rope_in_attn:
        o = attend_rope(q, k, v, cos[:, 0], sin[:, 0], slot, kc, vc, allowed, L, scaling)
    else:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        kc[rows, :, slot] = k
        vc[rows, :, slot] = v
        o = attend(q, kc, vc, allowed, hidden, L, scaling, attn)
    out = F.linear(o, o_w, o_b)
    if fac is not None and fac[3] is not None:
        out = out + _lora_delta(o, fac[3], mask)
    x = x + out
    h = _rms(x, ln2, e2)
    gu = F.linear(h, gu_w)
    if fac is not None and (extra := _lora_cat(h, fac[4:6], mask, (inter, inter))) is not None:
        gu = gu + extra
    g, u = gu.split(inter, dim=-1)
    act = F.silu(g) * u
    out = F.linear(act, down_w)
    if fac is not None and fac[6] is not None:
        out = out + _lora_delta(act, fac[6], mask)
    return x + out


#: :func:`_layer` as a nested compile region (made at import: dynamo does not trace nested_compile_region itself)
_LAYER_REGION = torch.compiler.nested_compile_region(_layer)


def decode_logits(layout: FusedLayout, weights: list, keys: list[torch.Tensor], values: list[torch.Tensor],
                  ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, allowed: torch.Tensor,
                  kv_len: int | torch.Tensor | None = None, attn: str = "eager",
                  lora: tuple | None = None, regions: bool = False) -> torch.Tensor:
    """One decode step: ``ids``/``pos``/``slot`` ``[batch]`` int64 (token, position id, key slot
    written), ``allowed [batch, max_len]`` bool (key slots visible, ``slot`` included) ->
    ``[batch, vocab]`` logits in the model dtype. Writes each layer's new key/value into
    ``keys[i]``/``values[i]`` (``[batch, kv_heads, max_len, head_dim]``) at ``slot``.

    The formula is transformers' for these models with ``attn_implementation="eager"``
    (``eager_attention_forward``: scores in the model dtype, fp32 softmax); ``weights`` is
    ``layout.weights`` (passed separately so a compiled caller sees them as inputs). With
    ``kv_len`` (an int, or a 1-D tensor whose length is the count), attention reads only key slots
    ``[0, kv_len)`` (every visible slot must lie there).
    ``attn`` (:data:`ATTN_KINDS`): "eager" is that formula; "fp32" keeps the scores in fp32 (equal
    to "eager" for fp32 models, closer to an fp32 forward for bf16 ones). The new key/value are
    written with ``index_put_`` (in place under torch.compile; ``scatter_`` made inductor copy the
    whole cache per layer and step). ``lora``: ``(mask, per-layer factors)`` of held adapters applied
    per row (:meth:`ferrule.rollout._multi_lora.MultiLoraPool.fast_factors`), or None. ``regions``: each
    layer as one nested compile region (:data:`_LAYER_REGION`; ``rollout_engine.compile_regions``): under
    torch.compile the layer is traced and compiled once and reused for every layer, the same values.
    """
    b = ids.shape[0]
    hq, hkv, d = layout.hq, layout.hkv, layout.head_dim
    n = len(layout.layer_idx)
    embed, norm_w, lm_head = weights[n * _PER_LAYER:]
    x = F.embedding(ids, embed)
    cos, sin = layout.rotary(x[:, None], pos[:, None])
    cos, sin = cos[:, 0, None, :], sin[:, 0, None, :]  # [b, 1, d]
    # the attended length: the whole cache, an int, or the length of a 1-D tensor (decode_dynamic "marked":
    # a tensor dimension is symbolic under torch.compile where an int argument is specialised)
    L = keys[0].shape[2] if kv_len is None else kv_len.shape[0] if isinstance(kv_len, torch.Tensor) else kv_len
    if attn not in ATTN_KINDS:
        raise ValueError(f"decode attention {attn!r} is not one of {ATTN_KINDS} (rollout_engine.attention)")
    hidden = ~allowed[:, None, None, :L]
    rows = torch.arange(b, device=ids.device)
    rope_in_attn = fuses_rope(attn, ids.device)
    # with the Triton kernels (custom ops writing the cache) the layers stay unrolled: an input-mutating custom op
    # inside a nested compile region failed on torch 2.12 (pytorch/pytorch#186807)
    layer = _LAYER_REGION if regions and not uses_triton(attn, ids.device) else _layer
    shape = (hq, hkv, d, layout.inter, layout.scaling, attn, rope_in_attn)
    mask = None if lora is None else lora[0][:b]
    for i in range(n):
        fac = None if lora is None else lora[1][i]  # [q, k, v, o, gate, up, down]: (A, B) or None
        x = layer(x, cos, sin, rows, slot, allowed, hidden, keys[i], values[i],
                  weights[i * _PER_LAYER:(i + 1) * _PER_LAYER - 1], layout.eps[3 * i:3 * i + 3], shape, fac, mask)
    return F.linear(_rms(x, norm_w, layout.eps[-1]), lm_head)


def _step(layout: FusedLayout, weights: list, keys: list, values: list, ids: torch.Tensor, pos: torch.Tensor,
          slot: torch.Tensor, allowed: torch.Tensor, prompt_len: torch.Tensor, p: torch.Tensor, col: torch.Tensor,
          temperature: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor, stop_t: torch.Tensor,
          tokens_out: torch.Tensor, lp_out: torch.Tensor, raw_out: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor,
          stopped: torch.Tensor, kv_len: int | torch.Tensor | None = None, attn: str = "eager", chunks: int = 0,
          lora: tuple | None = None, regions: bool = False) -> None:
    """Forward on the staged input, sample token ``col``, record it, stage the next input, ``col += 1``
    (greedy or sampled by the ``greedy`` flag tensor: one graph for both, :func:`~ferrule.rollout._fast_sampling.sample_record`)."""
    logits = decode_logits(layout, weights, keys, values, ids, pos, slot, allowed, kv_len, attn, lora, regions)
    _sample_record(logits, prompt_len, p, col, temperature, noise, greedy, stop_t, tokens_out, lp_out, raw_out,
                   lengths, finished, stopped, ids, pos, slot, allowed, chunks)


_COMPILED: dict[str, Any] = {}


@contextlib.contextmanager
def _recompile_limit(dynamic: str = "auto") -> Any:
    """Context raising dynamo's recompile limit to :data:`RECOMPILE_LIMIT` while the fast step
    compiles (past the limit dynamo would silently run the step eagerly inside the graph); with
    ``decode_dynamic`` "marked" also without duck sizing (``use_duck_shape``), so that two marked
    dimensions equal at the first compile (a batch rung of 64 and an attended length of 64) get
    their own symbols instead of one, which a later call with unequal values would fail; and without
    automatic dynamic shapes (``automatic_dynamic_shapes``): the marked dimensions are the only symbolic
    ones, so a second model of other shapes in the process (another head dim, hidden size or RMSNorm
    epsilon) gets a compile of its own instead of one where dynamo made the weights' sizes and the layer's
    floats symbolic. With ``compile_regions`` that generalised compile failed (torch 2.13 on CPU:
    KeyError in dynamo; torch 2.11 + inductor on an H100: a symbolic float as a region operand)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    with cfg.patch(**{name: max(getattr(cfg, name), RECOMPILE_LIMIT)}):
        if dynamic != "marked":
            yield
            return
        import torch.fx.experimental._config as fx_cfg

        with fx_cfg.patch(use_duck_shape=False), cfg.patch(automatic_dynamic_shapes=False):
            yield


def compiles() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far, every function counted
    (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; a compile served from the on-disk
    caches counts too): ``EmbeddedEngine.info()["compiles"]`` adds up its calls' differences."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


#: torch.compile backend of the fast step (tests on CPU set "eager": dynamo's graphs and guards, no inductor)
BACKEND = "inductor"


_RAW = {"step": _step, "step_kv": _step, "first": _sample_record, "logits": decode_logits}


def step_modes(settings: Any) -> tuple[bool, bool]:
    """``(compile, regions)`` of a fast step (static or continuous) for these ``RolloutEngineSettings``:
    ``compile_step``, and ``compile_regions`` where it applies: a compiled step with ``decode_dynamic``
    "marked", every batch and length dimension symbolic before the compile (a size specialised while dynamo
    traced the first layer's region broke its reuse for the next layers: torch 2.13, KeyError in
    stamp_out_subgraph, seen on CPU with the caches left unmarked)."""
    compile_ = bool(settings.compile_step)
    return compile_, compile_ and bool(settings.compile_regions) and settings.decode_dynamic == "marked"


def _compiled(name: str, dynamic: str = "auto", compile: bool = True) -> Any:
    """The compiled fast-step function ``name`` ("step", "step_kv", "first"; "logits": :func:`decode_logits`
    alone, for :class:`FastContinuous`) for
    ``RolloutEngineSettings.decode_dynamic`` ``dynamic``, one per process; with ``compile`` false
    (``rollout_engine.compile_step``) the function itself, uncompiled (CUDA graphs still capture it).

    "marked": a compile with the batch (dim 0) and length dimensions of the step's inputs
    symbolic from the first call (:func:`_mark_dynamic`; the weights static), the attended length
    passed as a tensor's length and a stop-id buffer of one size, so one compile serves every batch
    rung, cache length and attended length. "all": every dimension and int argument symbolic
    (``dynamic=True``, the weights' shapes too). "auto": torch's automatic dynamic shapes
    (``dynamic=None``): a static compile first, then one recompile per dimension that changes (a
    new rung cost 61.6 s of compiling on an H100, docs/benchmarks.md, issue 40).
    """
    if not compile:
        return _RAW[name]
    key = (name, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_RAW[name], dynamic=True if dynamic == "all" else None, backend=BACKEND)
    return _COMPILED[key]


def _mark_dynamic(tensors0: list, tensors01: list, kv: list, lora: tuple | None = None) -> None:
    """``decode_dynamic: marked``: the batch (dim 0) and length dims of the step's inputs symbolic from the first
    compile (``torch._dynamo.maybe_mark_dynamic``), the weights left static; ``lora``'s row mask (rows x
    held ranks) and factors (their held-rank dimension) too, so a new rung or adapter count does not recompile."""
    from torch._dynamo import maybe_mark_dynamic

    for t in tensors0:
        if t is not None:
            maybe_mark_dynamic(t, 0)
    for t in tensors01:
        if t is not None:
            maybe_mark_dynamic(t, 0)
            maybe_mark_dynamic(t, 1)
    for t in kv:
        maybe_mark_dynamic(t, 0)
        maybe_mark_dynamic(t, 2)
    if lora is not None:
        maybe_mark_dynamic(lora[0], 0)
        maybe_mark_dynamic(lora[0], 1)
        for layer in lora[1] or ():
            for ab in layer:
                if ab is not None:
                    maybe_mark_dynamic(ab[0], 0)  # A [held ranks, in]
                    maybe_mark_dynamic(ab[1], 1)  # B [out, held ranks]


class _Replay:
    """Stands in for a CUDA graph off CUDA (CPU tests of the compiled step): each replay calls the step."""

    def __init__(self, fn: Any, args: tuple, dynamic: str):
        self.fn, self.args, self.dynamic = fn, args, dynamic

    def replay(self) -> Any:
        with _recompile_limit(self.dynamic):
            return self.fn(*self.args)


def attended_length(need: int, bucket: int, max_len: int, dynamic: str, attn: str,
                    device: torch.device) -> int | None:
    """The ``kv_len`` a fast step compiles and captures for a replay whose visible key slots all lie in
    ``[0, need)``: ``need`` rounded up to ``bucket`` (``rollout_engine.kv_bucket``; 0, or attention that fuses
    RoPE: the whole cache), capped at ``max_len``; None for the whole cache where the compiled function has
    one for it (decode_dynamic "auto"). With decode_dynamic "marked" never ``max_len`` itself: slicing the
    cache or mask to it is a contiguous view, to less a strided one, and dynamo guards on which
    (``allowed.size(1) != kv_len``) and recompiled at the last bucket; every caller's visible slots end
    below ``max_len - 1``, or include a row's prompt below it (continuous batching's finished rows)."""
    if fuses_rope(attn, device):
        bucket = 0  # its kernel attends up to each row's slot: one graph for the whole cache
    want = None if bucket <= 0 else min(max_len, -(-need // bucket) * bucket)
    # with decode_dynamic "all" the attended length is symbolic: one compiled function for every
    # length, the whole cache included; else "step" (whole cache) and "step_kv" compile apart
    whole = max_len if dynamic in ("all", "marked") else None
    use = whole if want in (None, max_len) else want
    if dynamic == "marked" and not uses_triton(attn, device):
        use = min(use, max_len - 1)
    return use


def _kv_len_arg(spans: dict[int, torch.Tensor], kv_len: int | None, dynamic: str, attn: str,
                device: torch.device) -> int | torch.Tensor | None:
    """The compiled step's ``kv_len`` argument: with decode_dynamic "marked" (and attention that slices the
    cache) a ``[kv_len]`` uint8 tensor whose length is the attended length, a symbolic dimension where an int
    would be specialised (its values are never read; one per length, kept in ``spans``); else ``kv_len``."""
    if dynamic != "marked" or not isinstance(kv_len, int) or uses_triton(attn, device):
        return kv_len
    if kv_len not in spans:
        spans[kv_len] = torch.empty(kv_len, dtype=torch.uint8, device=device)
    return spans[kv_len]


def _capture(fn: Any, args: tuple, pool: Any, dynamic: str, state: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Compile and warm up ``fn(*args)`` twice on a side stream (the compile, cuBLAS workspaces), then capture one
    call as a CUDA graph in ``pool``; returns ``(graph, the captured call's output)``. Counts the capture in the
    engine's ``state.counters["graph_captures"]`` (:meth:`EmbeddedEngine.info`) where the state has counters.
    The three calls run the step three times: a caller whose step mutates its inputs restores them after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with _recompile_limit(dynamic):
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(*args)
    if getattr(state, "counters", None) is not None:
        state.counters["graph_captures"] += 1
    return graph, out


class _LogitsGraph:
    """A captured :func:`decode_logits` replay and its output buffer (``[batch, vocab]``, model dtype)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor):
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class FastContinuous:
    """The fast decode forward for continuous batching (:func:`ferrule.rollout._continuous.run_continuous`,
    ``rollout_engine.continuous_fast``): one :func:`decode_logits` step per replay, compiled once
    (:func:`_compiled` "logits") and captured as one CUDA graph per attended length on CUDA (a
    :class:`_Replay` elsewhere), on the inputs :meth:`DecodeState.set_step
    <ferrule.rollout._static_cache.DecodeState.set_step>` stages (``ids``/``pos [batch, 1]``, ``slots
    [batch]`` one key slot per row, ``allowed [batch, max_len]``) and the KV cache the state's prefills
    fill (:meth:`~ferrule.rollout._static_cache.DecodeState.prefill_rows` refills stay valid: same buffers).
    The sampler and the loop's bookkeeping stay outside. Attached to the state (``state.fast_continuous``),
    so it goes wherever the engine drops its decode states.

    Args:
        state: the bucket's ``DecodeState``, after its first prefill (the cache exists). Each call then
            :meth:`bind` s its :class:`FusedLayout` (``EmbeddedEngine._fast_layout``), the engine's
            ``RolloutEngineSettings`` (``kv_bucket``, ``attention``, ``decode_dynamic``, ``compile_regions``)
            and CUDA graph pool (None off CUDA).
    """

    def __init__(self, state: Any):
        self.state = state
        self.ids, self.pos = state.ids.view(-1), state.pos.view(-1)  # [batch] views of set_step's buffers
        self.graphs: dict[tuple, Any] = {}
        self.spans: dict[int, torch.Tensor] = {}
        self.layout_key: tuple | None = None
        self.layout: FusedLayout | None = None
        self.settings: Any = None
        self.pool: Any = None

    def bind(self, layout: FusedLayout, settings: Any, pool: Any) -> "FastContinuous":
        """Set this call's layout, settings and graph pool; returns self."""
        if self.layout_key != layout.key():
            self.graphs.clear()
            self.layout_key = layout.key()
        self.layout, self.settings, self.pool = layout, settings, pool
        if uses_triton(settings.attention, self.ids.device):
            import ferrule.rollout._decode_attn_triton  # noqa: F401  (triton imported before the compile)
        return self

    def step(self, need: int) -> torch.Tensor:
        """Run the staged step; ``need``: every row's visible key slots lie in ``[0, need)``. Returns
        ``[batch, vocab]`` logits in the model dtype (under a CUDA graph its static output: read it, or
        clone it, before the next step)."""
        st = self.settings
        kv_len = attended_length(need, int(st.kv_bucket), self.state.max_len, st.decode_dynamic, st.attention,
                                 self.ids.device)
        return self._graph(kv_len).replay()

    def _graph(self, kv_len: int | None) -> Any:
        st, layout = self.settings, self.layout
        dynamic, attn = st.decode_dynamic, st.attention
        compile_, regions = step_modes(st)
        key = (attn, kv_len, regions, dynamic, compile_)
        if key in self.graphs:
            return self.graphs[key]
        c = self.state.cache
        keys, values = [c.keys[i] for i in layout.layer_idx], [c.values[i] for i in layout.layer_idx]
        span = _kv_len_arg(self.spans, kv_len, dynamic, attn, self.ids.device)
        args = (layout, layout.weights, keys, values, self.ids, self.pos, self.state.slots, self.state.allowed,
                span, attn, None, regions)
        fn = _compiled("logits", dynamic, compile_)
        if dynamic == "marked":
            _mark_dynamic([self.ids, self.pos, self.state.slots, span if isinstance(span, torch.Tensor) else None],
                          [self.state.allowed], keys + values)
        # the step writes only the staged slots' keys and values, which the real replay writes again
        if not self.ids.is_cuda:  # no graphs off CUDA (CPU tests): compiled at the first replay, one call each
            self.graphs[key] = _Replay(fn, args, dynamic)
            return self.graphs[key]
        self.graphs[key] = _LogitsGraph(*_capture(fn, args, self.pool, dynamic, self.state))
        return self.graphs[key]


class FastStatic:
    """Buffers and captured graphs of one ``(batch, max_len)`` bucket for the static decode loop.

    Attached to the bucket's :class:`~ferrule.rollout._static_cache.DecodeState` (which owns the KV
    cache, filled by its HF prefill), so everything the engine drops with its decode states
    (sleep, LoRA changes, eviction) goes with it.
    """

    def __init__(self, state: Any, vocab: int, device: torch.device):
        b, L = state.batch, state.max_len
        self.state = state
        z = dict(device=device)
        self.ids = torch.zeros(b, dtype=torch.long, **z)
        self.pos = torch.zeros(b, dtype=torch.long, **z)
        self.slot = torch.zeros(b, dtype=torch.long, **z)
        self.prompt_len = torch.zeros(b, dtype=torch.long, **z)
        self.p = torch.zeros((), dtype=torch.long, **z)
        self.col = torch.zeros((), dtype=torch.long, **z)
        self.temperature = torch.ones((), dtype=torch.float32, **z)  # 1 for greedy calls
        self.greedy = torch.zeros((), dtype=torch.bool, **z)  # the sampling kind as data: one graph for both
        self.noise = torch.ones((b, vocab), dtype=torch.float32, **z)  # drawn per step by sampled calls only
        self.stop_bufs: dict[int, torch.Tensor] = {}  # stop-id buffers by padded size
        self.spans: dict[int, torch.Tensor] = {}  # "marked": [kv_len] tensors whose length is the attended length
        self.tokens_out = torch.zeros((b, L), dtype=torch.long, **z)
        self.lp_out = torch.zeros((b, L), dtype=torch.float32, **z)
        self.raw_out = torch.zeros((b, L), dtype=torch.float32, **z)
        self.lengths = torch.zeros(b, dtype=torch.long, **z)
        self.finished = torch.zeros(b, dtype=torch.bool, **z)
        self.stopped = torch.zeros(b, dtype=torch.bool, **z)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.chunks = 0  # sampler vocabulary chunks (rollout_engine.sampler_chunks), set per run
        self.dynamic = "auto"  # rollout_engine.decode_dynamic, set per run
        self.lora: tuple | None = None  # held adapters' (mask, factors) per row (ferrule.rollout._multi_lora), per run
        self.regions = False  # rollout_engine.compile_regions, set per run
        self.compile = True  # rollout_engine.compile_step, set per run
        self.layout_key: tuple | None = None

    def _stop_buf(self, n: int) -> torch.Tensor:
        # "marked": one size (MAX_STOP_IDS), so the stop list's length never recompiles the step
        size = MAX_STOP_IDS if self.dynamic == "marked" else max(16, 1 << max(0, n - 1).bit_length())
        if size not in self.stop_bufs:
            self.stop_bufs[size] = torch.full((size,), -1, dtype=torch.long, device=self.ids.device)
        return self.stop_bufs[size]

    def _args(self, layout: FusedLayout, kv_len: int | None = None, attn: str = "eager") -> tuple:
        c = self.state.cache
        keys = [c.keys[i] for i in layout.layer_idx]
        values = [c.values[i] for i in layout.layer_idx]
        kv_len = _kv_len_arg(self.spans, kv_len, self.dynamic, attn, self.ids.device)
        return (layout, layout.weights, keys, values, self.ids, self.pos, self.slot, self.state.allowed,
                self.prompt_len, self.p, self.col, self.temperature, self.noise, self.greedy, self.stop_t,
                self.tokens_out, self.lp_out, self.raw_out, self.lengths, self.finished,
                self.stopped, kv_len, attn, self.chunks, self.lora, self.regions)

    def _graph(self, layout: FusedLayout, pool: Any, kv_len: int | None = None,
               attn: str = "eager") -> torch.cuda.CUDAGraph:
        if self.layout_key != layout.key():
            self.graphs.clear()
            self.layout_key = layout.key()
        # no sampling kind in the key: greedy / sampled / raw logprobs are runtime data of one graph
        key = (self.stop_t.numel(), attn, self.chunks, kv_len, self.lora is not None, self.regions, self.compile)
        if key in self.graphs:
            return self.graphs[key]
        args = self._args(layout, kv_len, attn)
        small = [t for t in args[4:] if isinstance(t, torch.Tensor) and t is not self.noise]  # what a step mutates
        saved = [t.clone() for t in small]
        fn = _compiled("step" if kv_len is None else "step_kv", self.dynamic, self.compile)
        if self.dynamic == "marked":
            span = args[21] if isinstance(args[21], torch.Tensor) else None
            _mark_dynamic([self.ids, self.pos, self.slot, self.prompt_len, self.lengths, self.finished, self.stopped,
                           self.noise, span], [self.state.allowed, self.tokens_out, self.lp_out, self.raw_out],
                          list(args[2]) + list(args[3]), self.lora)
        if not self.ids.is_cuda:  # no graphs off CUDA (CPU tests): compile now, then one call per replay
            with _recompile_limit(self.dynamic):
                fn(*args)
            for t, s in zip(small, saved):
                t.copy_(s)
            self.graphs[key] = _Replay(fn, args, self.dynamic)
            return self.graphs[key]
        graph, _ = _capture(fn, args, pool, self.dynamic, self.state)
        for t, s in zip(small, saved):  # the warm-up and capture ran the step three times: undo
            t.copy_(s)
        self.graphs[key] = graph
        return graph

    def run(self, layout: FusedLayout, logits: torch.Tensor, real: int, p: int, prompt_len: torch.Tensor,
            params: Any, stop_ids: list[int], gen: torch.Generator | None, pool: Any, settings: Any = None,
            lora: tuple | None = None):
        """The static decode loop after the prefill (``logits [batch, vocab]`` of the last prompt slot);
        returns what ``EmbeddedEngine._run`` returns. ``settings``: the engine's
        :class:`~ferrule.engine_settings.RolloutEngineSettings` (``kv_bucket``, ``attention``,
        ``sampler_chunks``; None: their defaults). ``lora``: held adapters applied per row
        (:meth:`ferrule.rollout._multi_lora.MultiLoraPool.fast_factors`), or None."""
        self.lora = lora
        if settings is None:
            from ferrule.engine_settings import RolloutEngineSettings

            settings = RolloutEngineSettings()
        greedy, want_raw = bool(params.greedy), bool(params.return_raw_logprobs)
        n_new = params.max_new_tokens
        self.prompt_len.copy_(prompt_len)
        self.p.fill_(p)
        self.col.zero_()
        self.temperature.fill_(1.0 if greedy else float(params.temperature))
        self.greedy.fill_(greedy)
        self.dynamic = settings.decode_dynamic
        self.compile, self.regions = step_modes(settings)
        self.stop_t = self._stop_buf(len(stop_ids))
        self.stop_t.fill_(-1)
        if stop_ids:
            self.stop_t[:len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.long)
        self.lengths.zero_()
        self.stopped.zero_()
        self.finished.zero_()
        self.finished[real:] = True
        noise = self.noise
        if not greedy:  # greedy calls draw nothing: the step does not read the noise where greedy
            noise.exponential_(1, generator=gen)
        want_chunks = int(settings.sampler_chunks) if logits.is_cuda else 0
        self.chunks = vocab_chunks(logits.shape[-1], want_chunks) if want_chunks > 1 else 0
        if self.dynamic == "marked":
            _mark_dynamic([logits, self.ids, self.pos, self.slot, self.prompt_len, self.lengths, self.finished,
                           self.stopped, noise], [self.state.allowed, self.tokens_out, self.lp_out, self.raw_out], [])
        with _recompile_limit(self.dynamic):
            first = _compiled("first", self.dynamic, self.compile)
            first(logits, self.prompt_len, self.p, self.col, self.temperature, noise, self.greedy, self.stop_t,
                  self.tokens_out, self.lp_out, self.raw_out, self.lengths, self.finished, self.stopped, self.ids,
                  self.pos, self.slot, self.state.allowed, self.chunks)
        # graphs are captured after the first sample staged step 1's input: their warm-up runs write
        # the cache only at slots the real steps write again before reading
        bucket, attn = int(settings.kv_bucket), settings.attention
        if uses_triton(attn, self.ids.device):
            import ferrule.rollout._decode_attn_triton  # noqa: F401  (triton imported before the compile)
        max_len = self.state.max_len
        kv_len, graph = None, None
        for t in range(1, n_new):
            if t % 8 == 0 and bool(self.finished.all()):
                break
            # this replay writes slot p + t - 1 and attends over slots [0, p + t) (p + t <= max_len - 1)
            use = attended_length(p + t, bucket, max_len, self.dynamic, attn, self.ids.device)
            if graph is None or use != kv_len:
                kv_len = use
                graph = self._graph(layout, pool, use, attn)
            if not greedy:
                noise.exponential_(1, generator=gen)
            graph.replay()
        lengths_h, stopped_h = self.lengths.tolist(), self.stopped.tolist()
        tok_h, lp_h = self.tokens_out[:real, :n_new].tolist(), self.lp_out[:real, :n_new].tolist()
        raw_h = self.raw_out[:real, :n_new].tolist() if want_raw else None
        return [(tok_h[r][:lengths_h[r]], lp_h[r][:lengths_h[r]], None if raw_h is None else raw_h[r][:lengths_h[r]],
                 "stop" if stopped_h[r] else "length") for r in range(real)]


def base_ptrs(model: torch.nn.Module) -> tuple[int, ...]:
    """Addresses of the model's own parameters (a served adapter's factors left out)."""
    return tuple(p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n)


def engine_layout(engine: Any, params: Any, stop_ids: list[int], matcher: Any, media_inputs: Any) -> FusedLayout | None:
    """The layout an :class:`~ferrule.rollout.embedded.EmbeddedEngine` call decodes with on the
    fast path, or None for the plain path (fast decode off, stop strings, media, truncated
    sampling, too many stop ids, placeholder tokens to ban, or an adapter that cannot be merged).

    Re-fuses when a base parameter moved since the last call (e.g. a wake), except under a served
    adapter, whose PEFT wrappers hide the checkpoint names the engine would have to rebuild (then
    the plain path). With an adapter, returns the layout of its
    :class:`~ferrule.rollout._lora_merge.MergedLora` (``engine._merged_lora``), merged again only
    when the weights or the adapter changed since the last merge (every call with
    ``engine.settings.lora_merged`` false).
    """
    if not (engine.fast_decode and matcher is None and not media_inputs and len(stop_ids) <= MAX_STOP_IDS
            and fused_applies(params) and not engine._towers()):
        return None
    merged = getattr(engine, "_merged_lora", None)
    if merged is not None and merged.adapter is not engine._lora:
        merged = engine._merged_lora = None  # another adapter, or none: free the merged buffers first
    ptrs = base_ptrs(engine.model) if merged is None else merged.base_ptrs()
    if engine._fused is None or engine._fused[0] != ptrs:
        if engine._lora is not None:
            return None
        engine._fuse_weights()
    layout = engine._fused[1]
    multi = engine._multi.fast(len(layout.layer_idx))  # adapters per row: the step adds their terms
    if multi is not None:
        return layout if multi[1] is not None else None
    if engine._lora is None:
        return layout
    if merged is None or merged.base_key != layout.key():
        engine._merged_lora = None
        try:
            merged = engine._merged_lora = MergedLora(layout, engine._lora, engine.model)
        except ValueError:
            return None
    merged.refresh(merged.version(engine._weights_serial) if engine.settings.lora_merged else None)
    return merged.layout
