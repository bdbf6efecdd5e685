"""Builder extension points for families whose decoder is not plain Llama (used by :mod:`.gpt_builder`).

Each option is a model option a family's config translation may produce (or a keyword of
:func:`ferrule.megatron.gpt_builder.build_gpt_model`); every one leaves the megatron parameter
names of the standard local spec unchanged and adds only the parameters named below.

- ``zero_centered_norms=True``: every RMSNorm computes ``norm(x) * (1 + w)`` in fp32 and casts
  back (HF ``Gemma2RMSNorm``); the stored weight is HF's ``w`` unchanged, so conversion is
  bit-exact. Class :class:`FerruleRMSNorm`.
- ``extra_norms=("post_attention", "post_mlp")``: an RMSNorm on the attention output and/or the
  dense MLP output *before* the residual add (Gemma-2's ``post_attention_layernorm`` /
  ``post_feedforward_layernorm``). They live inside the row-parallel output projections
  (:class:`PostNormRowParallelLinear`): parameters
  ``decoder.layers.N.self_attention.linear_proj.post_layernorm.weight`` and
  ``decoder.layers.N.mlp.linear_fc2.post_layernorm.weight`` ``[hidden]`` (replicated over TP;
  the norm sees the full, all-reduced output).
- ``attn_logit_softcapping=c``: scores ``s = q.k * scale`` become ``c * tanh(s / c)`` before
  masking and softmax (HF Gemma-2 ``eager_attention_forward``); SDPA cannot do this, so
  :class:`ferrule.megatron.attention.SDPAttention` takes an explicit matmul path for it.
- ``final_logit_softcapping=c``: logits ``[s, b, vocab / tp]`` become ``c * tanh(logits / c)``
  (HF ``Gemma2ForCausalLM.forward``); applied by a forward hook on ``output_layer``, so the
  ``labels=`` loss sees capped logits too.
- ``embedding_multiplier=m``: the word embeddings ``[s, b, hidden]`` are multiplied by ``m``
  (Gemma's ``sqrt(hidden_size)``, cast to the activation dtype as HF does); a forward hook on
  ``embedding``.
- ``layer_spec``: a complete megatron ``ModuleSpec`` for ``TransformerLayer`` (or a
  ``"module:attr"`` reference to ``f(config) -> ModuleSpec``) replacing the local spec. The
  ``core_attention`` choice composes with it (:func:`compose_core_attention`: a spec whose
  core attention is megatron's plain ``DotProductAttention`` gets ferrule's, SDPA by default);
  every other option above and in :mod:`ferrule.megatron.layer_options` is refused by name
  together with ``layer_spec`` (the builder cannot apply it to a spec it does not know; use
  :func:`customize_local_spec` to build such a spec).
- ``core_attention``: ``"sdpa"``, ``"local"``, a ``DotProductAttention`` subclass, or a
  ``"module:attr"`` reference to one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from .layer_options import FullProjectionRMSNorm, LayerRoPESelfAttention, QK_NORM_SCOPES, pre_norms_kept

__all__ = ["FerruleRMSNorm", "PostNormRowParallelLinear", "EXTRA_NORMS", "customize_local_spec",
           "compose_core_attention", "install_output_hooks", "resolve_class"]

#: Values accepted by the ``extra_norms`` option.
EXTRA_NORMS = ("post_attention", "post_mlp")


def resolve_class(value: Any, what: str) -> Any:
    """``value`` itself, or the object a ``"module:attr"`` string names."""
    if isinstance(value, str) and ":" in value:
        from ferrule.contract.specs import resolve_ref

        return resolve_ref(value)
    if isinstance(value, str):
        raise ValueError(f"{what}={value!r} is neither a known name nor a 'module:attr' reference.")
    return value


class FerruleRMSNorm(torch.nn.Module):
    """RMSNorm ``[..., hidden]`` computed in fp32: ``x / sqrt(mean(x^2) + eps) * g`` cast back to x's dtype.

    ``g = 1 + weight`` when ``zero_centered`` (weight initialised to 0; HF ``Gemma2RMSNorm``),
    else ``g = weight`` (initialised to 1; HF ``LlamaRMSNorm`` multiplies after the cast, which
    is the same in fp32). Constructor matches megatron's norm builders
    (``config, hidden_size, eps``).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, zero_centered: bool = False,
                 **_unused: Any) -> None:
        super().__init__()
        self.eps = float(eps)
        self.zero_centered = bool(zero_centered)
        dtype = getattr(config, "params_dtype", torch.float32)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        if config is not None and getattr(config, "sequence_parallel", False):
            raise NotImplementedError("FerruleRMSNorm does not support sequence parallelism.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = (1.0 + self.weight.float()) if self.zero_centered else self.weight.float()
        return (h * gain).to(x.dtype)


def _norm_spec(zero_centered: bool):
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=FerruleRMSNorm, params={"zero_centered": zero_centered})


