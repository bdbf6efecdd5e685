"""``ferrule.losses.gspo`` (Tinker ``gspo``) against a float64 reference written from the GSPO-token
definition (Zheng et al. 2025, arXiv:2507.18071; Tinker's gspo page): per datum
``s = exp(mean_{M}(t - q))``, per token ``l_i = -min(s A_i, clip(s, lo, hi) A_i)`` whose gradient
with respect to ``t_i`` is ``-s A_i`` on the unclipped branch and 0 on the clipped one.

Also: packing several data into one call (``segment_ids``) equals one call per datum, the train
engine's packed micro-batches pass them, and the served loss through the tinker SDK.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from ferrule.losses import LOSS_CONFIG_DEFAULTS, get_loss, validate_loss_inputs

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (7, 4, 9)


def reference(t, q, adv, mask, lo, hi):
    """Loss values and d loss / d t of one datum, float64, from the definition (no autograd)."""
    t, q, adv = (x.double().tolist() for x in (t, q, adv))
    m = [i for i, v in enumerate(mask.tolist()) if v != 0]
    s = math.exp(sum(t[i] - q[i] for i in m) / len(m))
    values, grads = [], []
    for ti, ai in zip(t, adv):
        unclipped, clipped = s * ai, min(max(s, lo), hi) * ai
        if clipped < unclipped:
            values.append(-clipped)
            grads.append(0.0)
        else:
            values.append(-unclipped)
            grads.append(-s * ai)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64), s


def datum(seed: int, n: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    t = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    q = t + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * spread
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.float64)
    mask[: n // 3] = 0.0                      # prompt positions: not in the ratio, advantage 0
    adv[: n // 3] = 0.0
    return t, q, adv, mask


@pytest.mark.parametrize("spread,config", [(1e-4, None), (2e-2, None), (3.0, {"clip_low_threshold": 0.8,
                                                                                 "clip_high_threshold": 1.2})])
def test_gspo_matches_the_definition(spread, config):
    cfg = dict(LOSS_CONFIG_DEFAULTS["gspo"], **(config or {}))
    seen_clipped = 0
    for k, n in enumerate(LENGTHS):
        t, q, adv, mask = datum(10 + k, n, spread)
        tt = t.clone().requires_grad_(True)
        inputs = {"target_tokens": torch.zeros(n, dtype=torch.long), "logprobs": q, "advantages": adv,
                  "sequence_ratio_mask": mask}
        validate_loss_inputs("gspo", inputs, config)
        loss, metrics = get_loss("gspo")(tt, inputs, config)
        loss.sum().backward()
        want, want_grad, s = reference(t, q, adv, mask, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        assert torch.allclose(loss.detach(), want, atol=1e-12, rtol=0)
        assert torch.allclose(tt.grad, want_grad, atol=1e-12, rtol=0)
        assert float(metrics["ratio:sum"]) == pytest.approx(s * n, rel=1e-12)
        seen_clipped += int(metrics["clipped_tokens:sum"])
    if spread > 1e-2:   # the default band (3e-4 / 4e-4) clips whole sequences, the wide one some
        assert seen_clipped > 0


def test_packed_data_equal_one_call_per_datum():
    parts = [datum(20 + k, n, 2e-3) for k, n in enumerate(LENGTHS)]
    singles, grads = [], []
    for t, q, adv, mask in parts:
        tt = t.clone().requires_grad_(True)
        loss, _ = get_loss("gspo")(tt, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask})
        loss.sum().backward()
        singles.append(loss.detach())
        grads.append(tt.grad)
    t = torch.cat([p[0] for p in parts]).requires_grad_(True)
    packed = {"logprobs": torch.cat([p[1] for p in parts]), "advantages": torch.cat([p[2] for p in parts]),
              "sequence_ratio_mask": torch.cat([p[3] for p in parts]),
              "segment_ids": torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))}
    loss, _ = get_loss("gspo")(t, packed)
    loss.sum().backward()
    assert torch.equal(loss.detach(), torch.cat(singles)) and torch.equal(t.grad, torch.cat(grads))
    # without segment_ids the three data would share one ratio: a different loss
    t2 = t.detach().clone()
    merged, _ = get_loss("gspo")(t2, {k: v for k, v in packed.items() if k != "segment_ids"})
    assert not torch.equal(merged, loss.detach())


def test_gspo_refuses_an_empty_ratio_mask_and_unknown_keys():
    inputs = {"target_tokens": torch.zeros(3, dtype=torch.long), "logprobs": torch.zeros(3),
              "advantages": torch.ones(3), "sequence_ratio_mask": torch.zeros(3)}
    with pytest.raises(ValueError, match="sequence_ratio_mask.*marks no token"):
        validate_loss_inputs("gspo", inputs)
    with pytest.raises(ValueError, match="'kl_coef' is not accepted by loss 'gspo'"):
        validate_loss_inputs("gspo", dict(inputs, sequence_ratio_mask=torch.ones(3)), {"kl_coef": 0.1})


def test_served_gspo_through_the_tinker_sdk(tmp_path_factory):
    """The SDK's forward with loss_fn="gspo": the server's loss equals the reference over the
    logprobs it returns (one datum per ratio, whatever the SDK's chunking)."""
    pytest.importorskip("tinker")
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "tests" / "dist"))
    import train_engine_worker as w
    from serve_helpers import MODEL_NAME, RunningServer
    from tinker import types

    srv = RunningServer(w.make_hf_dir(tmp_path_factory.mktemp("gspo_base") / "tiny"), tmp_path_factory.mktemp("gspo"))
    try:
        tc = srv.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        g = torch.Generator().manual_seed(3)
        data, extra = [], []
        for n in (6, 9, 5, 8):   # chunk_len 3: two requests
            toks = torch.randint(0, 96, (n + 1,), generator=g)
            mask = torch.ones(n)
            mask[:2] = 0.0
            adv = torch.randn(n, generator=g) * mask
            data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                                    loss_fn_inputs={"target_tokens": toks[1:].tolist(), "advantages": adv.tolist(),
                                                    "logprobs": [-4.5] * n, "sequence_ratio_mask": mask.tolist()}))
            extra.append((adv, mask))
        first = tc.forward(data, "gspo",
                           {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}).result(timeout=120)
        total = 0.0
        for (adv, mask), out in zip(extra, first.loss_fn_outputs):
            t = torch.tensor(out["logprobs"].tolist(), dtype=torch.float64)
            want, _, _ = reference(t, torch.full_like(t, -4.5), adv.double(), mask, 0.5, 2.0)
            total += float(want.sum())
        assert first.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)
        fb = tc.forward_backward(data, "gspo").result(timeout=120)   # default band, trains
        assert math.isfinite(fb.metrics["loss:sum"])
    finally:
        srv.stop()


