"""Probe for tests/test_megatron_cpu_compat.py: does upstream megatron-core still need each patch?

Usage: python tests/dist/cpu_compat_probe.py OUT_JSON

One process, gloo world size 1. For every patch of ``ferrule.megatron.cpu_compat.PATCHES`` and
``ferrule.megatron.te_compat.PATCHES``:
revert that one patch, run its reproduction against upstream code (recording the exception
type and message, or "ok"), re-apply it and run the reproduction again. Writes
``{patch: {"upstream": ..., "patched": ...}}`` to OUT_JSON. ``gloo_uneven_all_gather`` needs two ranks: its
reproduction spawns one pair of gloo processes (both states in one run, about 8 s).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch

SEED = 5


def _tiny_model():
    from ferrule.config_translation import ConfigTranslation
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen.qwen3 import CONFIG_TRANSLATION

    assert isinstance(CONFIG_TRANSLATION, ConfigTranslation)
    hf = {
        "model_type": "qwen3", "hidden_act": "silu", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    return build_from_hf_config(hf, ParallelLayout(), CONFIG_TRANSLATION)[0]


def repro_current_device():
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")


def repro_synchronize():
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    with tempfile.TemporaryDirectory() as d:
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0), replica_id=0)}
        dist_checkpointing.save(sd, d)


def repro_streams():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen.qwen3_moe import CONFIG_TRANSLATION

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # class-level cache: drop a stale stub
    hf = {
        "model_type": "qwen3_moe", "hidden_act": "silu", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "moe_intermediate_size": 8, "num_local_experts": 2,
        "num_experts_per_tok": 1, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 32,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    model = build_from_hf_config(hf, ParallelLayout(), CONFIG_TRANSLATION, moe_token_dispatcher_type="alltoall")[0]
    ids = torch.randint(0, 64, (1, 4))
    model(ids, torch.arange(4)[None], None)


def repro_moe_te_general_gemm():
    from megatron.core.transformer.moe import moe_utils

    moe_utils.router_gating_linear(torch.randn(3, 4), torch.randn(2, 4), None, torch.float32)


def repro_moe_split_sizes():
    import torch.distributed as dist
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    out = torch.empty(3)
    dist.all_to_all_single(out, torch.arange(3.0), output_split_sizes=splits, input_split_sizes=splits)
    assert torch.equal(out, torch.arange(3.0)), out


def repro_gloo_scatter_contiguous():
    import torch.distributed as dist

    full = torch.arange(12.0).reshape(3, 4)
    view = full[:, 1:3]  # non-contiguous [3, 2]
    recv = torch.empty(3, 2)
    dist.scatter(recv, [view], src=0)
    if not torch.equal(recv, view):
        raise AssertionError(f"gloo scatter delivered wrong values for a non-contiguous tensor: {recv.tolist()}")


def _uneven_gather_rank(rank: int, init: str, out) -> None:
    """Child of :func:`repro_gloo_uneven_all_gather`: the uneven first-dim ``all_gather`` that megatron's
    ``mappings._gather_along_first_dim(output_split_sizes=...)`` makes, over a 2-rank gloo group, first
    unpatched, then with the patch (a failed size check sends nothing, so the group stays usable)."""
    import torch.distributed as dist

    from ferrule.megatron import cpu_compat

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    expected = torch.cat([torch.zeros(2, 3), torch.ones(3, 3)])
    for state in ("upstream", "patched"):
        if state == "patched":
            cpu_compat.patch_gloo_uneven_all_gather([])
        got = expected.new_empty(expected.shape)
        try:
            dist.all_gather(list(torch.split(got, [2, 3])), torch.full((2 + rank, 3), float(rank)))
            out.put((state, rank, "ok" if torch.equal(got, expected) else f"AssertionError: wrong {got.tolist()}"))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out.put((state, rank, f"{type(exc).__name__}: {exc}"))
    dist.destroy_process_group()


_UNEVEN: dict = {}


def repro_gloo_uneven_all_gather():
    """Needs 2 ranks (the probe has 1): one pair of spawned gloo processes runs both states, cached here."""
    import torch.multiprocessing as mp

    from ferrule.megatron import cpu_compat

    if not _UNEVEN:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_uneven_gather_rank, args=(r, f"file://{tmp}/store", out)) for r in range(2)]
            for p in procs:
                p.start()
            for _ in range(4):
                state, rank, msg = out.get(timeout=120)
                _UNEVEN.setdefault(state, []).append(msg)
            for p in procs:
                p.join(timeout=60)
    state = "patched" if "gloo_uneven_all_gather" in cpu_compat.applied() else "upstream"
    bad = [msg for msg in _UNEVEN[state] if msg != "ok"]
    if bad:
        name, _, message = bad[0].partition(": ")
        raise {"RuntimeError": RuntimeError}.get(name, AssertionError)(message)


def _optimizer(distopt: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _tiny_model()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distopt), module=model
    )
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distopt, clip_grad=1.0), [ddp]
    )


def repro_optimizer_device_literals():
    _optimizer(distopt=False)


def repro_optimizer_type_checks():
    from megatron.core.optimizer import clip_grads

    _optimizer(distopt=True)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=2.0)
    assert torch.allclose(p.grad, torch.full((3,), 0.5), atol=1e-5), p.grad


def repro_schedules_device_literal():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _tiny_model()
    ids = torch.randint(0, 64, (1, 4))
    pos = torch.arange(4)[None]

    def step(it, m):
        return m(ids, pos, None, labels=ids), lambda o: (o.mean(), {})

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=4, micro_batch_size=1, forward_only=True)


def repro_causal_mask_device_literal():
    from megatron.core.transformer import utils

    mask = utils.get_default_causal_mask(3)
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]], mask


def repro_embedding_group_cuda():
    # a tied-embedding model's setup at PP > 1 (the pipeline size is raised on the config so the
    # first/last-stage all-reduce runs; at world size 1 the embedding group is this rank alone)
    model = _tiny_model()
    model.share_embeddings_and_output_weights = True
    model.config.pipeline_model_parallel_size = 2
    try:
        before = model.shared_embedding_or_output_weight().detach().clone()
        model.setup_embeddings_and_output_layer()
        assert torch.equal(model.shared_embedding_or_output_weight(), before)
    finally:
        model.config.pipeline_model_parallel_size = 1


def _run(fn) -> str:
    try:
        fn()
        return "ok"
    except BaseException as exc:  # noqa: BLE001 - the probe records whatever upstream raises
        frames = traceback.extract_tb(exc.__traceback__)
        upstream = [f for f in frames if f"{os.sep}megatron{os.sep}" in f.filename] or frames
        site = upstream[-1]
        rel = site.filename.split(f"{os.sep}megatron{os.sep}core{os.sep}")[-1]
        return f"{type(exc).__name__}: {exc} @ {rel}:{site.name}"


def main() -> None:
    from ferrule.megatron import cpu_compat, te_compat
    from ferrule.megatron.parallel import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), seed=SEED)
    results = {}
    for table in (cpu_compat, te_compat):
        for patch in table.PATCHES:
            repro = globals()[f"repro_{patch.name}"]
            table.revert([patch.name])
            upstream = _run(repro)
            table.apply()
            results[patch.name] = {"upstream": upstream, "patched": _run(repro)}
    results["_applied"] = list(cpu_compat.applied()) + list(te_compat.applied())
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
