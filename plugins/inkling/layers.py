"""Inkling building blocks for megatron-core 0.16.1 (local spec, no TransformerEngine): norms, ShortConv, attention.

Each module matches one function of the numerical referee,
``transformers/models/inkling/modeling_inkling.py`` (transformers 5.24), named in its docstring.
Megatron activations are ``[seq, batch, hidden]`` (``s, b, h``); HF's are ``[batch, seq, hidden]``.
Tensor parallelism (TP) splits query heads, KV heads and the relative-state heads (column-parallel
``linear_q/k/v/r``, row-parallel ``linear_proj``); norms, ``rel_logits_proj`` and the
hidden-width ShortConvs are replicated.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

__all__ = ["InklingRMSNorm", "InklingShortConv", "InklingRelativeLogits", "InklingSelfAttention",
           "InklingNormedEmbedding", "InklingFinalNorm", "mark_tp_sharded", "tp_sharded_state_dict"]


def mark_tp_sharded(param: torch.nn.Parameter, dim: int) -> None:
    """Mark ``param`` as split over TP on ``dim`` (megatron's grad-norm / checkpoint attributes)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            delattr(param, attr)
    set_tensor_model_parallel_attributes(param, True, dim, 1)


def tp_sharded_state_dict(module: torch.nn.Module, prefix: str, axis_map: dict, sharded_offsets=()) -> dict:
    """``sharded_state_dict`` of a module whose own tensors are TP-split on ``axis_map[name]`` (others replicated)."""
    state = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)


class InklingRMSNorm(torch.nn.Module):
    """RMSNorm exactly as HF ``InklingRMSNorm.forward``: ``w * (x_fp32 * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    Used for ``input_layernorm``, ``pre_mlp_layernorm``, q/k norms (per head, ``[head_dim]``),
    the embedding norm and the final norm. Weight ``[hidden]``, initialised to ones; replicated
    over TP. Accepts megatron's ``build_module`` keywords (``config``, ``hidden_size``, ``eps``).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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


class InklingRelativeLogits(MegatronModule):
    """Query-content-dependent relative position bias, HF ``InklingRelativeLogits.forward``.

    ``weight`` ``[d_rel, rel_extent]`` (HF ``rel_logits_proj.proj``) is a bank of bias-vs-distance
    profiles; each query token's relative state ``r`` ``[b, s, heads, d_rel]`` mixes them:
    ``bias[b, h, q, k] = (r[b, q, h] @ weight)[q - k]`` for ``0 <= q - k < rel_extent``, else 0.
    Returns ``[b, heads, s_q, s_k]`` (fp32 when inputs are). Replicated over TP: every rank
    uses it for its own heads, so its gradient is summed over the TP group
    (``copy_to_tensor_model_parallel_region`` on the weight: identity forward, all-reduce backward).
    """

    def __init__(self, config, d_rel: int, rel_extent: int):
        super().__init__(config=config)
        self.rel_extent = int(rel_extent)
        self.weight = torch.nn.Parameter(torch.empty(d_rel, rel_extent, dtype=config.params_dtype))
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=config.init_method_std)

    def forward(self, rel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        logits = (rel @ weight).transpose(1, 2)  # [b, heads, s_q, extent]
        distance = (q_pos[:, None] - k_pos[None, :])[None, None]
        index = distance.clamp(0, self.rel_extent - 1).expand(*logits.shape[:2], -1, -1)
        bias = logits.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= self.rel_extent), 0.0)


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


class InklingNormedEmbedding(LanguageModelEmbedding):
    """Token embedding followed by RMSNorm, HF ``InklingNormedEmbedding.forward``.

    megatron's ``LanguageModelEmbedding`` (``word_embeddings``: vocab-parallel
    ``[padded_vocab, hidden]``, no position embedding; output ``[s, b, hidden]``) plus
    ``embed_norm`` (replicated). With ``padding_idx`` (HF ``pad_token_id``) the padding row gets a
    zero gradient, as ``nn.Embedding(padding_idx=...)`` gives it.
    """

    def __init__(self, config, vocab_size: int, max_sequence_length: int, padding_idx: int | None = None):
        super().__init__(config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                         position_embedding_type="none")
        self.embed_norm = InklingRMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        self.padding_idx = padding_idx
        emb = self.word_embeddings
        if padding_idx is not None and emb.vocab_start_index <= padding_idx < emb.vocab_end_index:
            local = padding_idx - emb.vocab_start_index

            def _zero_padding_row(grad):
                grad = grad.clone()
                grad[local] = 0
                return grad

            emb.weight.register_hook(_zero_padding_row)

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        return self.embed_norm(super().forward(input_ids=input_ids, position_ids=position_ids))
