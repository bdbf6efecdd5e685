"""Build the Megatron Inkling text model (a megatron-core ``GPTModel`` with an Inkling layer spec).

Layer ``L`` (0-based, global) is built from the model options of
:mod:`ferrule.plugins.inkling.config`: local (sliding-window) or global attention
(:class:`~ferrule.plugins.inkling.layers.InklingSelfAttention`), dense
(:class:`~ferrule.plugins.inkling.moe.InklingDenseMLP`) or MoE
(:class:`~ferrule.plugins.inkling.moe.InklingMoELayer`) MLP. The embedding is
:class:`~ferrule.megatron.shared_layers.InklingNormedEmbedding`, the final norm
:class:`~ferrule.plugins.inkling.layers.InklingFinalNorm` (carrying the muP logit division), the
output layer megatron's untied vocab-parallel ``output_layer``; no position embedding (the
relative bias lives in the attention).

Call :func:`build_inkling_model` after :func:`ferrule.megatron.parallel.init_distributed`; the
result has the interface of ``ferrule.megatron.gpt_builder.build_gpt_model`` (``model(ids, pos,
attention_mask=None)`` -> logits ``[b, s, padded_vocab / tp]``, or per-token loss with ``labels``).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from ferrule.megatron.device import get_backend
from ferrule.megatron.gpt_builder import mark_tensor_parallel_params
from ferrule.megatron.gpt_config import check_layout_fits, make_transformer_config, padded_vocab_size

__all__ = ["build_inkling_model", "inkling_layer_spec", "check_inkling_layout"]


def check_inkling_layout(config_kwargs: Mapping[str, Any], options: Mapping[str, Any], layout) -> None:
    """Raise ``ValueError`` (naming the number and the fix) if ``layout`` cannot split this Inkling model.

    TP must divide the global and the sliding-window head and KV-head counts (KV heads are not
    replicated across TP ranks), the dense and expert widths; EP must divide the routed experts.
    Sequence and context parallelism are not implemented for the Inkling attention.
    """
    check_layout_fits(config_kwargs, layout)
    tp = layout.tp
    counts = {"swa_num_attention_heads": options["swa_num_attention_heads"],
              "swa_num_key_value_heads": options["swa_num_key_value_heads"],
              "num_attention_heads": config_kwargs["num_attention_heads"],
              "num_key_value_heads": config_kwargs["num_query_groups"],
              "intermediate_size": config_kwargs["ffn_hidden_size"]}
    if any(options["sparse_layers"]):
        counts["moe_intermediate_size"] = options["moe_intermediate_size"]
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(f"Inkling: tp={tp} must divide {bad} (whole heads per rank; KV-head replication is not "
                         f"implemented); choose a tp that divides them.")
    if getattr(layout, "cp", 1) > 1:
        raise ValueError("Inkling: context parallelism is not implemented (the relative bias and ShortConvs need the "
                         "whole sequence); use cp=1.")


def inkling_layer_spec(layer_index: int, options: Mapping[str, Any], config):
    """``ModuleSpec`` of global layer ``layer_index`` (0-based): its attention kind and MLP kind."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from ferrule.megatron.shared_layers import InklingRMSNorm
    from ferrule.plugins.inkling.layers import InklingSelfAttention
    from ferrule.plugins.inkling.moe import InklingDenseMLP, InklingMoELayer, InklingRouter

    sliding = bool(options["sliding_layers"][layer_index])
    attention = ModuleSpec(module=InklingSelfAttention, params=dict(
        sliding=sliding,
        num_heads=options["swa_num_attention_heads"] if sliding else config.num_attention_heads,
        num_kv_heads=options["swa_num_key_value_heads"] if sliding else config.num_query_groups,
        head_dim=options["swa_head_dim"] if sliding else config.kv_channels,
        d_rel=options["d_rel"],
        rel_extent=options["sliding_window_size"] if sliding else options["rel_extent"],
        window=options["sliding_window_size"] if sliding else None,
        conv_kernel_size=options["conv_kernel_size"],
        log_scaling_n_floor=options["log_scaling_n_floor"],
        log_scaling_alpha=options["log_scaling_alpha"],
    ))
    dense_mlp = get_gpt_layer_local_spec(num_experts=None).submodules.mlp.submodules
    if options["sparse_layers"][layer_index]:
        experts = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                           ).submodules.mlp.submodules.experts
        router = functools.partial(InklingRouter, n_shared_experts=options["n_shared_experts"],
                                   route_scale=options["route_scale"])
        mlp = ModuleSpec(module=InklingMoELayer, submodules=MoESubmodules(experts=experts, router=router),
                         params=dict(n_shared_experts=options["n_shared_experts"],
                                     conv_kernel_size=options["conv_kernel_size"]))
    else:
        mlp = ModuleSpec(module=InklingDenseMLP, submodules=dense_mlp,
                         params=dict(conv_kernel_size=options["conv_kernel_size"]))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=InklingRMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=InklingRMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def build_inkling_model(config, options: Mapping[str, Any], *, parallel_output: bool = True,
                        make_vocab_size_divisible_by: int = 128, pre_process: bool | None = None,
                        post_process: bool | None = None, vp_stage: int | None = None):
    """One megatron ``GPTModel`` holding this pipeline stage's Inkling layers.

    Args:
        config: a ``TransformerConfig`` from the Inkling translation (``qk_layernorm=True``).
        options: the translation's model options (see :mod:`ferrule.plugins.inkling.config`).
        parallel_output, make_vocab_size_divisible_by, pre_process, post_process, vp_stage: as
            :func:`ferrule.megatron.gpt_builder.build_gpt_model`.

    Returns:
        A ``GPTModel`` on the backend's device; parameters in ``config.params_dtype`` except the
        ShortConv weights and the router's weight / ``global_scale`` / ``expert_bias`` (fp32, as
        HF keeps them: ``_keep_in_fp32_modules_strict``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from ferrule.megatron.shared_layers import InklingNormedEmbedding
    from ferrule.plugins.inkling.layers import InklingFinalNorm

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    block = TransformerBlockSubmodules(
        layer_specs=[inkling_layer_spec(offset + i, options, config) for i in range(count)],
        layer_norm=ModuleSpec(module=InklingFinalNorm,
                              params={"logits_multiplier": options["logits_mup_width_multiplier"]}))
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    vocab = padded_vocab_size(int(options["vocab_size"]), config.tensor_model_parallel_size,
                              make_vocab_size_divisible_by)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab,
                     max_sequence_length=int(options["max_sequence_length"]), pre_process=pre_process,
                     post_process=post_process, parallel_output=parallel_output,
                     share_embeddings_and_output_weights=False, position_embedding_type="none", vp_stage=vp_stage)
    if pre_process:
        model.embedding = InklingNormedEmbedding(config, vocab, int(options["max_sequence_length"]),
                                                 padding_idx=options.get("padding_idx"))
    backend = get_backend()
    if backend.kind == "cuda":
        model = model.to(backend.device)
    mark_tensor_parallel_params([model])
    return model


def build_from_hf_config(hf_config: Mapping[str, Any], layout, translation, *, params_dtype=torch.float32,
                         parallel_output: bool = True, moe_token_dispatcher_type: str = "alltoall",
                         use_cpu_initialization: bool | None = None, config_overrides=None,
                         make_vocab_size_divisible_by: int = 128, core_attention: str | None = None) -> list:
    """Provider body: this rank's Inkling model chunks for an HF config (see ``ProviderSpec.build``).

    ``core_attention`` is accepted for interface compatibility (None, ``'sdpa'`` or ``'eager'``,
    all meaning the same): the Inkling attention computes HF's eager attention with the
    per-query relative bias itself; another value is refused.

    Raises:
        ConfigTranslationError: unsupported HF config (from the translation).
        ValueError: a layout the model cannot use (see :func:`check_inkling_layout`).
        RuntimeError: megatron not initialized with ``layout``.
    """
    from megatron.core import parallel_state

    if core_attention not in (None, "eager", "sdpa"):
        raise ValueError(f"Inkling: core_attention={core_attention!r}; the Inkling attention is built in "
                         f"(relative bias + window), leave it unset.")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Inkling provider: call ferrule.megatron.parallel.init_distributed(layout) first.")
    config_kwargs, options = translation.to_mcore(hf_config)
    check_inkling_layout(config_kwargs, options, layout)
    overrides = dict(config_overrides or {})
    if config_kwargs.get("num_moe_experts"):
        overrides.setdefault("moe_token_dispatcher_type", moe_token_dispatcher_type)
    config = make_transformer_config(config_kwargs, layout, params_dtype=params_dtype, activation="silu",
                                     use_cpu_initialization=use_cpu_initialization, overrides=overrides)
    stages = layout.vpp or 1
    return [build_inkling_model(config, options, parallel_output=parallel_output,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                vp_stage=(i if layout.vpp else None)) for i in range(stages)]


