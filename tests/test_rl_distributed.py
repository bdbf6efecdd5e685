"""``ferrule train`` on 2 ranks (CPU, gloo): DP=2, TP=2, PP=2 (tied embeddings), LoRA at DP=2 and
TP=2, and a Qwen3-MoE at EP=2 (full-parameter and LoRA), each against one process.

Referee: the same GRPO run in one process (tests/dist/rl_referee.py, on the CPU), on the tiny model and task of
tests/test_rl_e2e.py with ``rollout.prompts_per_shard=2`` (4 prompts: two rollout shards, so
DP=2 runs one shard on each replica), a KL term to a frozen reference and two optimizer steps
per rollout; the LoRA layouts against the same run with the same ``lora`` section, EP=2 against
the same run on a tiny Qwen3-MoE (same width and tokenizer, 4 experts, top 2). Every 2-rank run
happens in ONE torchrun launch (tests/dist/rl_worker.py): per layout an uninterrupted run and a
resume from its step-2 checkpoint. Two more launches check failures (a rank that raises; a user
error through ``ferrule train --nproc 2``).

LoRA under torchrun: every rollout rank must serve the same adapter after each sync
(``served``: the other replica's engine gets the driver's adapter through
``fan_out_lora_adapter``), every sync is verified (``check_weight_update_equal``), and the
sampled responses equal one process's, so the second replica's shard (sampled on its own
engine) saw the trained adapter.

EP=2 (DP=2, each rank holds 2 of the 4 experts): tokens of both ranks meet in the experts'
matmuls (all-to-all dispatch) and the dense gradients are all-reduced, so sums run in another
order than in one process: the same fp32-rounding tolerance holds. The MoE model has
``router_aux_loss_coef=0``: megatron's ``aux_loss`` load-balancing loss is computed per
micro-batch over the tokens of one DP rank (reduced over the TP/CP group only), so with it the
router gradient depends on how the batch is split across ranks, which is not a rounding effect.

Tolerances: the rollouts (tokens) must be identical; the per-step metrics of a layout may differ
from one process by fp32 rounding only, because the layouts sum in another order: DP=2 sums two
ranks' gradients (all-reduce) instead of accumulating all data in one buffer, TP=2 splits the
matmul reductions and the vocabulary softmax over two ranks, PP=2 adds the tied embedding's two
gradient halves across stages and the grad norm per stage, EP=2 feeds both ranks' tokens to each
expert's matmuls. Those differences are ~1e-7 relative per op and grow through a few Adam steps at
lr 1e-2 (measured: at most 5.2e-6 relative, LoRA at EP=2; 3.2e-6 without LoRA), hence
``METRIC_RTOL`` = 3e-5 (``METRIC_ATOL`` = 1e-6 for metrics that are themselves ~1e-8, such as
the train/rollout logprob difference). A resume at the same
layout repeats the same operations, so it must be bit-identical (metrics, samples, weights).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
import rl_worker as w  # noqa: E402
import test_rl_e2e as e2e  # noqa: E402

#: relative tolerance of a layout's per-step metrics vs one process (module docstring); measured on
#: the CI CPU: at most 5.2e-6 (loss, LoRA at EP=2; 3.2e-6 ppo_kl at TP=2), about 2/3 of the float metrics
#: bit-identical
METRIC_RTOL = 3e-5
METRIC_ATOL = 1e-6
TIMING = re.compile(r"^(time.*|.*_per_s|memory_.*|mfu)$")  # timings, memory and mfu (from time) vary run to run
#: collective timeout of the failure runs (seconds); the job must end well within it
FAIL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_dist")
    e2e._build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"{e2e.WORDS[i % 8]} {e2e.WORDS[(i // 8) % 8]} {i}", "answer": "7"}) + "\n")
    (root / "tiny.yaml").write_text(e2e.CONFIG)
    _build_moe_model(root / "model_moe")
    overrides = [f"model.hf_dir={root / 'model'}", f"data.jsonl_path={root / 'task.jsonl'}",
                 "rollout.prompts_per_shard=2",
                 # a frozen reference (rank 0 only; its logprobs are broadcast) and two optimizer steps
                 # per rollout (old logprobs from the train engine) exercise every batch input
                 "algorithm.kl_coef=0.05", "train.optim_steps_per_rollout=2",
                 # no reward-curve PNG: nothing here reads it, and drawing it was half of a 3-step run's time
                 # (cProfile: 1.46 of 2.74 s, matplotlib's tight_layout and savefig)
                 "logging.plot_at_end=false"]
    (root / "overrides.json").write_text(json.dumps(overrides))
    return root


#: the EP layout's model: test_rl_e2e's width and tokenizer, 4 routed experts (top 2) in every layer; no
#: load-balancing loss (module docstring)
MOE = dict(e2e.TINY, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def _build_moe_model(out: Path) -> None:
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    e2e._build_model(out)  # the character tokenizer (the dense model it also writes is replaced below)
    dense = json.loads((out / "config.json").read_text())
    cfg = AutoConfig.for_model(model_type="qwen3_moe", vocab_size=dense["vocab_size"], eos_token_id=dense["eos_token_id"],
                               pad_token_id=dense["pad_token_id"], bos_token_id=None, **MOE)
    torch.manual_seed(e2e.SEED)
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(out)


#: the layouts the 2-GPU test runs over NCCL
GPU_LAYOUTS = ("dp2", "lora_dp2", "ep2")


def _layout_overrides(name: str, work: Path) -> list[str]:
    """The overrides a layout shares with its one-process referee (model, LoRA; not ``parallel.*``)."""
    return [f"{k}={str(v).format(work=work)}" for k, v in w.LAYOUTS[name].items() if not k.startswith("parallel.")]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _comparable(entries):
    return [{k: v for k, v in e.items() if k != "time" and not TIMING.match(k)} for e in entries]


def _diff_report(mine, ref) -> str:
    """Which float metrics differ, the largest relative difference among those with |value| >= 1e-3
    and the largest absolute one among the smaller ones (printed with pytest -s)."""
    rel, small, n, same = (0.0, ""), (0.0, ""), 0, 0
    for a, b in zip(_comparable(mine), _comparable(ref)):
        for k, v in a.items():
            if not (isinstance(v, float) and isinstance(b.get(k), float)):
                continue
            n += 1
            same += v == b[k]
            if abs(b[k]) >= 1e-3:
                rel = max(rel, (abs(v - b[k]) / abs(b[k]), f"step {a['step']} {k}"))
            else:
                small = max(small, (abs(v - b[k]), f"step {a['step']} {k}"))
    return (f"{same}/{n} float metrics bit-identical; max rel diff (|x| >= 1e-3) {rel[0]:.2e} ({rel[1]}); "
            f"max abs diff (|x| < 1e-3) {small[0]:.2e} ({small[1]})")


def _assert_close(mine, ref, where):
    print(f"{where} vs one process: {_diff_report(mine, ref)}")
    assert [e["step"] for e in mine] == [e["step"] for e in ref], where
    for a, b in zip(_comparable(mine), _comparable(ref)):
        assert a.keys() == b.keys(), (where, a.keys() ^ b.keys())
        for k in a:
            if isinstance(b[k], float):
                assert math.isclose(a[k], b[k], rel_tol=METRIC_RTOL, abs_tol=METRIC_ATOL), (where, a["step"], k, a[k], b[k])
            else:
                assert a[k] == b[k], (where, a["step"], k, a[k], b[k])


def _cpu_env():
    """``_env()`` with the GPUs hidden: the gloo test and its referee train on the CPU on any machine
    (ferrule's CPU backend is for CUDA-less processes: ``ferrule.megatron.device.get_backend``)."""
    return dict(_env(), CUDA_VISIBLE_DEVICES="")


def _one_process(work: Path, jobs: list[list[str]]) -> list:
    """The referee runs (one process, CPU): ``(metrics, responses, weights digest)`` per job, in order.
    On a machine without CUDA they run in this process, as a referee process with ``_cpu_env()`` would
    run them (one thread, no process group left afterwards); with CUDA in a process of their own, where
    CUDA is hidden (ferrule's device backend is fixed per process)."""
    import torch

    if not torch.cuda.is_available():
        import warnings

        import rl_referee
        from inproc import environment

        from ferrule.megatron.parallel import destroy_distributed

        with environment(_cpu_env()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the referee process's PYTHONWARNINGS=ignore
            torch.set_num_threads(1)  # its OMP_NUM_THREADS=1 (environment() restores the count)
            destroy_distributed()  # no process group of an earlier test: the runs start as in a fresh process
            try:
                out = rl_referee.run_jobs(work / "tiny.yaml", jobs)
            finally:
                destroy_distributed()
        return json.loads(json.dumps(out))  # the same lists a referee process writes
    spec, out = work / "referee_jobs.json", work / "referee_results.json"
    spec.write_text(json.dumps({"config": str(work / "tiny.yaml"), "jobs": jobs}))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist" / "rl_referee.py"), str(spec), str(out)],
                          capture_output=True, text=True, timeout=400, env=_cpu_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


def _launch_worker(dist_pool, work: Path, layouts: str | None = None, *, cpu: bool = False) -> dict:
    env = _cpu_env() if cpu else _env()
    if layouts:
        env[w.LAYOUTS_ENV] = layouts
    worker = [str(REPO / "tests" / "dist" / "rl_worker.py"), str(work)]
    if dist_pool is None:  # NCCL over two GPUs: its own launch (the pool's ranks are gloo / CPU)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               *worker], capture_output=True, text=True, timeout=560, env=env, cwd=REPO)
    else:
        proc = dist_pool.run(worker, timeout=560, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return json.loads((work / "results.json").read_text())


@pytest.mark.timeout(600)
def test_layouts_match_one_process_and_resume_bit_identically(dist_pool, work, tmp_path):
    # gloo on the CPU on any machine (GPUs hidden from the workers and the referee); NCCL: test_dp2_on_two_gpus
    results = _launch_worker(dist_pool, work, cpu=True)
    print({name: round(runs["seconds"], 1) for name, runs in results.items()}, "seconds per layout (2 ranks)")

    # resume each layout's step-2 checkpoint in one process (DP 2 -> 1, TP 2 -> 1, PP 2 -> 1: the torch_dist
    # weights and Adam state reshard; LoRA DP 2 -> 1: DP replica 0's adapter shard and Adam state); step 3 then
    # matches the one-process run
    for name in results:
        cross = tmp_path / f"{name}_to_1"
        shutil.copytree(work / name / "full", cross)
        shutil.rmtree(cross / "checkpoints" / f"step_{w.STEPS:06d}")
    # the referees (one process, same config, and the same model / lora section as the layout), then the
    # cross-layout resumes: one launch, on the CPU
    base = json.loads((work / "overrides.json").read_text())
    common = base + [f"train.steps={w.STEPS}", f"checkpoint.interval={w.CKPT_EVERY}", "checkpoint.keep=0"]
    keys = list(dict.fromkeys(tuple(_layout_overrides(name, work)) for name in results))  # dense, LoRA, MoE, ...
    out = _one_process(work, [common + list(k) + [f"logging.run_dir={tmp_path / f'one_{i}'}"] for i, k in enumerate(keys)]
                       + [common + _layout_overrides(name, work) + [f"logging.run_dir={tmp_path / f'{name}_to_1'}",
                                                                    "checkpoint.resume=true"] for name in results])
    refs, crossed = dict(zip(keys, out[:len(keys)])), dict(zip(results, out[len(keys):]))
    for ref_metrics, ref_responses, _ in refs.values():
        assert len({e["reward_mean"] for e in ref_metrics}) > 1 or len(set(ref_responses)) > 8  # not trivially constant

    for name, runs in results.items():
        ref_metrics, ref_responses, _ = refs[tuple(_layout_overrides(name, work))]
        full_m, full_r, full_w = runs["full"]
        res_m, res_r, res_w = runs["resumed"]
        # resume at this layout: bit-identical metrics, samples and final weights (and adapter)
        assert _comparable(res_m) == _comparable(full_m), name
        assert res_r == full_r and res_w == full_w, name
        # the layout vs one process: the same rollouts, metrics within fp32 rounding
        assert full_r == ref_responses, name
        _assert_close(full_m, ref_metrics, name)
        assert {"time_train_s_max", "time_rollout_s_min"} <= full_m[0].keys(), name
        if name.startswith("lora"):
            # both replicas' rollout engines serve the driver's adapter, which trained (sync_bytes: adapter only)
            ranks = [r for r, _ in runs["served"]]
            assert ranks == ([0] if name == "lora_tp2" else [0, 1]), (name, runs["served"])
            assert len({d for _, d in runs["served"]}) == 1, (name, runs["served"])
            assert all(0 < e["sync_bytes"] < 100_000 for e in full_m), name

    for name, got in crossed.items():
        if name in REFUSED_CROSS_RESUME:  # refused before training, with the reason (a ConfigError)
            assert isinstance(got, dict) and re.search(REFUSED_CROSS_RESUME[name], got["config_error"]), (name, got)
            continue
        ref_metrics, ref_responses, _ = refs[tuple(_layout_overrides(name, work))]
        cross_m, cross_r, _ = got
        assert cross_r == ref_responses, name
        _assert_close(cross_m, ref_metrics, f"{name} -> 1 resume")


#: checkpoints that do not resume in one process: the LoRA adapter's Adam state is saved per rank (only
#: the DP size may change); megatron chains a separate expert optimizer only at ep > 1
_LORA_REFUSAL = (r"(?s)LoRA optimizer state per rank .* at world size 2; this engine runs .* at world size 1\. "
                 r"Only the data-parallel size may change .* resume this LoRA run with the checkpoint's "
                 r"parallel\.\* and 2 ranks")
REFUSED_CROSS_RESUME = {
    "lora_tp2": _LORA_REFUSAL, "lora_ep2": _LORA_REFUSAL,
    "ep2": r"written at expert-parallel size ep=2, this engine runs ep=1; megatron-core keeps the Adam state of "
           r"routed experts in a separate",
}


@pytest.mark.timeout(240)
def test_a_rank_that_raises_stops_the_job_with_its_message(work, tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits in a collective: torchrun ends both ranks, the
    message is in the output, and the job is down long before the collective timeout."""
    mark = tmp_path / "failed_at"
    base = json.loads((work / "overrides.json").read_text())
    args = [str(work / "tiny.yaml"), *base, "train.steps=4", f"logging.run_dir={tmp_path / 'run'}",
            f"parallel.timeout_s={FAIL_TIMEOUT_S}", "checkpoint.interval=100"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "dist" / "rl_fail_worker.py"), "1", "2", str(mark), *args],
                          capture_output=True, text=True, timeout=200, env=_env(), cwd=REPO)
    ended = time.time()
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in proc.stdout + proc.stderr
    assert ended - float(mark.read_text()) < FAIL_TIMEOUT_S / 2, "the job outlived the failing rank"


@pytest.mark.timeout(240)
def test_cli_nproc_checks_the_layout_first_and_passes_a_user_error_through(work, tmp_path):
    """``ferrule train --nproc 2`` in this process (tests/inproc.py): the layout check refuses before any rank
    starts, and a user error in a rank comes back through the torchrun it starts as one line with exit code 2."""
    from inproc import run_ferrule

    base = json.loads((work / "overrides.json").read_text())
    cli = ["train", "--nproc", "2", str(work / "tiny.yaml"), *base]
    # a layout that does not fit: refused before any rank starts, valid sizes named
    bad = run_ferrule(cli + ["parallel.tp=3", f"logging.run_dir={tmp_path / 'bad'}"], env=_env(), cwd=REPO)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "parallel.tp: 3 does not divide the model's attention heads 4, KV heads 2" in bad.stderr
    assert "valid tp: [1, 2]" in bad.stderr and "Traceback" not in bad.stderr
    assert "tp=1 pp=2" in bad.stderr  # tp*pp=3 does not divide 2 ranks: the valid pairs are listed
    assert not (tmp_path / "bad").exists()  # no rank started (a rank would have made its run folder)
    # a reward function that raises on the reference answers: refused at set-up, exit code 2 and its message
    (tmp_path / "dist_rewards.py").write_text(e2e.REWARD_MODULE)
    t0 = time.time()
    res = run_ferrule(cli + ["reward.function=dist_rewards:broken", "train.steps=2",
                             f"logging.run_dir={tmp_path / 'broken'}"],
                      env=dict(_env(), PYTHONPATH=str(tmp_path)), cwd=REPO)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: rank 0: reward function 'dist_rewards:broken' raised TypeError"), last
    assert time.time() - t0 < 180


def _cfg(**parallel):
    from ferrule.rl.config import config_from_dict

    return config_from_dict({"model": {"hf_dir": "unused"}, "parallel": parallel}, validate=False)


DENSE = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 6}


@pytest.mark.parametrize("parallel, world, fragments", [
    ({"tp": 3}, 6, ["parallel.tp: 3 does not divide the model's attention heads 8, KV heads 2 and FFN width 96",
                    "valid tp: [1, 2]"]),
    ({"pp": 4}, 4, ["parallel.pp: 4 does not divide the model's 6 layers", "valid pp: [1, 2, 3, 6]"]),
    ({"tp": 2, "pp": 2}, 2, ["tp*pp = 2*2 = 4 does not divide the world size 2",
                             "tp=1 pp=1, tp=1 pp=2, tp=2 pp=1"]),
    ({"ep": 2}, 2, ["parallel.ep: 2 > 1 but the model has no routed experts"]),
    ({"vpp": 2, "pp": 2}, 2, ["parallel.vpp: 2 virtual pipeline stages are not supported",
                              "non-interleaved pipeline schedule"]),
])
def test_layout_is_checked_against_world_size_and_model(parallel, world, fragments):
    from ferrule.rl.config import ConfigError
    from ferrule.rl.distributed import check_layout

    with pytest.raises(ConfigError) as info:
        check_layout(_cfg(**parallel), DENSE, world)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, text


def test_valid_layouts_pass_and_experts_are_checked():
    from ferrule.rl.config import ConfigError
    from ferrule.rl.distributed import check_layout

    check_layout(_cfg(tp=2, pp=3), DENSE, 12)  # DP = 2
    moe = dict(DENSE, num_experts=6)
    check_layout(_cfg(ep=2), moe, 4)
    with pytest.raises(ConfigError, match=r"parallel.ep: 4 does not divide the model's 6 routed experts; valid ep: \[1, 2, 3, 6\]"):
        check_layout(_cfg(ep=4), moe, 4)


def test_shards_and_their_seeds_do_not_depend_on_the_replica_count():
    from ferrule.rl.distributed import plan_shards, shard_seed
    from ferrule.rl.loop import rollout_seed

    one = plan_shards(8, 2, 1, 5, 3)
    two = plan_shards(8, 2, 2, 5, 3)
    assert [(s.start, s.stop, s.seed) for s in one] == [(s.start, s.stop, s.seed) for s in two]
    assert [s.replica for s in two] == [0, 1, 0, 1] and {s.replica for s in one} == {0}
    # shard 0 keeps the single-shard seed of earlier runs; the others are distinct sha256 seeds
    assert one[0].seed == rollout_seed(5, 3) and len({s.seed for s in one}) == 4
    assert shard_seed(5, 3, 1) != shard_seed(5, 4, 1)
    # default (0): one shard per replica, the last one shorter
    assert [(s.start, s.stop) for s in plan_shards(5, 0, 2, 0, 1)] == [(0, 3), (3, 5)]
    assert [(s.start, s.stop) for s in plan_shards(4, 0, 1, 0, 1)] == [(0, 4)]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_dp2_on_two_gpus_matches_one_gpu(work, tmp_path):
    """The same checks over NCCL (2 GPUs) at DP=2, LoRA DP=2 (the adapter fan-out between GPUs) and
    Qwen3-MoE EP=2: same responses as one GPU, metrics within METRIC_RTOL, resume exact."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL DP=2); CPU machines run the gloo layouts test")
    results = _launch_worker(None, work, ",".join(GPU_LAYOUTS))
    base = json.loads((work / "overrides.json").read_text())
    common = base + [f"train.steps={w.STEPS}", f"checkpoint.interval={w.CKPT_EVERY}", "checkpoint.keep=0"]
    for name in GPU_LAYOUTS:
        ref_metrics, ref_responses, _ = w.run(work / "tiny.yaml", common + _layout_overrides(name, work)
                                              + [f"logging.run_dir={tmp_path / f'one_{name}'}"])
        full_m, full_r, full_w = results[name]["full"]
        res_m, res_r, res_w = results[name]["resumed"]
        assert _comparable(res_m) == _comparable(full_m) and res_r == full_r and res_w == full_w, name
        assert full_r == ref_responses, name
        _assert_close(full_m, ref_metrics, f"{name} (NCCL)")
        if "served" in results[name]:  # both GPUs' rollout engines serve the same adapter
            assert len({d for _, d in results[name]["served"]}) == 1 and len(results[name]["served"]) == 2, name
