"""``rollout.engine: sglang`` in the GRPO loop: what is ours, tested without an SGLang server.

No SGLang server runs here (sglang is not installed on these machines), so nothing below claims
that the loop works against a live server. Tested: the translation of ``rollout.sglang_args``
into launch flags (parsed back by an argparse parser declared like SGLang's flags), the config
refusals, the driver-only rollout roles and shard routing (the loop's ``_rollout`` with a
recording engine object), the engine arguments the driver builds, a launch that fails because
sglang is missing (a real subprocess; the error carries the server log), the stop of a launched
server process (at the end and on SIGTERM), the disk transport's clean-up, and the loop's wiring
end to end with the *embedded* engine put behind the client's interface (same metrics and
samples as the embedded run: this checks ferrule's side of the path, not SGLang).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ferrule.rl.config import ConfigError, config_from_dict

BASE = {
    "model": {"hf_dir": "/models/tiny"},
    "rollout": {"engine": "sglang", "temperature": 1.0, "max_new_tokens": 4, "n_samples_per_prompt": 2},
    "data": {"jsonl_path": "/data/task.jsonl", "system_prompt_preset": "none", "max_prompt_tokens": 64},
    "train": {"prompts_per_step": 4, "micro_batch_tokens": 1024, "seed": 3},
    "eval": {"interval": 0},
    "logging": {"run_dir": "/runs/sglang"},
}


def _cfg(*overrides: str, validate: bool = True):
    return config_from_dict(json.loads(json.dumps(BASE)), list(overrides), validate=validate)


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    return str(info.value)


# ------------------------------------------------------------------------------- launch flags
def _sglang_like_parser() -> argparse.ArgumentParser:
    """Flags declared the way SGLang's ``ServerArgs.add_cli_args`` declares them (store_true
    switches, typed values, ``nargs="+"`` lists, a JSON string), as an independent parser."""
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", type=str)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--tp-size", type=int)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", type=str, nargs="+")
    p.add_argument("--json-model-override-args", type=str)
    p.add_argument("--attention-backend", type=str)
    return p


def test_sglang_args_become_flags_that_argparse_reads_back():
    from ferrule.rl.rollout_engine import sglang_launch_args

    args = {"mem_fraction_static": 0.7, "tp_size": 2, "enable_lora": True, "disable_radix_cache": False,
            "max_lora_rank": 16, "lora_target_modules": ["q_proj", "v_proj"], "attention-backend": "triton",
            "json_model_override_args": {"rope_scaling": {"type": "yarn", "factor": 2.0}}}
    flags = sglang_launch_args(args)
    assert flags == ["--mem-fraction-static", "0.7", "--tp-size", "2", "--enable-lora", "--max-lora-rank", "16",
                     "--lora-target-modules", "q_proj", "v_proj", "--attention-backend", "triton",
                     "--json-model-override-args", '{"rope_scaling": {"type": "yarn", "factor": 2.0}}']
    ns = _sglang_like_parser().parse_args(flags)
    assert ns.mem_fraction_static == 0.7 and ns.tp_size == 2 and ns.enable_lora is True
    assert ns.disable_radix_cache is False  # false: the switch is left off
    assert ns.lora_target_modules == ["q_proj", "v_proj"] and ns.attention_backend == "triton"
    assert json.loads(ns.json_model_override_args) == args["json_model_override_args"]


def test_bad_sglang_args_are_refused_together_naming_each_key():
    from ferrule.rl.rollout_engine import sglang_launch_args

    with pytest.raises(ConfigError) as info:
        sglang_launch_args({"--tp-size": 2, "model_path": "/x", "port": 1234, "context_length": None,
                            "lora_target_modules": [], "lora_paths": [["a"]], "ok_flag": True})
    problems = info.value.problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    for key in ("--tp-size", "model_path", "port", "context_length", "lora_target_modules", "lora_paths"):
        assert f"rollout.sglang_args.{key}:" in text
    assert "the server loads model.hf_dir" in text and "rollout.sglang_url" in text


# ------------------------------------------------------------------------------- config checks
def test_a_valid_sglang_config_loads():
    cfg = _cfg()
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang_weight_transport == "tensor"
    _cfg("rollout.sglang_url=http://10.0.0.5:30000", "rollout.sglang_weight_transport=disk")


@pytest.mark.parametrize("overrides, fragments", [
    (["rollout.temperature=0.7"], ["rollout.temperature: 0.7 with rollout.engine=sglang",
                                   "set rollout.temperature=1.0"]),
    (["rollout.sglang_url=http://h:1", "rollout.sglang_args={tp_size: 2}"],
     ["rollout.sglang_args: ['tp_size'] are launch flags", "clear rollout.sglang_url"]),
    (["rollout.sglang_url=localhost:30000"], ["rollout.sglang_url: 'localhost:30000' is not an http(s) URL"]),
    (["rollout.sglang_args={dtype: float16}"], ["rollout.sglang_args.dtype: 'float16' differs from "
                                                "model.dtype='float32'"]),
    (["rollout.sglang_args={host: 0.0.0.0}"], ["rollout.sglang_args.host: set by the loop"]),
    (["lora.rank=8"], ["rollout.sglang_args.enable_lora: lora.rank > 0",
                       "rollout.sglang_args.max_lora_rank: None", "rollout.sglang_args.lora_target_modules: required"]),
    (["lora.rank=8", "rollout.sglang_args={enable_lora: true, max_lora_rank: 4, lora_target_modules: [q_proj], "
                     "max_loaded_loras: 1}"],
     ["max_lora_rank: 4; the server sizes its LoRA buffers", "max_loaded_loras: 1"]),
    (["rollout.engine=embedded", "rollout.sglang_weight_transport=disk"],
     ["rollout.sglang_url/sglang_args/sglang_weight_transport: only used with rollout.engine=sglang"]),
])
def test_what_sglang_cannot_do_is_refused_at_config_time(overrides, fragments):
    text = _problems(*overrides)
    for fragment in fragments:
        assert fragment in text, text


def test_lora_with_the_server_flags_loads():
    cfg = _cfg("lora.rank=8", "rollout.sglang_args={enable_lora: true, max_lora_rank: 8, "
                              "lora_target_modules: [q_proj, k_proj, v_proj, o_proj]}")
    assert cfg.lora.rank == 8


def test_several_ranks_accept_sglang():
    from ferrule.rl.distributed import check_layout

    dense = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2}
    check_layout(_cfg("parallel.tp=2"), dense, 4)  # DP=2: rank 0 drives the server, nothing refused


def test_check_weight_update_equal_is_refused_before_anything_loads(tmp_path):
    from ferrule.rl.loop import GRPOTrainer

    cfg = _cfg(f"logging.run_dir={tmp_path / 'run'}")  # model.hf_dir does not exist: refused before the paths
    with pytest.raises(ConfigError, match="--check-weight-update-equal: rollout.engine=sglang cannot be verified"):
        GRPOTrainer(cfg, check_weight_update_equal=True)


# ------------------------------------------------------------------------------- roles and shards
def test_driver_only_roles_hold_one_rollout_rank_and_no_group(monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ferrule.rl import distributed as rl_dist

    # 4 ranks, TP=2, DP=2: ranks (tp, pp, dp) = 0:(0,0,0) 1:(1,0,0) 2:(0,0,1) 3:(1,0,1), seen from rank 2
    coords = [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 1), (3, 1, 0, 1)]
    groups = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: groups.append(list(ranks)) or f"group{ranks}")
    monkeypatch.setattr(rl_dist, "all_gather_objects", lambda obj: coords)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: 1)

    embedded = rl_dist.rank_roles()
    assert embedded.rollout_ranks == (0, 2) and embedded.replica == 1 and groups == [[0, 2]]
    sglang = rl_dist.rank_roles(driver_only_rollout=True)
    assert sglang.rollout_ranks == (0,) and sglang.rollout_group is None and sglang.replica is None
    assert groups == [[0, 2]]  # no second group
    assert rl_dist.fan_out_rollout_weights(sglang, None, 1) == 0  # nothing to fan out
    assert {s.replica for s in rl_dist.plan_shards(8, 2, len(sglang.rollout_ranks), 3, 1)} == {0}


class _RecordingEngine:
    """Stands in for the driver's engine object in ``_rollout``: records each ``generate`` call."""

    kind = "sglang"

    def __init__(self):
        self.calls = []

    def generate(self, requests, params):
        from ferrule.rollout import GenerateResult

        self.calls.append(([r.prompt_token_ids for r in requests], params))
        return [GenerateResult(token_ids=(9,), logprobs=(-0.5,), finish_reason="stop", prompt_index=i,
                               sample_index=j, request_id=r.request_id)
                for i, r in enumerate(requests) for j in range(params.n)]


