"""Issue 40 item 3: engine settings are typed config sections that reach the engines and the run's
``config.yaml``; the former environment variables still work for one release, with a warning.

One in-process ``ferrule train`` run of test_rl_e2e's tiny Qwen3 (one step) with a non-default value
in each section, each chosen so that the engine's behaviour shows it: ``train_engine.fused_logprobs:
true`` (off by default on CPU), ``rollout_engine.max_batch: 3`` (default: all rows at once),
``weight_sync.direct: false`` (default: the direct path in one process).
"""

from __future__ import annotations

import io
import warnings

import pytest
import yaml

from transformers import AutoConfig, GenerationMixin, Qwen3ForCausalLM  # noqa: F401  (before megatron's patches)

ENGINE_SECTIONS = """\
train_engine: {fused_logprobs: true, logprob_chunk_tokens: 7, fused_adam: false}
rollout_engine: {max_batch: 3, kv_bucket: 32}
weight_sync: {direct: false}
"""


@pytest.mark.timeout(300)
def test_config_engine_sections_reach_the_engines_the_sync_config_yaml_and_the_startup_report(tmp_path):
    from rich.console import Console
    from test_rl_e2e import CONFIG, _build_model

    from ferrule.engine_settings import RolloutEngineSettings, TrainEngineSettings, WeightSyncSettings
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import GRPOTrainer

    _build_model(tmp_path / "model")
    (tmp_path / "task.jsonl").write_text("".join(f'{{"prompt": "say {i}", "answer": "7"}}\n' for i in range(8)))
    (tmp_path / "tiny.yaml").write_text(CONFIG + ENGINE_SECTIONS)
    run_dir = tmp_path / "run"
    cfg = load_config(tmp_path / "tiny.yaml", [f"model.hf_dir={tmp_path / 'model'}",
                                               f"data.jsonl_path={tmp_path / 'task.jsonl'}",
                                               f"logging.run_dir={run_dir}", "train.steps=1",
                                               "logging.plot_at_end=false", "checkpoint.enabled=false",
                                               "rollout_engine.batch_ladder=[4, 16]"])
    assert cfg.train_engine == TrainEngineSettings(fused_logprobs=True, logprob_chunk_tokens=7, fused_adam=False)
    assert cfg.rollout_engine == RolloutEngineSettings(max_batch=3, kv_bucket=32, batch_ladder=[4, 16])
    assert cfg.weight_sync == WeightSyncSettings(direct=False)
    out = io.StringIO()
    trainer = GRPOTrainer(cfg, console=Console(file=out, width=400))
    trainer.run()

    # the engines hold the sections and act on them
    assert trainer.engine.fast_paths == cfg.train_engine
    assert trainer.engine.fused_logprobs is True and trainer.engine.logprob_chunk_tokens == 7
    assert trainer.rollout.settings == cfg.rollout_engine and trainer.rollout.max_batch == 3
    assert trainer.last_sync.direct is False  # the bucketed path ran
    # config.yaml records them, reloadable
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train_engine"]["fused_logprobs"] is True and saved["train_engine"]["logprob_chunk_tokens"] == 7
    assert saved["rollout_engine"]["max_batch"] == 3 and saved["rollout_engine"]["batch_ladder"] == [4, 16]
    assert saved["weight_sync"]["direct"] is False
    assert load_config(run_dir / "config.yaml").to_dict() == cfg.to_dict()
    # the start-up report names each section and what it resolved to here
    text = out.getvalue()
    assert "train_engine: fused_logprobs=True" in text and "weight_sync: direct=False" in text
    assert "train engine paths on: fused_logprobs" in text


