"""Each megatron patch table is applied on its own condition, never on the device alone.

- ``ferrule.megatron.te_compat`` (TransformerEngine / Apex absent): applied wherever a patch's
  ``needed()`` holds, CUDA or not. A CUDA machine without TE (what ``pip install`` gives) is
  simulated here by making ``torch.cuda.is_available()`` answer True in a fresh process: the
  backend must come out as CUDA, the TE patch must be installed and the CPU table never imported.
- ``ferrule.megatron.cpu_compat`` (no CUDA): refuses to apply where CUDA is available.

Runs on CPU and on GPU machines alike (nothing here needs a device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SIMULATED_CUDA = r"""
import json, sys
import torch
torch.cuda.is_available = lambda: True      # a CUDA machine without TransformerEngine / Apex
from ferrule.megatron import device, te_compat
backend = device.get_backend()
from megatron.core.transformer.moe import moe_utils
print(json.dumps({"kind": backend.kind, "dist": backend.dist_backend, "te_applied": list(te_compat.applied()),
                  "te_general_gemm_defined": hasattr(moe_utils, "te_general_gemm"),
                  "te_general_gemm": repr(getattr(moe_utils, "te_general_gemm", "<undefined>")),
                  "have_te": moe_utils.HAVE_TE,
                  "cpu_compat_imported": "ferrule.megatron.cpu_compat" in sys.modules}))
"""


def test_te_patches_apply_on_a_cuda_machine_without_te():
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("FERRULE_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _SIMULATED_CUDA], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["have_te"] is False  # the premise: TE is absent here
    assert out["kind"] == "cuda" and out["dist"] == "nccl"
    assert out["te_applied"] == ["moe_te_general_gemm"]
    assert out["te_general_gemm_defined"] and out["te_general_gemm"] == "None"
    assert out["cpu_compat_imported"] is False


def test_te_patch_is_skipped_where_upstream_defines_the_name():
    """The condition is upstream's state (``te_general_gemm`` bound or not), not the device."""
    from megatron.core.transformer.moe import moe_utils

    from ferrule.megatron import te_compat

    before = te_compat.applied()
    te_compat.revert()
    assert not hasattr(moe_utils, "te_general_gemm")  # megatron-core 0.16.1 without TE
    sentinel = object()
    moe_utils.te_general_gemm = sentinel  # what a TE install binds
    try:
        assert not te_compat.PATCHES[0].needed()
        assert te_compat.apply() == ()
        assert moe_utils.te_general_gemm is sentinel
    finally:
        del moe_utils.te_general_gemm
        if before:
            te_compat.apply()
    assert te_compat.PATCHES[0].needed() is (not before)


def test_every_patch_has_one_condition():
    """The two tables are disjoint, and only the CPU table refuses a CUDA machine."""
    import torch

    from ferrule.megatron import te_compat

    names = set(te_compat.PATCH_NAMES)
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is never imported on a CUDA machine")
    from ferrule.megatron import cpu_compat

    assert not names & set(cpu_compat.PATCH_NAMES)
    assert all(callable(p.needed) for p in te_compat.PATCHES)
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        with pytest.raises(RuntimeError, match="must not be applied on a machine with CUDA"):
            cpu_compat.apply()
        te_compat.apply()  # no device check at all
    finally:
        torch.cuda.is_available = real
