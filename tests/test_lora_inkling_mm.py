"""LoRA on the multimodal ``inkling`` family (CPU, fp32): the language model is adapted with Inkling's
appliers (attention, dense MLP, routed and shared experts), the vision and audio towers stay frozen.

Referee: transformers' ``InklingForConditionalGeneration`` + ``peft.PeftModel.from_pretrained`` on the
exported adapter (PEFT keys under ``model.language_model.layers.L``, transformers' module names, not the
released checkpoint's ``model.llm.*``): logprobs within 1e-5 on a text-only batch and on a prompt with
an image and an audio clip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import InklingForConditionalGeneration

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import lora_worker as lw  # noqa: E402

from inkling_fixtures import MM_AUDIO_TOKEN, MM_IMAGE_TOKEN, tiny_inkling_mm_dir, tiny_media  # noqa: E402

from ferrule.lora import LoraSettings, adapter_entries, hf_adapter_state_dict, load_hf_adapter, peft_config  # noqa: E402

peft = pytest.importorskip("peft", reason="peft (the dev extra) is the HF PEFT referee")

PEFT_ATOL = 1e-5
TEXT_VOCAB = 80  # below the tiny model's placeholder ids (90, 91)


def _datum(tokens: torch.Tensor, media=None):
    from ferrule.megatron.batching import Datum

    return Datum(tokens[:-1], {"target_tokens": tokens[1:].clone(), "weights": torch.ones(tokens.numel() - 1)}, media)


def _batch():
    """Three text-only data and one prompt with an image and an audio clip (placeholders expanded)."""
    g = torch.Generator().manual_seed(11)
    text = lambda n: torch.randint(0, TEXT_VOCAB, (n,), generator=g)  # noqa: E731
    data = [_datum(text(n)) for n in (6, 11, 4)]
    pixel_values, dmel = tiny_media()
    ids = torch.cat([text(3), torch.full((pixel_values.shape[0],), MM_IMAGE_TOKEN), text(2),
                     torch.full((dmel.shape[0],), MM_AUDIO_TOKEN), text(5)])
    data.append(_datum(ids, {"vision": [pixel_values], "audio": [dmel]}))
    return data


def _hf_logprobs(model, batch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for d in batch:
            kw = {}
            if d.media:
                kw = {"pixel_values": d.media["vision"][0], "audio_input_ids": d.media["audio"][0][None]}
            logits = model(input_ids=d.model_input[None], **kw).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            out.append(lp.gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0])
    return out


def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def _hf(path):
    return InklingForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("settings,kinds", [
    (LoraSettings(rank=2, alpha=5), {"attention", "dense_mlp", "routed_experts", "shared_experts"}),
    (LoraSettings(rank=3, alpha=4, use_rslora=True, target_modules=("q_proj", "r_proj", "linear_fc2", "lm_head")),
     {"attention", "dense_mlp", "routed_experts", "shared_experts", "lm_head"}),
])
def test_multimodal_inkling_lora_matches_hf_peft_with_and_without_media(tmp_path, settings, kinds):
    path = tiny_inkling_mm_dir(tmp_path / "mm")
    engine = lw.lora_engine(path, settings=settings)
    assert engine.family == "inkling"
    assert {e.kind for e in adapter_entries(engine.model)} == kinds
    trainable = [n for n, p in engine.model[0].module.named_parameters() if p.requires_grad]
    towers = [n for n, p in engine.model[0].module.named_parameters() if n.startswith("towers.")]
    assert towers and all(".lora.lora_" in n for n in trainable) and not any(n.startswith("towers.") for n in trainable)
    tensors = lw.randomize_adapter(engine, seed=6)
    config = peft_config(engine)
    assert all(k.startswith(("base_model.model.model.language_model.layers.", "base_model.model.lm_head."))
               for k in tensors)
    assert "q_proj" in config["target_modules"] and "wq_du" not in config["target_modules"]
    assert "mlp.shared_experts.down_proj" in config["target_parameters"]
    adapter = lw.write_peft_dir(tmp_path / "adapter", tensors, config)
    batch = _batch()
    ours = engine.forward_logprobs(batch)
    base_lp = _hf_logprobs(_hf(path), batch)
    model = peft.PeftModel.from_pretrained(_hf(path), adapter).eval()
    from peft.utils import get_peft_model_state_dict

    # PEFT's own names and shapes for this model (it also saves lm_head's base weight when lm_head is targeted)
    assert {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items() if ".lora_" in k} == \
        {k: tuple(v.shape) for k, v in tensors.items()}
    ref = _hf_logprobs(model, batch)
    assert _max_diff(ours, ref) <= PEFT_ATOL
    assert _max_diff(ours[-1:], ref[-1:]) <= PEFT_ATOL and _max_diff(ref, base_lp) > 1e-2
    # import round trip, then a step on the multimodal datum changes adapter factors only (towers frozen)
    fresh = lw.lora_engine(path, settings=settings)
    load_hf_adapter(fresh, tensors, config)
    assert lw.same({k: v.cpu() for k, v in hf_adapter_state_dict(fresh).items()}, tensors)
    base0, ad0 = lw.base_snapshot(fresh), lw.adapter_snapshot(fresh)
    fresh.forward_backward(batch, "cross_entropy")
    assert fresh.optim_step()["success"] and lw.same(base0, lw.base_snapshot(fresh))
    assert all(not torch.equal(ad0[k], v) for k, v in lw.adapter_snapshot(fresh).items() if k.endswith("lora_B"))
    # adapter-only sync into the embedded rollout engine (InklingForConditionalGeneration + PEFT), verified
    from ferrule.rollout.embedded import EmbeddedEngine
    from ferrule.sync import sync_lora_adapter

    stats = sync_lora_adapter(fresh, EmbeddedEngine(hf_dir=path), version=1, check_equal=True)
    assert stats.bytes == sum(v.numel() * v.element_size() for v in tensors.values())
