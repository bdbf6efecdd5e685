"""torchrun worker (2 gloo processes, TP=2) for tests/test_lora.py, plus shared helpers.

Usage: torchrun --nproc-per-node 2 tests/dist/lora_worker.py WORK_DIR

WORK_DIR holds ``qwen2`` (tiny HF checkpoint) and ``adapter`` (a PEFT adapter with random B that the
test wrote at world size 1), plus ``qwen3_moe`` / ``adapter_moe`` for EP=2; rank 0 writes
``results.json``:

- ``tp2_logprobs``: fb logprobs of the TP=2 LoRA engine with that adapter loaded (the test compares
  them with its world-size-1 engine's and with HF + PEFT).
- ``tp2_roundtrip``: the adapter exported at TP=2 equals the imported one bit for bit.
- ``tp2_resume``: 2 steps, save, 2 more; a fresh TP=2 engine loads and repeats them: identical
  losses, grad norms, Adam steps and adapter tensors; the base stays untouched.
- ``tp2_split``: fb(8) vs fb(3)+fb(5) at TP=2: identical grad norm and adapter after the step.
- ``ep2_*``: Qwen3-MoE (``qwen3_moe``, adapter ``adapter_moe``) at EP=2: round trip, fb logprobs,
  grad norm and the exported adapter after one step (the test compares them with world size 1),
  and exact resume.
- ``inkling_tp2_*``: Inkling text (``inkling``, adapter ``adapter_inkling`` incl. shared experts) at
  TP=2, expert TP 1: round trip, logprobs, then one fb + step (grad norm, adapter after the step);
  ``inkling_etp2_refused``: the message of the refused build at megatron's default etp = tp = 2.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

RANK, ALPHA = 4, 12.0


def make_llama_dir(out_dir: Path, seed: int = 0, tie: bool = True) -> Path:
    """A tiny random Llama checkpoint (fp32; tied embeddings like SmolLM2) written by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                      rope_theta=10000.0)
    LlamaForCausalLM(cfg).float().save_pretrained(out_dir)
    return Path(out_dir)


def randomize_adapter(engine, seed: int, scale: float = 0.2) -> dict:
    """The engine's exported adapter with every ``lora_B`` replaced by seeded random values (``A`` kept,
    so fused parts keep sharing it); loaded into the engine and returned (CPU tensors)."""
    import torch

    from ferrule.lora import hf_adapter_state_dict, load_hf_adapter

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sorted(hf_adapter_state_dict(engine).items()):
        v = v.detach().cpu()
        out[k] = (scale * torch.randn(v.shape, generator=g, dtype=torch.float32)).to(v.dtype) if ".lora_B." in k else v
    load_hf_adapter(engine, out)
    return out


def write_peft_dir(out_dir: Path, tensors: dict, config: dict) -> Path:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def adapter_snapshot(engine) -> dict:
    from ferrule.lora.model import adapter_params

    return {k: p.detach().clone() for k, p in adapter_params(engine.model).items()}


def base_snapshot(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.model[0].module.named_parameters()
            if not getattr(p, "is_lora_adapter", False)}


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lora_engine(hf_dir: Path, layout=None, settings=None, **kw):
    from ferrule.lora import LoraSettings
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout

    import train_engine_worker as tw

    return TrainEngine.from_hf(hf_dir, layout or ParallelLayout(), optimizer=kw.pop("optimizer", OptimizerSettings(lr=tw.LR)),
                               lora=settings or LoraSettings(rank=RANK, alpha=ALPHA), **kw)


def split_run(hf_dir: Path, layout, splits, adapter: dict) -> tuple[float, dict]:
    from ferrule.lora import load_hf_adapter

    import train_engine_worker as tw

    engine = lora_engine(hf_dir, layout)
    load_hf_adapter(engine, adapter)
    batch = tw.make_batch()
    start = 0
    for n in splits:
        engine.forward_backward(batch[start:start + n], "cross_entropy")
        start += n
    return engine.optim_step()["grad_norm"], adapter_snapshot(engine)


def resume_check(hf_dir: Path, layout, adapter: dict, ckpt: Path) -> dict:
    from ferrule.lora import load_hf_adapter
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.lora import LoraSettings

    import train_engine_worker as tw

    a = lora_engine(hf_dir, layout)
    load_hf_adapter(a, adapter)
    base0 = base_snapshot(a)
    tw.train_steps(a, 2, seed0=10)
    a.save(ckpt)
    cont_a = tw.train_steps(a, 2, seed0=20)
    final_a = adapter_snapshot(a)
    b = TrainEngine.from_torch_dist(ckpt, layout, optimizer=OptimizerSettings(lr=tw.LR),
                                    lora=LoraSettings(rank=RANK, alpha=ALPHA))
    cont_b = tw.train_steps(b, 2, seed0=20)
    return {"losses_equal": cont_a == cont_b, "cont_a": cont_a, "cont_b": cont_b,
            "adapter_equal": same(final_a, adapter_snapshot(b)), "base_untouched": same(base0, base_snapshot(a)),
            "step": b.step}