def _driver(cfg):
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.loop import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only what _rollout reads: no model, no server
    trainer.cfg, trainer.roles, trainer.rollout = cfg, RankRoles(0, 1, (0,)), _RecordingEngine()
    trainer.stop_ids, trainer.stop_strings, trainer._media_cache = (7,), (), {}
    return trainer


class _Prompt:
    def __init__(self, i):
        self.id, self.index = f"p{i}", i


@pytest.mark.parametrize("per_shard, calls", [(0, [(0, 5)]), (2, [(0, 2), (2, 4), (4, 5)])])
def test_the_driver_runs_every_shard_with_its_seed_in_order(per_shard, calls):
    from ferrule.rl.distributed import shard_seed

    cfg = _cfg(f"rollout.prompts_per_shard={per_shard}", validate=False)
    trainer = _driver(cfg)
    prompts, ids = [_Prompt(i) for i in range(5)], [(1, 2, i + 3) for i in range(5)]
    results = trainer._rollout(4, prompts, ids)
    made = trainer.rollout.calls
    assert [len(reqs) for reqs, _ in made] == [b - a for a, b in calls]
    assert [reqs for reqs, _ in made] == [ids[a:b] for a, b in calls]
    assert [p.seed for _, p in made] == [shard_seed(3, 4, k) for k in range(len(calls))]
    assert all(p.n == 2 and p.temperature == 1.0 and p.stop_token_ids == (7,) for _, p in made)
    # SGLang cannot return raw and tempered logprobs together; at temperature 1 they are the same
    assert not any(p.return_raw_logprobs for _, p in made)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(5) for j in range(2)]
    embedded = _driver(_cfg("rollout.engine=embedded", validate=False))
    embedded._rollout(4, prompts, ids)
    assert all(p.return_raw_logprobs for _, p in embedded.rollout.calls)


