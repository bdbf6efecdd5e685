"""Weight sync end to end on CPU (issue 5, first "Done when"): TrainEngine -> EmbeddedEngine.

For a tiny Qwen3 (tied embeddings, MQA, head_dim != hidden/heads) and a tiny Qwen3-MoE (4
experts, top-2, untied), in fp32:

1. transformers builds a random model and saves it; the TrainEngine and the EmbeddedEngine both
   boot from that checkpoint;
2. the TrainEngine trains a few steps (cross entropy, large lr so the weights move);
3. *sync skipped*: the rollout engine greedily continues a fixed prompt; the train engine's
   ``forward_logprobs`` on those tokens differ from the engine's logprobs (stale weights);
4. ``sync_weights``; the engine's greedy logprobs for the prompt now match the train engine's
   ``forward_logprobs`` on the same tokens within 1e-5;
5. ``check_weight_update_equal`` passes (exact compare), then raises naming exactly the one
   tensor we corrupt inside the engine, and the checksum mode does the same.

The independent reference is the trained megatron model itself (its own forward), compared with
the transformers model the rollout engine runs.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from transformers import AutoConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

from ferrule.plugins.qwen import qwen3, qwen3_moe
from ferrule.sync import WeightSyncError, check_weight_update_equal, sync_weights, tensor_checksum

warnings.filterwarnings("ignore")

TRAIN_STEPS = 3
LR = 3e-2
PROMPT = [3, 17, 42, 8, 61, 5]
NEW_TOKENS = 8
TOL = 1e-5
SEED = 0


def _hf_dir(tmp_path_factory, mod, cls):
    out = tmp_path_factory.mktemp(mod.MAPPING.family)
    torch.manual_seed(SEED)
    cls(AutoConfig.for_model(**mod.TINY_HF_CONFIG)).float().save_pretrained(out)
    return out


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


def _engine_continuation(rollout):
    from ferrule.rollout import SamplingParams

    (res,) = rollout.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return list(res.token_ids), torch.tensor(res.logprobs, dtype=torch.float32)


def _train_logprobs(engine, tokens):
    from ferrule.megatron.batching import Datum

    seq = PROMPT + tokens
    datum = Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])})
    (lp,) = engine.forward_logprobs([datum])
    return lp[-len(tokens):].float()


class _ChecksumView:
    """A rollout engine that reports only checksums (as a remote engine would)."""

    def __init__(self, rollout):
        self.rollout = rollout

    def weight_checksums(self):
        return {k: tensor_checksum(v) for k, v in self.rollout.get_hf_state_dict().items()}


FAMILIES = [
    pytest.param(qwen3, Qwen3ForCausalLM, "model.layers.1.self_attn.k_proj.weight", id="qwen3"),
    pytest.param(qwen3_moe, Qwen3MoeForCausalLM, "model.layers.0.mlp.experts.2.down_proj.weight", id="qwen3_moe"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mod,cls,corrupt", FAMILIES)
def test_sync_makes_rollout_logprobs_match_train_engine(tmp_path_factory, mod, cls, corrupt):
    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.rollout.embedded import EmbeddedEngine

    hf_dir = _hf_dir(tmp_path_factory, mod, cls)
    family = mod.MAPPING.family
    engine = TrainEngine.from_hf(hf_dir, optimizer=OptimizerSettings(lr=LR, clip_grad=0.0))
    rollout = EmbeddedEngine(hf_dir=hf_dir)
    vocab = mod.TINY_HF_CONFIG["vocab_size"]
    for step in range(TRAIN_STEPS):
        engine.forward_backward(_batch(vocab, seed=step), "cross_entropy")
        assert engine.optim_step()["success"]

    # sync skipped: the engine still serves the boot weights
    tokens, stale = _engine_continuation(rollout)
    assert (stale - _train_logprobs(engine, tokens)).abs().max() > 1e-2

    stats = sync_weights(engine, rollout, version=TRAIN_STEPS, bucket_bytes=16 * 1024, direct=False)
    assert stats.sender and stats.version == TRAIN_STEPS and rollout.weights_version == TRAIN_STEPS
    assert stats.buckets > 1 and stats.bytes > 16 * 1024
    tokens, synced = _engine_continuation(rollout)
    diff = (synced - _train_logprobs(engine, tokens)).abs().max()
    assert diff <= TOL, f"{family}: rollout vs train logprobs differ by {diff:.3e} after sync"

    report = check_weight_update_equal(engine, rollout)
    expected_tensors = len(rollout.get_hf_state_dict()) - (1 if mod.TINY_HF_CONFIG["tie_word_embeddings"] else 0)
    assert report.mode == "exact" and report.compared == expected_tensors
    assert check_weight_update_equal(engine, _ChecksumView(rollout)).mode == "checksum"

    with torch.no_grad():
        rollout.get_hf_state_dict()[corrupt].view(-1)[3] += 1e-3
    for view in (rollout, _ChecksumView(rollout)):
        with pytest.raises(WeightSyncError) as exc:
            check_weight_update_equal(engine, view)
        differing = re.findall(r"^  - (\S+):", str(exc.value), flags=re.M)
        assert differing == [corrupt], str(exc.value)
    # a fresh sync with verification restores the tensor and passes: the bucketed path, then the direct one
    stats = sync_weights(engine, rollout, version=TRAIN_STEPS + 1, check_equal=True, direct=False)
    assert stats.checked and stats.buckets == 1 and not stats.direct
    with torch.no_grad():
        rollout.get_hf_state_dict()[corrupt].view(-1)[3] += 1e-3
    stats = sync_weights(engine, rollout, version=TRAIN_STEPS + 2, check_equal=True)
    assert stats.checked and stats.direct and stats.buckets == 0


class _Recorder:
    """A rollout-engine sink that keeps what it receives (the checkpoint-format HF tensors)."""

    def __init__(self):
        self.buckets, self.version = [], None

    def update_weights(self, named_tensors, version):
        self.buckets.append([(k, v.detach().clone()) for k, v in named_tensors])
        self.version = version


@pytest.mark.timeout(120)
def test_qwen3_moe_synced_buckets_load_into_transformers(tmp_path_factory):
    """The MoE buckets are a valid HF checkpoint: transformers' own loader (which fuses the
    per-expert checkpoint tensors into its stacked layout) reproduces the trained model."""
    import json

    from safetensors.torch import save_file

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine

    hf_dir = _hf_dir(tmp_path_factory, qwen3_moe, Qwen3MoeForCausalLM)
    engine = TrainEngine.from_hf(hf_dir, optimizer=OptimizerSettings(lr=LR, clip_grad=0.0))
    for step in range(TRAIN_STEPS):
        engine.forward_backward(_batch(qwen3_moe.TINY_HF_CONFIG["vocab_size"], seed=step), "cross_entropy")
        assert engine.optim_step()["success"]
    sink = _Recorder()
    stats = sync_weights(engine, sink, version=7, bucket_bytes=8 * 1024)
    received = [k for b in sink.buckets for k, _ in b]
    assert len(received) == len(set(received)) == stats.tensors
    # one expert = gate + up + down = 3 * 16 * 32 * 4 bytes = 6144 <= 8 KiB: each expert travels whole
    where: dict[str, list[int]] = {}
    for i, b in enumerate(sink.buckets):
        for k, _ in b:
            if m := re.match(r"(model\.layers\.\d+\.mlp\.experts\.\d+)\.", k):
                where.setdefault(m.group(1), []).append(i)
    assert len(sink.buckets) > 1 and sink.version == 7
    assert len(where) == 2 * 4 and all(len(v) == 3 and len(set(v)) == 1 for v in where.values()), where
    out = tmp_path_factory.mktemp("synced")
    save_file({k: v.contiguous() for b in sink.buckets for k, v in b}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((hf_dir / "config.json").read_text())))
    hf = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = [9, 33, 2, 71, 14, 50, 27, 88]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROMPT[1:] + tokens)[:, None])[:, 0][-len(tokens):]
    diff = (ref - _train_logprobs(engine, tokens)).abs().max()
    assert diff <= TOL, f"transformers-loaded synced MoE weights differ from the train engine by {diff:.3e}"
    # and the boot checkpoint does not match (the sync carried the trained weights)
    boot = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits0 = boot(torch.tensor([PROMPT + tokens])).logits[0, :-1].float()
    ref0 = torch.log_softmax(logits0, -1).gather(-1, torch.tensor(PROMPT[1:] + tokens)[:, None])[:, 0][-len(tokens):]
    assert (ref0 - _train_logprobs(engine, tokens)).abs().max() > 1e-2


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "weight_sync_worker.py"


@pytest.mark.timeout(200)
def test_sync_under_tp_ep_pp(dist_pool, tmp_path):
    """2 gloo ranks: TP=2 (qwen3), PP=2 (qwen3), EP=2 (qwen3_moe; dense DP=2). The synced tensors
    equal the HF checkpoint loaded into the sharded model bit for bit; only rank 0 sends; a
    corrupted engine tensor is named by the check on every rank."""
    import json
    import os

    torch.manual_seed(SEED)
    cfg = dict(qwen3.TINY_HF_CONFIG, num_key_value_heads=2, tie_word_embeddings=False)  # tp=2 needs 2 KV groups
    Qwen3ForCausalLM(AutoConfig.for_model(**cfg)).float().save_pretrained(tmp_path / "qwen3")
    torch.manual_seed(SEED)
    Qwen3MoeForCausalLM(AutoConfig.for_model(**qwen3_moe.TINY_HF_CONFIG)).float().save_pretrained(tmp_path / "qwen3_moe")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = dist_pool.run([str(WORKER), str(tmp_path)], cwd=ROOT, env=env, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1))
    for case in ("tp2", "pp2", "ep2"):
        a, b = r0[case], r1[case]
        assert a["sender"] and not b["sender"] and b["buckets"] == 0 and a["buckets"] > 1, case
        assert a["same_keys"] and a["unequal"] == [] and a["duplicates"] == 0, (case, a)
        assert a["clean_check"] is True and b["clean_check"] is False  # report on rank 0, None elsewhere
        for r in (a, b):  # the verdict is raised on every rank, naming exactly the corrupted tensor
            assert r["corrupt_error"] is not None, (case, r)
            assert re.findall(r"^  - (\S+):", r["corrupt_error"], flags=re.M) == [r["corrupt"]], r["corrupt_error"]
