"""``TrainEngine.save`` works from a plain script without ``if __name__ == "__main__":`` (issue 9).

megatron's torch_dist writer starts a ``multiprocessing`` Manager with the spawn method, which
re-imports the caller's ``__main__`` script and dies with multiprocessing's "bootstrapping
phase" RuntimeError unless the script has the guard. The script below has none; it trains one
step, saves, loads into a fresh engine and compares the exported weights tensor by tensor. It
runs twice in a subprocess: as a file (``python script.py``) and as code without a file
(``python -c``), which is how a notebook kernel runs a cell (its ``__main__`` has no
``__file__``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import train_engine_worker as w  # noqa: E402

SCRIPT = """\
import json
import sys

import torch

from ferrule.megatron.batching import Datum
from ferrule.megatron.engine import OptimizerSettings, TrainEngine

hf_dir, out = sys.argv[1], sys.argv[2]
engine = TrainEngine.from_hf(hf_dir, optimizer=OptimizerSettings(lr=1e-2))
tokens = torch.arange(1, 10)
engine.forward_backward([Datum(tokens[:-1].tolist(), {"target_tokens": tokens[1:], "weights": torch.ones(8) / 8})],
                        "cross_entropy")
engine.optim_step()
trained = {k: v.clone() for k, v in engine.export_hf_state()}
engine.save(out + "/ckpt")
loaded = TrainEngine.from_torch_dist(out + "/ckpt")
again = dict(loaded.export_hf_state())
print("RESULT " + json.dumps({"step": loaded.step, "adam_step": loaded.adam_step(), "tensors": len(trained),
                              "identical": trained.keys() == again.keys()
                              and all(torch.equal(trained[k], again[k]) for k in trained)}))
"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return w.make_hf_dir(tmp_path_factory.mktemp("save_script") / "hf")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["script_file", "code_without_file"])
def test_save_and_load_without_main_guard(hf_dir, tmp_path, how):
    if how == "script_file":
        script = tmp_path / "train_and_save.py"
        script.write_text(SCRIPT)
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-c", SCRIPT]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*cmd, str(hf_dir), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result == {"step": 1, "adam_step": 1, "tensors": result["tensors"], "identical": True}
    assert result["tensors"] > 0
    assert (tmp_path / "ckpt" / "metadata.json").is_file()
