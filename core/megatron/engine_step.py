"""The train engine's core loop: micro-batches (padded or packed ``thd``), megatron's
``forward_backward_func`` with the loss applied per micro-batch, and the gather of per-datum
outputs across DP and PP ranks. The methods ``_run`` / ``_microbatch`` / ``_pad_mask`` of
:class:`ferrule.megatron.engine.TrainEngine` call these functions with the engine.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..losses import SEQUENCE_LEVEL, finalize_metrics, get_loss, sum_metrics
from . import routing_replay
from .batching import FBOutput, assign_dp_ranks, pack_microbatches
from .towers import embed_with_media

if TYPE_CHECKING:
    from .engine_inputs import _Prepared

__all__ = ["PACK_ALIGN", "pad_mask", "vocab_parallel_entropy", "microbatch", "run", "gather"]


def _no_finalize(*args: Any, **kwargs: Any) -> None:
    """Stand-in for ``config.finalize_model_grads_func`` during ``forward_backward``."""
    return None


#: packed (``thd``) rows are padded to a multiple of this many tokens on CUDA.
PACK_ALIGN = 1024


def _unwrap_gpt(model: Any) -> Any:
    """The megatron ``GPTModel`` inside a DDP / Float16Module wrapper (``.module`` chain)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return model


def pad_mask(engine: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """Boolean ``[v_local]`` mask of padded vocabulary columns on this TP rank (None if none)."""
    from megatron.core import parallel_state as ps

    v_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    if start + v_local <= engine.vocab_size:
        return None
    return torch.arange(start, start + v_local, device=logits.device) >= engine.vocab_size

def vocab_parallel_entropy(logits: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    """Entropy (nats) of the softmax over the full vocabulary, from this TP rank's logits
    ``[..., v_local]`` (fp32) -> ``[...]`` fp32, with autograd history (the entropy bonus).

    ``H = log S - T / S`` with ``S = sum exp(z - m)``, ``T = sum exp(z - m) (z - m)`` and ``m`` the
    global max: ``S`` and ``T`` are summed over the tensor-parallel group with megatron's
    ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), as
    ``VocabParallelCrossEntropy`` sums its softmax denominator. ``pad``: ``[v_local]`` bool, the
    padded vocabulary columns (:func:`pad_mask`), left out of both sums.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits if pad is None else logits.masked_fill(pad, float("-inf"))
    m = z.detach().amax(dim=-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = z - m
    e = shifted.exp()
    t_part = torch.where(e > 0, e * shifted, torch.zeros_like(e))  # exp(-inf) * -inf would be nan
    sums = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), t_part.sum(-1)]))
    return sums[0].log() - sums[1] / sums[0]


def microbatch(engine: Any, data: list[_Prepared], idx: list[int] | None) -> dict:
    """Device tensors of one micro-batch. ``spans[k] = (row, start, n)`` locates datum
    ``idx[k]``'s tokens: padded layout ``[b, max_len]`` (row k, start 0), or with
    :attr:`packed_sequences` one row of concatenated data (``thd``: row 0, start at the
    datum's offset, per-document positions and ``cu_seqlens``)."""
    device = next(engine.model[0].parameters()).device
    lengths = [1] if idx is None else [data[i].tokens.numel() for i in idx]  # None: EP lock-step filler
    toks = [torch.zeros(1, dtype=torch.int64)] if idx is None else [data[i].tokens for i in idx]
    labs = [torch.zeros(1, dtype=torch.int64)] if idx is None else [data[i].inputs["target_tokens"] for i in idx]
    out = {"idx": idx, "lengths": lengths, "packed_seq_params": None,
           "media": [] if idx is None else [data[i].media for i in idx]}
    if engine.packed_sequences and len(set(lengths)) > 1:  # equal lengths: padding costs nothing
        from megatron.core.packed_seq_params import PackedSeqParams

        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        # on CUDA the row is padded to a multiple of PACK_ALIGN tokens (the padding is one
        # more document, never selected), so FlexAttention compiles for a few lengths only
        align = PACK_ALIGN if device.type == "cuda" else 1
        pad = -offsets[-1] % align
        docs = lengths + ([pad] if pad else [])
        if pad:
            offsets.append(offsets[-1] + pad)
            toks, labs = toks + [torch.zeros(pad, dtype=torch.int64)], labs + [torch.zeros(pad, dtype=torch.int64)]
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        out.update(tokens=torch.cat(toks).unsqueeze(0).to(device), labels=torch.cat(labs).unsqueeze(0).to(device),
                   position_ids=torch.cat([torch.arange(n) for n in docs]).unsqueeze(0).to(device),
                   spans=[(0, offsets[k], n) for k, n in enumerate(lengths)],
                   packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=max(docs), max_seqlen_kv=max(docs)))
        return _with_routes(out, data, idx, 1, offsets[-1], device)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    labels = torch.zeros_like(tokens)
    for row, (t, y) in enumerate(zip(toks, labs)):
        tokens[row, : t.numel()] = t
        labels[row, : t.numel()] = y
    b, s = tokens.shape
    out.update(tokens=tokens.to(device), labels=labels.to(device), spans=[(k, 0, n) for k, n in enumerate(lengths)],
               position_ids=torch.arange(s, device=device).unsqueeze(0).expand(b, s))
    return _with_routes(out, data, idx, b, s, device)


def _with_routes(out: dict, data: list[_Prepared], idx: list[int] | None, b: int, s: int, device: torch.device) -> dict:
    """``out["routes"]``: the data's replayed experts in router token order ``[s * b, layers, top_k]``
    (:func:`ferrule.megatron.routing_replay.microbatch_routes`), or None without routing replay."""
    from .routing_replay import microbatch_routes

    with_routes = idx is not None and data[idx[0]].routes is not None
    out["routes"] = (microbatch_routes([data[i].routes for i in idx], out["spans"], b, s, device)
                     if with_routes else None)
    return out


def _forward_step_func(engine: Any, data: list[_Prepared], loss_fn: str | None, loss: Any, loss_cfg: dict,
                       records: list, metric_list: list) -> Any:
    """megatron's ``forward_step_func`` for one fb call: runs the model on a micro-batch (media
    scattered in; on the last stage with ``fused_logprobs`` the hidden states, whose logprobs come
    from the output weight chunk by chunk) and returns the loss function that appends each datum's
    ``(index, logprobs, elementwise loss)`` to ``records`` and its metrics to ``metric_list``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from .fused_logprob import DEFAULT_CHUNK_TOKENS, linear_logprobs

    # the entropy bonus needs every position's full logits: the fused path never forms them
    with_entropy = loss is not None and float(loss_cfg.get("entropy_coef", 0.0)) > 0
    fused = engine.fused_logprobs and not engine.config.sequence_parallel and not with_entropy
    grad_accum = getattr(engine, "grad_accum_fusion", False)
    replaying = bool(data) and data[0].routes is not None


    def forward_step(data_iterator: Iterator[dict], model: Any):
        mb = next(data_iterator)
        gpt = _unwrap_gpt(model)
        if replaying:  # in force until the next micro-batch (a recomputation in the backward replays too)
            routing_replay.replay(engine.moe_routers, mb["routes"])
        extra = {"packed_seq_params": mb["packed_seq_params"]} if mb["packed_seq_params"] is not None else {}
        if gpt.pre_process and any(mb["media"]):
            extra["decoder_input"] = embed_with_media(gpt, mb["tokens"], mb["position_ids"], mb["media"])
        if fused and gpt.post_process:
            # the last stage returns final-norm hidden states [s, b, h]; logprobs come from
            # them and the output weight, chunk by chunk (fused_logprob)
            weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
                else gpt.output_layer.weight
            gpt.post_process = False
            try:
                output = model(mb["tokens"], mb["position_ids"], attention_mask=None, **extra)
            finally:
                gpt.post_process = True
        else:
            weight = None
            output = model(mb["tokens"], mb["position_ids"], attention_mask=None, **extra)

        def select(x: torch.Tensor) -> torch.Tensor:
            """``[b, s, ...]`` -> the data's tokens concatenated, ``[T, ...]``."""
            return torch.cat([x[row, a:a + n] for row, a, n in mb["spans"]])

        entropy: list[torch.Tensor] = []  # with_entropy: the valid tokens' entropy [T], filled by row_logprobs

        def row_logprobs(out: torch.Tensor, expected_grad: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
            """(logprobs of the valid tokens, concatenated [T] fp32; a [b, s] view or None).
            ``expected_grad``: the loss's known d loss / d logprobs (cross entropy), fused path only."""
            if weight is not None:
                main_grad = getattr(weight, "main_grad", None) if grad_accum and weight.requires_grad else None
                return linear_logprobs(select(out.transpose(0, 1)), weight, select(mb["labels"]), engine.vocab_size,
                                       tp_group=ps.get_tensor_model_parallel_group(),
                                       chunk_tokens=getattr(engine, "logprob_chunk_tokens", DEFAULT_CHUNK_TOKENS),
                                       main_grad=main_grad, one_pass=getattr(engine, "logprob_one_pass", True),
                                       expected_grad=expected_grad if main_grad is not None else None), None
            logits = out.float()
            mask = pad_mask(engine, logits)
            if with_entropy:
                entropy.append(select(vocab_parallel_entropy(logits, mask)))
            if mask is not None:
                logits = logits.masked_fill(mask, float("-inf"))
            full = -vocab_parallel_cross_entropy(logits, mb["labels"])  # [b, s]
            return select(full), full

        def loss_func(out: torch.Tensor):
            n_tokens = torch.tensor(sum(mb["lengths"]), dtype=torch.int)
            if mb["idx"] is None or loss is None:
                t, full = row_logprobs(out)
                if mb["idx"] is None:
                    return (full if full is not None else t).sum() * 0.0, n_tokens, {}
                for i, lp in zip(mb["idx"], t.detach().cpu().split(mb["lengths"])):
                    records.append((i, lp, None))
                return t.sum().detach() * 0.0, n_tokens, {}
            inputs = {}
            for key in data[mb["idx"][0]].inputs:
                parts = []
                for i, n in zip(mb["idx"], mb["lengths"]):
                    v = data[i].inputs[key]
                    parts.append(v.reshape(1).expand(n) if v.numel() == 1 and n != 1 else v.reshape(n))
                inputs[key] = torch.cat(parts).to(out.device)
            # cross entropy is linear in the logprobs (l = -weights * t): its gradient is known up front
            expected = -inputs["weights"].float() if loss_fn == "cross_entropy" and "weights" in inputs else None
            t, full = row_logprobs(out, expected)
            if loss_fn in SEQUENCE_LEVEL:  # the loss couples each datum's tokens: say where data start
                inputs["segment_ids"] = torch.repeat_interleave(
                    torch.arange(len(mb["idx"])), torch.tensor(mb["lengths"])).to(t.device)
            per_token, metrics = loss(t, inputs, loss_cfg, entropy=entropy[0] if entropy else None)
            pieces = per_token.detach().float().cpu().split(mb["lengths"])
            tp = t.detach().float().cpu().split(mb["lengths"])
            for i, lp, el in zip(mb["idx"], tp, pieces):
                records.append((i, lp, el))
            metric_list.append({k: float(v) for k, v in metrics.items()})
            return per_token.sum(), n_tokens, {}

        return output, loss_func

    return forward_step


def run(engine: Any, data: list[_Prepared], loss_fn: str | None, loss_cfg: dict, forward_only: bool) -> FBOutput:
    """One fb (or forward-only) call over prepared ``data``: plan DP ranks and micro-batches, run
    megatron's schedule with the DDP chunks in ``no_sync`` and gradient finalization swapped for a
    no-op (restored afterwards, also on error; a failed fb discards the window), gather outputs."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lengths = [p.tokens.numel() for p in data]
    ranks = assign_dp_ranks(lengths, engine.dp_size, None if forward_only else engine._window_loads)
    per_rank = [pack_microbatches([i for i, r in enumerate(ranks) if r == d], lengths,
                                  engine.max_tokens_per_microbatch, packed=engine.packed_sequences)
                for d in range(engine.dp_size)]
    mbs: list[list[int] | None] = list(per_rank[engine.dp_rank])
    if ps.get_expert_model_parallel_world_size() > 1:  # expert all-to-alls need lock-step ranks
        mbs += [None] * (max(len(m) for m in per_rank) - len(mbs))
    loss = get_loss(loss_fn) if loss_fn else None
    records: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
    metric_list: list[dict[str, float]] = []
    microbatches = [microbatch(engine, data, idx) for idx in mbs]

    forward_step = _forward_step_func(engine, data, loss_fn, loss, loss_cfg, records, metric_list)
    if data[0].routes is not None:
        routing_replay.check_layout(engine.layout)
        routing_replay.attach(engine.moe_routers)

    config = engine.config
    saved = config.finalize_model_grads_func
    config.finalize_model_grads_func = _no_finalize
    try:
        if microbatches:
            with contextlib.ExitStack() as stack:
                for chunk in engine.model:
                    stack.enter_context(chunk.no_sync())
                if forward_only:
                    stack.enter_context(torch.no_grad())
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(microbatches), model=engine.model,
                    num_microbatches=len(microbatches), seq_length=max(mb["tokens"].shape[1] for mb in microbatches),
                    micro_batch_size=max(mb["tokens"].shape[0] for mb in microbatches), forward_only=forward_only)
    except BaseException:
        if not forward_only:
            engine.zero_grad()  # a partial micro-batch set would corrupt the window: discard it
        raise
    finally:
        config.finalize_model_grads_func = saved
        routing_replay.clear(engine.moe_routers)
    return gather(engine, len(data), records, metric_list, forward_only)


def gather(engine: Any, n: int, records: list, metric_list: list, forward_only: bool) -> FBOutput:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    payload = (records, metric_list)
    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        gathered: list = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, payload, group=ps.get_data_parallel_group())
    else:
        gathered = [payload]
    if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        box = [gathered]
        last = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
        gathered = box[0]
    outputs: list[dict[str, torch.Tensor] | None] = [None] * n
    metrics_all: list[dict[str, float]] = []
    for recs, mets in gathered:
        for i, lp, el in recs:
            outputs[i] = {"logprobs": lp} if el is None else {"logprobs": lp, "elementwise_loss": el}
        metrics_all += mets
    if any(o is None for o in outputs):
        raise RuntimeError("internal error: some data produced no output (batch plan mismatch across ranks).")
    metrics = finalize_metrics(sum_metrics(metrics_all)) if metrics_all else {}
    return FBOutput(loss_fn_outputs=outputs, metrics=metrics)  # type: ignore[arg-type]
