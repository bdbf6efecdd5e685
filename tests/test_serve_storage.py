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
