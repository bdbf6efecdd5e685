"""``ferrule serve`` stores what changed (issue 46): a LoRA client's ``save_state`` holds the adapter,
its Adam state, scheduler and RNG, and the frozen base's fingerprint, not the base.

A base wide enough (hidden 256, 1.5 M parameters, 6 MB) that the adapter (rank 4, ~32 k parameters)
and the base differ by far more than the checkpoint's fixed files. Referees: the adapter's own
parameter count (bytes of adapter + Adam's two moments, computed here from the shapes), the
client's own ``forward`` before the save, and a different base that must be refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
from serve_helpers import MODEL_NAME, RunningServer, adam, sdk_data  # noqa: E402


def _wide_base(out: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).float().save_pretrained(out)
    return out


def test_lora_save_state_stores_the_adapter_and_its_optimizer_not_the_base(tmp_path):
    from ferrule.megatron.checkpoint import CheckpointMismatchError
    from ferrule.megatron.engine import TrainEngine

    base = _wide_base(tmp_path / "wide", seed=0)
    srv = RunningServer(base, tmp_path / "storage", chunk_len=1024)
    try:
        tc = srv.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        data = sdk_data(seed=4, lengths=(7, 5))
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam()).result()
        before = tc.forward(data, "cross_entropy").result(timeout=120)
        path = tc.save_state("s1").result(timeout=120).path
        folder = srv.storage / "checkpoints" / tc.model_id / "weights" / "s1"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        engine = srv.backend.engines[tc.model_id]
        adapter = sum(p.numel() * p.element_size() for p in engine.model[0].parameters() if p.requires_grad)
        frozen = sum(p.numel() * p.element_size() for p in engine.model[0].parameters() if not p.requires_grad)
        print(f"save_state: {size} bytes on disk; adapter {adapter} bytes (+ Adam: {3 * adapter}); frozen base {frozen}")
        assert frozen > 10 * 3 * adapter                  # the case the issue measured: a base far larger
        assert size <= 2 * 3 * adapter, (size, adapter)   # adapter + Adam's exp_avg, exp_avg_sq, within 2x
        # it resumes exactly, on this base
        again = srv.client().create_training_client_from_state_with_optimizer(path).result(timeout=120)
        after = again.forward(data, "cross_entropy").result(timeout=120)
        for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs):
            assert a["logprobs"].tolist() == b["logprobs"].tolist()
        # on another base (other values, same shapes) it is refused, naming the fingerprints
        other = TrainEngine.from_hf(_wide_base(tmp_path / "other", seed=1), lora=engine.lora)
        with pytest.raises(CheckpointMismatchError, match="without its frozen base"):
            other.load(folder, load_optimizer=True)
    finally:
        srv.stop()


def test_adapter_sampler_checkpoints_store_the_adapter_and_sample_as_peft(tmp_path):
    """The default ``--sampler-checkpoints auto`` (a plain LoRA client: its adapter): save_weights_for_sampler
    writes the PEFT adapter only, and sampling it (interleaved with the base and an adapter snapshot) equals
    HF + PEFT on that folder."""
    from peft import PeftModel
    from tinker import types
    from transformers import Qwen2ForCausalLM

    base = _wide_base(tmp_path / "wide", seed=0)
    srv = RunningServer(base, tmp_path / "storage", chunk_len=1024)
    try:
        sc = srv.client()
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        tc.forward_backward(sdk_data(seed=6, lengths=(7, 5)), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        path = tc.save_weights_for_sampler("a1").result(timeout=120).path
        folder = srv.storage / "checkpoints" / tc.model_id / "sampler_weights" / "a1"
        names = {f.name for f in folder.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names
        engine = srv.backend.engines[tc.model_id]
        adapter = sum(p.numel() * p.element_size() for p in engine.model[0].parameters() if p.requires_grad)
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"adapter sampler checkpoint: {size} bytes; adapter {adapter} bytes")
        assert size <= 2 * adapter, (size, adapter)
        prompt = types.ModelInput.from_ints([5, 9, 33, 2, 71, 14, 8])
        hf = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt.to_ints()])
            def ref_of(model):
                lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
                return lp.gather(-1, ids[0, 1:, None])[:, 0]
            ref_base = ref_of(hf)
            ref_adapter = ref_of(PeftModel.from_pretrained(hf, folder).eval())
        assert float((ref_adapter - ref_base).abs().max()) > 1e-3          # the adapter changes the model
        by_path = sc.create_sampling_client(model_path=path)
        plain = sc.create_sampling_client(base_model=MODEL_NAME)
        snapshot = tc.save_weights_and_get_sampling_client()                # the adapter, in memory
        # --sampler-checkpoints merged stays selectable (the flag is read when weights are saved): a full merged
        # copy in memory and on disk, swapped in as full weights, computing the same model
        srv.backend.sampler_checkpoints = "merged"
        merged_snap = tc.save_weights_and_get_sampling_client()
        merged_path = tc.save_weights_for_sampler("m1").result(timeout=120).path
        srv.backend.sampler_checkpoints = "auto"
        assert (folder.parent / "m1" / "model.safetensors").is_file()
        by_merged_path = sc.create_sampling_client(model_path=merged_path)
        for client, ref in ((by_path, ref_adapter), (plain, ref_base), (snapshot, ref_adapter),
                            (merged_snap, ref_adapter), (by_path, ref_adapter), (by_merged_path, ref_adapter),
                            (plain, ref_base)):     # swaps both ways
            got = torch.tensor(client.compute_logprobs(prompt).result(timeout=120)[1:], dtype=torch.float64)
            assert float((got - ref).abs().max()) < 1e-5

        # several sessions' adapters and the base in ONE decode batch (batched multi-adapter decode): a second
        # adapter (one more step) as an unnamed snapshot, the first by path, the base; greedy, against HF + PEFT
        from ferrule.rollout.base import SamplingParams
        from ferrule.serve.backend import AdapterWeights, SampleSpec

        tc.forward_backward(sdk_data(seed=7, lengths=(6, 4)), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        tc.save_weights_and_get_sampling_client()
        tc.save_weights_for_sampler("a2").result(timeout=120)
        backend = srv.backend
        snap2 = max(backend._snapshots, key=lambda k: int(k.rsplit(":", 1)[1]))
        assert isinstance(backend._snapshots[snap2], AdapterWeights)   # the adapter, not a merged copy
        a1 = backend.saved_weights(folder)
        # (PeftModel.from_pretrained wrapped `hf` itself above: fresh copies of the base)
        fresh = lambda: Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32).eval()  # noqa: E731
        refs = {snap2: PeftModel.from_pretrained(fresh(), folder.parent / "a2").eval(), None: fresh(),
                str(a1): PeftModel.from_pretrained(fresh(), folder).eval()}
        params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
        sources = [snap2, None, a1, snap2]
        specs = [SampleSpec(prompt.to_ints()[:4 + i], 1, params, False) for i in range(len(sources))]
        calls = []
        generate = backend.rollout.generate
        backend.rollout.generate = lambda reqs, p: calls.append([r.lora_adapter for r in reqs]) or generate(reqs, p)
        try:
            results = backend.sample_many(list(zip(sources, specs)))
        finally:
            del backend.rollout.generate
        assert calls == [[snap2, None, str(a1), snap2]]                  # one generate call, one adapter per row
        for src, spec, (seqs, _, _) in zip(sources, specs, results):
            ((tokens, lps, _),) = seqs
            ids = torch.tensor([spec.prompt + tokens])
            with torch.no_grad():
                lp = torch.log_softmax(refs[None if src is None else str(src)](ids).logits[0].double(), -1)
            want = lp[len(spec.prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            assert tokens == lp[len(spec.prompt) - 1:-1].argmax(-1).tolist()
            assert float((torch.tensor(lps, dtype=torch.float64) - want).abs().max()) < 1e-5
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~60 s alone on 2 busy cores
def test_soak_four_tenants_ten_snapshots_and_twenty_forward_backwards_each_memory_stays_bounded(tmp_path):
    """Issue 46's soak check, bounded: 4 tenants (keys) each run 10 rounds of 2 ``forward_backward`` +
    ``optim_step`` + an unnamed snapshot (``save_weights_and_get_sampling_client``) sampled once, all
    through the SDK on one loopback server in this process, with the default ``--sampler-checkpoints auto`` (a
    LoRA client's snapshot holds the adapter). The process's resident memory after the last round stays within 20% of
    its level after the first (activations released, snapshots past the per-tenant limit dropped); every
    snapshot samples its own tenant's weights (logprobs differ between tenants and from the previous
    round). With ``--sampler-checkpoints merged`` snapshots (a full copy each) memory grows until each tenant
    holds MAX_SNAPSHOTS of them, then stays: 626 -> 750 MiB by round 5 here (6 MB base), flat after."""
    import gc

    import psutil
    from tinker import types

    from ferrule.serve.backend import MAX_SNAPSHOTS, AdapterWeights

    keys = {f"tml-soak-{i:04d}": f"soak{i}" for i in range(4)}
    srv = RunningServer(_wide_base(tmp_path / "wide", seed=0), tmp_path / "storage", keys=keys, chunk_len=1024)
    proc = psutil.Process()
    prompt = types.ModelInput.from_ints([5, 9, 33, 2, 71, 14, 8])
    try:
        clients = [srv.client(k).create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=i).result()
                   for i, k in enumerate(keys)]
        rss, last = [], [None] * len(clients)
        for rnd in range(10):
            for i, tc in enumerate(clients):
                for j in range(2):
                    tc.forward_backward(sdk_data(seed=1000 * i + 10 * rnd + j, lengths=(9, 6, 12)), "cross_entropy")
                tc.optim_step(adam()).result(timeout=120)
                lp = tc.save_weights_and_get_sampling_client().compute_logprobs(prompt).result(timeout=120)[1:]
                assert lp != last[i] and all(lp != other for other in last[:i])   # its own, new weights
                last[i] = lp
            gc.collect()
            rss.append(proc.memory_info().rss)
        assert sum(len(v) for v in srv.backend._tenant_snapshots.values()) == len(clients) * MAX_SNAPSHOTS
        assert all(isinstance(w, AdapterWeights) for w in srv.backend._snapshots.values())
        print(f"soak: RSS per round {[round(r / 2**20) for r in rss]} MiB; after round 1 {rss[0] / 2**20:.0f} MiB, "
              f"max {max(rss) / 2**20:.0f} MiB, after round 10 {rss[-1] / 2**20:.0f} MiB")
        assert rss[-1] <= 1.2 * rss[0], [round(r / 2**20) for r in rss]
    finally:
        srv.stop()