class PostNormRowParallelLinear(RowParallelLinear):
    """A ``RowParallelLinear`` whose (all-reduced) output is normalised by its child ``post_layernorm``.

    Output ``(norm(x W^T), bias)``; bias must be None (``add_bias_linear=False``), since the norm
    would otherwise see a pre-bias output. ``zero_centered`` selects the ``(1 + w)`` norm.
    """

    def __init__(self, *args: Any, zero_centered: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            raise NotImplementedError("a post-norm output projection needs add_bias_linear=False.")
        self.post_layernorm = FerruleRMSNorm(self.config, self.output_size, self.config.layernorm_epsilon,
                                             zero_centered=zero_centered)

    def forward(self, input_):
        out, bias = super().forward(input_)
        return self.post_layernorm(out), bias


def customize_local_spec(spec, config, *, attention_cls, attn_logit_softcapping: float | None,
                         extra_norms: tuple[str, ...], zero_centered_norms: bool, pre_norms: Any = True,
                         qk_norm: str = "per_head", layer_rope: tuple | None = None):
    """The local layer ``spec`` with the core attention, norms, post-norms and RoPE of the options.

    ``pre_norms``, ``qk_norm`` and ``layer_rope`` are described in
    :mod:`ferrule.megatron.layer_options`; the rest in this module's docs.

    Returns:
        ``(layer_spec, final_norm_spec_or_None)``; the final norm spec must go to the
        ``TransformerBlock`` (megatron builds it there, not in the layer).

    Raises:
        ValueError: an unknown ``extra_norms`` / ``pre_norms`` entry or ``qk_norm`` scope,
            ``qk_norm='full_projection'`` without ``qk_layernorm``, or a post-MLP norm on an MoE layer.
    """
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    bad = [n for n in extra_norms if n not in EXTRA_NORMS]
    if bad:
        raise ValueError(f"extra_norms has {bad}; supported: {list(EXTRA_NORMS)}.")
    if qk_norm not in QK_NORM_SCOPES:
        raise ValueError(f"qk_norm={qk_norm!r}; supported: {list(QK_NORM_SCOPES)}.")
    if qk_norm == "full_projection" and not config.qk_layernorm:
        raise ValueError("qk_norm='full_projection' needs TransformerConfig qk_layernorm=True (Constant row).")
    kept = pre_norms_kept(pre_norms)
    custom_norms = zero_centered_norms or bool(extra_norms)
    if (custom_norms or qk_norm != "per_head") and config.normalization != "RMSNorm":
        raise ValueError(f"zero_centered_norms / extra_norms / qk_norm need normalization='RMSNorm', "
                         f"got {config.normalization!r}.")
    sub = spec.submodules
    attn = sub.self_attention
    core = ModuleSpec(module=attention_cls, params={"softcap": attn_logit_softcapping}) \
        if attn_logit_softcapping is not None else attention_cls
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
    norm = _norm_spec(zero_centered_norms) if custom_norms else None
    if qk_norm == "full_projection":
        attn_sub = dataclasses.replace(attn_sub, **{f"{w}_layernorm": ModuleSpec(
            module=FullProjectionRMSNorm, params={"which": w, "zero_centered": zero_centered_norms}) for w in "qk"})
    elif norm is not None and config.qk_layernorm:
        attn_sub = dataclasses.replace(attn_sub, q_layernorm=norm, k_layernorm=norm)
    if "post_attention" in extra_norms:
        attn_sub = dataclasses.replace(attn_sub, linear_proj=ModuleSpec(
            module=PostNormRowParallelLinear, params={"zero_centered": zero_centered_norms}))
    attn_spec = dataclasses.replace(attn, submodules=attn_sub)
    if layer_rope is not None:
        attn_spec = dataclasses.replace(attn_spec, module=LayerRoPESelfAttention,
                                        params={**attn_spec.params, "layer_rope": tuple(layer_rope)})
    changes: dict[str, Any] = {"self_attention": attn_spec}
    if norm is not None:
        changes.update(input_layernorm=norm, pre_mlp_layernorm=norm)
    if "attention" not in kept:
        changes["input_layernorm"] = IdentityOp
    if "mlp" not in kept:
        changes["pre_mlp_layernorm"] = IdentityOp
    if "post_mlp" in extra_norms:
        if config.num_moe_experts:
            raise ValueError("extra_norms=('post_mlp',) is implemented for dense MLPs only.")
        mlp = sub.mlp
        changes["mlp"] = dataclasses.replace(mlp, submodules=dataclasses.replace(
            mlp.submodules, linear_fc2=ModuleSpec(module=PostNormRowParallelLinear,
                                                  params={"zero_centered": zero_centered_norms})))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes)), norm


def compose_core_attention(spec, attention_cls):
    """``spec`` (a ``TransformerLayer`` ``ModuleSpec``) with ``attention_cls`` as its core attention, when
    the spec's own is megatron's plain ``DotProductAttention`` (the local spec's, 2.7x slower than
    SDPA on an H200); any other core attention, or a spec of another shape, is returned unchanged."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    attn_sub = getattr(attn, "submodules", None)
    if attn_sub is None or getattr(attn_sub, "core_attention", None) is not DotProductAttention:
        return spec
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn_sub, core_attention=attention_cls))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def install_output_hooks(model, *, embedding_multiplier: float | None, final_logit_softcapping: float | None) -> None:
    """Forward hooks on ``model.embedding`` (scale) and ``model.output_layer`` (soft-cap), where present."""
    if embedding_multiplier is not None and getattr(model, "embedding", None) is not None:
        multiplier = float(embedding_multiplier)

        def _scale(_module, _inputs, output):
            # HF: hidden * torch.tensor(multiplier, dtype=hidden.dtype)
            return output * torch.tensor(multiplier, dtype=output.dtype, device=output.device)

        model.embedding.register_forward_hook(_scale)
    if final_logit_softcapping is not None and getattr(model, "output_layer", None) is not None:
        cap = float(final_logit_softcapping)

        def _softcap(_module, _inputs, output):
            logits, bias = output
            return torch.tanh(logits / cap) * cap, bias

        model.output_layer.register_forward_hook(_softcap)
