"""Inkling building blocks for megatron-core 0.16.1 (local spec, no TransformerEngine): norms, ShortConv, attention.

Each module matches one function of the numerical referee,
``transformers/models/inkling/modeling_inkling.py`` (transformers 5.24), named in its docstring.
Megatron activations are ``[seq, batch, hidden]`` (``s, b, h``); HF's are ``[batch, seq, hidden]``.
Tensor parallelism (TP) splits query heads, KV heads and the relative-state heads (column-parallel
``linear_q/k/v/r``, row-parallel ``linear_proj``); norms, ``rel_logits_proj`` and the
hidden-width ShortConvs are replicated. The pieces Inkling-2 uses too (the HF RMSNorm, the normed
embedding, the relative logits, the TP helpers) are the core's :mod:`ferrule.megatron.shared_layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

from ferrule.compat import renamed_name
from ferrule.megatron.shared_layers import InklingRelativeLogits, InklingRMSNorm, mark_tp_sharded, tp_sharded_state_dict

__all__ = ["InklingShortConv", "InklingSelfAttention", "InklingFinalNorm"]


def __getattr__(name: str):  # what Inkling-2 shares moved to ferrule.megatron.shared_layers (ferrule.compat)
    return renamed_name(__name__, name)


class InklingFinalNorm(InklingRMSNorm):
    """Final norm fused with the muP output scaling: ``InklingRMSNorm(x) / logits_mup_width_multiplier``.

    HF: ``InklingTextModel.norm`` followed by ``InklingForCausalLM.forward``'s
    ``last_hidden_state / config.logits_mup_width_multiplier`` before ``lm_head``. Megatron's
    ``TransformerBlock`` owns ``final_layernorm`` on the last stage, so the division lives here
    (parameter name ``decoder.final_layernorm.weight`` is unchanged).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, logits_multiplier: float = 1.0):
        super().__init__(config, hidden_size, eps)
        self.logits_multiplier = float(logits_multiplier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.logits_multiplier


class InklingShortConv(MegatronModule):
    """Causal depthwise convolution along time plus identity residual, in fp32.

    HF ``InklingShortConvolution.forward`` (prefill path, ``causal_conv1d_fn`` fallback):
    ``y_t = x_t + sum_{i<W} w[c, 0, i] * x_{t-(W-1)+i}`` per channel ``c``, zero history before
    the first token, computed in fp32 and cast back to the input dtype. Weight ``[C, 1, W]``
    (HF ``conv1d.weight``), ``W = conv_kernel_size``. Input/output ``[s, b, C]``.

    ``tp_split=True`` (K and V convs): ``C`` is this rank's share of the KV channels and the
    weight is split over TP on dim 0 (contiguous, like ``linear_k``); otherwise (attention and
    MLP output convs over ``hidden``) it is replicated.
    """

    def __init__(self, config, channels: int, kernel_size: int, tp_split: bool = False):
        super().__init__(config=config)
        self.kernel_size = int(kernel_size)
        self.tp_split = tp_split
        self.weight = torch.nn.Parameter(torch.empty(channels, 1, self.kernel_size, dtype=torch.float32))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
        if tp_split:
            mark_tp_sharded(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        s = h.shape[0]
        conv_in = h.permute(1, 2, 0)  # [b, C, s]
        out = F.conv1d(conv_in, self.weight.float(), padding=self.kernel_size - 1, groups=conv_in.shape[1])[..., :s]
        return (out.permute(2, 0, 1) + h).to(dtype).contiguous()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return tp_sharded_state_dict(self, prefix, {"weight": 0} if self.tp_split else {}, sharded_offsets)


class InklingSelfAttention(MegatronModule):
    """One Inkling attention block (local or global), HF ``InklingAttention.forward`` + ``attn_sconv``.

    Per token (``x`` = ``input_layernorm`` output, ``[s, b, hidden]``)::

        q = q_layernorm(linear_q(x))                       per head, [heads, head_dim]
        k = k_layernorm(k_sconv(linear_k(x)))              [kv_heads, head_dim]
        v = v_sconv(linear_v(x))
        r = linear_r(x)                                    [heads, d_rel]
        scores = q k^T / head_dim + rel_logits_proj(r) + mask        (softmax scale 1/d: q, k are normed)
        out = attn_sconv(linear_proj(softmax_fp32(scores) v))

    Global layers (``sliding=False``): causal, relative extent ``rel_extent``, optional log
    scaling ``tau(n) = 1 + alpha * log(max(n / n_floor, 1))`` of q and of the bias for query
    position ``n`` (1-based). Local layers: keys with ``q - k < window`` only, extent ``window``,
    their own head counts (``swa_*``). GQA: query head ``h`` uses KV head ``h // (heads/kv_heads)``
    (HF ``repeat_kv``). Scores, bias and softmax follow HF ``eager_attention_forward``.

    TP: ``linear_q/k/v/r`` are column-parallel (whole heads per rank; ``tp`` must divide both
    head counts), ``linear_proj`` row-parallel, ``k_sconv``/``v_sconv`` split with ``linear_k/v``.
    ``attention_mask`` (megatron convention: bool, True = masked, broadcastable to
    ``[b, 1, s, s]``) is combined with the causal/window mask. Packed sequences are refused.
    """

    def __init__(self, config, layer_number: int = 1, *, sliding: bool, num_heads: int, num_kv_heads: int,
                 head_dim: int, d_rel: int, rel_extent: int, window: int | None, conv_kernel_size: int,
                 log_scaling_n_floor: int | None = None, log_scaling_alpha: float = 0.1, **_megatron_kwargs):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"Inkling {'local' if sliding else 'global'} attention has {num_heads} heads / {num_kv_heads} KV heads; "
                f"tp={tp} must divide both (KV-head replication is not implemented).")
        self.layer_number = layer_number
        self.sliding, self.window = sliding, window
        self.head_dim, self.d_rel = head_dim, d_rel
        self.heads, self.kv_heads = num_heads // tp, num_kv_heads // tp
        self.log_scaling_n_floor = None if sliding else log_scaling_n_floor
        self.log_scaling_alpha = log_scaling_alpha
        hidden = config.hidden_size

        def column(out_features):
            return tensor_parallel.ColumnParallelLinear(
                hidden, out_features, config=config, init_method=config.init_method, bias=False, gather_output=False)

        self.linear_q = column(num_heads * head_dim)
        self.linear_k = column(num_kv_heads * head_dim)
        self.linear_v = column(num_kv_heads * head_dim)
        self.linear_r = column(num_heads * d_rel)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            num_heads * head_dim, hidden, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)
        self.k_sconv = InklingShortConv(config, self.kv_heads * head_dim, conv_kernel_size, tp_split=True)
        self.v_sconv = InklingShortConv(config, self.kv_heads * head_dim, conv_kernel_size, tp_split=True)
        self.q_layernorm = InklingRMSNorm(config, head_dim, config.layernorm_epsilon)
        self.k_layernorm = InklingRMSNorm(config, head_dim, config.layernorm_epsilon)
        self.rel_logits_proj = InklingRelativeLogits(config, d_rel, rel_extent)
        self.attn_sconv = InklingShortConv(config, hidden, conv_kernel_size)

    def _mask(self, s: int, device) -> torch.Tensor:
        """``[s, s]`` bool, True = masked: future keys, and keys ``window`` or more tokens back on local layers."""
        pos = torch.arange(s, device=device)
        distance = pos[:, None] - pos[None, :]
        masked = distance < 0
        if self.sliding:
            masked = masked | (distance >= self.window)
        return masked

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_unused):
        if packed_seq_params is not None:
            raise NotImplementedError("Inkling attention does not support packed (THD) sequences; pass [b, s] batches.")
        s, b, _ = hidden_states.shape
        q, _ = self.linear_q(hidden_states)
        k, _ = self.linear_k(hidden_states)
        v, _ = self.linear_v(hidden_states)
        r, _ = self.linear_r(hidden_states)
        k, v = self.k_sconv(k), self.v_sconv(v)
        # [s, b, heads*d] -> [b, heads, s, d]
        q = self.q_layernorm(q.view(s, b, self.heads, self.head_dim)).permute(1, 2, 0, 3)
        k = self.k_layernorm(k.view(s, b, self.kv_heads, self.head_dim)).permute(1, 2, 0, 3)
        v = v.view(s, b, self.kv_heads, self.head_dim).permute(1, 2, 0, 3)
        pos = torch.arange(s, device=hidden_states.device)
        bias = self.rel_logits_proj(r.view(s, b, self.heads, self.d_rel).transpose(0, 1), pos, pos)
        if self.log_scaling_n_floor is not None:
            tau = 1.0 + self.log_scaling_alpha * torch.log(((pos + 1).float() / self.log_scaling_n_floor).clamp(min=1.0))
            tau = tau.view(1, 1, -1, 1)
            q = (q.float() * tau).to(q.dtype)
            bias = (bias.float() * tau).to(bias.dtype)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / self.head_dim) + bias
        masked = self._mask(s, hidden_states.device)
        if attention_mask is not None:
            masked = masked | attention_mask.bool()
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        context = torch.matmul(probs, v)  # [b, heads, s, d]
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        out, _ = self.linear_proj(context)
        return self.attn_sconv(out), None
