"""Inkling-2 building blocks for megatron-core 0.16.1 (local spec, no TransformerEngine): norms, clips, convs, attention.

Each module matches one class of the numerical referee,
``transformers/models/inkling2/modeling_inkling2.py`` (transformers 5.24), named in its docstring.
Megatron activations are ``[seq, batch, hidden]`` (``s, b, h``); HF's are ``[batch, seq, hidden]``.
Positions are ``0..s-1`` (the log scaling reads them; packed sequences are refused).

TP splits query, KV and relative-state heads: column-parallel ``linear_q/k/v/r``, ``linear_gate``,
``linear_sink`` and the dynamic-convolution ``weight_proj`` (whole heads per rank), row-parallel
``linear_proj``; the per-head scales and the KV convolution weights are split with their heads.
Norms, the relative-profile bank, the hidden-width convolutions and the block attention residuals
are replicated. Shared with Inkling, from the core (:mod:`ferrule.megatron.shared_layers`): the
relative-profile bank (``InklingRelativeLogits``: identical arithmetic), the normed embedding and the TP helpers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

from ferrule.megatron.shared_layers import (InklingNormedEmbedding, InklingRelativeLogits, mark_tp_sharded,
                                            tp_sharded_state_dict)

__all__ = ["Inkling2RMSNorm", "unweighted_rms_norm", "l2_clip", "log_scale", "Inkling2ScaledL2Clip",
           "Inkling2ShortConv", "Inkling2DynamicShortConv", "Inkling2BlockAttentionResidual", "attend_blocks", "Inkling2Attention",
           "Inkling2NormedEmbedding", "Inkling2LoopMessageGate"]


class Inkling2RMSNorm(torch.nn.Module):
    """HF ``Inkling2RMSNorm``: ``(w * (x_fp32 * rsqrt(mean(x^2) + eps))).to(x.dtype)``; weight ``[hidden]``, replicated."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``Inkling2UnweightedRMSNorm``: ``x_fp32 * rsqrt(mean(x^2) + eps)`` in the input dtype (no weight)."""
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """HF ``Inkling2L2Clip``: each last-dim vector scaled down to L2 norm ``threshold`` when longer (fp32 inside)."""
    h = x.float()
    norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    return (h * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


def log_scale(x: torch.Tensor, positions: torch.Tensor, alpha: float, n_floor: int) -> torch.Tensor:
    """HF ``Inkling2LogScale``: ``x * (1 + alpha * log(max((pos + 1) / n_floor, 1)))``.

    ``x`` ``[s, b, heads, d]``, ``positions`` ``[s]`` (0-based).
    """
    tau = 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))
    return (x.float() * tau.view(-1, 1, 1, 1)).to(x.dtype)


