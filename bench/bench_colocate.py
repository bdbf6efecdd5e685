"""Real sizes on one GPU: GRPO steps with train and rollout resident together, or taking turns.

Random-weight Qwen2/Qwen3-shaped models built on the GPU (no checkpoint on disk), bf16 params with
fp32 master weights, fp32 gradients and Adam (full-parameter), or a LoRA adapter on the frozen
base. Each step is the loop's (``ferrule.rl.loop``): generate ``prompts x n`` responses with the
embedded engine (temperature 1), a synthetic verifiable reward (the fraction of even token ids in
the response: no task, the numbers are about memory and time), GRPO advantages, one
``forward_backward`` (``importance_sampling``) + ``optim_step``, a full weight sync (LoRA: the
adapter). With ``--colocate`` the step runs the ``train.colocate`` order through the same
:class:`ferrule.rl.colocate.Colocation` and :class:`~ferrule.rl.colocate.PhaseMeter` the loop uses.

One row per process (a CUDA OOM leaves the process's allocator in a state not worth trusting):

    python bench/bench_colocate.py --shape qwen3-4b --colocate      # one row, JSON on stdout
    python bench/bench_colocate.py --rows qwen3-4b:off qwen3-4b:on qwen3-4b:on:lora16 --out rows.jsonl
    python bench/bench_colocate.py --shape tiny --steps 1            # CPU smoke run of the code path

Printed per row: parameters, per-phase peak memory (GiB), step time split (rollout / train /
sync / offload+onload+sleep+wake), colocated: the page-locked host memory the stashes hold
(``host_stash_bytes``) and how it was page-locked; or ``"oom"`` with the phase it happened in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {  # HF config fields; vocab 151936 as the Qwen releases
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    # Qwen3-8B's layer (hidden 4096, MLP 12288, 32 heads, 8 KV heads) at 24 / 26 / 28 / 30 layers (5.88 / 6.27 / 6.65 / 7.04 B)
    "qwen3-8b-l24": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False),
    "qwen3-8b-l26": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=26,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False),
    "qwen3-8b-l28": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=28,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False),
    "qwen3-8b-l30": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=30,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
GIB = 2**30


def _hf_config(shape: dict):
    from transformers import AutoConfig

    fields = dict(shape)
    cfg = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=4096, rms_norm_eps=1e-6, **fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def _train_engine(hf_cfg, dtype, lora_rank: int, micro_batch_tokens: int):
    import torch

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout

    hf = hf_cfg.to_dict()
    family, table, chunks = TrainEngine._build(hf, ParallelLayout(), 1234, dtype, None)
    g = torch.Generator(device=next(chunks[0].parameters()).device).manual_seed(0)
    with torch.no_grad():  # random weights, as HF initialises (normal 0.02, norms at 1)
        for name, p in chunks[0].named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    lora = None
    if lora_rank:
        from ferrule.lora import LoraSettings

        lora = LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank, target_modules="all")
    return TrainEngine(chunks, hf_config=hf, family=family, mapping_table=table, layout=ParallelLayout(),
                       optimizer=OptimizerSettings(lr=1e-6), params_dtype=dtype,
                       max_tokens_per_microbatch=micro_batch_tokens, lora=lora)


def _rollout_engine(hf_cfg, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM

    from ferrule.rollout.embedded import EmbeddedEngine

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    return EmbeddedEngine(model=model)


def _sync(engine, rollout, version: int):
    from ferrule.sync import sync_lora_adapter, sync_weights

    if engine.lora is not None:
        return sync_lora_adapter(engine, rollout, version=version)
    return sync_weights(engine, rollout, version=version)


def _train(engine, results, prompts, n: int):
    import numpy as np
    import torch

    from ferrule.rl.advantages import grpo_advantages, token_weights
    from ferrule.rl.batch import Sample, build_datums

    samples = [Sample(group=r.prompt_index, prompt_ids=tuple(prompts[r.prompt_index]), response_ids=r.token_ids,
                      rollout_logprobs=r.logprobs, truncated=r.finish_reason == "length") for r in results]
    rewards = [float(np.mean([t % 2 == 0 for t in r.token_ids])) if r.token_ids else 0.0 for r in results]
    adv = grpo_advantages(rewards, group_size=n)
    w = token_weights([len(s.response_ids) for s in samples], mode="token_mean")
    datums = build_datums(samples, weights=w, advantages=list(adv),
                          behaviour_logprobs=[torch.tensor(s.rollout_logprobs) for s in samples], use_tis=False)
    engine.forward_backward(datums, "importance_sampling")
    return engine.optim_step(), sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def run_row(args) -> dict:
    import torch

    from ferrule.megatron.device import get_backend
    from ferrule.rl.colocate import Colocation, PhaseMeter
    from ferrule.rollout import SamplingParams

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    hf_cfg = _hf_config(SHAPES[args.shape])
    row: dict = {"shape": args.shape, "colocate": args.colocate, "lora_rank": args.lora, "steps": args.steps,
                 "prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.new_tokens}
    phase = "build"
    try:
        engine = _train_engine(hf_cfg, dtype, args.lora, args.micro_batch_tokens)
        row["params"] = sum(p.numel() for p in engine.model[0].parameters())
        row["trainable_params"] = sum(p.numel() for p in engine.model[0].parameters() if p.requires_grad)
        backend = get_backend()
        rollout = _rollout_engine(hf_cfg, dtype, backend.device)  # before Adam's moments exist: both fit
        phase = "initial sync"
        _sync(engine, rollout, 0)  # (a LoRA adapter is injected here, into the awake rollout engine)
        meter = PhaseMeter()
        col = Colocation(engine, rollout, meter) if args.colocate else None
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, hf_cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                   for _ in range(args.prompts)]
        steps = []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            backend.reset_peak_memory()
            phase = "rollout"
            if col is not None:
                col.rollout_phase()
            meter.record_now("memory_offloaded_bytes")
            meter.start()
            t = time.perf_counter()
            results = rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                               n=args.n, seed=step, ignore_eos=True))
            backend.synchronize()
            t_rollout = time.perf_counter() - t
            meter.stop("rollout")
            phase = "train"
            if col is not None:
                col.train_phase()
            meter.start()
            t = time.perf_counter()
            res, tokens = _train(engine, results, prompts, args.n)
            backend.synchronize()
            t_train = time.perf_counter() - t
            meter.stop("train")
            phase = "sync"
            meter.start()
            t = time.perf_counter()
            stats = _sync(engine, rollout, step)
            t_sync = time.perf_counter() - t
            meter.stop("sync")
            if col is not None:
                col.offload_train()
            m = meter.pop()
            if col is not None:  # page-locked host memory held by the stashes (train state + rollout weights)
                stashes = list(engine._offload.stashes) + ([rollout._sleep.stash] if rollout._sleep.stash is not None else [])
                m["host_stash_bytes"] = sum(st.host_bytes for st in stashes)
                m["host_moved_bytes"] = sum(st.nbytes for st in stashes)
                m["host_pinned"] = sorted({st.pinned for st in stashes if st.host_bytes})
            steps.append({"step": step, "time_step_s": time.perf_counter() - t0, "time_rollout_s": t_rollout,
                          "time_train_s": t_train, "time_sync_s": t_sync, "train_tokens": tokens,
                          "grad_norm": res["grad_norm"], "sync_bytes": stats.bytes,
                          "step_peak_bytes": backend.memory_stats().get("peak_allocated"), **m})
            print(json.dumps({"shape": args.shape, "colocate": args.colocate, **steps[-1]}), file=sys.stderr)
        row["steps_detail"] = steps
        row["result"] = "ok"
    except torch.OutOfMemoryError as exc:
        row["result"] = "oom"
        row["oom_phase"] = phase
        row["oom_message"] = str(exc).split("\n")[0][:300]
    if cuda:
        row["device"] = torch.cuda.get_device_name()
        row["device_total_bytes"] = get_backend().total_memory() if row.get("result") == "ok" else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    ap.add_argument("--colocate", action="store_true")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear (0: full-parameter)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--rows", nargs="*", help="SHAPE:on|off[:loraR] rows, each in its own process")
    ap.add_argument("--row-timeout", type=int, default=300)
    ap.add_argument("--deadline-s", type=float, default=None, help="start no row after this many seconds")
    ap.add_argument("--out", help="append each row's JSON to this file")
    args = ap.parse_args()
    if not args.rows:
        print(json.dumps(run_row(args)))
        return
    common = [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--n={args.n}",
              f"--prompt-tokens={args.prompt_tokens}", f"--new-tokens={args.new_tokens}",
              f"--micro-batch-tokens={args.micro_batch_tokens}"]
    start = time.perf_counter()
    for spec in args.rows:
        left = None if args.deadline_s is None else args.deadline_s - (time.perf_counter() - start)
        if left is not None and left < 30:
            print(json.dumps({"spec": spec, "result": "not run (deadline)"}), flush=True)
            continue
        shape, mode, *rest = spec.split(":")
        cmd = [sys.executable, __file__, "--shape", shape, *common, *(["--colocate"] if mode == "on" else []),
               *([f"--lora={rest[0].removeprefix('lora')}"] if rest else [])]
        t0 = time.perf_counter()
        try:
            timeout = args.row_timeout if left is None else min(args.row_timeout, left)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"shape": shape, "spec": spec, "result": "error",
                                                       "stderr": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired as exc:
            row = {"shape": shape, "spec": spec, "result": "timeout",
                   "stderr": (exc.stderr or b"")[-1500:].decode(errors="replace") if exc.stderr else ""}
        row["spec"], row["wall_s"] = spec, round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
