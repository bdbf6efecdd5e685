"""The entries and named derivations that families share: RoPE (base, scaling, partial rotary),
sliding windows, head width, MoE expert count and top-k normalisation, the keys every config may
carry harmlessly, and :data:`DECODER_ENTRIES` (a Llama-style decoder's whole table).

Built from :mod:`ferrule.config_translation.vocabulary`; re-exported by :mod:`ferrule.config_translation`.
"""

from __future__ import annotations

from typing import Any, Mapping

from .vocabulary import ConfigTranslationError, Constant, Derived, Field, Harmless, register_shared_rows

# ---------------------------------------------------------------------------------------------
# Named derivations shared by families.
# ---------------------------------------------------------------------------------------------

#: RoPE types megatron-core reproduces: plain RoPE, linear position interpolation
#: (``seq_len_interpolation_factor``), Llama-3.1 scaling (``rope_scaling``, with megatron's fixed
#: low/high frequency factors 1 / 4 and original context 8192) and YaRN (``YarnRotaryEmbedding``,
#: ``position_embedding_type='yarn'``). Not ``dynamic`` (NTK-aware scaling recomputed from each
#: batch's length: megatron-core 0.16.1 has no such embedding; docs/plugins.md), ``longrope``, ...
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: Llama-3.1 scaling constants hard-coded in megatron-core 0.16.1 ``RotaryEmbedding._apply_scaling``.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_ROPE_FIELDS = {"default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"}}
_ROPE_FIELDS["linear"] = _ROPE_FIELDS["default"] | {"factor"}
_ROPE_FIELDS["llama3"] = _ROPE_FIELDS["linear"] | set(MEGATRON_LLAMA3_ROPE)
#: ``transformers.modeling_rope_utils._compute_yarn_parameters`` reads these
_ROPE_FIELDS["yarn"] = _ROPE_FIELDS["linear"] | {"original_max_position_embeddings", "attention_factor", "beta_fast",
                                                 "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def is_per_layer_type_rope(hf: Mapping[str, Any]) -> bool:
    """Whether ``rope_parameters`` holds one RoPE per layer type (Gemma-3:
    ``{"sliding_attention": {...}, "full_attention": {...}}``, keyed by the ``layer_types`` values).

    Such a config is translated by :data:`ferrule.config_translation.layer_types.LAYER_TYPE_ROPE_ENTRIES`
    (model option ``layer_rope``); the flat rows (:data:`ROPE_SCALING_ENTRIES`) then produce
    their neutral values (no scaling, full rotary) for the unused model-wide table.
    """
    params, layer_types = hf.get("rope_parameters"), hf.get("layer_types")
    return (isinstance(params, Mapping) and bool(params) and all(isinstance(v, Mapping) for v in params.values())
            and isinstance(layer_types, (list, tuple)) and set(layer_types) <= set(params))


def _rope_params(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (or a legacy ``rope_scaling`` + ``rope_theta``) as one dict, validated.

    With a parsed config (:func:`parse_hf_config`) transformers has already merged the legacy
    keys into ``rope_parameters``; the legacy branch serves hand-built dicts passed to the
    entries directly.

    Raises:
        ConfigTranslationError: a rope type megatron-core cannot reproduce, a field ferrule does not
            translate for that type, or Llama-3.1 constants other than megatron's.
    """
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        key = "rope_scaling"
        params = dict(hf.get("rope_scaling") or {})
        if hf.get("rope_theta") is not None:
            params.setdefault("rope_theta", hf["rope_theta"])
    if not isinstance(params, Mapping):
        raise ConfigTranslationError(f"HF key {key!r}={params!r} must be a dict.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigTranslationError(
            f"HF key '{key}.rope_type'={rope_type!r} is not supported; supported rope types: "
            f"{list(SUPPORTED_ROPE_TYPES)} (megatron-core's RotaryEmbedding and YarnRotaryEmbedding implement no "
            f"other scaling). Use a checkpoint with one of those, or extend the family's provider (docs/plugins.md "
            f"\"RoPE scaling\" says what that takes)."
        )
    extra = sorted(set(params) - _ROPE_FIELDS[rope_type])
    if extra:
        raise ConfigTranslationError(
            f"HF key {key!r} has field(s) {extra} that ferrule does not translate for rope_type={rope_type!r}; "
            f"translated: {sorted(_ROPE_FIELDS[rope_type])}."
        )
    if rope_type == "llama3":
        for name, value in MEGATRON_LLAMA3_ROPE.items():
            if float(params.get(name, value)) != float(value):
                raise ConfigTranslationError(
                    f"HF key '{key}.{name}'={params.get(name)!r}: megatron-core's llama3 RoPE scaling hard-codes "
                    f"{name}={value}; this checkpoint's scaling cannot be reproduced."
                )
    return {**params, "rope_type": rope_type}


def rope_theta_from_hf(hf: Mapping[str, Any]) -> float:
    """RoPE base (``theta``) from ``rope_parameters`` (transformers 5) or legacy ``rope_theta``.

    The rope type and scaling fields are validated here too (see :data:`SUPPORTED_ROPE_TYPES`);
    :func:`rope_scaling_from_hf` and :func:`rotary_percent_from_hf` translate them.

    Raises:
        ConfigTranslationError: an unsupported ``rope_type`` / field (naming the key and the
            supported types), or no theta anywhere.
    """
    params = _rope_params(hf)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigTranslationError("HF config has no RoPE base: expected 'rope_parameters.rope_theta' or 'rope_theta'.")
    return float(theta)


def rope_theta_to_hf(value: float, _cfg: Mapping[str, Any], opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`rope_theta_from_hf` (with the scaling options): the transformers-5
    ``rope_parameters`` dict."""
    params: dict[str, Any] = {"rope_theta": float(value), "rope_type": "default"}
    scaling = opts.get("rope_scaling")
    if scaling:
        params.update(rope_type=scaling["type"], factor=float(scaling["factor"]))
        if scaling["type"] == "llama3":
            params.update(MEGATRON_LLAMA3_ROPE)
        if scaling["type"] == "yarn":
            params.update({k: scaling[k] for k in ("original_max_position_embeddings", "attention_factor", "beta_fast",
                                                   "beta_slow", "truncate")})
    if float(opts.get("rotary_percent", 1.0)) != 1.0:
        params["partial_rotary_factor"] = float(opts["rotary_percent"])
    return {"rope_parameters": params}


def rope_scaling_from_hf(hf: Mapping[str, Any]) -> dict | None:
    """Model option ``rope_scaling``: None (plain RoPE), ``{"type": "linear"|"llama3", "factor": f}``
    or, for YaRN, :func:`yarn_from_hf`'s dict (``type: "yarn"``, every parameter resolved).

    HF ``linear`` divides the inverse frequencies by ``factor``
    (``modeling_rope_utils._compute_linear_scaling_rope_parameters``); megatron divides the
    positions by ``seq_len_interpolation_factor`` instead (same angles). HF ``llama3``
    (``_compute_llama3_parameters``) is megatron's ``RotaryEmbedding(rope_scaling=True,
    rope_scaling_factor=factor)`` when the constants equal :data:`MEGATRON_LLAMA3_ROPE`.
    """
    if is_per_layer_type_rope(hf):
        return None
    params = _rope_params(hf)
    if params["rope_type"] == "default":
        return None
    if params["rope_type"] == "yarn":
        return yarn_from_hf(hf, params)
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ConfigTranslationError(f"HF rope '{params['rope_type']}' scaling needs a positive 'factor', got {factor!r}.")
    return {"type": params["rope_type"], "factor": float(factor)}


def yarn_from_hf(hf: Mapping[str, Any], params: Mapping[str, Any]) -> dict:
    """HF YaRN ``rope_parameters`` resolved as ``transformers.modeling_rope_utils._compute_yarn_parameters``
    (transformers 5.24) resolves them, for megatron's ``YarnRotaryEmbedding`` (Peng et al. 2023, "YaRN").

    Returns ``{"type": "yarn", "factor", "original_max_position_embeddings", "attention_factor",
    "beta_fast", "beta_slow", "truncate"}``: ``factor`` defaults to ``max_position_embeddings /
    original_max_position_embeddings``; ``attention_factor`` (the cos/sin multiplier megatron
    calls the concentration factor, ``mscale``) to ``get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim)`` when both are set, else ``get_mscale(factor)`` with
    ``get_mscale(s, m) = 0.1 m ln(s) + 1`` (1 for ``s <= 1``); ``beta_fast`` / ``beta_slow`` to 32 / 1
    (also when 0, as HF's ``or``); ``truncate`` (megatron ``correction_range_round_to_int``) to True.

    Raises:
        ConfigTranslationError: a missing ``original_max_position_embeddings``, a non-positive
            factor, or ``partial_rotary_factor`` != 1 (megatron's YaRN builds its frequencies over
            the whole ``kv_channels``, HF over the rotated part only).
    """
    import math

    where = "rope_parameters"
    orig = params.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ConfigTranslationError(f"HF key '{where}.original_max_position_embeddings'={orig!r}: YaRN needs the "
                                     f"pre-training context (a positive integer, tokens).")
    factor = params.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", 0) / orig
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ConfigTranslationError(f"HF key '{where}.factor'={factor!r}: YaRN needs a positive factor.")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigTranslationError(f"HF key '{where}.partial_rotary_factor'={partial!r} with rope_type 'yarn': "
                                     f"megatron-core's YarnRotaryEmbedding computes its frequencies over the whole "
                                     f"head (kv_channels), HF over the rotated part only; not reproducible.")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)
    if float(attention) != 1.0 and factor <= 1:
        raise ConfigTranslationError(f"HF key '{where}.attention_factor'={attention!r} with factor {factor} <= 1: "
                                     f"megatron's YaRN scales cos/sin only when the factor is above 1.")
    return {"type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig,
            "attention_factor": float(attention), "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1), "truncate": bool(params.get("truncate", True))}


def rotary_percent_from_hf(hf: Mapping[str, Any]) -> float:
    """Model option ``rotary_percent`` (megatron ``GPTModel``) from HF ``partial_rotary_factor``.

    HF (``_compute_default_rope_parameters``) rotates the first ``int(head_dim * factor)``
    channels of each head; megatron's ``RotaryEmbedding`` uses ``int(kv_channels *
    rotary_percent)`` and passes the rest through (``apply_rotary_pos_emb_bshd``). The factor is
    read from ``rope_parameters`` (transformers 5) or the top-level key.
    """
    if is_per_layer_type_rope(hf):
        return 1.0
    params = _rope_params(hf)
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    value = 1.0 if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        raise ConfigTranslationError(f"HF key 'partial_rotary_factor'={value!r} must be a number in (0, 1].")
    return float(value)


def _owned_elsewhere(_value: Any, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """``to_hf`` of an entry whose HF keys another entry writes (e.g. ``rope_parameters``)."""
    return {}


def _layer_types(hf: Mapping[str, Any]) -> list[str] | None:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return None
    bad = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ConfigTranslationError(
            f"HF key 'layer_types' has {bad}; ferrule translates 'full_attention' and 'sliding_attention' only."
        )
    return list(layer_types)


def window_size_from_hf(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    """``TransformerConfig.window_size`` from HF ``sliding_window`` (and ``layer_types``).

    HF (``masking_utils.sliding_window_overlay``) lets query ``i`` see keys ``j`` with
    ``i - sliding_window < j <= i``: ``sliding_window`` tokens including itself. Megatron's
    window ``(left, right)`` (flash-attention convention) sees ``i - left <= j <= i + right``, so
    ``window_size = (sliding_window - 1, 0)``. None when no layer slides (no ``sliding_window``,
    or every ``layer_types`` entry ``'full_attention'``).
    """
    window = hf.get("sliding_window")
    layer_types = _layer_types(hf)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        if layer_types and "sliding_attention" in layer_types:
            raise ConfigTranslationError("HF key 'layer_types' has sliding layers but 'sliding_window' is null.")
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigTranslationError(f"HF key 'sliding_window'={window!r} must be an integer >= 1 (tokens).")
    return (window - 1, 0)


def window_size_to_hf(value: tuple[int, int] | None, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`window_size_from_hf`: writes ``sliding_window`` when a window is set
    (without one, ``base``'s ``sliding_window`` / ``layer_types`` stay as they are)."""
    return {} if value is None else {"sliding_window": int(value[0]) + 1}


def window_attn_skip_freq_from_hf(hf: Mapping[str, Any]) -> list[int] | None:
    """``TransformerConfig.window_attn_skip_freq``: per layer 1 = sliding, 0 = full attention.

    None (every layer slides, or none does) unless ``layer_types`` mixes both, as Gemma-2's
    alternating layers do (megatron ``is_layer_window_attention``, 1-based layer numbers).
    """
    layer_types = _layer_types(hf)
    if window_size_from_hf(hf) is None or layer_types is None or set(layer_types) == {"sliding_attention"}:
        return None
    return [int(t == "sliding_attention") for t in layer_types]


def head_dim_from_hf(hf: Mapping[str, Any]) -> int:
    """Per-head width (``kv_channels``): ``head_dim`` if set, else ``hidden_size // num_attention_heads``.

    Qwen3 sets ``head_dim`` explicitly and it may differ from hidden/heads (Qwen3-0.6B: 1024 /
    16 heads with head_dim 128).
    """
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        return int(head_dim)
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if not hidden or not heads or hidden % heads:
        raise ConfigTranslationError(
            f"HF config has no 'head_dim' and hidden_size={hidden!r} is not divisible by "
            f"num_attention_heads={heads!r}; set 'head_dim'."
        )
    return hidden // heads


def head_dim_to_hf(value: int, cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`head_dim_from_hf`: always writes ``head_dim`` (transformers reads it)."""
    return {"head_dim": int(value)}


def head_dim_to_hf_implicit(value: int, cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """For families whose HF config has no ``head_dim`` (Qwen2): require hidden/heads."""
    implied = cfg["hidden_size"] // cfg["num_attention_heads"]
    if value != implied:
        raise ConfigTranslationError(
            f"kv_channels={value} differs from hidden_size/num_attention_heads={implied}; this "
            f"family's HF config cannot express that (it has no 'head_dim' key)."
        )
    return {}


def num_experts_from_hf(hf: Mapping[str, Any]) -> int:
    """Routed expert count: ``num_local_experts`` (transformers 5) or legacy ``num_experts``.

    Raises:
        ConfigTranslationError: neither key is present, or both are present and differ.
    """
    a, b = hf.get("num_local_experts"), hf.get("num_experts")
    if a is not None and b is not None and a != b:
        raise ConfigTranslationError(
            f"HF config has num_local_experts={a} and num_experts={b}; they must agree (remove one)."
        )
    value = a if a is not None else b
    if value is None or int(value) < 1:
        raise ConfigTranslationError("HF config needs 'num_local_experts' (or legacy 'num_experts') >= 1 for an MoE model.")
    return int(value)


def num_experts_to_hf(value: int, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`num_experts_from_hf` (writes the transformers-5 key)."""
    return {"num_local_experts": int(value)}


def pre_softmax_from_norm_topk_prob(hf: Mapping[str, Any]) -> bool:
    """``moe_router_pre_softmax`` from HF ``norm_topk_prob``.

    HF Qwen3-MoE: ``softmax`` over all experts, take top-k, and if ``norm_topk_prob`` divide by
    the top-k sum. Megatron (``moe_utils.topk_routing_with_score_function``): with
    ``pre_softmax`` it softmaxes all logits then takes top-k (= HF without renormalisation);
    without it, it takes top-k logits and softmaxes those (= HF with renormalisation, since
    softmax over a subset equals the renormalised full softmax). So ``pre_softmax = not
    norm_topk_prob``.
    """
    value = hf.get("norm_topk_prob", False)
    if not isinstance(value, bool):
        raise ConfigTranslationError(f"HF key 'norm_topk_prob'={value!r} must be true or false.")
    return not value


def pre_softmax_to_norm_topk_prob(value: bool, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`pre_softmax_from_norm_topk_prob`."""
    return {"norm_topk_prob": not bool(value)}


#: RoPE scaling and partial rotary (model options ``rope_scaling`` and ``rotary_percent``). The
#: family's own ``Derived("rotary_base", ...)`` owns and writes ``rope_parameters``.
ROPE_SCALING_ENTRIES: tuple = (
    Derived("rope_scaling", rope_scaling_from_hf, _owned_elsewhere, hf_keys=(), target="option",
            reads=("rope_parameters", "rope_scaling", "rope_theta")),
    Derived("rotary_percent", rotary_percent_from_hf, _owned_elsewhere, hf_keys=(), target="option",
            reads=("rope_parameters", "partial_rotary_factor")),
)

#: Sliding-window attention (``TransformerConfig.window_size`` / ``window_attn_skip_freq``), from
#: HF ``sliding_window`` and ``layer_types``.
SLIDING_WINDOW_ENTRIES: tuple = (
    Derived("window_size", window_size_from_hf, window_size_to_hf, hf_keys=(),
            reads=("sliding_window", "layer_types")),
    Derived("window_attn_skip_freq", window_attn_skip_freq_from_hf, _owned_elsewhere, hf_keys=(),
            reads=("layer_types", "sliding_window")),
)

#: Keys every transformers config may carry that cannot change a decoder's numbers.
COMMON_HARMLESS: tuple = (
    Harmless("model_type", "selects the family (each family Requires its own model_type)"),
    Harmless("architectures", "names the HF class; the family is chosen by model_type"),
    Harmless("transformers_version", "provenance only"),
    Harmless("dtype", "storage dtype of the checkpoint; conversion keeps each tensor's dtype"),
    Harmless("torch_dtype", "transformers-4 spelling of dtype (storage dtype only)"),
    Harmless("quantization_config", "storage format of the weights: ferrule.formats.quantized_weights reads MXFP8 / FP8 "
             "dequantized as transformers does and refuses every other quant_method"),
    Harmless("_name_or_path", "provenance only"),
    Harmless("_model_name_or_path", "provenance only (written by transformers' GGUF loader, e.g. SmolLM2's)"),
    Harmless("bos_token_id", "tokenizer/generation metadata; no effect on logits"),
    Harmless("eos_token_id", "tokenizer/generation metadata; no effect on logits"),
    Harmless("unk_token_id", "tokenizer metadata; no effect on logits"),
    Harmless("pad_token_id", "tokenizer metadata; ferrule's embedding has no padding_idx and HF's gradient "
             "masking of padding_idx does not change forward logits"),
    Harmless("use_cache", "KV-cache switch of HF generate; no effect on logits"),
    Harmless("output_attentions", "HF forward output switch"),
    Harmless("output_hidden_states", "HF forward output switch"),
    Harmless("return_dict", "HF forward output switch"),
    Harmless("id2label", "classification-head labels; unused by causal LMs"),
    Harmless("label2id", "classification-head labels; unused by causal LMs"),
    Harmless("problem_type", "classification-head loss choice; unused by causal LMs"),
    Harmless("tokenizer_class", "tokenizer metadata"),
    Harmless("chunk_size_feed_forward", "HF memory-saving chunking of the MLP; same numbers"),
)

#: Entries every Llama-style decoder shares (HF ``LlamaConfig`` field names; RMSNorm pre-norm,
#: SwiGLU MLP without biases, RoPE, GQA): layer/width/head counts, norm epsilon, init std,
#: dropout, and the model options vocab size, max sequence length, tied embeddings, rope and
#: silu; RoPE scaling / partial rotary, sliding windows and the generic harmless keys. A family adds its ``model_type`` requirement, head width (``kv_channels``), RoPE base,
#: QKV bias / q-k norm, MoE fields and anything it must refuse. ``num_key_value_heads`` is
#: required (Llama-1 style configs without it are refused rather than guessed).
DECODER_ENTRIES: tuple = (
    Field("num_hidden_layers", "num_layers", cast=int),
    Field("hidden_size", "hidden_size", cast=int),
    Field("intermediate_size", "ffn_hidden_size", cast=int),
    Field("num_attention_heads", "num_attention_heads", cast=int),
    Field("num_key_value_heads", "num_query_groups", cast=int),
    Field("rms_norm_eps", "layernorm_epsilon", cast=float),
    Field("initializer_range", "init_method_std", default=0.02, cast=float),
    Field("attention_dropout", "attention_dropout", default=0.0, cast=float),
    Constant("hidden_dropout", 0.0),
    Constant("normalization", "RMSNorm"),
    Constant("gated_linear_unit", True),
    Constant("add_bias_linear", False),
    Field("vocab_size", "vocab_size", target="option", cast=int),
    Field("max_position_embeddings", "max_sequence_length", target="option", cast=int),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", target="option", default=False, cast=bool),
    Constant("position_embedding_type", "rope", target="option"),
    Constant("activation", "silu", target="option"),
    *ROPE_SCALING_ENTRIES,
    *SLIDING_WINDOW_ENTRIES,
    *COMMON_HARMLESS,
)

for _group_name, _group in (("ROPE_SCALING_ENTRIES in DECODER_ENTRIES", ROPE_SCALING_ENTRIES),
                            ("SLIDING_WINDOW_ENTRIES in DECODER_ENTRIES", SLIDING_WINDOW_ENTRIES),
                            ("COMMON_HARMLESS", COMMON_HARMLESS), ("DECODER_ENTRIES", DECODER_ENTRIES)):
    register_shared_rows(_group_name, _group)
