"""Fused kernels for megatron-core's local layer spec on CUDA, without TransformerEngine or Apex.

megatron-core routes two elementwise chains to fused kernels when its config asks for them:

- SwiGLU (``config.bias_activation_fusion``; ``megatron.core.fusions.fused_bias_swiglu``): its
  own ``torch.compile``-d forward and backward (``megatron.core.jit.jit_fuser``), which needs no
  TE. Without the flag, ``silu(gate) * up`` runs as separate kernels with their intermediates
  saved for backward.
- RoPE (``config.apply_rope_fusion``): megatron calls
  ``rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=...)``, which is TE's kernel and
  ``None`` without TE. :func:`enable_cuda_fusions` fills that slot, only where it is empty, with
  ``torch.compile`` of megatron's own unfused ``_apply_rotary_pos_emb_bshd`` (same formula:
  ``t * cos + rotate_half(t) * sin`` on the first ``rot_dim`` channels), so the cos/sin, the
  half rotation, the products and the concatenation become one kernel each way. The packed
  (``thd``) slot, ``fused_apply_rotary_pos_emb_thd``, gets :func:`_rope_thd` likewise.

Both are flags read at forward time, so the engine turns them on after the model is built, on
CUDA only: on CPU the unfused eager path stays the bit-exact reference the tests pin.
``TrainEngineSettings(cuda_fusions=False)`` turns them off (for benchmarks and debugging).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["enable_cuda_fusions"]


def _rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
              cp_rank: int = 0) -> torch.Tensor:
    """RoPE for packed (``thd``) tokens, the contract of TE's ``fused_apply_rotary_pos_emb_thd``:
    ``t`` ``[T, h, d]``, ``cu_seqlens`` ``[n + 1]``, ``freqs`` ``[max_s, 1, 1, rot_dim]``; every
    document's positions restart at 0 (megatron's ``_apply_rotary_pos_emb_thd``, without its
    per-document Python loop and host syncs: positions are gathered, then the bshd kernel runs)."""
    if cp_size != 1:
        raise NotImplementedError("packed-sequence RoPE with context parallelism is not supported without TE.")
    total = t.shape[0]
    cu = cu_seqlens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], counts, output_size=total)
    positions = torch.arange(total, device=t.device) - starts
    return _compiled_rope()(t.unsqueeze(1), freqs[positions]).squeeze(1)


#: ``TrainEngineSettings.compile_dynamic`` of the process: the compiled kernels below are process-wide
#: caches, so the first train engine's setting holds (:func:`set_compile_dynamic`)
_COMPILE_DYNAMIC = "all"


def set_compile_dynamic(mode: str) -> None:
    """Set ``"all"`` or ``"auto"`` (:func:`compile_dynamic`) before the first compile of this process."""
    global _COMPILE_DYNAMIC
    if mode not in ("all", "auto"):
        raise ValueError(f"compile_dynamic={mode!r}; expected 'all' or 'auto'.")
    _COMPILE_DYNAMIC = mode


def compile_dynamic() -> bool | None:
    """``torch.compile``'s ``dynamic`` for ferrule's compiled CUDA kernels (RoPE, the fused logprob
    reductions): ``True`` (every dimension symbolic, one compile) unless the train engine's
    ``compile_dynamic`` is ``"auto"`` (``None``: torch's automatic dynamic shapes, so only the dimensions
    that change between calls, the token count, become symbolic and the head / vocabulary sizes stay
    compile-time constants)."""
    return None if _COMPILE_DYNAMIC == "auto" else True


@functools.cache
def _compiled_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        """``t`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, rot_dim]`` -> ``[s, b, h, d]`` (megatron's math)."""
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)

    return torch.compile(rope, dynamic=compile_dynamic())


def enable_cuda_fusions(config: Any, enabled: bool = True) -> list[str]:
    """Turn on the fused SwiGLU and RoPE paths of a built model's ``TransformerConfig`` (in place).

    Only where they apply: SwiGLU for ``gated_linear_unit`` with SiLU (megatron's fused kernel
    has no other gated activation without TE); RoPE for ``position_embedding_type='rope'``
    without multi-latent attention (not YaRN: ``apply_rotary_pos_emb``'s fused ``thd`` path
    ignores its ``mscale``). Does nothing when not ``enabled`` (``TrainEngineSettings.cuda_fusions``).

    Returns:
        The names of the fusions now on (``'swiglu'``, ``'rope'``).
    """
    if not enabled:
        return []
    from megatron.core.models.common.embeddings import rope_utils

    enabled = []
    if config.gated_linear_unit and config.activation_func is F.silu and not config.use_te_activation_func:
        config.bias_activation_fusion = True
        enabled.append("swiglu")
    # not with YaRN: megatron's fused path drops its cos/sin factor (mscale) for packed (thd) input
    if getattr(config, "multi_latent_attention", False) is False and getattr(config, "mrope_section", None) is None \
            and not hasattr(config, "yarn_rotary_scaling_factor"):
        if rope_utils.fused_apply_rotary_pos_emb is None:
            rope_utils.fused_apply_rotary_pos_emb = _compiled_rope()
        if rope_utils.fused_apply_rotary_pos_emb_thd is None:
            rope_utils.fused_apply_rotary_pos_emb_thd = _rope_thd
        config.apply_rope_fusion = True
        enabled.append("rope")
    return enabled


# ---------------------------------------------------------------- weight-gradient accumulation


def wgrad_accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ inputs`` (``[out, T] @ [T, in]``) without a bf16 weight gradient.

    With bf16 operands and an fp32 ``main_grad`` on CUDA this is one cuBLAS GEMM accumulating in
    fp32 straight into the buffer (``torch.addmm(..., out_dtype=float32, out=main_grad)``, what
    Apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` does), so the gradient is not
    rounded to bf16 and no separate ``main_grad.add_`` pass runs. Same dtypes: ``addmm_``. Where
    ``out_dtype`` is unsupported (CPU): the product in the operands' dtype, then added.
    """
    a = grad_output.t()
    if main_grad.dtype == a.dtype:
        main_grad.addmm_(a, inputs)
        return
    global _ADDMM_OUT_DTYPE
    if _ADDMM_OUT_DTYPE is not False and main_grad.is_cuda:
        try:
            torch.addmm(main_grad, a, inputs, out_dtype=main_grad.dtype, out=main_grad)
            _ADDMM_OUT_DTYPE = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            if _ADDMM_OUT_DTYPE:
                raise
            _ADDMM_OUT_DTYPE = False
    main_grad.add_(a @ inputs)


#: whether ``torch.addmm(..., out_dtype=)`` works here (None: not tried yet).
_ADDMM_OUT_DTYPE = None


class _WgradShim:
    """Stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` module, the slot megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` calls under
    ``gradient_accumulation_fusion`` (arguments ``(total_input [T, in], grad_output [T, out], main_grad)``)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        wgrad_accumulate(main_grad, grad_output, total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def enable_grad_accum_fusion(chunks: list) -> int:
    """Switch megatron's ``gradient_accumulation_fusion`` on for every Column/RowParallelLinear
    whose weight is trained and has a DDP ``main_grad`` buffer (call after the DDP wrap): the
    weight gradient is accumulated in fp32 straight into ``main_grad`` (:func:`wgrad_accumulate`)
    instead of a bf16 ``weight.grad`` that DDP's hook then adds. Fills megatron's
    ``fused_weight_gradient_mlp_cuda`` slot with :class:`_WgradShim` where Apex is absent.

    Returns:
        The number of linear layers switched.
    """
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = _WgradShim
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
                w = getattr(m, "weight", None)
                if w is not None and w.requires_grad and getattr(w, "main_grad", None) is not None:
                    m.gradient_accumulation_fusion = True
                    n += 1
    return n


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's no-Apex ``local_multi_tensor_l2_norm`` (which runs one ``torch.norm``
    per tensor and then copies every per-tensor norm to the host, one synchronisation each):
    ``torch._foreach_norm`` and the norm of those norms, on the device. fp32 throughout; the
    summation order differs, so the value can differ in the last bits. Returns ``([1] tensor, None)``."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's ``local_multi_tensor_scale`` (``dst.copy_(src * scale)`` per tensor,
    through an fp32 temporary each): the same values (an fp32 product, then the cast into ``dst``'s
    dtype) with multi-tensor ops."""
    src, dst = tensor_lists
    if not src:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_optimizer_helpers() -> list[str]:
    """Replace megatron's no-Apex fallbacks of the optimizer step's helpers, where they are in
    use, by multi-tensor torch ops: the grad-norm (:func:`_foreach_l2_norm`) and the scale / copy
    used by clipping and by the fp32-master -> bf16-model copy (:func:`_foreach_scale`).
    Process-wide (megatron's module globals); returns the names replaced."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    done = []
    if getattr(clip_grads, "l2_norm_impl", None) is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
        done.append("l2_norm")
    for mod in (clip_grads, mopt):
        if getattr(mod, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = _foreach_scale
            done.append(f"scale:{mod.__name__.rsplit('.', 1)[-1]}")
    return done


def use_fused_adam(optimizer) -> int:
    """Switch every torch Adam/AdamW under a megatron optimizer to ``fused=True`` (one multi-tensor
    CUDA kernel per dtype group instead of foreach's chain of passes over the fp32 masters); the
    step counters move to the parameters' device, as fused Adam keeps them. Returns the number of
    param groups switched (0 when the parameters are not on CUDA)."""
    n = 0
    for sub in list(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        opt = getattr(sub, "optimizer", None)
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if not group["params"] or not all(p.is_cuda for p in group["params"]):
                continue
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                st = opt.state.get(p)
                if st and "step" in st and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device)
            n += 1
        opt.defaults["fused"], opt.defaults["foreach"] = True, False
    return n


# ---------------------------------------------------------------- activations recomputed in backward


class _Recompute:
    """A saved tensor replaced by ``fn(source)``: ``source`` is held by the producing op's own backward anyway."""

    __slots__ = ("fn", "source", "shape")

    def __init__(self, fn, source: torch.Tensor, shape: torch.Size) -> None:
        self.fn, self.source, self.shape = fn, source, shape


def _tag(out: torch.Tensor, fn, source: torch.Tensor) -> torch.Tensor:
    """Mark ``out`` as cheaply recomputable by ``fn(source)`` for the consumers wrapped by :func:`_recomputing`."""
    if torch.is_grad_enabled() and isinstance(out, torch.Tensor):
        out._ferrule_recompute = (fn, source)
    return out


def _tagging_swiglu(orig):
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    def recompute(x: torch.Tensor) -> torch.Tensor:
        return swiglu(x.reshape(-1, x.shape[-1]))  # the forward's own compiled kernel: bit-identical

    def bias_swiglu_impl(input, bias, *args, **kwargs):
        out = orig(input, bias, *args, **kwargs)
        if bias is None and not args[:1] == (True,):  # not with an fp8-stored input
            _tag(out, recompute, input)
        return out

    bias_swiglu_impl._ferrule_tagging = True
    return bias_swiglu_impl


def _tagging_norm(norm_forward):
    def forward(x, *args, **kwargs):
        out = norm_forward(x, *args, **kwargs)
        if not args and not kwargs:
            _tag(out, norm_forward, x)
        return out

    forward._ferrule_tagging = True
    return forward


def _recomputing(linear_forward):
    """A linear layer's forward whose saved input, when it is a tagged tensor, is stored as its
    recipe and recomputed when the backward unpacks it (``saved_tensors_hooks``)."""

    def forward(input_, *args, **kwargs):
        tag = getattr(input_, "_ferrule_recompute", None)
        if tag is None or not torch.is_grad_enabled():
            return linear_forward(input_, *args, **kwargs)
        fn, source = tag
        ptr, shape, dtype = input_.data_ptr(), input_.shape, input_.dtype

        def pack(t):
            if t.data_ptr() == ptr and t.shape == shape and t.dtype == dtype:
                return _Recompute(fn, source, shape)
            return t

        def unpack(x):
            if isinstance(x, _Recompute):
                with torch.no_grad():
                    return x.fn(x.source).view(x.shape)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return linear_forward(input_, *args, **kwargs)

    forward._ferrule_recomputing = True
    return forward


LEAN_ACTIVATIONS = ("swiglu", "norms", "compact_v")


def enable_lean_activations(chunks: list, which=LEAN_ACTIVATIONS) -> list[str]:
    """Drop cheaply recomputable tensors from the saved activations of every transformer layer:

    - ``swiglu``: the fused SwiGLU's output (``linear_fc2``'s input, ``tokens x ffn_hidden``) is
      recomputed from the SwiGLU input, which the SwiGLU backward keeps anyway, by the forward's
      own compiled kernel (needs ``bias_activation_fusion``, :func:`enable_cuda_fusions`);
    - ``norms``: the input / pre-MLP RMSNorm outputs (``linear_qkv`` / ``linear_fc1`` inputs,
      ``tokens x hidden``) are recomputed from the norm input, which the norm backward keeps;
    - ``compact_v``: core attention saves a compact copy of V instead of a view that holds the
      whole fused QKV projection (:class:`~ferrule.megatron.attention.SDPAttention`).

    Every recompute reruns the same kernel on the same input, so values and gradients are
    bit-identical; the cost is one elementwise pass per tensor in backward. Qwen2-0.5B at 16k
    tokens: 159 + 2 x 29 + 34 MB a layer, 6.0 GB over 24 layers. ``which``: a subset of
    :data:`LEAN_ACTIVATIONS`. Returns what was switched on.

    Raises:
        ValueError: an unknown name in ``which``.
    """
    unknown = set(which) - set(LEAN_ACTIVATIONS)
    if unknown:
        raise ValueError(f"unknown lean activation(s) {sorted(unknown)}; choose from {list(LEAN_ACTIVATIONS)}.")
    from megatron.core.transformer import mlp as mlp_mod
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from .attention import SDPAttention

    done = set()
    for chunk in chunks:
        for m in chunk.modules():
            if "swiglu" in which and isinstance(m, mlp_mod.MLP) and m.config.bias_activation_fusion and m.config.gated_linear_unit \
                    and m.activation_func is F.silu and not getattr(m.linear_fc2.forward, "_ferrule_recomputing", False):
                if not getattr(mlp_mod.bias_swiglu_impl, "_ferrule_tagging", False):
                    mlp_mod.bias_swiglu_impl = _tagging_swiglu(mlp_mod.bias_swiglu_impl)
                m.linear_fc2.forward = _recomputing(m.linear_fc2.forward)
                done.add("swiglu")
            if "norms" in which and isinstance(m, TransformerLayer):
                pairs = [(m.input_layernorm, getattr(m.self_attention, "linear_qkv", None)),
                         (m.pre_mlp_layernorm, getattr(m.mlp, "linear_fc1", None))]
                for norm, consumer in pairs:
                    if isinstance(norm, IdentityOp) or consumer is None or getattr(norm.forward, "_ferrule_tagging", False):
                        continue
                    norm.forward = _tagging_norm(norm.forward)
                    if not getattr(consumer.forward, "_ferrule_recomputing", False):
                        consumer.forward = _recomputing(consumer.forward)
                    done.add("norms")
            if "compact_v" in which and isinstance(m, SDPAttention):
                m.compact_value = True
                done.add("compact_v")
    return sorted(done)