class Inkling2ScaledL2Clip(MegatronModule):
    """HF ``Inkling2ScaledL2Clip`` / ``Inkling2LogScaledL2Clip``: learned ``scale`` ``[heads, d]``, L2 clip, then
    (``log_scaling``) :func:`log_scale`. ``scale`` is split over TP with the heads (dim 0)."""

    def __init__(self, config, num_heads: int, head_dim: int, threshold: float, *, log_scaling: bool = False,
                 alpha: float = 0.1, n_floor: int = 1):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.threshold, self.log_scaling, self.alpha, self.n_floor = float(threshold), log_scaling, alpha, n_floor
        self.scale = torch.nn.Parameter(torch.ones(num_heads // tp, head_dim, dtype=config.params_dtype))
        mark_tp_sharded(self.scale, 0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = l2_clip(x.float() * self.scale.float(), self.threshold).to(x.dtype)
        return log_scale(h, positions, self.alpha, self.n_floor) if self.log_scaling else h

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return tp_sharded_state_dict(self, prefix, {"scale": 0}, sharded_offsets)


class Inkling2ShortConv(MegatronModule):
    """HF ``Inkling2ShortConvolution`` (prefill path): ``(x + causal_depthwise_conv(x)) / sqrt(W + 1)`` in fp32.

    Weight ``[C, 1, W]`` fp32 (HF ``conv1d.weight``); input/output ``[s, b, C]``. ``tp_split=True``
    (sliding-layer K and V convs): ``C`` is this rank's share of the KV channels, split on dim 0.
    """

    def __init__(self, config, channels: int, kernel_size: int, tp_split: bool = False):
        super().__init__(config=config)
        self.kernel_size, self.tp_split = int(kernel_size), tp_split
        self.weight = torch.nn.Parameter(torch.empty(channels, 1, self.kernel_size, dtype=torch.float32))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
        if tp_split:
            mark_tp_sharded(self.weight, 0)

    def forward(self, x: torch.Tensor, dynamic_input: torch.Tensor | None = None) -> torch.Tensor:
        h = x.float()
        s = h.shape[0]
        conv_in = h.permute(1, 2, 0)  # [b, C, s]
        out = F.conv1d(conv_in, self.weight.float(), padding=self.kernel_size - 1, groups=conv_in.shape[1])[..., :s]
        return ((out.permute(2, 0, 1) + h) / math.sqrt(self.kernel_size + 1)).to(x.dtype).contiguous()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return tp_sharded_state_dict(self, prefix, {"weight": 0} if self.tp_split else {}, sharded_offsets)


class Inkling2DynamicShortConv(MegatronModule):
    """HF ``Inkling2DynamicShortConvolution``: per-token taps shared within each KV head (full-attention K and V).

    ``taps[t, head, c, lag] = static_weight[lag, c] + weight_proj(dyn[t])[head, lag]``;
    ``out[t, c] = (x[t, c] + sum_lag taps[t, head(c), c, lag] * x[t - lag, c]) / sqrt(2W + 1)`` in fp32, zero
    history. ``static_weight`` ``[W, C]`` (split over TP on dim 1 with the KV channels), ``weight_proj``
    column-parallel ``[kv_heads * W, hidden]`` (heads-major rows: whole heads per rank).
    Input ``x`` ``[s, b, C_local]``, ``dynamic_input`` ``[s, b, hidden]``.
    """

    def __init__(self, config, num_heads: int, head_dim: int, kernel_size: int):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.kernel_size, self.heads, self.head_dim = int(kernel_size), num_heads // tp, head_dim
        self.static_weight = torch.nn.Parameter(torch.zeros(self.kernel_size, self.heads * head_dim,
                                                            dtype=config.params_dtype))
        mark_tp_sharded(self.static_weight, 1)
        self.weight_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, num_heads * self.kernel_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False)

    def forward(self, x: torch.Tensor, dynamic_input: torch.Tensor) -> torch.Tensor:
        s, b, c = x.shape
        k = self.kernel_size
        dyn, _ = self.weight_proj(dynamic_input)
        taps = (self.static_weight.float().T.view(self.heads, self.head_dim, k)
                + dyn.float().view(s, b, self.heads, 1, k))  # [s, b, heads, d, W]
        h = x.float()
        padded = F.pad(h, (0, 0, 0, 0, k - 1, 0))  # [s + W - 1, b, C]
        windows = torch.stack([padded[k - 1 - lag: k - 1 - lag + s] for lag in range(k)], dim=-1)  # [s, b, C, W]
        out = (windows.view(s, b, self.heads, self.head_dim, k) * taps).sum(-1).reshape(s, b, c)
        return ((out + h) / math.sqrt(2 * k + 1)).to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = tp_sharded_state_dict(self, prefix, {"static_weight": 1}, sharded_offsets)
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "weight_proj.")}
        state.update(self.weight_proj.sharded_state_dict(prefix + "weight_proj.", sharded_offsets, metadata))
        return state


