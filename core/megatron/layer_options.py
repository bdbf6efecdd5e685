"""Per-layer RoPE, pre-norm placement and q/k norm scope: builder options for non-Llama decoders.

Used by :mod:`ferrule.megatron.extensions` (which turns model options into a layer spec); every
class here keeps the local spec's megatron parameter names.

- ``layer_rope``: one RoPE per decoder layer, a tuple with an entry per layer (HF order), each
  a mapping ``{"rotary_base": float, "rope_scaling": None | {"type": "linear"|"llama3",
  "factor": f}, "rotary_percent": float (optional, default the model's), "layer_type": str
  (optional, the HF layer type it came from; reports and the kit's per-type comparison)}``. HF families with
  one RoPE per layer *type* (Gemma-3's ``rope_parameters.{sliding_attention,full_attention}``
  with ``layer_types``) produce it with
  :data:`ferrule.config_translation.LAYER_TYPE_ROPE_ENTRIES`. Implemented by
  :class:`LayerRoPESelfAttention`, which replaces the model-wide table ``GPTModel`` passes with
  its own (megatron ``RotaryEmbedding`` built from the layer's entry; no parameters, nothing in
  the checkpoint). Context parallelism is refused (the model-wide table is CP-sliced).
- ``pre_norms``: ``True`` (default, Llama: ``input_layernorm`` before attention and
  ``pre_mlp_layernorm`` before the MLP), ``False`` (neither: OLMo-2, whose layers normalise the
  attention / MLP *outputs* only, with ``extra_norms``), or a tuple naming the ones kept
  (``("attention",)``, ``("mlp",)``). A dropped pre-norm is megatron's ``IdentityOp`` (no
  parameter).
- ``qk_norm``: scope of the q/k RMSNorm when ``TransformerConfig.qk_layernorm`` is set:
  ``"per_head"`` (default; megatron's, HF Qwen3 / Gemma-3: one ``[head_dim]`` weight shared by
  every head) or ``"full_projection"`` (HF OLMo-2: ``q_norm`` over the whole ``[num_heads *
  head_dim]`` query projection, ``k_norm`` over ``[num_kv_heads * head_dim]``, before the heads
  are split). :class:`FullProjectionRMSNorm` is TP-aware: each rank holds its heads' slice of the
  weight (``TPSplit.COLUMN`` rows in the mapping table, dim 0, HF head order), and the mean of
  squares is all-reduced over the TP group (autograd-aware: gradients are all-reduced too).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from megatron.core.transformer.attention import SelfAttention

__all__ = ["LayerRoPESelfAttention", "FullProjectionRMSNorm", "keep_sharded_qk_norm_grads", "PRE_NORMS",
           "QK_NORM_SCOPES", "pre_norms_kept", "check_layer_rope", "rope_scaling_kwargs", "yarn_config_attributes"]

#: Names accepted in a ``pre_norms`` tuple.
PRE_NORMS = ("attention", "mlp")
#: Values of the ``qk_norm`` option.
QK_NORM_SCOPES = ("per_head", "full_projection")
_LAYER_ROPE_KEYS = {"layer_type", "rotary_base", "rope_scaling", "rotary_percent"}


def pre_norms_kept(value: Any) -> tuple[str, ...]:
    """The pre-norms kept by a ``pre_norms`` option value (True: both; False: none).

    Raises:
        ValueError: a value that is neither a bool nor a tuple of :data:`PRE_NORMS` names.
    """
    if value is True:
        return PRE_NORMS
    if value is False:
        return ()
    if isinstance(value, (tuple, list)) and all(v in PRE_NORMS for v in value):
        return tuple(value)
    raise ValueError(f"pre_norms={value!r}: use True, False or a tuple of {list(PRE_NORMS)}.")


def check_layer_rope(layer_rope: Any, num_layers: int) -> tuple[dict, ...]:
    """``layer_rope`` validated: one mapping per layer with keys from ``rotary_base``, ``rope_scaling``,
    ``rotary_percent``.

    Raises:
        ValueError: wrong length, a non-mapping entry, an unknown key, no ``rotary_base``, or a
            ``rope_scaling`` other than None / linear / llama3 (YaRN is model-wide only: megatron's
            ``YarnRotaryEmbedding`` also scales attention, which a per-layer table cannot).
    """
    if not isinstance(layer_rope, (tuple, list)) or len(layer_rope) != num_layers:
        raise ValueError(f"layer_rope needs one entry per decoder layer ({num_layers}), got {layer_rope!r}.")
    out = []
    for i, entry in enumerate(layer_rope):
        if not isinstance(entry, Mapping) or "rotary_base" not in entry:
            raise ValueError(f"layer_rope[{i}]={entry!r}: expected a mapping with 'rotary_base'.")
        unknown = sorted(set(entry) - _LAYER_ROPE_KEYS)
        if unknown:
            raise ValueError(f"layer_rope[{i}] has unknown key(s) {unknown}; known: {sorted(_LAYER_ROPE_KEYS)}.")
        kind = (entry.get("rope_scaling") or {}).get("type")
        if kind not in (None, "linear", "llama3"):
            raise ValueError(f"layer_rope[{i}] (layer type {entry.get('layer_type')!r}) has rope_scaling type {kind!r}; "
                             f"per-layer RoPE supports linear and llama3 scaling only.")
        out.append(dict(entry))
    return tuple(out)


def rope_scaling_kwargs(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """``GPTModel`` keywords for the ``rope_scaling`` model option (see :func:`build_gpt_model`)."""
    if not rope_scaling:
        return {}
    kind, factor = rope_scaling.get("type"), float(rope_scaling.get("factor", 0.0))
    if kind == "linear":
        return {"seq_len_interpolation_factor": factor}
    if kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": factor}
    if kind == "yarn":  # position_embedding_type='yarn' + config attributes (yarn_config_attributes)
        return {}
    raise ValueError(f"rope_scaling={dict(rope_scaling)!r}: type must be 'linear', 'llama3' or 'yarn'.")


def yarn_config_attributes(rope_scaling: Mapping[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` attributes megatron-core 0.16.1 reads for ``position_embedding_type='yarn'``.

    ``GPTModel`` builds ``YarnRotaryEmbedding`` from ``config.yarn_*`` (``getattr`` without a
    default: a plain ``TransformerConfig`` has no such fields, so the builder sets them), and
    ``Attention`` multiplies cos/sin by ``_yarn_get_concentration_factor_from_config(config)``.
    ``rope_scaling`` is :func:`ferrule.config_translation.yarn_from_hf`'s dict. The concentration
    factor is HF's ``attention_factor``: when it is HF's default ``0.1 ln(factor) + 1``,
    ``yarn_mscale`` / ``yarn_mscale_all_dim`` are None (megatron's ``_yarn_get_mscale(factor)``,
    the same formula); otherwise ``yarn_mscale = (attention_factor - 1) / (0.1 ln(factor))`` with
    ``yarn_mscale_all_dim = 0`` (megatron: ``get_mscale(factor, m) / get_mscale(factor, 0)``).
    """
    import math

    factor, attention = float(rope_scaling["factor"]), float(rope_scaling["attention_factor"])
    default = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    if attention == default:
        mscale = mscale_all_dim = None
    else:
        mscale, mscale_all_dim = (attention - 1.0) / (0.1 * math.log(factor)), 0.0
    return {"yarn_rotary_scaling_factor": factor,
            "yarn_original_max_position_embeddings": int(rope_scaling["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rope_scaling["beta_fast"]), "yarn_beta_slow": float(rope_scaling["beta_slow"]),
            "yarn_mscale": mscale, "yarn_mscale_all_dim": mscale_all_dim,
            "yarn_correction_range_round_to_int": bool(rope_scaling["truncate"])}


class LayerRoPESelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` that rotates q/k with its own layer's RoPE (``layer_rope`` option).

    Construction is ``SelfAttention``'s plus the ModuleSpec param ``layer_rope`` (the validated
    per-layer tuple); layer ``layer_number`` (1-based, global over pipeline stages, megatron's
    numbering) uses ``layer_rope[layer_number - 1]``. In ``forward`` the model-wide
    ``rotary_pos_emb`` ``[s, 1, 1, rotary_dim]`` is replaced by this layer's table of the same
    length (megatron's ``RotaryEmbedding(s)``: angles ``pos * inv_freq``, positions divided by
    ``seq_len_interpolation_factor`` for linear scaling, Llama-3.1 frequencies for ``llama3``).
    """

    def __init__(self, *args: Any, layer_rope: tuple = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        if self.config.context_parallel_size > 1:
            raise NotImplementedError("layer_rope (per-layer RoPE) does not support context parallelism.")
        entry = layer_rope[self.layer_number - 1]
        scaling = rope_scaling_kwargs(entry.get("rope_scaling"))
        self.layer_rotary = RotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=float(entry.get("rotary_percent", 1.0)),
            rotary_base=float(entry["rotary_base"]),
            use_cpu_initialization=self.config.use_cpu_initialization,
            seq_len_interpolation_factor=scaling.get("seq_len_interpolation_factor"),
            rope_scaling=scaling.get("rope_scaling", False),
            rope_scaling_factor=scaling.get("rope_scaling_factor", 8.0),
        )

    def forward(self, hidden_states, attention_mask, *args: Any, rotary_pos_emb=None, packed_seq_params=None,
                **kwargs: Any):
        if rotary_pos_emb is not None:
            packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            rotary_pos_emb = self.layer_rotary(rotary_pos_emb.shape[0], packed_seq=packed)
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=packed_seq_params, **kwargs)


def keep_sharded_qk_norm_grads() -> None:
    """Keep megatron's gradient finalization from summing a TP-sharded q/k norm's gradient over TP.

    megatron-core 0.16.1's ``finalize_model_grads`` sums over the TP group the gradient of every parameter whose
    name holds ``q_layernorm`` / ``k_layernorm`` (``config.qk_layernorm``;
    ``_allreduce_non_tensor_model_parallel_grads``), right for megatron's per-head norm (one replicated weight, each rank's gradient partial) but wrong for
    :class:`FullProjectionRMSNorm`, whose weight is TP-sharded: every rank got the sum of two different shards'
    gradients (``ferrule check --tp 2 --grads`` on the tiny OLMo-2: ``k_norm.weight`` relative difference 1; the
    raw per-rank gradients match HF within 1.1e-6). The wrapper installed here hides the gradient of such a
    parameter (``tensor_model_parallel``) from that sum and gives it back unchanged; every other parameter is
    reduced as megatron reduces it. Idempotent; installed when such a norm is built at TP > 1.
    """
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package attr: a function

    original = fmg._allreduce_non_tensor_model_parallel_grads
    if getattr(original, "_ferrule_keeps_sharded_qk_norms", False):
        return

    def allreduce(model, config, *args, **kwargs):
        from megatron.core.utils import get_attr_wrapped_model

        hidden = []
        if getattr(config, "qk_layernorm", False):
            for chunk in model:
                for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
                    if ("q_layernorm" in name or "k_layernorm" in name) and getattr(param, "tensor_model_parallel",
                                                                                    False):
                        attr = "main_grad" if hasattr(param, "main_grad") else "grad"
                        hidden.append((param, attr, getattr(param, attr)))
                        setattr(param, attr, None)  # megatron skips a parameter without a gradient
        try:
            return original(model, config, *args, **kwargs)
        finally:
            for param, attr, grad in hidden:
                setattr(param, attr, grad)

    allreduce._ferrule_keeps_sharded_qk_norms = True
    fmg._allreduce_non_tensor_model_parallel_grads = allreduce


class FullProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over a whole q or k projection ``[sq, b, heads_local, head_dim]`` (HF OLMo-2 ``q_norm``/``k_norm``).

    ``y = x / sqrt(mean over all heads and channels of x^2 + eps) * w`` in fp32, cast back to x's
    dtype (HF ``Olmo2RMSNorm``: weight multiplied in fp32). ``which="q"`` spans
    ``num_attention_heads * kv_channels`` channels, ``"k"`` ``num_query_groups * kv_channels``;
    this rank holds ``1/tp`` of the heads and of the weight (dim 0, marked
    ``tensor_model_parallel``), and the sum of squares is all-reduced over the TP group.
    ``zero_centered`` uses ``1 + w`` (weight initialised to 0). Constructor matches megatron's
    norm builders (``config, hidden_size=head_dim, eps``).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, which: str = "q",
                 zero_centered: bool = False, **_unused: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if which not in ("q", "k"):
            raise ValueError(f"FullProjectionRMSNorm(which={which!r}): use 'q' or 'k'.")
        heads = config.num_attention_heads if which == "q" else (config.num_query_groups or config.num_attention_heads)
        tp = config.tensor_model_parallel_size
        self.eps, self.zero_centered, self.tp = float(eps), bool(zero_centered), tp
        self.full_width = int(heads) * int(hidden_size)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(self.full_width // tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if tp > 1:
            keep_sharded_qk_norm_grads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        flat = h.reshape(*h.shape[:-2], -1)  # [sq, b, heads_local * head_dim]
        sq_sum = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            import torch.distributed.nn.functional as dist_fn
            from megatron.core import parallel_state

            sq_sum = dist_fn.all_reduce(sq_sum, group=parallel_state.get_tensor_model_parallel_group())
        flat = flat * torch.rsqrt(sq_sum / self.full_width + self.eps)
        gain = (1.0 + self.weight.float()) if self.zero_centered else self.weight.float()
        return (flat * gain).reshape(h.shape).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The weight as a TP-sharded tensor (dim 0), so torch_dist checkpoints reshard across TP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 0}, sharded_offsets)
