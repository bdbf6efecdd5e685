"""Build the Megatron Inkling-2 text model: a megatron-core ``GPTModel`` whose decoder carries block attention residuals.

HF ``Inkling2TextModel.forward`` does not keep one residual stream: every
``n_layers_per_attn_res_block`` layers the current hidden state is appended to ``block_states``,
and each layer's attention / MLP input (and the final norm's input) is a learned attention over
those blocks plus the partial state (:class:`~ferrule.plugins.inkling2.layers.Inkling2BlockAttentionResidual`).
:class:`Inkling2Block` (a ``TransformerBlock``) carries ``block_states`` from layer to layer;
:class:`Inkling2Layer` is one HF ``Inkling2SlidingDecoderLayer`` / ``Inkling2FullDecoderLayer``.

Parameter names (megatron side) are ``decoder.layers.L.<module>...``, ``decoder.final_input.query``,
``decoder.final_layernorm.weight``, ``embedding.word_embeddings.weight``, ``embedding.embed_norm.weight``,
``output_layer.weight`` (padded vocabulary rows; rows past ``unpadded_vocab_size`` are zero on load and
their logits are masked to the dtype's minimum, so softmax gives them no mass).

Limits (each refused with a ``ValueError`` naming it): pipeline / virtual pipeline and context
parallelism (``block_states`` would have to cross stages; the convolutions need the whole sequence).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from ferrule.megatron.device import get_backend
from ferrule.megatron.extensions import install_output_hooks
from ferrule.megatron.gpt_builder import mark_tensor_parallel_params
from ferrule.megatron.gpt_config import check_layout_fits, make_transformer_config, padded_vocab_size
from ferrule.plugins.inkling2.layers import (Inkling2Attention, Inkling2BlockAttentionResidual, Inkling2NormedEmbedding,
                                             Inkling2RMSNorm, Inkling2ShortConv)
from ferrule.plugins.inkling2.moe import Inkling2Experts, Inkling2MoELayer, Inkling2Router

__all__ = ["Inkling2Layer", "Inkling2Block", "build_inkling2_model", "build_from_hf_config", "check_inkling2_layout"]


class Inkling2Layer(MegatronModule):
    """One decoder layer (HF ``Inkling2{Sliding,Full}DecoderLayer.forward``), ``[s, b, h]`` activations::

        x = attention_input(block_states, h)          (layer 0: x = h; full layers: 3 queries -> q, k, v inputs)
        a = post_attention_convolution(self_attention(norms(x)))
        r = a                if the layer starts a block (block_states += [h])
            h + a            otherwise
        out = r + post_mlp_convolution(mlp(pre_mlp_layernorm(mlp_input(block_states, r))))
    """

    def __init__(self, config, layer_number: int = 1, pg_collection=None, vp_stage=None, *, options: Mapping[str, Any]):
        super().__init__(config=config)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe.moe_layer import MoESubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module

        self.layer_number = layer_number
        index = layer_number - 1
        self.sliding = bool(options["sliding_layers"][index])
        self.is_block_boundary = index % int(options["n_layers_per_attn_res_block"]) == 0
        hidden, eps, k = config.hidden_size, config.layernorm_epsilon, int(options["conv_kernel_size"])
        self.attention_input = (Inkling2BlockAttentionResidual(config, 1 if self.sliding else 3) if index > 0 else None)
        self.mlp_input = Inkling2BlockAttentionResidual(config, 1)
        s = self.sliding
        self.self_attention = Inkling2Attention(
            config, sliding=s, num_heads=options["swa_num_attention_heads"] if s else config.num_attention_heads,
            num_kv_heads=options["swa_num_key_value_heads"] if s else config.num_query_groups,
            head_dim=options["swa_head_dim"] if s else config.kv_channels, d_rel=options["d_rel"],
            rel_extent=options["sliding_window_size"] if s else options["rel_extent"],
            window=options["sliding_window_size"] if s else None, conv_kernel_size=k,
            qk_clip=options["qk_l2_clip_threshold"], rel_clip=options["rel_l2_clip_threshold"],
            log_scaling_alpha=options["log_scaling_alpha"], log_scaling_n_floor=options["log_scaling_n_floor"])
        if s:
            self.input_layernorm = Inkling2RMSNorm(config, hidden, eps)
        else:
            self.q_input_layernorm = Inkling2RMSNorm(config, hidden, eps)
            self.k_input_layernorm = Inkling2RMSNorm(config, hidden, eps)
            self.v_input_layernorm = Inkling2RMSNorm(config, hidden, eps)
        self.pre_mlp_layernorm = Inkling2RMSNorm(config, hidden, eps)
        self.post_attention_convolution = Inkling2ShortConv(config, hidden, k)
        self.post_mlp_convolution = Inkling2ShortConv(config, hidden, k)
        mlp_sub = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False
                                           ).submodules.mlp.submodules.experts.submodules
        experts = ModuleSpec(module=Inkling2Experts, submodules=mlp_sub,
                             params=dict(gate_softcap=options["mlp_gate_softcap"], up_softcap=options["mlp_up_softcap"]))
        import functools
        router = functools.partial(Inkling2Router, route_scale=options["route_scale"])
        self.mlp = build_module(ModuleSpec(module=Inkling2MoELayer, submodules=MoESubmodules(experts=experts, router=router)),
                                config=config, layer_number=layer_number, pg_collection=pg_collection)
        self.loop_range = None
        if "loop_layer_index_start" in options:
            self.loop_range = tuple(int(options[k]) for k in ("loop_layer_index_start", "loop_layer_index_end",
                                                               "loop_num_passes"))
        self.loop = "loop_layer_index_start" in options and (
            int(options["loop_layer_index_start"]) <= index < int(options["loop_layer_index_end"]))
        if self.loop:
            from ferrule.plugins.inkling2.layers import Inkling2LoopMessageGate

            for which in ("q", "k", "v", "mlp"):
                setattr(self, f"{which}_message_gate", Inkling2LoopMessageGate(config, int(options["loop_gate_rank"])))

    def forward(self, hidden_states: torch.Tensor, block_states: torch.Tensor, attention_mask=None,
                messages: tuple | None = None) -> torch.Tensor:
        """``messages``: the loop passes after the first give loop layers the previous pass's ``(q, k, v, mlp)``
        messages, mixed into the attention and MLP inputs by the message gates (HF ``Inkling2Loop*LoopDecoderLayer``)."""
        dtype = hidden_states.dtype
        block_residual = hidden_states
        if self.sliding:
            x = hidden_states if self.attention_input is None else self.attention_input(block_states, hidden_states)[0]
            if messages is None:
                attn = self.self_attention(self.input_layernorm(x).to(dtype), attention_mask=attention_mask)
            else:
                xq, xk, xv = (self.input_layernorm(gate(x, m)).to(dtype) for gate, m in
                              zip((self.q_message_gate, self.k_message_gate, self.v_message_gate), messages))
                attn = self.self_attention(xq, xk, xv, attention_mask=attention_mask)
        else:
            if self.attention_input is None:
                xq = xk = xv = hidden_states
            else:
                xq, xk, xv = self.attention_input(block_states, hidden_states)
            if messages is not None:
                xq, xk, xv = (gate(x, m) for gate, x, m in zip(
                    (self.q_message_gate, self.k_message_gate, self.v_message_gate), (xq, xk, xv), messages))
            attn = self.self_attention(self.q_input_layernorm(xq).to(dtype), self.k_input_layernorm(xk).to(dtype),
                                       self.v_input_layernorm(xv).to(dtype), attention_mask=attention_mask)
        residual = h = self.post_attention_convolution(attn).float()
        if self.is_block_boundary:
            block_states = torch.cat([block_states, block_residual.unsqueeze(-2)], dim=-2)
        else:
            residual = h = block_residual.float() + h
        h = self.mlp_input(block_states, h)[0]
        if messages is not None:
            h = self.mlp_message_gate(h, messages[3])
        h, _ = self.mlp(self.pre_mlp_layernorm(h).to(dtype))
        h = self.post_mlp_convolution(h)
        return (residual + h).to(dtype)


class Inkling2Block(TransformerBlock):
    """``TransformerBlock`` running :class:`Inkling2Layer` s with ``block_states`` (HF ``Inkling2TextModel.forward``)
    and the final attention residual ``final_input`` before ``final_layernorm``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        self.final_input = Inkling2BlockAttentionResidual(self.config, 1)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, inference_context=None, **_unused):
        if packed_seq_params is not None or inference_context is not None:
            raise NotImplementedError("Inkling-2: packed (THD) sequences and megatron inference contexts are not "
                                      "supported; pass [b, s] batches.")
        if not self.pre_process:
            hidden_states = self.input_tensor
        block_states = hidden_states.new_zeros(*hidden_states.shape[:-1], 0, hidden_states.shape[-1])
        for layer in self.layers:
            new = layer(hidden_states, block_states, attention_mask=attention_mask)
            if layer.is_block_boundary:
                block_states = torch.cat([block_states, hidden_states.unsqueeze(-2)], dim=-2)
            hidden_states = new
        out = self.final_input(block_states, hidden_states)[0]
        return self.final_layernorm(out).to(hidden_states.dtype)