class Inkling2BlockAttentionResidual(MegatronModule):
    """HF ``Inkling2BlockAttentionResidual``: learned queries attend over the block states and the partial state.

    ``sources = unweighted_rms_norm(cat(block_states, partial), eps=1e-6)`` ``[s, b, N + 1, H]`` (fp32);
    per query ``q``: ``softmax(sources @ q / sqrt(H)) @ sources``. ``query`` is ``[H]`` for one query or
    ``[n, H]`` (HF shapes; zeros-initialised, fp32); replicated. Returns a tuple of ``n`` fp32 ``[s, b, H]``.
    """

    def __init__(self, config, num_queries: int = 1):
        super().__init__(config=config)
        shape = (config.hidden_size,) if num_queries == 1 else (num_queries, config.hidden_size)
        self.query = torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float32))

    def forward(self, block_states: torch.Tensor, partial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return attend_blocks(block_states, partial, self.query)


def attend_blocks(block_states: torch.Tensor, partial: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The block attention of :class:`Inkling2BlockAttentionResidual` for ``query`` ``[H]`` or ``[n, H]``.

    ``block_states`` ``[s, b, N, H]``, ``partial`` ``[s, b, H]``; returns ``n`` fp32 ``[s, b, H]``.
    """
    sources = unweighted_rms_norm(torch.cat([block_states, partial.unsqueeze(-2)], dim=-2).float(), 1e-6)
    hidden = sources.shape[-1]
    q = query.float().view(-1, hidden)  # [n, H]
    scores = torch.einsum("sbkh,nh->sbnk", sources, q) * hidden ** -0.5
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.einsum("sbnk,sbkh->sbnh", probs, sources).unbind(-2)


class Inkling2NormedEmbedding(InklingNormedEmbedding):
    """HF ``Inkling2NormedEmbedding``: token embedding then :class:`Inkling2RMSNorm` (Inkling's, with Inkling-2's norm)."""

    def __init__(self, config, vocab_size: int, max_sequence_length: int, padding_idx: int | None = None):
        super().__init__(config, vocab_size, max_sequence_length, padding_idx=padding_idx)
        self.embed_norm = Inkling2RMSNorm(config, config.hidden_size, config.layernorm_epsilon)


class Inkling2Attention(MegatronModule):
    """One Inkling-2 attention, HF ``Inkling2SlidingAttention`` (``sliding=True``) / ``Inkling2FullAttention``.

    With ``x`` the (normed) query input and ``xk``, ``xv`` the key / value inputs (``x`` on sliding layers)::

        q = clip(scale_q * linear_q(x))            [heads, d]   (full: then log scaling)
        k = l2_clip(conv_k(linear_k(xk)))          [kv_heads, d]   (full: dynamic conv with taps from xk)
        v = unweighted_rms(conv_v(linear_v(xv)))
        r = clip(scale_r * linear_r(x))            [heads, d_rel]  (full: then log scaling)
        scores = q k^T / sqrt(d) + rel_logits_proj(r) + mask,   one extra sink logit linear_sink(x) per head
        out = linear_proj(sigmoid(linear_gate(x)) * (softmax_fp32([scores, sink])[:-1] @ v))

    Sliding layers see keys with ``0 <= q - k < window`` and use their own head counts; full layers are causal.
    GQA as HF ``repeat_kv``. ``attention_mask`` (megatron convention: bool, True = masked) is combined.
    """

    def __init__(self, config, *, sliding: bool, num_heads: int, num_kv_heads: int, head_dim: int, d_rel: int,
                 rel_extent: int, window: int | None, conv_kernel_size: int, qk_clip: float, rel_clip: float,
                 log_scaling_alpha: float, log_scaling_n_floor: int):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"Inkling-2 {'sliding' if sliding else 'full'} attention has {num_heads} heads / {num_kv_heads} KV "
                f"heads; tp={tp} must divide both (KV-head replication is not implemented).")
        self.sliding, self.window, self.head_dim, self.d_rel = sliding, window, head_dim, d_rel
        self.heads, self.kv_heads = num_heads // tp, num_kv_heads // tp
        self.eps = config.layernorm_epsilon
        self.qk_clip = float(qk_clip)
        hidden = config.hidden_size

        def column(out_features):
            return tensor_parallel.ColumnParallelLinear(
                hidden, out_features, config=config, init_method=config.init_method, bias=False, gather_output=False)

        self.linear_q, self.linear_k, self.linear_v = (column(num_heads * head_dim), column(num_kv_heads * head_dim),
                                                       column(num_kv_heads * head_dim))
        self.linear_r, self.linear_gate, self.linear_sink = (column(num_heads * d_rel), column(num_heads * head_dim),
                                                             column(num_heads))
        self.linear_proj = tensor_parallel.RowParallelLinear(
            num_heads * head_dim, hidden, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)
        log = dict(log_scaling=not sliding, alpha=log_scaling_alpha, n_floor=log_scaling_n_floor)
        self.q_clip = Inkling2ScaledL2Clip(config, num_heads, head_dim, qk_clip, **log)
        self.r_clip = Inkling2ScaledL2Clip(config, num_heads, d_rel, rel_clip, **log)
        if sliding:
            self.k_sconv = Inkling2ShortConv(config, self.kv_heads * head_dim, conv_kernel_size, tp_split=True)
            self.v_sconv = Inkling2ShortConv(config, self.kv_heads * head_dim, conv_kernel_size, tp_split=True)
        else:
            self.k_sconv = Inkling2DynamicShortConv(config, num_kv_heads, head_dim, conv_kernel_size)
            self.v_sconv = Inkling2DynamicShortConv(config, num_kv_heads, head_dim, conv_kernel_size)
        self.rel_logits_proj = InklingRelativeLogits(config, d_rel, rel_extent)

    def _masked(self, s: int, device, attention_mask) -> torch.Tensor:
        pos = torch.arange(s, device=device)
        distance = pos[:, None] - pos[None, :]
        masked = distance < 0
        if self.sliding:
            masked = masked | (distance >= self.window)
        return masked if attention_mask is None else masked | attention_mask.bool()

    def forward(self, x, xk=None, xv=None, attention_mask=None):
        xk = x if xk is None else xk
        xv = x if xv is None else xv
        s, b, _ = x.shape
        pos = torch.arange(s, device=x.device)
        q = self.q_clip(self.linear_q(x)[0].view(s, b, self.heads, self.head_dim), pos).permute(1, 2, 0, 3)
        k = self.k_sconv(self.linear_k(xk)[0], xk).view(s, b, self.kv_heads, self.head_dim)
        k = l2_clip(k, self.qk_clip).permute(1, 2, 0, 3)
        v = self.v_sconv(self.linear_v(xv)[0], xv).view(s, b, self.kv_heads, self.head_dim)
        v = unweighted_rms_norm(v, self.eps).permute(1, 2, 0, 3)
        r = self.r_clip(self.linear_r(x)[0].view(s, b, self.heads, self.d_rel), pos)
        bias = self.rel_logits_proj(r.transpose(0, 1), pos, pos)  # [b, heads, s, s]
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5 + bias
        scores = scores.masked_fill(self._masked(s, x.device, attention_mask), torch.finfo(scores.dtype).min)
        sink = self.linear_sink(x)[0].permute(1, 2, 0).unsqueeze(-1)  # [b, heads, s, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
        context = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        gate = torch.sigmoid(self.linear_gate(x)[0].float())
        out, _ = self.linear_proj((context.float() * gate).to(context.dtype))
        return out


class Inkling2LoopMessageGate(MegatronModule):
    """HF ``Inkling2LoopMessageGate``: ``(1 - tanh(F g)) * h + tanh(G g) * m`` with
    ``g = down @ [rms(h); rms(m)]`` (unweighted RMSNorm, eps ``rms_norm_eps``), all in fp32.

    ``down_weight`` ``[rank, 2H]`` (params dtype), ``forget_weight`` / ``gain_weight`` ``[H, rank]`` fp32: the
    released names (HF ``down_proj``, ``forget_gate_proj``, ``message_gate_proj``). Returns fp32 ``[s, b, H]``.
    """

    def __init__(self, config, rank: int):
        super().__init__(config=config)
        hidden, self.eps = config.hidden_size, config.layernorm_epsilon
        self.down_weight = torch.nn.Parameter(torch.empty(rank, 2 * hidden, dtype=config.params_dtype))
        self.forget_weight = torch.nn.Parameter(torch.empty(hidden, rank, dtype=torch.float32))
        self.gain_weight = torch.nn.Parameter(torch.empty(hidden, rank, dtype=torch.float32))
        if config.perform_initialization:
            for w in (self.down_weight, self.forget_weight, self.gain_weight):
                torch.nn.init.normal_(w, std=config.init_method_std)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, lora_name: str) -> torch.Tensor:
        """``x @ weight.T``, plus the LoRA holder's ``scaling * B (A x)`` when
        :func:`ferrule.plugins.inkling2.lora.apply_loop_gate` attached one under ``lora_name`` (HF's linear name)."""
        y = x @ weight.T
        holder = self._modules.get(lora_name)
        return y if holder is None else y + holder.lora(x).to(y.dtype)

    def forward(self, hidden_states: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        h, m = hidden_states.float(), message.float()
        g = torch.cat([unweighted_rms_norm(h, self.eps), unweighted_rms_norm(m, self.eps)], dim=-1)
        g = self._linear(g.to(self.down_weight.dtype), self.down_weight, "down_proj").float()
        forget = self._linear(g, self.forget_weight, "forget_gate_proj")
        return (1 - torch.tanh(forget)) * h + torch.tanh(self._linear(g, self.gain_weight, "message_gate_proj")) * m
