"""Build megatron-core ``GPTModel``\\ s (dense or MoE) from a ``TransformerConfig`` or an HF config.

Usage (what family providers and converters call)::

    from ferrule.megatron.parallel import ParallelLayout, init_distributed
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.gpt_config import padded_vocab_size
    from ferrule.plugins.qwen.qwen3 import CONFIG_TRANSLATION

    layout = ParallelLayout(tp=2)
    init_distributed(layout, seed=1234)             # process group + megatron groups + RNG
    models = build_from_hf_config(hf_config_dict, layout, CONFIG_TRANSLATION)
    model = models[0]                                # one GPTModel per virtual pipeline stage
    logits = model(input_ids, position_ids, attention_mask=None)  # [b, s, padded_vocab / tp]

- ``input_ids``/``position_ids`` are ``[batch, seq]`` int64; ``attention_mask=None`` means
  causal (megatron's boolean mask convention otherwise: True = masked out).
- Output: with ``labels`` ``[b, s]`` the per-token cross-entropy loss ``[b, s]`` (fp32);
  without, logits ``[b, s, padded_vocab_size / tp]`` (vocab-parallel; gather over the TP
  group, or build with ``parallel_output=False`` to get ``[b, s, padded_vocab_size]``).
  Columns ``>= hf vocab_size`` are padding (see :func:`padded_vocab_size`); drop them.
- The ``labels=`` loss is computed over the *padded* vocabulary: padding columns (zero rows
  after conversion) have logit 0 and enter the softmax denominator. For HF-exact logprobs,
  compute them from ``logits[..., :vocab_size]``.
- Embedding/output weights have ``padded_vocab_size(vocab, tp)`` rows in total (split over TP;
  the same total for every power-of-two TP, so checkpoints reshard).
- Parameters are fp32 unless ``params_dtype=torch.bfloat16`` is passed; on CPU they are built
  with ``use_cpu_initialization`` (full master weight from the CPU generator, then split), so
  the initial weights do not depend on TP.
- Attention uses :class:`ferrule.megatron.attention.SDPAttention` unless
  ``core_attention='local'`` (megatron's ``DotProductAttention``).

The signatures of :func:`build_gpt_model`, :func:`build_from_hf_config` and
:func:`ferrule.megatron.gpt_config.padded_vocab_size` are stable API.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ferrule.compat import renamed_name

from ..config_translation import ConfigTranslation, ConfigTranslationError
from .gpt_config import DEFAULT_VOCAB_DIVISIBLE_BY, make_transformer_config, padded_vocab_size
from .option_names import BUILDER_READ_OPTIONS, DEPRECATED_OPTION_NAMES, MODEL_OPTION_KEYS
from .parallel import ParallelLayout
from .device import get_backend

__all__ = ["build_gpt_model", "build_from_hf_config"]


def __getattr__(name: str):
    # the config half (ferrule.megatron.gpt_config) was re-exported here; ferrule.compat lists the old names
    return renamed_name(__name__, name)


def build_gpt_model(
    config,
    *,
    vocab_size: int,
    max_sequence_length: int,
    share_embeddings_and_output_weights: bool = False,
    rotary_base: float = 10000.0,
    rotary_percent: float = 1.0,
    rope_scaling: Mapping[str, Any] | None = None,
    position_embedding_type: str = "rope",
    core_attention: Any = "sdpa",
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    parallel_output: bool = True,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    layer_spec: Any = None,
    embedding_multiplier: float | None = None,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
    extra_norms: tuple[str, ...] = (),
    zero_centered_norms: bool = False,
    pre_norms: Any = True,
    qk_norm: str = "per_head",
    layer_rope: Any = None,
):
    """One megatron-core ``GPTModel`` with the local layer spec (no TransformerEngine).

    Args:
        config: a ``TransformerConfig`` (dense, or MoE when ``num_moe_experts`` is set:
            routed experts via ``moe_router_topk``/``moe_ffn_hidden_size``/
            ``moe_router_pre_softmax``; a shared expert via ``moe_shared_expert_intermediate_size``;
            q/k RMSNorm via ``qk_layernorm``; QKV bias via ``add_qkv_bias``).
        vocab_size: the *unpadded* vocabulary (tokens); padded with :func:`padded_vocab_size`.
        max_sequence_length: tokens (HF ``max_position_embeddings``).
        share_embeddings_and_output_weights: tied input/output embeddings (HF ``tie_word_embeddings``).
        rotary_base: RoPE theta.
        rotary_percent: fraction of each head's channels that RoPE rotates (HF
            ``partial_rotary_factor``); the rest pass through.
        rope_scaling: None, ``{"type": "linear", "factor": f}`` (megatron
            ``seq_len_interpolation_factor=f``: positions divided by ``f``, = HF linear scaling) or
            ``{"type": "llama3", "factor": f}`` (megatron ``rope_scaling=True``, Llama-3.1 scaling) or
            :func:`ferrule.config_translation.yarn_from_hf`'s ``{"type": "yarn", ...}`` (megatron
            ``position_embedding_type='yarn'``, ``YarnRotaryEmbedding``; the ``config.yarn_*``
            attributes are set here, :func:`~ferrule.megatron.layer_options.yarn_config_attributes`).
        position_embedding_type: ``'rope'`` (the only type the HF families use; YaRN comes through
            ``rope_scaling``).
        core_attention: ``'sdpa'`` (:class:`SDPAttention`), ``'local'`` (megatron's), or a
            ``DotProductAttention`` subclass / ``"module:attr"`` reference to one.
        parallel_output: keep logits split over TP (True, for vocab-parallel cross entropy).
        pre_process / post_process: embedding / output layer on this pipeline stage; None reads
            megatron's parallel state (first / last stage).
        vp_stage: virtual pipeline stage index (None without interleaving).
        layer_spec, embedding_multiplier, attn_logit_softcapping, final_logit_softcapping,
            extra_norms, zero_centered_norms: extension points for non-Llama decoders
            (Gemma-2 style); see :mod:`ferrule.megatron.extensions`.
        pre_norms, qk_norm, layer_rope: pre-norm placement, q/k norm scope and one RoPE per
            layer (OLMo-2 / Gemma-3 style); see :mod:`ferrule.megatron.layer_options`.

    Returns:
        A ``GPTModel`` on the backend's device.

    Raises:
        ValueError: ``layer_spec`` together with options it would not apply (named), or an
            invalid option value.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from .layer_options import rope_scaling_kwargs as _rope_kwargs

    position_embedding_type = _yarn_position_embedding(config, rope_scaling, layer_rope, position_embedding_type)
    spec = _layer_spec(config, layer_spec, core_attention, vp_stage=vp_stage, rotary_percent=rotary_percent,
                       attn_logit_softcapping=attn_logit_softcapping, extra_norms=extra_norms,
                       zero_centered_norms=zero_centered_norms, pre_norms=pre_norms, qk_norm=qk_norm,
                       layer_rope=layer_rope)

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by),
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        **_rope_kwargs(rope_scaling),
        vp_stage=vp_stage,
    )
    from .extensions import install_output_hooks

    install_output_hooks(model, embedding_multiplier=embedding_multiplier,
                         final_logit_softcapping=final_logit_softcapping)
    backend = get_backend()
    if backend.kind == "cuda":
        model = model.to(backend.device)
    mark_tensor_parallel_params([model])
    from .moe import guard_expert_bias_add

    guard_expert_bias_add([model])
    norm_weights_to_params_dtype(model, config.params_dtype)
    return model