def check_inkling2_layout(config_kwargs: Mapping[str, Any], options: Mapping[str, Any], layout) -> None:
    """Raise ``ValueError`` (naming the number and the fix) if ``layout`` cannot split this model."""
    check_layout_fits(config_kwargs, layout)
    if getattr(layout, "pp", 1) > 1 or getattr(layout, "vpp", None):
        raise ValueError("Inkling-2: pipeline parallelism is not implemented (the block attention residuals carry "
                         "every block's state across layers); use pp=1.")
    if getattr(layout, "cp", 1) > 1:
        raise ValueError("Inkling-2: context parallelism is not implemented (the relative bias and convolutions need "
                         "the whole sequence); use cp=1.")
    tp = layout.tp
    counts = {"swa_num_attention_heads": options["swa_num_attention_heads"],
              "swa_num_key_value_heads": options["swa_num_key_value_heads"],
              "num_attention_heads": config_kwargs["num_attention_heads"],
              "num_key_value_heads": config_kwargs["num_query_groups"],
              "moe_intermediate_size": options["moe_intermediate_size"]}
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(f"Inkling-2: tp={tp} must divide {bad} (whole heads per rank; KV-head replication is not "
                         f"implemented); choose a tp that divides them.")


def _install_output(model, options) -> None:
    """Final-logit soft-cap (the builder's ``final_logit_softcapping`` hook), then padded rows masked."""
    from megatron.core import parallel_state

    install_output_hooks(model, embedding_multiplier=None, final_logit_softcapping=options["final_logit_softcapping"])
    unpadded = int(options["unpadded_vocab_size"])

    def _mask_padding(module, _inputs, output):
        logits, bias = output
        local = logits.shape[-1]
        # vocab-parallel logits hold this rank's rows; gathered ones (parallel_output=False) start at column 0
        start = parallel_state.get_tensor_model_parallel_rank() * local if local == module.weight.shape[0] else 0
        if start + local <= unpadded:
            return logits, bias
        cols = torch.arange(start, start + local, device=logits.device) >= unpadded
        return logits.masked_fill(cols, torch.finfo(logits.dtype).min), bias

    model.output_layer.register_forward_hook(_mask_padding)


