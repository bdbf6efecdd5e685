"""A static KV cache and the fixed-shape decode step of the embedded engine (optionally a CUDA graph).

Layout: every attention layer gets ``keys``/``values`` buffers ``[batch, num_kv_heads,
max_len, head_dim]`` allocated on first use. The batch is left-padded: prompt tokens occupy
slots ``[P - len_i, P)`` of row ``i`` (``P`` = longest prompt), generated token ``t`` occupies
slot ``P + t``. Which slots each query may see is given by boolean 4-D masks that we build
(True = attend, the convention of ``torch.nn.functional.scaled_dot_product_attention``) and pass
to the HF model: a model with several layer types gets ``attention_mask={layer_type: mask}``
(decoders with ``config.layer_types`` take a dict as-is, ``Qwen3Model.forward``: "It may already
have been prepared by e.g. generate"); a model with one layer type gets the bare 4-D tensor,
because models without ``layer_types`` (``Qwen3MoeModel``, ``MixtralModel``) call
``create_causal_mask`` themselves, which returns any 4-D mask unchanged
(``masking_utils._preprocess_mask_arguments``) but fails on a dict. Either way no mask code of
transformers runs and the decode step has static shapes.

The cache implements the one method HF attention layers call, ``update(key_states,
value_states, layer_idx, ...)`` (transformers 5.17 passes ``cache_kwargs`` positionally, 5.24
passes ``kwargs=``; both are ignored), writing at slots given by ``write_index`` (a tensor we
set before each forward, so the write is graph-safe).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class StaticKVCache:
    """Fixed-size KV cache; see the module docstring for the layout.

    Args:
        max_len: slots per row (prompt + generated tokens), tokens.
    """

    is_compileable = True

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.write_index: torch.Tensor | None = None  # [q_len] int64 slots for the next prefill forward
        self.row_slots: torch.Tensor | None = None  # [batch] int64 slot per row for the next decode forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[batch, kv_heads, q_len, head_dim]`` states; return the full buffers.

        With ``row_slots`` set (decode, ``q_len == 1``) row ``b`` writes at slot ``row_slots[b]``
        (each row has its own slot: continuous batching refills rows at different times);
        otherwise every row writes at the slots ``write_index`` (prefill).
        """
        if layer_idx not in self.keys:
            b, h, _, d = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros((b, h, self.max_len, d))
            self.values[layer_idx] = value_states.new_zeros((b, h, self.max_len, value_states.shape[-1]))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.row_slots is not None:
            b, h, _, d = key_states.shape
            idx = self.row_slots.view(b, 1, 1, 1)
            k.scatter_(2, idx.expand(b, h, 1, d), key_states)
            v.scatter_(2, idx.expand(b, h, 1, value_states.shape[-1]), value_states)
        else:
            k.index_copy_(2, self.write_index, key_states)
            v.index_copy_(2, self.write_index, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only used by HF when position_ids is None
        raise RuntimeError("StaticKVCache: pass position_ids explicitly; the slot layout is left-padded.")

    def __len__(self) -> int:
        return len(self.keys)


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """``"cache"`` (transformers >= 5.24) or ``"past_key_values"`` (older 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_windows(config: Any) -> dict[str, int | None]:
    """Map each layer type of ``config`` to its sliding window (tokens) or None (full attention).

    A config without ``layer_types`` has one layer type for all layers: sliding when
    ``config.sliding_window`` is set, else full, which is how such models choose their mask
    (``Qwen3MoeModel.forward``: ``create_causal_mask if self.config.sliding_window is None else
    create_sliding_window_causal_mask``).

    Raises:
        NotImplementedError: a layer type other than full / sliding attention (e.g. linear
            attention), which needs a cache this engine does not have.
    """
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text_config, "sliding_window", None)
    types = tuple(getattr(text_config, "layer_types", None)
                  or ("full_attention" if window is None else "sliding_attention",))
    unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(
            f"The embedded rollout engine supports layer types {SUPPORTED_LAYER_TYPES}; this model has {unknown}. "
            "Use the sglang engine for this model.")
    return {t: (window if t == "sliding_attention" else None) for t in set(types)}


def prefill_masks(prompt_mask: torch.Tensor, p: int, windows: dict[str, int | None],
                  additive_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """4-D masks ``[batch, 1, p, max_len]`` for the prompt forward (query slots ``0..p-1``).

    Query slot ``i`` sees key slot ``j`` iff ``j <= i`` and ``j`` holds a prompt token (or
    ``j == i``, so padding queries never have an empty row and SDPA never yields NaN), and,
    for a sliding layer with window ``w``, ``i - j < w`` (HF ``sliding_window_overlay``).

    Args:
        prompt_mask: ``[batch, max_len]`` bool, True on prompt slots.
        p: prompt slots (longest prompt), tokens.
        windows: :func:`layer_windows` output.
        additive_dtype: None for boolean masks (SDPA); a float dtype for the additive masks of
            the eager attention path (0 = attend, dtype min = masked).
    """
    dev = prompt_mask.device
    i = torch.arange(p, device=dev)[:, None]
    j = torch.arange(prompt_mask.shape[1], device=dev)[None, :]
    base = (j <= i)[None] & (prompt_mask[:, None, :] | (j == i)[None])
    out = {}
    for layer_type, w in windows.items():
        m = base if w is None else base & ((i - j) < w)[None]
        out[layer_type] = _to_mask(m[:, None], additive_dtype)
    return out


def mask_argument(masks: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask=`` value for the HF model: the tensor itself when there is one layer type."""
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _to_mask(m: torch.Tensor, additive_dtype: torch.dtype | None) -> torch.Tensor:
    if additive_dtype is None:
        return m
    return torch.zeros(m.shape, dtype=additive_dtype, device=m.device).masked_fill(~m, torch.finfo(additive_dtype).min)


class DecodeState:
    """Buffers for decoding one ``(batch, max_len)`` bucket; optionally compiled and/or a CUDA graph.

    Per step the caller stages the sampled tokens, their position ids and each row's key slot
    (:meth:`set_step`) and calls :meth:`step`, which runs the model on ``[batch, 1]`` inputs
    (eagerly, or by replaying the CUDA graph) and returns ``[batch, vocab]`` logits in the
    model's dtype (a static buffer under a graph: read it before the next step).

    Every row has its own slot (``slots [batch]``): the static path passes the same slot for all
    rows; continuous batching (:mod:`ferrule.rollout._continuous`) refills single rows with new
    prompts through :meth:`prefill_rows` while the other rows keep decoding.

    Args:
        compile_model: run the decode forward through ``torch.compile`` (inductor fuses the
            norms, RoPE, SwiGLU and cache writes that the eager HF model runs as ~25 small
            kernels per layer); the graph is then captured from the compiled code. CUDA only:
            the CPU path stays the exact eager one.
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, windows: dict[str, int | None],
                 device: torch.device, additive_dtype: torch.dtype | None, use_cuda_graph: bool,
                 graph_pool: Any = None, compile_model: bool = False):
        self.model = model
        self.batch, self.max_len = batch, max_len
        self.windows = windows
        self.additive_dtype = additive_dtype
        self.cache = StaticKVCache(max_len)
        self.cache_kw = cache_kwarg_name(model)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slots = torch.zeros((batch,), dtype=torch.long, device=device)
        self._key_index = torch.arange(max_len, device=device)
        self.allowed = torch.zeros((batch, max_len), dtype=torch.bool, device=device)  # key slots visible
        mask_dtype = torch.bool if additive_dtype is None else additive_dtype
        self.masks = {t: torch.zeros((batch, 1, 1, max_len), dtype=mask_dtype, device=device) for t in windows}
        self.use_cuda_graph = use_cuda_graph
        self.graph_pool = graph_pool  # shared memory pool of all captured graphs (torch.cuda.graph_pool_handle)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_logits: torch.Tensor | None = None
        self._forward = _compiled_decode_forward() if compile_model else _decode_forward

    # -- prompt ---------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prompt_mask: torch.Tensor,
                share: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the prompt ``[batch, P]`` through the model; return last-slot logits ``[batch, vocab]`` fp32.

        ``share``: ``(unique [u], source [batch])`` int64, for rows that hold one prompt (the ``n``
        samples of a request): the model runs on rows ``unique`` only (with a temporary cache of
        this state's length, so each row's attention sees the same slots and mask as here), and row
        ``b`` gets the keys, values and logits of row ``unique[source[b]]`` (a gather per layer).
        """
        p = input_ids.shape[1]
        self.allowed.copy_(prompt_mask)
        if share is not None:
            return self._prefill_shared(input_ids, position_ids, prompt_mask, *share)
        masks = prefill_masks(prompt_mask, p, self.windows, self.additive_dtype)
        self.cache.write_index = torch.arange(p, device=input_ids.device)
        self.cache.row_slots = None
        out = self.model(input_ids=input_ids, attention_mask=mask_argument(masks), position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.cache.row_slots = self.slots
        return out.logits[:, -1, :].float()

    def _prefill_shared(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        unique: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        p = input_ids.shape[1]
        tmp = StaticKVCache(self.max_len)
        tmp.write_index = torch.arange(p, device=input_ids.device)
        masks = prefill_masks(prompt_mask[unique], p, self.windows, self.additive_dtype)
        out = self.model(input_ids=input_ids[unique], attention_mask=mask_argument(masks),
                         position_ids=position_ids[unique], use_cache=True, logits_to_keep=1, **{self.cache_kw: tmp})
        for layer, k in tmp.keys.items():
            v = tmp.values[layer]
            if layer not in self.cache.keys:  # the first prefill of this state allocates its buffers
                self.cache.keys[layer] = k.new_zeros((self.batch, *k.shape[1:]))
                self.cache.values[layer] = v.new_zeros((self.batch, *v.shape[1:]))
            self.cache.keys[layer][:, :, :p] = k[source, :, :p]
            self.cache.values[layer][:, :, :p] = v[source, :, :p]
        self.cache.write_index = tmp.write_index
        self.cache.row_slots = self.slots
        return out.logits[:, -1, :].float()[source]

    def prefill_rows(self, rows: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     prompt_mask: torch.Tensor, share: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Prefill new prompts into some rows of a live batch (continuous batching).

        The prompts ``[k, P]`` (left-padded among themselves) run through the model with a
        temporary cache of ``P`` slots, whose keys/values are then copied into slots ``[0, P)``
        of ``rows``; those rows see only their own prompt slots afterwards. Rows not in ``rows``
        are untouched. The decode buffers must exist (after one :meth:`prefill`).

        Args:
            rows: ``[k]`` int64 row indices. input_ids / position_ids: ``[k, P]`` int64.
            prompt_mask: ``[k, P]`` bool, True on prompt tokens.
            share: as :meth:`prefill`'s, over the ``k`` new rows: the model runs on ``unique`` of them.

        Returns:
            ``[k, vocab]`` float32 next-token logits of the new rows.
        """
        p = input_ids.shape[1]
        tmp = StaticKVCache(p)
        tmp.write_index = torch.arange(p, device=input_ids.device)
        unique, source = share if share is not None else (None, None)
        pick = (lambda t: t) if unique is None else (lambda t: t[unique])
        masks = prefill_masks(pick(prompt_mask), p, self.windows, self.additive_dtype)
        out = self.model(input_ids=pick(input_ids), attention_mask=mask_argument(masks),
                         position_ids=pick(position_ids), use_cache=True, logits_to_keep=1, **{self.cache_kw: tmp})
        spread = (lambda t: t) if source is None else (lambda t: t[source])
        for layer, k in tmp.keys.items():
            self.cache.keys[layer][rows, :, :p] = spread(k)
            self.cache.values[layer][rows, :, :p] = spread(tmp.values[layer])
        allowed = torch.zeros((len(rows), self.max_len), dtype=torch.bool, device=self.allowed.device)
        allowed[:, :p] = prompt_mask
        self.allowed[rows] = allowed
        return spread(out.logits[:, -1, :].float())

    # -- decode ---------------------------------------------------------------------------
    def set_step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: int | torch.Tensor) -> None:
        """Stage a decode step: ``tokens``/``positions`` ``[batch]`` int64 go to key slot ``slots``
        (one int for every row, or ``[batch]`` int64, one slot per row)."""
        self.ids.copy_(tokens[:, None])
        self.pos.copy_(positions[:, None])
        if isinstance(slots, int):
            self.slots.fill_(slots)
        else:
            self.slots.copy_(slots)
        self.allowed.scatter_(1, self.slots[:, None], True)
        for t, w in self.windows.items():
            vis = self.allowed
            if w is not None:  # HF sliding_window_overlay: query slot s sees key slot j iff s - j < w
                vis = vis & (self._key_index[None, :] > (self.slots[:, None] - w))
            m = self.masks[t]
            m[:, 0, 0, :] = vis if self.additive_dtype is None else _to_mask(vis, self.additive_dtype)

    def _eager_step(self) -> torch.Tensor:
        return self._forward(self.model, self.ids, mask_argument(self.masks), self.pos, self.cache, self.cache_kw)

    def step(self) -> torch.Tensor:
        """Run one decode step; returns ``[batch, vocab]`` logits in the model's dtype."""
        self.cache.row_slots = self.slots
        if not self.use_cuda_graph:
            return self._eager_step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.static_logits

    def _capture(self) -> None:
        # Warm up on a side stream (cuBLAS/SDPA workspace allocation, compilation), then capture.
        # The warm-up writes K/V into the staged slots, which the first real step overwrites
        # before reading.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self.static_logits = self._eager_step()
        self.graph = graph
        if getattr(self, "counters", None) is not None:  # the engine's (EmbeddedEngine.info)
            self.counters["graph_captures"] += 1


def _decode_forward(model: torch.nn.Module, ids: torch.Tensor, mask: Any, pos: torch.Tensor, cache: StaticKVCache,
                    cache_kw: str) -> torch.Tensor:
    """One decode forward ``[batch, 1]`` -> last-position logits ``[batch, vocab]`` (model dtype)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
    return out.logits[:, -1, :]


_COMPILED: Any = None

#: ``attn_implementation`` name under which the engine registers its decode attention: SDPA as a
#: ``torch.library`` custom op (:func:`opaque_sdpa`), which ``torch.compile`` keeps as one opaque
#: call instead of tracing it. Traced by inductor, SDPA with the boolean ``[batch, 1, 1, max_len]``
#: mask and GQA got its inputs copied into a new layout and ran a slower cuDNN kernel (H200,
#: Qwen2-0.5B shape, batch 256: 74 us + 2 x 20 us of copies per layer vs 16 us eager); a graph
#: break around it instead split the model into one compiled frame per layer, past dynamo's
#: recompile limit. As a custom op the whole decode forward stays one graph.
OPAQUE_SDPA = "ferrule_sdpa_opaque"


def _sdpa_with_repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                         scale: float | None) -> torch.Tensor:
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    n_rep = hq // hkv
    if n_rep > 1 and s == 1 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
        # one query token (decode): kv head h serves query heads [h * n_rep, (h + 1) * n_rep) (HF's
        # repeat_kv grouping); run those as n_rep queries on the kv head instead of copying the cache
        # n_rep times (transformers' pack_gqa for this case)
        out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, n_rep, d), key, value,
                                                               attn_mask=attn_mask, scale=scale)
        return out.reshape(b, hq, 1, -1).transpose(1, 2).contiguous()
    if n_rep > 1:  # HF's repeat_kv
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("ferrule::decode_sdpa", mutates_args=())
def _decode_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 scale: float | None) -> torch.Tensor:
    return _sdpa_with_repeat_kv(query, key, value, attn_mask, scale)


@_decode_sdpa.register_fake
def _(query, key, value, attn_mask, scale):
    b, h, s, _ = query.shape
    return query.new_empty((b, s, h, value.shape[-1]))


def opaque_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An HF attention function (``AttentionInterface``): query ``[batch, heads, q_len, head_dim]``,
    key/value ``[batch, kv_heads, kv_len, head_dim]``, a boolean or additive 4-D mask (the engine
    always passes one) -> ``([batch, q_len, heads, head_dim], None)``, computed as transformers'
    ``sdpa_attention_forward`` computes it with a mask (``repeat_kv``, then SDPA; no dropout at
    inference, ``is_causal`` False because the mask is explicit).

    Any other call is a plain forward of the engine's model outside the engine's decode step (the
    service's prompt logprobs and logprob extras, a user's own ``engine.model(ids)``): with no mask
    (transformers passes none for an unpadded causal batch) or with dropout, it is transformers'
    own ``sdpa_attention_forward``, so the model computes exactly what it computed as ``"sdpa"``.
    """
    if attention_mask is None or dropout > 0.0:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _sdpa_with_repeat_kv(query, key, value, attention_mask, scaling), None  # autograd: not through the op
    return torch.ops.ferrule.decode_sdpa(query, key, value, attention_mask, scaling), None


def use_opaque_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` (an ``"sdpa"`` HF model) to :data:`OPAQUE_SDPA` (:func:`opaque_sdpa`).

    Returns:
        True if the model now uses it (or already did); False for other attention
        implementations or composite configs, which the engine then does not compile.
    """
    from transformers import AttentionInterface

    config = model.config
    if hasattr(config, "get_text_config") and config.get_text_config(decoder=True) is not config:
        return False
    attn = getattr(config, "_attn_implementation", None)
    if attn == OPAQUE_SDPA:
        return True
    if attn != "sdpa":
        return False
    AttentionInterface.register(OPAQUE_SDPA, opaque_sdpa)
    config._attn_implementation = OPAQUE_SDPA
    return True


def _compiled_decode_forward() -> Any:
    """:func:`_decode_forward` through ``torch.compile`` (one wrapper per process; inductor
    specialises it per model and bucket shape)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_decode_forward, dynamic=False)
    return _COMPILED