def test_engine_packed_micro_batches_keep_one_ratio_per_datum(tmp_path):
    """The train engine packs several data into one micro-batch when given a token budget; the
    per-datum losses must equal one datum per micro-batch (each datum keeps its own ratio)."""
    sys.path.insert(0, str(REPO / "tests" / "dist"))
    import train_engine_worker as w

    from ferrule.megatron.batching import Datum
    from ferrule.megatron.engine import TrainEngine

    hf_dir = w.make_hf_dir(tmp_path / "tiny")
    g = torch.Generator().manual_seed(4)
    data = []
    for n in (6, 9, 5, 8):
        toks = torch.randint(0, 96, (n + 1,), generator=g)
        mask = torch.ones(n)
        mask[:2] = 0.0
        data.append(Datum(toks[:-1].tolist(), {"target_tokens": toks[1:], "advantages": torch.randn(n, generator=g) * mask,
                                               "logprobs": torch.full((n,), -4.5), "sequence_ratio_mask": mask}))
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    alone = TrainEngine.from_hf(hf_dir).forward(data, "gspo", cfg)
    packed_engine = TrainEngine.from_hf(hf_dir, max_tokens_per_microbatch=64)
    packed = packed_engine.forward(data, "gspo", cfg)
    for a, b in zip(alone.loss_fn_outputs, packed.loss_fn_outputs):
        assert float((torch.as_tensor(a["elementwise_loss"]) - torch.as_tensor(b["elementwise_loss"])).abs().max()) < 1e-5
    assert packed.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], abs=1e-5)


def test_ferrule_train_builds_gspo_data_and_config():
    """``algorithm.loss=gspo`` in ferrule train: the response tokens form the ratio, the clip band
    comes from eps_clip / eps_clip_high, and truncated IS / KL are refused by the config checks."""
    import numpy as np

    from ferrule.rl.batch import Sample, build_datums, loss_fn_config
    from ferrule.rl.config import ConfigError, config_from_dict

    cfg = config_from_dict({"model": {"hf_dir": "x"}, "data": {"jsonl_path": "x"},
                            "algorithm": {"loss": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "use_tis": False}},
                           validate=False)
    name, loss_cfg = loss_fn_config(cfg.algorithm)
    assert name == "gspo" and loss_cfg == pytest.approx({"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4})
    s = Sample(group=0, prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logprobs=torch.tensor([-1.0, -2.0]),
               truncated=False)
    (d,) = build_datums([s], weights=[np.array([0.5, 0.5])], advantages=[1.0],
                        behaviour_logprobs=[torch.tensor([-1.0, -2.0])], use_tis=False, sequence_ratio=True)
    assert d.loss_fn_inputs["sequence_ratio_mask"].tolist() == [0.0, 0.0, 1.0, 1.0]
    validate_loss_inputs("gspo", d.loss_fn_inputs, loss_cfg)
    with pytest.raises(ConfigError, match="gspo: the sequence-ratio loss takes no truncated-IS"):
        config_from_dict({"model": {"hf_dir": "x"}, "data": {"jsonl_path": "x"}, "algorithm": {"loss": "gspo"}})