# ------------------------------------------------------------------------------- the engine
def test_driver_engine_arguments_launch_or_attach(tmp_path):
    from ferrule.rl.rollout_engine import _sglang_engine_kwargs

    run = tmp_path / "run"
    launch = _sglang_engine_kwargs(_cfg(f"logging.run_dir={run}", "model.dtype=bfloat16",
                                        "rollout.sglang_args={tp_size: 2, enable_metrics: true}"))
    assert launch == {"weight_transport": "tensor", "disk_dir": str(run / "sglang_weights"),
                      "lora_dir": str(run / "sglang_lora"), "model_path": "/models/tiny",
                      "launch_args": ("--dtype", "bfloat16", "--tp-size", "2", "--enable-metrics"),
                      "python": sys.executable, "log_path": str(run / "sglang_server.log")}
    attach = _sglang_engine_kwargs(_cfg(f"logging.run_dir={run}", "rollout.sglang_url=http://h:30000",
                                        "rollout.sglang_weight_transport=disk"))
    assert attach == {"weight_transport": "disk", "disk_dir": str(run / "sglang_weights"),
                      "lora_dir": str(run / "sglang_lora"), "url": "http://h:30000"}


def _sglang_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is None


@pytest.mark.skipif(not _sglang_missing(), reason="sglang is installed here, so a launch would start a real server")
def test_a_launch_without_sglang_is_one_config_error(tmp_path):
    import torch

    from ferrule.rl.rollout_engine import build_rollout_engine

    cfg = _cfg(f"logging.run_dir={tmp_path / 'run'}", "rollout.sglang_weight_transport=disk",
               f"model.hf_dir={tmp_path / 'model'}")
    with pytest.raises(ConfigError) as info:
        build_rollout_engine(cfg, dtype=torch.float32, device=torch.device("cpu"))
    assert info.value.problems == [
        f"rollout.engine: sglang with no rollout.sglang_url launches `python -m sglang.launch_server` with this "
        f"Python ({sys.executable}), which cannot import sglang; install sglang here, or start a server yourself "
        "and set rollout.sglang_url"]
    assert not (tmp_path / "run").exists()  # nothing launched or written
    # the same failure one level down: the client's launch of a Python without sglang ends with the log tail
    from ferrule.rollout import RolloutError
    from ferrule.rollout.sglang import SGLangEngine

    with pytest.raises(RolloutError, match="(?s)exited with code 1 during startup.*No module named 'sglang'"):
        SGLangEngine(model_path=str(tmp_path / "model"), log_path=str(tmp_path / "server.log"))


