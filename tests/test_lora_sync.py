"""Adapter-only weight sync (``ferrule.sync.lora_sync``) into the embedded engine.

Part 1 (always): adapters made by PEFT on the HF model itself (random, non-zero ``lora_B``) are
sent with :func:`send_lora_adapter` and verified with :func:`check_lora_adapter_equal`, which
must name a corrupted tensor, an adapter tensor that was not sent and a sent tensor the engine
lacks.

Part 2 (with ``ferrule.lora``, the train side of issue 13): a LoRA ``TrainEngine`` trains a few
steps; :func:`sync_lora_adapter` sends only the adapter; the embedded engine's logprobs then
match the train engine's ``forward_logprobs`` (1e-5, fp32) and HF + PEFT loading the same
adapter.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoConfig, Qwen3ForCausalLM

from ferrule.rollout import SamplingParams
from ferrule.rollout.embedded import EmbeddedEngine
from ferrule.sync import (WeightSyncError, check_lora_adapter_equal, send_lora_adapter, sync_lora_adapter,
                          tensor_checksum)

warnings.filterwarnings("ignore")

VOCAB = 96
RANK = 4
ALPHA = 12
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
PROMPT = [3, 17, 42, 8, 61, 5]
NEW_TOKENS = 8
TOL = 1e-5


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      initializer_range=0.2, eos_token_id=None, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


def peft_adapter(base, seed: int):
    torch.manual_seed(seed)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                                         init_lora_weights=False)).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    return ref, {k: v.detach().clone() for k, v in get_peft_model_state_dict(ref).items()}, \
        ref.peft_config["default"].to_dict()


class _ChecksumView:
    """A rollout engine that reports only adapter checksums (as a remote engine would)."""

    def __init__(self, rollout):
        self.rollout = rollout

    def lora_checksums(self):
        return {k: tensor_checksum(v) for k, v in self.rollout.get_lora_state_dict().items()}


def _listed(exc) -> list[str]:
    return re.findall(r"^  - (\S+?):?(?:\s|$)", str(exc.value), flags=re.M)


def test_send_and_check_adapter():
    base = tiny_qwen3()
    rollout = EmbeddedEngine(model=copy.deepcopy(base))
    _, tensors, cfg = peft_adapter(base, seed=1)
    n, nbytes = send_lora_adapter(tensors, cfg, rollout, version=3)
    assert n == len(tensors) == 2 * 2 * len(TARGETS) and rollout.weights_version == 3
    assert nbytes == sum(t.numel() * 4 for t in tensors.values())
    for view, mode in ((rollout, "exact"), (_ChecksumView(rollout), "checksum")):
        report = check_lora_adapter_equal(tensors, view)
        assert report.mode == mode and report.compared == len(tensors)

    names = sorted(tensors)
    # one adapter tensor not sent: the check names it (it would stay stale in the engine)
    with pytest.raises(WeightSyncError, match="not sent") as exc:
        check_lora_adapter_equal({k: v for k, v in tensors.items() if k != names[5]}, rollout)
    assert _listed(exc) == [names[5]]
    # a value differs in the engine: named, in both modes
    with torch.no_grad():
        rollout.get_lora_state_dict()[names[2]].view(-1)[1] += 1e-3
    for view in (rollout, _ChecksumView(rollout)):
        with pytest.raises(WeightSyncError, match="differing") as exc:
            check_lora_adapter_equal(tensors, view)
        assert _listed(exc) == [names[2]]
    # a sent tensor the engine does not serve
    extra = dict(tensors)
    extra["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(RANK, 32)
    with pytest.raises(WeightSyncError, match="does not serve"):
        check_lora_adapter_equal(extra, rollout)
    # a fresh send restores the corrupted value
    send_lora_adapter(tensors, cfg, rollout, version=4)
    check_lora_adapter_equal(tensors, rollout)


def test_send_refuses_what_is_not_an_adapter():
    base = tiny_qwen3()
    rollout = EmbeddedEngine(model=copy.deepcopy(base))
    _, tensors, cfg = peft_adapter(base, seed=1)
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        send_lora_adapter({**tensors, "model.norm.weight": torch.ones(32)}, cfg, rollout, version=1)
    with pytest.raises(WeightSyncError, match="no update_lora_adapter"):
        send_lora_adapter(tensors, cfg, object(), version=1)
    with pytest.raises(WeightSyncError, match="neither"):
        check_lora_adapter_equal(tensors, object())
    assert rollout.weights_version == 0 and rollout.get_lora_state_dict() == {}


def test_sync_lora_adapter_refuses_an_engine_without_lora():
    class NoLora:
        lora = None

    rollout = EmbeddedEngine(model=tiny_qwen3())
    with pytest.raises(WeightSyncError, match="ferrule.lora|trains no LoRA"):
        sync_lora_adapter(NoLora(), rollout, version=1)
    with pytest.raises(WeightSyncError, match="update_lora_adapter"):
        sync_lora_adapter(NoLora(), object(), version=1)


# ------------------------------------------------------------------ with the train side (ferrule.lora)
def _batch(vocab: int, seed: int, lengths=(9, 12, 7, 10)):
    from ferrule.megatron.batching import Datum

    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    out = []
    for n in lengths:
        toks = torch.randint(0, vocab, (n + 1,), generator=g)
        out.append(Datum(toks[:-1].tolist(), {"target_tokens": toks[1:].clone(),
                                              "weights": torch.full((n,), 1.0 / total)}))
    return out


def _continuation(rollout):
    (res,) = rollout.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return list(res.token_ids), torch.tensor(res.logprobs, dtype=torch.float64)


def _train_logprobs(engine, tokens):
    from ferrule.megatron.batching import Datum

    seq = PROMPT + tokens
    (lp,) = engine.forward_logprobs([Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])})])
    # on CUDA the train engine's logprobs live on the GPU; the rollout engine here is on the CPU
    return lp[-len(tokens):].double().cpu()


@pytest.mark.gpu  # also on CPU; on a CUDA machine the train engine is on the GPU
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_sync_lora_adapter_from_a_lora_train_engine(tmp_path, family):
    lora = pytest.importorskip("ferrule.lora", reason="ferrule.lora (the LoRA train side, branch issue13a) is not "
                                                      "in this tree yet")
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.plugins.qwen import qwen3, qwen3_moe

    mod, cls = (qwen3, Qwen3ForCausalLM) if family == "qwen3" else (qwen3_moe, Qwen3MoeForCausalLM)
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    cls(AutoConfig.for_model(**mod.TINY_HF_CONFIG)).float().save_pretrained(hf_dir)
    engine = TrainEngine.from_hf(hf_dir, optimizer=OptimizerSettings(lr=5e-2, clip_grad=0.0),
                                 lora=lora.LoraSettings(rank=RANK, alpha=ALPHA, target_modules="all"))
    rollout = EmbeddedEngine(hf_dir=hf_dir)
    base_before = {k: v.clone() for k, v in rollout.get_hf_state_dict().items()}
    vocab = mod.TINY_HF_CONFIG["vocab_size"]
    for step in range(3):
        engine.forward_backward(_batch(vocab, seed=step), "cross_entropy")
        assert engine.optim_step()["success"]

    tokens, stale = _continuation(rollout)
    assert (stale - _train_logprobs(engine, tokens)).abs().max() > 1e-3  # the adapter matters

    stats = sync_lora_adapter(engine, rollout, version=3, check_equal=True)
    adapter = lora.hf_adapter_state_dict(engine)
    assert stats.sender and stats.checked and stats.buckets == 1 and rollout.weights_version == 3
    assert stats.tensors == len(adapter) and stats.bytes == sum(t.numel() * t.element_size() for t in adapter.values())
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in adapter)  # only the adapter travelled
    tokens, synced = _continuation(rollout)
    torch.testing.assert_close(synced, _train_logprobs(engine, tokens), atol=TOL, rtol=0)
    # HF + PEFT loading the same adapter agree with the rollout engine
    cfg = lora.peft_config(engine)
    ref_dir = tmp_path / "adapter"
    from ferrule.rollout.sglang import write_peft_adapter_dir

    write_peft_adapter_dir(str(ref_dir), adapter, cfg)
    ref = PeftModel.from_pretrained(cls.from_pretrained(hf_dir).float(), str(ref_dir)).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(input_ids=torch.tensor([PROMPT + tokens])).logits[0].double(), -1)
    want = lp[len(PROMPT) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(synced, want, atol=TOL, rtol=0)
    # the base the rollout engine holds never changed (no merge)
    for k, v in rollout.get_hf_state_dict().items():
        assert torch.equal(v, base_before[k]), k
    # a second step and sync update the adapter in place (the export plan memoised on the engine
    # by the first export must read the new values)
    engine.forward_backward(_batch(vocab, seed=9), "cross_entropy")
    engine.optim_step()
    after = lora.hf_adapter_state_dict(engine)
    assert any(not torch.equal(adapter[k], after[k]) for k in after)  # copy=True kept the old values
    stats = sync_lora_adapter(engine, rollout, version=4, check_equal=True)
    # a served adapter on the train engine's device is written straight from the adapter parameters (one
    # cached plan of strided views: Qwen3's q/k/v parts of Megatron's fused lora_B included); the routed
    # experts' 3-D export is no fixed re-layout, so the MoE model goes through update_lora_adapter
    same_device = next(iter(after.values())).device == rollout.device
    assert stats.direct == (family == "qwen3" and same_device), stats
    for k, v in rollout.get_lora_state_dict().items():
        assert torch.equal(v, after[k].to(v.device, v.dtype)), k  # the train engine may be on the GPU
    with pytest.raises(ValueError, match="older"):  # either path refuses a version going backwards
        sync_lora_adapter(engine, rollout, version=2)
    assert rollout.weights_version == 4
    tokens, synced = _continuation(rollout)
    torch.testing.assert_close(synced, _train_logprobs(engine, tokens), atol=TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device memory after an adapter sync)")
def test_adapter_sync_leaves_device_memory_at_baseline(tmp_path):
    lora = pytest.importorskip("ferrule.lora", reason="ferrule.lora (the LoRA train side, branch issue13a) is not "
                                                      "in this tree yet")
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.plugins.qwen import qwen3

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    Qwen3ForCausalLM(AutoConfig.for_model(**qwen3.TINY_HF_CONFIG)).to(torch.bfloat16).save_pretrained(hf_dir)
    engine = TrainEngine.from_hf(hf_dir, params_dtype=torch.bfloat16, optimizer=OptimizerSettings(lr=1e-2),
                                 lora=lora.LoraSettings(rank=RANK, alpha=ALPHA))
    rollout = EmbeddedEngine(hf_dir=hf_dir, dtype=torch.bfloat16, device="cuda")
    sync_lora_adapter(engine, rollout, version=0, check_equal=True)  # first call injects the adapter
    rollout.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    for version in (1, 2, 3):
        engine.forward_backward(_batch(qwen3.TINY_HF_CONFIG["vocab_size"], seed=version), "cross_entropy")
        engine.optim_step()
        stats = sync_lora_adapter(engine, rollout, version=version)
        assert stats.device_memory_before is not None
        assert stats.device_memory_after == stats.device_memory_before, (version, stats)
    check_lora_adapter_equal(lora.hf_adapter_state_dict(engine), rollout)
