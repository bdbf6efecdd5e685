"""Bad config input is one clear line; sizes that cannot run are refused up front; an incomplete
shard index is named; checkpoint publication fsyncs before its renames (issue 28.16).

References: the byte offsets and line numbers of the files written here; the KV-cache size from
the static cache's layout ``[rows, kv_heads, max_len, head_dim]`` x 2 x layers, computed here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ferrule.rl.config import ConfigError, load_config
from inproc import run_ferrule

MINIMAL = "model: {hf_dir: some/hf}\ndata: {task: basic_arithmetic}\n"


def _problems(tmp_path: Path, text: bytes | str, overrides=(), name="c.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as exc:
        load_config(path, list(overrides))
    return "\n".join(exc.value.problems)


def test_non_utf8_config_is_one_line_naming_the_line(tmp_path):
    text = _problems(tmp_path, MINIMAL.encode() + b"logging: {run_dir: caf\xe9}\n")
    assert text == "line 3: byte b'\\xe9' is not UTF-8; save the file as UTF-8"
    res = run_ferrule(["train", tmp_path / "c.yaml"], env=dict(os.environ, FERRULE_PLUGINS="qwen,inkling"))
    assert res.returncode == 2 and "Traceback" not in res.stderr and "not UTF-8" in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) <= 2  # "1 config error in FILE:" + the problem


@pytest.mark.parametrize("value", [".inf", "-.inf", "1e400", ".nan"])
def test_non_finite_floats_are_refused(tmp_path, value):
    text = _problems(tmp_path, MINIMAL + f"optimizer: {{lr: {value}}}\n")
    assert "optimizer.lr: expected a finite float" in text


@pytest.mark.parametrize("value", ["inf", "1e400", "nan"])
def test_non_finite_overrides_are_refused(tmp_path, value):
    assert "optimizer.lr: expected a finite float" in _problems(tmp_path, MINIMAL, [f"optimizer.lr={value}"])


def test_duplicate_yaml_keys_are_refused_naming_both_lines(tmp_path):
    text = _problems(tmp_path, MINIMAL + "optimizer:\n  lr: 1.0e-6\n  clip_grad: 1.0\n  lr: 1.0e-2\n")
    assert "duplicate key 'lr' (first on line 4)" in text and "line 6" in text
    text = _problems(tmp_path, MINIMAL + "model: {dtype: float32}\n")
    assert "duplicate key 'model' (first on line 1)" in text


def _hf_dir(tmp_path: Path, **config) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    base = dict(model_type="qwen3", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                hidden_size=256, head_dim=32, max_position_embeddings=1024, vocab_size=100)
    (hf / "config.json").write_text(json.dumps({**base, **config}))
    return hf


def test_sizes_that_cannot_run_are_refused_before_any_model_loads(tmp_path):
    from ferrule.rl.run_checks import preflight, size_problems

    hf = _hf_dir(tmp_path)
    common = [f"model.hf_dir={hf}", f"logging.run_dir={tmp_path / 'run'}", "train.micro_batch_tokens=100000"]
    (tmp_path / "c.yaml").write_text(MINIMAL)
    ok = load_config(tmp_path / "c.yaml", common)
    assert size_problems(ok, json.loads((hf / "config.json").read_text())) == []

    long = load_config(tmp_path / "c.yaml", common + ["rollout.max_new_tokens=10000000",
                                                      "train.micro_batch_tokens=20000000"])
    rows, longest = 8 * 8, 512 + 10_000_000  # defaults: prompts_per_step 8, 8 samples, max_prompt_tokens 512
    need = rows * longest * 4 * 2 * 2 * 32 * 4  # rows x len x layers x (K, V) x kv heads x head_dim x fp32
    with pytest.raises(ConfigError) as exc:
        preflight(long)  # the machine's own memory: 20 TiB of KV cache fits no machine
    assert f"of up to {longest} tokens (data.max_prompt_tokens + max_new_tokens) need {need / 2**30:.1f} GiB" \
        in "\n".join(exc.value.problems)

    many = load_config(tmp_path / "c.yaml", common + ["rollout.n_samples_per_prompt=100000", "train.prompts_per_step=8"])
    rows, longest = 8 * 100_000, 512 + 256  # defaults: max_prompt_tokens 512, max_new_tokens 256
    need = rows * longest * 4 * 2 * 2 * 32 * 4  # rows x len x layers x (K, V) x kv heads x head_dim x fp32
    text = "\n".join(size_problems(many, json.loads((hf / "config.json").read_text()), memory_bytes=24 * 2**30))
    assert f"need {need / 2**30:.1f} GiB of KV cache alone, more than this machine's 24.0 GiB" in text
    assert "rollout.n_samples_per_prompt, max_new_tokens: 800000 rows" in text


def test_a_prompt_and_response_beyond_a_launched_sglang_servers_context_are_refused(tmp_path):
    """SGLang rejects a request whose prompt + max_new_tokens reaches the server's context length (its
    TokenizerManager check; without --context-length the length is the config's max_position_embeddings,
    here 1024): the run would stop at the first long prompt, so the config is refused up front."""
    from ferrule.rl.run_checks import size_problems

    hf = _hf_dir(tmp_path)
    hf_config = json.loads((hf / "config.json").read_text())
    (tmp_path / "c.yaml").write_text(MINIMAL)
    common = [f"model.hf_dir={hf}", f"logging.run_dir={tmp_path / 'run'}", "train.micro_batch_tokens=100000",
              "rollout.engine=sglang"]

    def problems(*extra: str) -> str:
        return "\n".join(size_problems(load_config(tmp_path / "c.yaml", common + list(extra)), hf_config))

    assert problems() == ""  # 512 + 256 < 1024
    text = problems("rollout.max_new_tokens=600")
    assert ("data.max_prompt_tokens, rollout.max_new_tokens: a prompt of up to 512 tokens + 600 new tokens reaches "
            "the SGLang server's context length 1024 (the model's max_position_embeddings)") in text, text
    assert "raise rollout.sglang_args.context_length" in text
    assert "context length 1024" in problems("eval.max_new_tokens=512")  # evaluation uses the same server
    assert problems("rollout.max_new_tokens=600", "rollout.sglang_args={context_length: 4096}") == ""
    assert "context length 1100 (rollout.sglang_args.context_length)" in problems(
        "rollout.max_new_tokens=600", "rollout.sglang_args={context_length: 1100}")
    assert problems("rollout.max_new_tokens=600", "rollout.sglang_url=http://127.0.0.1:30000") == ""  # its own length
    assert problems("rollout.max_new_tokens=600", "rollout.engine=embedded") == ""  # RoPE runs past it
    yarn = dict(hf_config, rope_scaling={"rope_type": "yarn", "factor": 4.0})  # SGLang multiplies by the factor
    assert size_problems(load_config(tmp_path / "c.yaml", common + ["rollout.max_new_tokens=600"]), yarn) == []


def test_a_shard_the_index_does_not_name_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    from ferrule.conformance import numeric as cn
    from ferrule.formats.safetensors_io import CheckpointError, SafetensorsReader

    src = cn.tiny_hf_dir("qwen2", tmp_path / "src")
    out = tmp_path / "hf"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out, max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    dropped = sorted(set(index["weight_map"].values()))[1]
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != dropped}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"does not name the shard\\(s\\) \\['{dropped}'\\]"):
        SafetensorsReader(out)


def test_publishing_a_folder_or_file_fsyncs_before_the_rename(tmp_path, monkeypatch):
    from ferrule.fs.util import commit_dir
    from ferrule.rl.checkpoints import atomic_write

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.realpath(a)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tmp = tmp_path / ".out.tmp"
    (tmp / "sub").mkdir(parents=True)
    files = [tmp / "a.bin", tmp / "sub" / "b.bin"]
    for f in files:
        f.write_bytes(b"x" * 100)
    commit_dir(tmp, tmp_path / "out")
    at = events.index(("replace", str(tmp)))
    synced = {path for kind, path in events[:at] if kind == "fsync"}
    assert {str(f) for f in files} | {str(tmp), str(tmp / "sub")} <= synced
    assert ("fsync", str(tmp_path)) in events[at:]  # the rename reached the directory too

    events.clear()
    atomic_write(tmp_path / "loop_state.json", "{}\n")
    kinds = [k for k, _ in events]
    assert kinds.index("fsync") < kinds.index("replace") and kinds[-1] == "fsync"


def test_agent_limits_below_one_are_refused_naming_the_key(tmp_path):
    text = "model: {hf_dir: some/hf}\nagent: {environment: guess_number}\neval: {interval: 0}\n"
    problems = _problems(tmp_path, text, ["agent.max_hung_env_calls=0", "agent.max_turns=0"])
    assert "agent.max_hung_env_calls: must be >= 1, got 0" in problems
    assert "agent.max_turns: must be >= 1, got 0" in problems
