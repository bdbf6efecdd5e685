"""User errors leave the ``ferrule`` CLI as one ``error:`` line and exit code 2 (issue 9).

Through the real console entry (``ferrule.cli.main``, run in-process by tests/inproc.py): a torch_dist checkpoint
whose tensors do not match its ``hf/config.json`` used to print ~97 traceback lines with exit
code 1, because torch's ``CheckpointException`` derives from ``BaseException`` and the
converter's ``except Exception`` missed it. (The ``ferrule train --resume`` case with a data set
that shrank is in tests/test_rl_e2e.py, which has the tiny RL run it needs.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ferrule.conformance import numeric as cn
from ferrule.user_errors import USER_ERRORS, user_error_message
from inproc import run_ferrule



def _ferrule(*args: str) -> subprocess.CompletedProcess:
    """The console entry point (``ferrule.cli.main``), in-process (tests/inproc.py)."""
    return run_ferrule(list(args), env=dict(os.environ, FERRULE_PLUGINS="qwen,inkling"))


@pytest.mark.timeout(200)
def test_torch_dist_not_matching_its_config_is_one_error_line(tmp_path):
    from ferrule.converters import hf_to_torch_dist

    hf_dir = cn.tiny_hf_dir("qwen2", tmp_path / "hf")
    ckpt = hf_to_torch_dist(hf_dir, tmp_path / "ckpt")
    cfg_file = ckpt / "hf" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2  # the stored tensors keep the old size
    cfg_file.write_text(json.dumps(cfg))

    # the checkpoint's checksums (ferrule.fs.integrity) name the edited file first: still valid JSON, so "changed since
    # the save" with how to load it on purpose (issue 45.7), not "damaged (truncated)"
    res = _ferrule("convert", "torch-dist-to-hf", str(ckpt), str(tmp_path / "out"))
    assert res.returncode == 2 and f"error: checkpoint file {cfg_file} was changed since the save" in res.stderr \
        and "checksums.json" in res.stderr, res.stderr[-3000:]
    (ckpt / "checksums.json").unlink()  # a folder without checksums (older): the mismatch itself is the error
    res = _ferrule("convert", "torch-dist-to-hf", str(ckpt), str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "[rank0]" not in res.stderr, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "decoder.layers.mlp.linear_fc1.weight" in errors[0] and str(ckpt) in errors[0]
    assert not (tmp_path / "out").exists()


def test_a_bug_keeps_its_traceback(tmp_path):
    """Not every exception is a user error: a RuntimeError inside a command keeps its traceback."""
    code = ("import typer; from ferrule.cli import app, main\n"
            "@app.command('boom')\n"
            "def boom() -> None:\n"
            "    raise RuntimeError('internal invariant broken')\n"
            "main()\n")
    res = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "internal invariant broken" in res.stderr
    assert not any(ln.startswith("error:") for ln in res.stderr.splitlines())


def test_checkpoint_exception_is_a_base_exception_and_maps_to_one_line():
    from torch.distributed.checkpoint.api import CheckpointException

    inner = ValueError("Global shape mismatch for tensor for key decoder.final_layernorm.weight")
    exc = CheckpointException("load failed", {1: (inner, None), 0: (inner, None)})
    assert not isinstance(exc, Exception)  # why ``except Exception`` missed it
    assert user_error_message(exc) == ("checkpoint cannot be loaded into this model (rank 0): ValueError: "
                                       "Global shape mismatch for tensor for key decoder.final_layernorm.weight")
    assert user_error_message(FileExistsError("out exists")) == "FileExistsError: out exists"
    assert user_error_message(RuntimeError("bug")) is None
    assert user_error_message(KeyboardInterrupt()) is None


def test_every_user_error_class_exists():
    import importlib

    for ref in USER_ERRORS:
        module, _, attr = ref.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert isinstance(cls, type) and issubclass(cls, BaseException), ref