def build_inkling2_model(config, options: Mapping[str, Any], *, parallel_output: bool = True,
                         make_vocab_size_divisible_by: int = 128, block_cls=None):
    """One megatron ``GPTModel`` holding the Inkling-2 text model (pp=1).

    ``block_cls``: the decoder class (default :class:`Inkling2Block`; Inkling-2-Loop passes
    :class:`ferrule.plugins.inkling2.loop.Inkling2LoopBlock`).

    Returns:
        A ``GPTModel`` on the backend's device; logits ``[b, s, padded_vocab / tp]`` (fp32 params: fp32).
        Convolution weights, router weight / bias and the attention-residual queries are fp32, as HF keeps them.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    norm = ModuleSpec(module=Inkling2RMSNorm)
    specs = [ModuleSpec(module=Inkling2Layer, params={"options": options}) for _ in range(config.num_layers)]
    vocab = padded_vocab_size(int(options["vocab_size"]), config.tensor_model_parallel_size,
                              make_vocab_size_divisible_by)
    empty = TransformerBlockSubmodules(layer_specs=[], layer_norm=norm)
    model = GPTModel(config=config, transformer_layer_spec=empty, vocab_size=vocab,
                     max_sequence_length=int(options["max_sequence_length"]), pre_process=True, post_process=True,
                     parallel_output=parallel_output, share_embeddings_and_output_weights=False,
                     position_embedding_type="none")
    model.decoder = (block_cls or Inkling2Block)(config=config, spec=TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm),
                                  pre_process=True, post_process=True, pg_collection=model.pg_collection)
    model.embedding = Inkling2NormedEmbedding(config, vocab, int(options["max_sequence_length"]),
                                              padding_idx=options.get("padding_idx"))
    _install_output(model, options)
    backend = get_backend()
    if backend.kind == "cuda":
        model = model.to(backend.device)
    mark_tensor_parallel_params([model])
    return model


def build_from_hf_config(hf_config: Mapping[str, Any], layout, translation, *, params_dtype=torch.float32,
                         parallel_output: bool = True, moe_token_dispatcher_type: str = "alltoall",
                         use_cpu_initialization: bool | None = None, config_overrides=None,
                         make_vocab_size_divisible_by: int = 128, core_attention: str | None = None,
                         block_cls=None) -> list:
    """Provider body: this rank's Inkling-2 model (one chunk) for an HF config (see ``ProviderSpec.build``).

    Raises:
        ConfigTranslationError: unsupported HF config (from the translation).
        ValueError: a layout the model cannot use (:func:`check_inkling2_layout`), or ``core_attention``
            other than None / ``'eager'`` / ``'sdpa'`` (the attention, with its sinks, is built in).
        RuntimeError: megatron not initialized.
    """
    from megatron.core import parallel_state

    if core_attention not in (None, "eager", "sdpa"):
        raise ValueError(f"Inkling-2: core_attention={core_attention!r}; the Inkling-2 attention (sinks, relative "
                         f"bias, window) is built in, leave it unset.")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Inkling-2 provider: call ferrule.megatron.parallel.init_distributed(layout) first.")
    config_kwargs, options = translation.to_mcore(hf_config)
    check_inkling2_layout(config_kwargs, options, layout)
    overrides = dict(config_overrides or {})
    overrides.setdefault("moe_token_dispatcher_type", moe_token_dispatcher_type)
    config = make_transformer_config(config_kwargs, layout, params_dtype=params_dtype, activation="silu",
                                     use_cpu_initialization=use_cpu_initialization, overrides=overrides)
    return [build_inkling2_model(config, options, parallel_output=parallel_output,
                                 make_vocab_size_divisible_by=make_vocab_size_divisible_by, block_cls=block_cls)]
