"""The config half of building a megatron-core ``GPTModel``: padded vocabulary, activations, the
``TransformerConfig`` from translated HF kwargs, and the layout check.

Import-light (megatron is imported inside :func:`make_transformer_config` only), so converters and
the conformance kit can check a layout before spawning processes. :mod:`ferrule.megatron.gpt_builder`
builds the model from it; its docstring has the usage.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from .parallel import ParallelLayout, ParallelLayoutError
from .device import get_backend
from ferrule.contract import registry

__all__ = ["ACTIVATIONS", "DEFAULT_VOCAB_DIVISIBLE_BY", "check_layout_fits", "check_family_layout", "gelu_tanh",
           "make_transformer_config", "padded_vocab_size"]

#: Megatron-LM's default ``--make-vocab-size-divisible-by``.
DEFAULT_VOCAB_DIVISIBLE_BY = 128

def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF ``gelu_pytorch_tanh`` / ``GELUTanh``; GeGLU in Gemma)."""
    return F.gelu(x, approximate="tanh")


#: Activation names (model option ``activation``, HF ``hidden_act`` spellings) -> torch functions.
#: With ``gated_linear_unit=True`` megatron computes ``act(x W_gate) * (x W_up)`` (SwiGLU for
#: silu, GeGLU for the gelus). A ``"module:attr"`` reference to any elementwise function is
#: accepted too.
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh}


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Embedding rows for ``vocab_size`` tokens at tensor-parallel size ``tp``.

    Rounds up to a multiple of ``lcm(divisible_by, tp)``: every TP rank holds the same number of
    rows, and, for the usual power-of-two ``tp <= divisible_by``, the padded size does not
    depend on ``tp``, so a torch_dist checkpoint saved at one TP size loads at another (the
    embedding's global shape is part of the checkpoint). This differs on purpose from
    Megatron-LM's ``_vocab_size_with_padding`` (multiple of ``divisible_by * tp``), whose padded
    size changes with TP. E.g. ``padded_vocab_size(151936, 1) == padded_vocab_size(151936, 8)
    == 151936``; ``padded_vocab_size(1000, 2) == 1024``; ``padded_vocab_size(100, 3, 128) == 384``.

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("divisible_by", divisible_by)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"padded_vocab_size: {name}={value!r}; expected an integer >= 1.")
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def make_transformer_config(
    config_kwargs: Mapping[str, Any],
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    activation: str = "silu",
    use_cpu_initialization: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
):
    """A ``TransformerConfig`` from translated kwargs plus the layout and runtime choices.

    Args:
        config_kwargs: ``TransformerConfig`` fields from :meth:`ConfigTranslation.to_mcore`.
        layout: sets tensor/pipeline/expert parallel sizes.
        params_dtype: ``torch.float32`` or ``torch.bfloat16`` (sets ``bf16`` and the pipeline dtype).
        activation: a key of :data:`ACTIVATIONS`, or a ``"module:attr"`` reference / callable.
        use_cpu_initialization: None = True on CPU, False on CUDA.
        overrides: extra ``TransformerConfig`` fields applied last (e.g.
            ``moe_token_dispatcher_type``, ``recompute_granularity``).

    Raises:
        ValueError: unknown activation/dtype, heads or KV groups not divisible by ``tp``, layers
            not divisible by ``pp``, experts not divisible by ``ep`` (naming value and fix).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if activation in ACTIVATIONS:
        activation_func = ACTIVATIONS[activation]
    elif callable(activation) or (isinstance(activation, str) and ":" in activation):
        from .extensions import resolve_class

        activation_func = resolve_class(activation, "activation")
    else:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {sorted(ACTIVATIONS)} "
                         f"or pass a 'module:attr' reference to an elementwise function.")
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype}; use torch.float32 or torch.bfloat16.")
    kw = dict(config_kwargs)
    kw.update(overrides or {})
    check_layout_fits(kw, layout)
    if use_cpu_initialization is None:
        use_cpu_initialization = get_backend().kind == "cpu"
    kw.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        context_parallel_size=layout.cp,
        sequence_parallel=False,  # the local spec's torch norms cannot do SP
        activation_func=activation_func,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
    )
    return TransformerConfig(**kw)


def check_layout_fits(config_kwargs: Mapping[str, Any], layout: ParallelLayout) -> None:
    """Raise :class:`~ferrule.megatron.parallel.ParallelLayoutError` (a ``ValueError``; the CLI prints it as one
    line) if ``layout`` cannot split the model described by ``config_kwargs``.

    ``config_kwargs`` are TransformerConfig kwargs (``num_attention_heads``, ``num_query_groups``,
    ``num_layers``, ``num_moe_experts``), as a family's config translation produces them. Cheap
    and import-free, so callers (e.g. the converters) can check before spawning processes.
    """
    heads = int(config_kwargs["num_attention_heads"])
    groups = int(config_kwargs.get("num_query_groups") or heads)
    if heads % layout.tp or groups % layout.tp:
        ok = [d for d in range(1, groups + 1) if heads % d == 0 and groups % d == 0]
        raise ParallelLayoutError(
            f"tp={layout.tp} must divide num_attention_heads={heads} and num_query_groups (KV heads)={groups}; "
            f"valid tp: {ok}."
        )
    layers = int(config_kwargs["num_layers"])
    if layers % layout.pp:
        raise ParallelLayoutError(f"pp={layout.pp} must divide num_layers={layers}; valid pp: "
                                  f"{[d for d in range(1, layers + 1) if layers % d == 0]}.")
    experts = config_kwargs.get("num_moe_experts")
    if experts and experts % layout.ep:
        raise ParallelLayoutError(f"ep={layout.ep} must divide the number of routed experts {experts}; "
                                  f"valid ep: {[d for d in range(1, experts + 1) if experts % d == 0]}.")
    if layout.ep > 1 and not experts:
        raise ParallelLayoutError(f"ep={layout.ep} but the model has no routed experts; use ep=1.")
    etp = layout.etp if layout.etp is not None else layout.tp
    if experts and config_kwargs.get("add_bias_linear") and etp != 1:
        # megatron-core 0.16.1 TransformerConfig.__post_init__ asserts "Bias in Moe is only supported when ETP==1"
        # (inside the build: a crash in a worker, after processes started)
        raise ParallelLayoutError(
            f"expert tensor-parallel size {etp}{' (the default: etp = tp)' if layout.etp is None else ''}: "
            f"megatron-core builds MoE layers with biases (add_bias_linear) only at etp=1; "
            f"set --etp 1 (train config: parallel.etp: 1).")
    if experts and layout.ep == 1 and layout.etp is not None and (etp > layout.tp or layout.tp % etp):
        raise ParallelLayoutError(f"etp={etp} must divide tp={layout.tp} when ep=1 (no sequence parallelism); "
                                  f"valid etp: {[d for d in range(1, layout.tp + 1) if layout.tp % d == 0]}.")


def check_family_layout(family: str, config_kwargs: Mapping[str, Any], layout: ParallelLayout) -> None:
    """:func:`check_layout_fits`, then the family's declared :class:`ferrule.contract.specs.LayoutSupport`
    (``ModelFamilySpec.layouts``): the one layout check every command runs before it starts processes.

    Raises:
        ParallelLayoutError: the layout cannot split the model or the family does not support it (one line).
    """
    check_layout_fits(config_kwargs, layout)
    support = registry.get_family(family).layouts
    refusal = support.refusal(family, layout) if support is not None else None
    if refusal:
        raise ParallelLayoutError(refusal)