def test_deprecated_env_var_applies_with_a_warning_naming_its_setting(monkeypatch):
    from ferrule.engine_settings import RolloutEngineSettings, TrainEngineSettings

    monkeypatch.setenv("FERRULE_FUSED_ADAM", "0")
    monkeypatch.setenv("FERRULE_LEAN_ACTIVATIONS", "swiglu,norms")
    monkeypatch.setenv("FERRULE_FAST_KV_BUCKET", "128")
    with pytest.warns(FutureWarning, match="FERRULE_FUSED_ADAM is deprecated .* set train_engine.fused_adam"):
        s = TrainEngineSettings().with_env()
    assert s.fused_adam is False and s.lean_activations == ["swiglu", "norms"]
    with pytest.warns(FutureWarning, match="rollout_engine.kv_bucket"):
        assert RolloutEngineSettings().with_env().kv_bucket == 128
    monkeypatch.setenv("FERRULE_FAST_KV_BUCKET", "lots")
    with pytest.raises(ValueError, match="FERRULE_FAST_KV_BUCKET='lots'.*set rollout_engine.kv_bucket instead"):
        RolloutEngineSettings().with_env()
    for name in ("FERRULE_FUSED_ADAM", "FERRULE_LEAN_ACTIVATIONS", "FERRULE_FAST_KV_BUCKET"):
        monkeypatch.delenv(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainEngineSettings().with_env() == TrainEngineSettings()  # nothing set: no warning


def test_defaults_are_on_where_verified_and_resolve_by_device():
    from ferrule.engine_settings import RolloutEngineSettings, TrainEngineSettings

    t, r = TrainEngineSettings(), RolloutEngineSettings()
    for key in ("fused_logprobs", "packed_sequences", "grad_accum_fusion", "logprob_one_pass", "fused_adam"):
        assert t.resolve(key, on_cuda=True) is True and t.resolve(key, on_cuda=False) is False, key
    assert t.lean_kinds(on_cuda=True) == ("swiglu", "norms", "compact_v") and t.lean_kinds(on_cuda=False) == ()
    assert t.logprob_chunk_tokens == 1024
    assert r.resolve("fast_decode", on_cuda=True) and r.attention == "fp32" and r.kv_bucket == 64  # triton: not verified
    assert r.continuous_fast is True  # CUDA exactness test green, 1.3-1.5x the transformers-forward path (H100)
    assert r.compile_regions is False  # exact on CUDA, not shown faster
    assert r.compile_step is True  # uncompiled: exact on CUDA, 0.45x the steady rate (pays for short runs only)


def test_serve_engine_setting_flags_parse_typed_and_refuse_bad_items():
    from ferrule.cli.serve import parse_engine_settings

    got = parse_engine_settings(["rollout_engine.kv_bucket=128", "train_engine.fused_adam=false",
                                 "rollout_engine.continuous_fast=true"])
    assert got["rollout_engine"].kv_bucket == 128 and got["train_engine"].fused_adam is False
    assert got["rollout_engine"].continuous_fast is True
    with pytest.raises(ValueError, match="rollout_engine.kv_bucket: expected int"):
        parse_engine_settings(["rollout_engine.kv_bucket=many"])
    with pytest.raises(ValueError, match="SECTION one of train_engine, rollout_engine"):
        parse_engine_settings(["weight_sync.direct=false"])


def test_compile_caches_go_under_ferrule_cache_dir_even_after_torch_set_its_default(monkeypatch, tmp_path):
    """torch writes its own default ``TORCHINDUCTOR_CACHE_DIR`` into the environment when inductor is imported
    (before any engine is built): that value must not keep torch.compile's cache out of ferrule's folder, while a
    folder the user chose is kept. Reference: torch's ``cache_dir_utils.default_cache_dir``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from ferrule import envs

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert cache_dir() == default_cache_dir()  # torch sets its default into os.environ
    got = envs.set_compile_cache_dirs(tmp_path / "compile")
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "torchinductor")
    assert cache_dir() == str(tmp_path / "compile" / "torchinductor")  # what inductor now uses
    assert got["TRITON_CACHE_DIR"] == str(tmp_path / "compile" / "triton")
    mine = str(tmp_path / "users_choice")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", mine)
    assert envs.set_compile_cache_dirs(tmp_path / "other")["TORCHINDUCTOR_CACHE_DIR"] == mine