def _yarn_position_embedding(config: Any, rope_scaling: Mapping[str, Any] | None, layer_rope: Any,
                             position_embedding_type: str) -> str:
    """For YaRN ``rope_scaling``: set megatron's ``config.yarn_*`` attributes and return ``"yarn"``
    (:func:`~ferrule.megatron.layer_options.yarn_config_attributes`); else ``position_embedding_type``.

    Raises:
        ValueError: YaRN together with ``layer_rope`` or another position embedding type.
    """
    if not (rope_scaling and rope_scaling.get("type") == "yarn"):
        return position_embedding_type
    from .layer_options import yarn_config_attributes

    if layer_rope is not None or position_embedding_type != "rope":
        raise ValueError("rope_scaling type 'yarn' is the model-wide YarnRotaryEmbedding; it cannot be combined "
                         f"with layer_rope or position_embedding_type={position_embedding_type!r}.")
    for key, value in yarn_config_attributes(rope_scaling).items():
        setattr(config, key, value)  # read by GPTModel (YarnRotaryEmbedding) and Attention (mscale)
    return "yarn"


def _layer_spec(config: Any, layer_spec: Any, core_attention: Any, *, vp_stage: int | None, rotary_percent: float,
                attn_logit_softcapping: float | None, extra_norms: Any, zero_centered_norms: bool, pre_norms: Any,
                qk_norm: Any, layer_rope: Any) -> Any:
    """The transformer layer spec of :func:`build_gpt_model`: the family's own ``layer_spec`` (with
    ferrule's core attention composed in; options it would drop are refused), or megatron's local
    spec customised by :mod:`ferrule.megatron.extensions` (a custom final norm makes it a block spec).

    Raises:
        ValueError: ``layer_spec`` together with options it would not apply (named), or an invalid
            ``layer_rope``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import core_attention_class

    attention_cls = core_attention_class(core_attention)
    final_norm = None
    if layer_rope is not None:
        from .layer_options import check_layer_rope

        layer_rope = tuple({"rotary_percent": rotary_percent, **e} for e in check_layer_rope(layer_rope, config.num_layers))
    layer_options = {"attn_logit_softcapping": attn_logit_softcapping, "extra_norms": tuple(extra_norms) or None,
                     "zero_centered_norms": zero_centered_norms or None, "pre_norms": None if pre_norms is True else pre_norms,
                     "qk_norm": None if qk_norm == "per_head" else qk_norm, "layer_rope": layer_rope}
    if layer_spec is not None:
        from .extensions import compose_core_attention, resolve_class

        ignored = sorted(k for k, v in layer_options.items() if v is not None)
        if ignored:
            raise ValueError(
                f"layer_spec replaces the whole decoder layer, so the model option(s) {ignored} would not be "
                f"applied to it; build them into the spec (ferrule.megatron.extensions.customize_local_spec does "
                f"this for the local spec) and drop the options, or drop layer_spec.")
        spec = resolve_class(layer_spec, "layer_spec")
        spec = spec(config) if callable(spec) and not isinstance(spec, ModuleSpec) else spec
        spec = compose_core_attention(spec, attention_cls)
    else:
        from .extensions import customize_local_spec

        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        spec, final_norm = customize_local_spec(
            spec, config, attention_cls=attention_cls, attn_logit_softcapping=attn_logit_softcapping,
            extra_norms=tuple(extra_norms), zero_centered_norms=zero_centered_norms, pre_norms=pre_norms,
            qk_norm=qk_norm, layer_rope=layer_rope)
        from .moe import with_token_split

        spec = with_token_split(spec)  # MoE at TP > 1 without SP: tokens split over TP around the dispatcher
    if final_norm is not None:  # megatron builds the final norm in the TransformerBlock
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                          layer_norm=final_norm)
    return spec


def norm_weights_to_params_dtype(model, dtype: torch.dtype) -> int:
    """Give torch norm layers the model's parameter dtype; returns how many tensors were cast.

    The local spec's ``WrappedTorchNorm`` builds ``torch.nn.RMSNorm`` / ``LayerNorm`` without a
    dtype, so a bf16 model got fp32 norm weights. ``torch.rms_norm`` with a bf16 input and an fp32
    weight cannot use its fused CUDA kernel and runs unfused (several elementwise kernels each way;
    measured on an H200, see docs/benchmarks.md). HF keeps these weights in the model dtype too
    (``Qwen2RMSNorm`` in a bf16 checkpoint), and megatron's mixed-precision optimizer keeps an
    fp32 master copy of every bf16 parameter, so training precision is unchanged.
    """
    if dtype == torch.float32:
        return 0
    cast = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            for name, p in module.named_parameters(recurse=False):
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    cast += 1
    return cast


_MODEL_OPTION_KEYS = MODEL_OPTION_KEYS
#: Model options :func:`build_from_hf_config` reads itself (not passed to :func:`build_gpt_model` as model
#: options): ``activation``, and ``core_attention`` (the default when the caller passes none).
_BUILDER_READ_OPTIONS = BUILDER_READ_OPTIONS


def _local_rotary_base_to_layer_rope(config_kwargs: Mapping[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """``local_rotary_base`` (an earlier release's Gemma-3 spelling: the RoPE base of the sliding-window layers)
    as the ``layer_rope`` option: sliding layers (megatron's ``is_layer_window_attention`` over
    ``window_size`` / ``window_attn_skip_freq``) get ``local_rotary_base`` without scaling, the others the
    model-wide ``rotary_base`` and ``rope_scaling`` (Gemma-3: local layers plain RoPE at base 10 000, global
    layers the config's base and scaling)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    options = dict(options)
    local = float(options.pop("local_rotary_base"))
    if "layer_rope" in options:
        return options  # the family already translates one RoPE per layer type: the old option adds nothing
    percent = options.get("rotary_percent", 1.0)
    layer_rope = []
    for number in range(1, int(config_kwargs["num_layers"]) + 1):
        if is_layer_window_attention(config_kwargs.get("window_size"), config_kwargs.get("window_attn_skip_freq"),
                                     number):
            layer_rope.append({"layer_type": "sliding_attention", "rotary_base": local, "rope_scaling": None,
                               "rotary_percent": percent})
        else:
            layer_rope.append({"layer_type": "full_attention", "rotary_base": float(options.get("rotary_base", 10000.0)),
                               "rope_scaling": options.get("rope_scaling"), "rotary_percent": percent})
    options["layer_rope"] = tuple(layer_rope)
    options.pop("rope_scaling", None)  # carried per layer now (the model-wide table goes unused)
    return options


#: Model options of earlier releases that still build, with a ``FutureWarning`` naming the replacement:
#: ``old name -> (replacement, migrate(config_kwargs, options) -> options)``. Removed one release after.
DEPRECATED_MODEL_OPTIONS: dict[str, tuple[str, Any]] = {
    "local_rotary_base": (DEPRECATED_OPTION_NAMES["local_rotary_base"], _local_rotary_base_to_layer_rope),
}


def migrate_model_options(translation_name: str, config_kwargs: Mapping[str, Any],
                          options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every :data:`DEPRECATED_MODEL_OPTIONS` entry rewritten to its replacement, each with a
    ``FutureWarning`` (shown by default) naming the translation, the old option and the replacement."""
    import warnings

    out = dict(options)
    for old, (replacement, migrate) in DEPRECATED_MODEL_OPTIONS.items():
        if old in out:
            warnings.warn(f"translation {translation_name!r} produces the model option {old!r}, deprecated: use "
                          f"{replacement}. It is migrated for this release and will be refused in the next.",
                          FutureWarning, stacklevel=3)
            out = migrate(config_kwargs, out)
    return out


def _check_live_layout(layout: ParallelLayout) -> None:
    """Raise RuntimeError unless megatron's parallel state is initialized with ``layout``'s tp, pp, ep, etp."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_from_hf_config: call ferrule.megatron.parallel.init_distributed(layout) first.")
    live = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    wanted = (layout.tp, layout.pp, layout.ep, layout.etp if layout.etp is not None else layout.tp)
    if live != wanted:
        raise RuntimeError(
            f"build_from_hf_config: layout asks tp,pp,ep,etp={wanted} but megatron "
            f"was initialized with {live}; re-run init_distributed with this layout."
        )


def _model_kwargs(translation: ConfigTranslation, options: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`build_gpt_model` keywords among the translation's model options.

    Raises:
        ConfigTranslationError: an option the builder does not know (named, with the closest known name).
    """
    model_kwargs = {k: options[k] for k in _MODEL_OPTION_KEYS if k in options}
    unknown = sorted(set(options) - set(_MODEL_OPTION_KEYS) - set(_BUILDER_READ_OPTIONS))
    if unknown:
        import difflib

        known = sorted(_MODEL_OPTION_KEYS + _BUILDER_READ_OPTIONS)
        hints = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k in unknown
                          if (m := difflib.get_close_matches(k, known, n=1)))
        raise ConfigTranslationError(
            f"translation {translation.name!r} produced model option(s) {unknown} that the builder does not know "
            f"(they would be silently dropped){' (' + hints + ')' if hints else ''}; known options: {known}.")
    return model_kwargs


def build_from_hf_config(
    hf_config: Mapping[str, Any],
    layout: ParallelLayout,
    translation: ConfigTranslation,
    *,
    params_dtype: torch.dtype = torch.float32,
    core_attention: str | None = None,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    parallel_output: bool = True,
    moe_token_dispatcher_type: str = "alltoall",
    use_cpu_initialization: bool | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> list:
    """Build this rank's megatron model chunks for an HF config (what providers call).

    Requires :func:`ferrule.megatron.parallel.init_distributed` with the same ``layout``.

    Args:
        hf_config: HF ``config.json`` contents / ``PretrainedConfig.to_dict()``.
        layout: the parallel layout (must match megatron's initialized state).
        translation: the family variant's :class:`ConfigTranslation`.
        params_dtype, use_cpu_initialization, config_overrides: see :func:`make_transformer_config`.
        core_attention, make_vocab_size_divisible_by, parallel_output: see :func:`build_gpt_model`;
            ``core_attention`` None: the translation's ``core_attention`` model option (a family's
            ``Constant("core_attention", "local", target="option")`` row), else ``"sdpa"``.
        moe_token_dispatcher_type: ``'alltoall'`` or ``'allgather'`` (MoE only).

    Returns:
        ``list[GPTModel]``, one per virtual pipeline stage (length 1 without ``layout.vpp``).

    Raises:
        ConfigTranslationError: the HF config is unsupported (from the translation), or the
            translation produced a model option the builder does not know (named, with the
            closest known name: a misspelt option would otherwise be dropped silently).
        RuntimeError: model parallel state not initialized, or initialized with another layout.
        ValueError: the layout does not fit the model (see :func:`make_transformer_config`).
    """
    _check_live_layout(layout)
    config_kwargs, options = translation.to_mcore(hf_config)
    options = migrate_model_options(translation.name, config_kwargs, options)
    missing = [k for k in ("vocab_size", "max_sequence_length") if k not in options]
    if missing:
        raise ConfigTranslationError(f"translation {translation.name!r} produced no model option(s) {missing}.")
    overrides = dict(config_overrides or {})
    if config_kwargs.get("num_moe_experts"):
        overrides.setdefault("moe_token_dispatcher_type", moe_token_dispatcher_type)
    config = make_transformer_config(
        config_kwargs,
        layout,
        params_dtype=params_dtype,
        activation=options.get("activation", "silu"),
        use_cpu_initialization=use_cpu_initialization,
        overrides=overrides,
    )
    model_kwargs = _model_kwargs(translation, options)
    stages = layout.vpp or 1
    return [
        build_gpt_model(
            config,
            core_attention=core_attention if core_attention is not None else options.get("core_attention", "sdpa"),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            parallel_output=parallel_output,
            vp_stage=(i if layout.vpp else None),
            **model_kwargs,
        )
        for i in range(stages)
    ]


def mark_tensor_parallel_params(chunks) -> int:
    """Mark tensor-parallel weights ``tensor_model_parallel=True`` where megatron left them unmarked.

    megatron-core 0.16.1 sets ``tensor_model_parallel`` / ``partition_dim`` on Column/RowParallelLinear
    and VocabParallelEmbedding weights only inside its init functions, i.e. only when
    ``config.perform_initialization`` is True (``tensor_parallel/layers.py``). Models built with
    ``perform_initialization=False`` (weights loaded afterwards) therefore count every TP shard
    as a duplicate in ``get_grad_norm_fp32``: at TP=2 the grad norm (and clipping) was wrong
    (0.942 instead of 1.178 on the tiny test model). :func:`build_gpt_model` calls this on every
    model it builds; it is idempotent. Returns the number of parameters fixed.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    fixed = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                params = [(getattr(module, "weight", None), 0)]
                if isinstance(module, ColumnParallelLinear):
                    params.append((getattr(module, "bias", None), 0))
            elif isinstance(module, RowParallelLinear):
                params = [(getattr(module, "weight", None), 1)]
            else:
                continue
            for p, dim in params:
                if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel", False):
                    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                        if hasattr(p, attr):
                            delattr(p, attr)
                    set_tensor_model_parallel_attributes(p, True, dim, 1)
                    fixed += 1
    return fixed