def main(work: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM  # noqa: F401  (before ferrule's CPU patches)

    from ferrule.lora import hf_adapter_state_dict, load_hf_adapter, read_peft_dir
    from ferrule.megatron.parallel import ParallelLayout

    import train_engine_worker as tw

    hf_dir = work / "qwen2"
    tensors, _ = read_peft_dir(work / "adapter")
    tp2 = ParallelLayout(tp=2)
    results: dict = {}
    engine = lora_engine(hf_dir, tp2)
    load_hf_adapter(engine, tensors)
    exported = {k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()}
    results["tp2_roundtrip"] = same(exported, tensors)
    out = engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    results["tp2_logprobs"] = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
    runs = [split_run(hf_dir, tp2, s, tensors) for s in ((8,), (3, 5))]
    results["tp2_split"] = {"grad_norms": [r[0] for r in runs], "identical": runs[0][0] == runs[1][0]
                            and same(runs[0][1], runs[1][1])}
    results["tp2_resume"] = resume_check(hf_dir, tp2, tensors, work / "ckpt_tp2")
    # Qwen3-MoE at EP=2 (DP=2): shared A reduced over both EP ranks, per-expert B on its owner
    from ferrule.megatron.parallel import destroy_distributed

    del engine
    destroy_distributed(keep_process_group=True)  # switch the megatron layout from TP=2 to EP=2
    moe_dir = work / "qwen3_moe"
    moe_tensors, _ = read_peft_dir(work / "adapter_moe")
    ep2 = ParallelLayout(ep=2)
    engine = lora_engine(moe_dir, ep2)
    load_hf_adapter(engine, moe_tensors)
    results["ep2_roundtrip"] = same({k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()}, moe_tensors)
    out = engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    results["ep2_logprobs"] = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
    results["ep2_grad_norm"] = engine.optim_step()["grad_norm"]
    results["ep2_after_step"] = {k: v.tolist() for k, v in hf_adapter_state_dict(engine).items()}
    results["ep2_resume"] = resume_check(moe_dir, ep2, moe_tensors, work / "ckpt_ep2")
    # the same step at TP=2, etp=1 (ep=1: the routed experts' B is dense, as its base weight; not summed over TP)
    del engine
    destroy_distributed(keep_process_group=True)
    engine = lora_engine(moe_dir, ParallelLayout(tp=2, etp=1))
    load_hf_adapter(engine, moe_tensors)
    engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")
    results["moe_tp2_grad_norm"] = engine.optim_step()["grad_norm"]
    results["moe_tp2_after_step"] = {k: v.tolist() for k, v in hf_adapter_state_dict(engine).items()}
    # Inkling text at TP=2 (attention adapters split like their base, shared-expert adapters replicated)
    if (work / "adapter_inkling").is_dir():
        from ferrule.lora import LoraSettings

        del engine
        destroy_distributed(keep_process_group=True)
        ink_tensors, ink_cfg = read_peft_dir(work / "adapter_inkling")
        ink_settings = LoraSettings(rank=ink_cfg["r"], alpha=ink_cfg["lora_alpha"], use_rslora=ink_cfg["use_rslora"])
        try:  # megatron's default etp = tp splits the routed experts: refused, not silently mis-sized
            lora_engine(work / "inkling", tp2, settings=ink_settings)
            results["inkling_etp2_refused"] = ""
        except ValueError as exc:
            results["inkling_etp2_refused"] = str(exc)
        destroy_distributed(keep_process_group=True)
        engine = lora_engine(work / "inkling", ParallelLayout(tp=2, etp=1), settings=ink_settings)
        load_hf_adapter(engine, ink_tensors, ink_cfg)
        results["inkling_tp2_roundtrip"] = same({k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()},
                                                ink_tensors)
        results["inkling_tp2_logprobs"] = [t.tolist() for t in engine.forward_logprobs(tw.make_batch(seed=3))]
        engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")  # MoE LoRA training at TP=2
        results["inkling_tp2_grad_norm"] = engine.optim_step()["grad_norm"]
        results["inkling_tp2_after_step"] = {k: v.tolist() for k, v in hf_adapter_state_dict(engine).items()}
    # Inkling-2 text at TP=2 (column q/k/v/r/gate/sink and row proj adapters split like their base, routed experts
    # etp 1), imported from the PEFT folder the driver exported at world size 1
    if (work / "adapter_inkling2").is_dir():
        from ferrule.lora import settings_from_peft_config

        del engine
        destroy_distributed(keep_process_group=True)
        ink2_tensors, ink2_cfg = read_peft_dir(work / "adapter_inkling2")
        engine = lora_engine(work / "inkling2", ParallelLayout(tp=2, etp=1),
                             settings=settings_from_peft_config(ink2_cfg, ink2_tensors))
        load_hf_adapter(engine, ink2_tensors, ink2_cfg)
        results["inkling2_tp2_roundtrip"] = same({k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()},
                                                 ink2_tensors)
        results["inkling2_tp2_logprobs"] = [t.tolist() for t in engine.forward_logprobs(tw.make_batch(seed=3))]
        engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")  # MoE layers train at TP>1 (docs/engine.md)
        results["inkling2_tp2_grad_norm"] = engine.optim_step()["grad_norm"]
        results["inkling2_tp2_after_step"] = {k: v.tolist() for k, v in hf_adapter_state_dict(engine).items()}
        del engine
        destroy_distributed(keep_process_group=True)  # EP=2: the routed experts' B split over the EP ranks
        engine = lora_engine(work / "inkling2", ParallelLayout(ep=2), settings=settings_from_peft_config(ink2_cfg,
                                                                                                    ink2_tensors))
        load_hf_adapter(engine, ink2_tensors, ink2_cfg)
        results["inkling2_ep2_roundtrip"] = same({k: v.cpu() for k, v in hf_adapter_state_dict(engine).items()},
                                                 ink2_tensors)
        results["inkling2_ep2_logprobs"] = [t.tolist() for t in engine.forward_logprobs(tw.make_batch(seed=3))]
        engine.forward_backward(tw.make_batch(seed=3), "cross_entropy")
        results["inkling2_ep2_grad_norm"] = engine.optim_step()["grad_norm"]
        results["inkling2_ep2_after_step"] = {k: v.tolist() for k, v in hf_adapter_state_dict(engine).items()}
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results))
    dist.barrier()
    del torch


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(Path(sys.argv[1]))
