"""torchrun worker for tests/test_megatron_runtime.py (2 gloo processes, one launch).

Usage: torchrun --nproc-per-node 2 tests/dist/runtime_worker.py CONFIGS_JSON OUT_JSON CKPT_DIR

Runs every multi-process check of the runtime layer and writes measured numbers (max abs
differences, losses, flags) from rank 0 to OUT_JSON; the test asserts on them. Checks:
  scatter   gloo scatter of non-contiguous views, upstream vs patched
  tp2       Qwen3 logits at TP=2 vs TP=1 (same seed, CPU init => same weights)
  pp2       1F1B over 2 stages (get_forward_backward_func) vs the PP=1 loss, same weights
  ep2       Qwen3-MoE logits at EP=2 (alltoall and allgather) vs EP=1, same weights
  optim     megatron DDP + get_megatron_optimizer (Adam, clip 1.0), distopt off/on, 2 steps,
            vs torch.optim.Adam on a copy with all-reduced gradients and clip_grad_norm_
  ckpt      dist_checkpointing save/load (torch_dist) of model + DistributedOptimizer state
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

SEED = 1234
SEQ = 8
MICRO_BATCH = 2


def _batch(vocab: int, seed: int, n: int = MICRO_BATCH):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).expand(n, SEQ).contiguous()
    return ids[:, :-1].contiguous(), pos, ids[:, 1:].contiguous()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def check_scatter(out: dict) -> None:
    import torch.distributed.distributed_c10d as c10d

    rank = dist.get_rank()
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    chunks = list(full.chunk(2, dim=1))  # non-contiguous [4, 3] views
    expected = chunks[rank].contiguous()
    for name, fn in (("upstream", c10d.scatter.__wrapped__), ("patched", dist.scatter)):
        recv = torch.empty(4, 3)
        fn(recv, chunks if rank == 0 else None, src=0)
        out[f"scatter_{name}_correct"] = bool(torch.equal(recv, expected))


def _build(hf_cfg, layout, module, **opts):
    from ferrule.megatron.parallel import destroy_distributed, init_distributed

    destroy_distributed(keep_process_group=True)
    init_distributed(layout, seed=SEED)
    return _provider(module)(hf_cfg, layout, **opts)


def check_tp_pp(cfgs: dict, out: dict) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen import qwen3

    hf = cfgs["qwen3"]
    ids, pos, labels = _batch(hf["vocab_size"], 7)
    ref = _build(hf, ParallelLayout(tp=1), qwen3, parallel_output=False)[0]
    with torch.no_grad():
        ref_logits = ref(ids, pos, None)
        ref_loss = ref(ids, pos, None, labels=labels).mean()
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items() if not k.endswith("_extra_state")}

    tp = _build(hf, ParallelLayout(tp=2), qwen3, parallel_output=False)[0]
    with torch.no_grad():
        out["tp2_logits_max_diff"] = _max_diff(tp(ids, pos, None), ref_logits)

    # PP=2: copy the reference weights into this stage (local layer i = global i + offset).
    stage = _build(hf, ParallelLayout(pp=2), qwen3)[0]
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    offset = pp_rank * (hf["num_hidden_layers"] // 2)
    sd = {}
    for k in stage.state_dict():
        if k.endswith("_extra_state"):
            continue
        if k.startswith("decoder.layers."):
            _, _, idx, rest = k.split(".", 3)
            sd[k] = ref_sd[f"decoder.layers.{int(idx) + offset}.{rest}"]
        else:
            sd[k] = ref_sd[k]
    missing, unexpected = stage.load_state_dict(sd, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")], missing

    def forward_step(data_iterator, model):
        x, p, y = next(data_iterator)
        output = model(x, p, None, labels=y)
        return output, lambda o: (o.mean(), {"loss": o.mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(ids, pos, labels)] * 2),
        model=[stage],
        num_microbatches=2,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    if parallel_state.is_pipeline_last_stage():
        pp_loss = torch.stack([d["loss"] for d in losses]).mean()
    else:
        pp_loss = torch.zeros(())
    dist.all_reduce(pp_loss)  # only the last stage contributes
    out["pp2_loss"] = float(pp_loss)
    out["pp1_loss"] = float(ref_loss)


def check_ep(cfgs: dict, out: dict) -> None:
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen import qwen3_moe

    hf = cfgs["qwen3_moe"]
    n_exp = hf["num_local_experts"]
    ids, pos, _ = _batch(hf["vocab_size"], 11)
    ref = _build(hf, ParallelLayout(ep=1), qwen3_moe, parallel_output=False)[0]
    with torch.no_grad():
        ref_logits = ref(ids, pos, None)
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items() if not k.endswith("_extra_state")}
    for dispatcher in ("alltoall", "allgather"):
        model = _build(hf, ParallelLayout(ep=2), qwen3_moe, parallel_output=False,
                       moe_token_dispatcher_type=dispatcher)[0]
        local = n_exp // 2
        first = dist.get_rank() * local
        sd = {}
        for k in model.state_dict():
            if k.endswith("_extra_state"):
                continue
            if ".local_experts." in k:
                head, rest = k.split(".local_experts.")
                idx, tail = rest.split(".", 1)
                sd[k] = ref_sd[f"{head}.local_experts.{int(idx) + first}.{tail}"]
            else:
                sd[k] = ref_sd[k]
        model.load_state_dict(sd, strict=False)
        with torch.no_grad():
            out[f"ep2_{dispatcher}_logits_max_diff"] = _max_diff(model(ids, pos, None), ref_logits)


def _optim_setup(hf, distopt: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen import qwen3

    from ferrule.megatron.device import get_backend

    model = _build(hf, ParallelLayout(tp=1), qwen3)[0]
    get_backend().seed_all(SEED)  # same seed: the reference copy starts from the same weights
    ref = _provider(qwen3)(hf, ParallelLayout(tp=1))[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt),
        module=model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=distopt, params_dtype=torch.float32),
        [ddp],
    )
    return ddp, opt, ref


def _megatron_step(ddp, opt, batch):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        x, p, y = next(data_iterator)
        output = model(x, p, None, labels=y)
        return output, lambda o: (o.mean(), {"loss": o.mean().detach()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
    )
    ok, grad_norm, _ = opt.step()
    assert ok, "megatron optimizer step reported failure"
    return float(losses[0]["loss"]), float(grad_norm)


def _reference_step(ref, ref_opt, batch):
    x, p, y = batch
    ref_opt.zero_grad()
    loss = ref(x, p, None, labels=y).mean()
    loss.backward()
    params = [q for q in ref.parameters() if q.grad is not None]
    for q in params:
        dist.all_reduce(q.grad)
        q.grad /= dist.get_world_size()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    ref_opt.step()
    return float(loss), float(norm)


def check_optim_and_ckpt(cfgs: dict, out: dict, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    hf = cfgs["qwen3"]
    batches = [_batch(hf["vocab_size"], 100 + 10 * s + dist.get_rank()) for s in range(3)]
    for distopt in (False, True):
        ddp, opt, ref = _optim_setup(hf, distopt)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
        tag = "distopt" if distopt else "nodistopt"
        for s in range(2):
            loss, norm = _megatron_step(ddp, opt, batches[s])
            ref_loss, ref_norm = _reference_step(ref, ref_opt, batches[s])
            out[f"optim_{tag}_step{s}_loss_diff"] = abs(loss - ref_loss)
            out[f"optim_{tag}_step{s}_gradnorm_diff"] = abs(norm - ref_norm)
        got = dict(ddp.module.named_parameters())
        out[f"optim_{tag}_param_max_diff"] = max(_max_diff(got[n], q) for n, q in ref.named_parameters())

    # Checkpoint: model + DistributedOptimizer state after 2 steps (ddp/opt are the distopt ones).
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    model_sd = ddp.module.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}
    dist_checkpointing.save(state, ckpt_dir)
    saved = {n: q.detach().clone() for n, q in ddp.module.named_parameters()}
    saved_steps = sorted({int(st["step"]) for st in opt.optimizer.state.values() if "step" in st})
    _megatron_step(ddp, opt, batches[2])
    cont = {n: q.detach().clone() for n, q in ddp.module.named_parameters()}

    ddp2, opt2, _ = _optim_setup(hf, True)  # same seed: perturb params to prove the load
    with torch.no_grad():
        for q in ddp2.module.parameters():
            q.add_(1.0)
    # torch Adam has no state before its first step and DistributedOptimizer.state_dict asserts a
    # single 'step' (even with is_loading=True): take one throwaway step first (lab finding 5b).
    _megatron_step(ddp2, opt2, batches[0])
    model_sd2 = ddp2.module.sharded_state_dict()
    template = {"model": model_sd2,
                "optimizer": opt2.sharded_state_dict(model_sd2, is_loading=True, metadata=meta)}
    loaded = dist_checkpointing.load(template, ckpt_dir)
    ddp2.module.load_state_dict(loaded["model"])
    with torch.no_grad():
        opt2.load_state_dict(loaded["optimizer"])
    got = dict(ddp2.module.named_parameters())
    out["ckpt_param_max_diff"] = max(_max_diff(got[n], q) for n, q in saved.items())
    out["ckpt_saved_adam_steps"] = saved_steps
    out["ckpt_loaded_adam_steps_upstream"] = sorted({int(st["step"]) for st in opt2.optimizer.state.values()})
    # Workaround for the upstream bug: dp_reshardable stores the per-param 'step' as a
    # LocalNonpersistentObject, so load_parameter_state_from_dp_reshardable writes the
    # template's (throwaway) step back over the one load_state_dict took from param_groups.
    group_steps = {g["step"] for g in loaded["optimizer"]["optimizer"]["param_groups"] if "step" in g}
    assert len(group_steps) == 1, group_steps
    for st in opt2.optimizer.state.values():
        st["step"] = torch.tensor(float(next(iter(group_steps))))
    out["ckpt_loaded_adam_steps_fixed"] = sorted({int(st["step"]) for st in opt2.optimizer.state.values()})
    _megatron_step(ddp2, opt2, batches[2])
    got = dict(ddp2.module.named_parameters())
    out["ckpt_resume_param_max_diff"] = max(_max_diff(got[n], q) for n, q in cont.items())


def main() -> None:
    cfg_path, out_path, ckpt_dir = sys.argv[1:4]
    from ferrule.megatron.device import get_backend
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed

    get_backend()
    with open(cfg_path) as f:
        cfgs = json.load(f)
    out: dict = {}
    init_distributed(ParallelLayout(), seed=SEED)
    check_scatter(out)
    check_tp_pp(cfgs, out)
    check_ep(cfgs, out)
    check_optim_and_ckpt(cfgs, out, ckpt_dir)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    dist.barrier()
    destroy_distributed()


def _provider(module):
    """The family's registered provider build (default build from the variant's config rows)."""
    from ferrule.contract.registry import provider_build

    return provider_build(module.MAPPING.family)


if __name__ == "__main__":
    main()