def test_tensor_transport_on_cpu_is_refused_naming_the_key(tmp_path):
    import torch

    from ferrule.rl.rollout_engine import build_rollout_engine

    cfg = _cfg(f"logging.run_dir={tmp_path / 'run'}", "rollout.sglang_url=http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="rollout.sglang_weight_transport: tensor hands the server CUDA IPC"):
        build_rollout_engine(cfg, dtype=torch.float32, device=torch.device("cpu"))
    assert not (tmp_path / "run").exists()  # refused before anything was launched or written


def test_release_stops_a_launched_server_and_restores_sigterm():
    from ferrule.rl.rollout_engine import _stop_on_sigterm, release_rollout_engine
    from ferrule.rollout.sglang import SGLangEngine

    before = signal.getsignal(signal.SIGTERM)
    engine = SGLangEngine(url="http://127.0.0.1:9")  # attach form: no server is contacted here
    engine.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                      start_new_session=True)
    _stop_on_sigterm(engine)
    assert signal.getsignal(signal.SIGTERM) is not before
    release_rollout_engine(engine)
    assert engine.process is None
    assert signal.getsignal(signal.SIGTERM) is before
    release_rollout_engine(engine)  # idempotent


def test_disk_transport_writes_the_bucket_then_removes_it(tmp_path):
    import torch
    from safetensors.torch import load_file

    from ferrule.rollout.sglang import SGLangEngine, SGLangHTTPError

    engine = SGLangEngine(url="http://127.0.0.1:9", weight_transport="disk", disk_dir=str(tmp_path / "w"))
    bucket = [("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3)), ("lm_head.weight", torch.ones(2, 3))]
    seen = []

    def request(method, path, json=None):
        folder = json["model_path"]
        seen.append((path, json["weight_version"], load_file(os.path.join(folder, "model.safetensors"))))
        return {"success": True}

    engine._request = request
    engine.update_weights(bucket, 3)
    (path, version, tensors), = seen
    assert path == "/update_weights_from_disk" and version == "3" and engine.weights_version == 3
    assert sorted(tensors) == sorted(n for n, _ in bucket)
    assert all(torch.equal(tensors[n], t) for n, t in bucket)
    assert os.listdir(tmp_path / "w") == []  # read by the server, then removed

    def refuse(method, path, json=None):
        raise SGLangHTTPError(method, path, 400, "bad weights")

    engine._request = refuse
    with pytest.raises(SGLangHTTPError):
        engine.update_weights(bucket, 4)
    assert os.listdir(tmp_path / "w") == [] and engine.weights_version == 3
    engine.shutdown()


def test_sigterm_stops_the_launched_server_then_the_process_dies_of_it(tmp_path):
    """torchrun stops ranks with SIGTERM: the driver's handler stops the server first."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, signal, subprocess, sys, time\n"
        "from ferrule.rl.rollout_engine import _stop_on_sigterm\n"
        "from ferrule.rollout.sglang import SGLangEngine\n"
        "engine = SGLangEngine(url='http://127.0.0.1:9')\n"
        "engine.process = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                                  start_new_session=True)\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(engine.process.pid))\n"
        "_stop_on_sigterm(engine)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped by engine.shutdown()
        os.kill(pid, 0)


# ------------------------------------------------------------------------------- the loop's wiring
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
import test_rl_distributed as td  # noqa: E402
import test_rl_e2e as e2e  # noqa: E402
from rl_sglang_worker import EmbeddedBehindTheClientInterface as _EmbeddedBehindTheClientInterface  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_sglang")
    e2e._build_model(root / "model")
    with open(root / "task.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{e2e.WORDS[i % 8]} {i}", "answer": "7"}) + "\n")
    (root / "tiny.yaml").write_text(e2e.CONFIG)
    (root / "overrides.json").write_text(json.dumps([f"model.hf_dir={root / 'model'}",
                                                     f"data.jsonl_path={root / 'task.jsonl'}",
                                                     "rollout.prompts_per_shard=2"]))
    return root


@pytest.mark.timeout(240)
def test_the_sglang_wiring_gives_the_embedded_runs_metrics_with_the_embedded_engine_behind_it(tiny, tmp_path,
                                                                                              monkeypatch):
    from ferrule.rl.config import load_config
    from ferrule.rl.loop import train
    from ferrule.rl.metrics import read_metrics

    steps = 3
    common = json.loads((tiny / "overrides.json").read_text()) + [f"train.steps={steps}"]
    train(load_config(tiny / "tiny.yaml", common + [f"logging.run_dir={tmp_path / 'embedded'}"]))
    monkeypatch.setattr("ferrule.rollout.sglang.SGLangEngine", _EmbeddedBehindTheClientInterface)
    monkeypatch.setattr("ferrule.rl.rollout_engine._sglang_importable", lambda: True)  # the stand-in plays the server
    _EmbeddedBehindTheClientInterface.built = []
    train(load_config(tiny / "tiny.yaml", common + [f"logging.run_dir={tmp_path / 'sglang'}", "rollout.engine=sglang",
                                                    "rollout.sglang_weight_transport=disk"]))
    (engine,) = _EmbeddedBehindTheClientInterface.built  # one engine, on the driver, and no embedded one
    assert engine.kwargs["model_path"] == str(tiny / "model") and engine.kwargs["url"] is None
    assert engine.kwargs["launch_args"] == ("--dtype", "float32") and engine.kwargs["weight_transport"] == "disk"
    assert engine.closed and engine.updates >= steps + 1 and engine.weights_version == steps
    a, b = read_metrics(tmp_path / "embedded" / "metrics.jsonl"), read_metrics(tmp_path / "sglang" / "metrics.jsonl")
    assert e2e._comparable(a) == e2e._comparable(b) and len({e["loss"] for e in a}) == steps  # not constant
    assert (tmp_path / "embedded" / "samples.jsonl").read_text() == (tmp_path / "sglang" / "samples.jsonl").read_text()


@pytest.mark.timeout(420)
def test_two_ranks_roll_out_on_the_driver_only_and_match_one_embedded_process(dist_pool, tiny, tmp_path):
    """DP=2 (gloo, CPU) with the embedded engine behind the client interface: rank 0 builds the only
    engine and gets every sync, rank 1 builds none; responses equal one embedded process's, metrics
    within tests/test_rl_distributed.py's DP tolerance (gradients summed over two ranks)."""
    steps = 3
    proc = dist_pool.run([str(Path(__file__).resolve().parent / "dist" / "rl_sglang_worker.py"), str(tiny),
                          str(tmp_path / "dp2"), f"train.steps={steps}"], timeout=400, env=td._cpu_env(), cwd=td.REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    out = json.loads((tiny / "sglang_results.json").read_text())
    (rank0,), rank1 = out["engines"]
    assert rank1 == [] and rank0[2] is True and rank0[1] >= steps + 1  # closed; initial sync + one per step
    metrics, responses, _ = out["run"]
    common = json.loads((tiny / "overrides.json").read_text()) + [f"train.steps={steps}"]
    (ref_metrics, ref_responses, _), = td._one_process(tiny, [common + [f"logging.run_dir={tmp_path / 'one'}"]])
    assert responses == ref_responses and len(set(responses)) > 8
    td._assert_close(metrics, ref_metrics, "sglang wiring at DP=2")


def test_an_attached_url_without_a_server_fails_before_training(tmp_path):
    import torch

    from ferrule.rl.rollout_engine import build_rollout_engine
    from ferrule.rollout.sglang import free_port

    url = f"http://127.0.0.1:{free_port()}"  # a port that was free a moment ago: nobody listens
    cfg = _cfg(f"logging.run_dir={tmp_path / 'run'}", f"rollout.sglang_url={url}",
               "rollout.sglang_weight_transport=disk", f"model.hf_dir={tmp_path}")
    with pytest.raises(ConfigError, match=rf"rollout.sglang_url: {url} does not answer GET /health \(ConnectError"):
        build_rollout_engine(cfg, dtype=torch.float32, device=torch.device("cpu"))
