"""Every CPU patch in ferrule.megatron.cpu_compat is still needed by megatron-core 0.16.1, and works.

One subprocess (tests/dist/cpu_compat_probe.py, gloo world size 1) reverts each patch in turn,
runs a reproduction against upstream code and records the exception, then re-applies the patch
and runs it again. A test here fails when upstream no longer fails the documented way: that is
the signal to retire the patch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "dist" / "cpu_compat_probe.py"

torch = pytest.importorskip("torch")
if torch.cuda.is_available():  # pragma: no cover - GPU machines never apply these patches
    pytest.skip("cpu_compat is only applied on machines without CUDA", allow_module_level=True)

#: patch -> (exception type, message fragment, upstream site fragment) that megatron-core 0.16.1
#: raises without the patch. The fragments are the ones each patch's docstring documents.
EXPECTED_UPSTREAM = {
    "current_device": ("AssertionError", "Torch not compiled with CUDA enabled", "utils.py:get_tensor"),
    "synchronize": ("AssertionError", "Torch not compiled with CUDA enabled", "filesystem_async.py"),
    "streams": ("RuntimeError", "torch.cuda.Stream requires CUDA support", "moe/token_dispatcher.py:__init__"),
    "moe_te_general_gemm": ("NameError", "name 'te_general_gemm' is not defined", "moe/moe_utils.py"),
    "moe_split_sizes": ("TypeError", "incompatible function arguments", "all_to_all_single"),
    "gloo_scatter_contiguous": ("AssertionError", "wrong values for a non-contiguous tensor", "repro_gloo_scatter"),
    "gloo_uneven_all_gather": ("RuntimeError", "ProcessGroupGloo::allgather: invalid tensor size",
                               "repro_gloo_uneven_all_gather"),
    "optimizer_device_literals": ("AssertionError", "Torch not compiled with CUDA enabled", "optimizer/optimizer.py:__init__"),
    "optimizer_type_checks": ("TypeError", "Wrapped parameters must be one of torch.cuda.FloatTensor",
                              "distrib_optimizer.py:_build_model_and_main_param_groups"),
    "schedules_device_literal": ("AssertionError", "Torch not compiled with CUDA enabled",
                                 "schedules.py:forward_backward_no_pipelining"),
    "causal_mask_device_literal": ("AssertionError", "Torch not compiled with CUDA enabled",
                                   "transformer/utils.py:get_default_causal_mask"),
    "embedding_group_cuda": ("AssertionError", "Torch not compiled with CUDA enabled",
                             "language_module.py:setup_embeddings_and_output_layer"),
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("probe") / "probe.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def _patch(name):
    from ferrule.megatron import cpu_compat, te_compat

    return {p.name: p for p in cpu_compat.PATCHES + te_compat.PATCHES}[name]


def test_table_covers_every_patch():
    from ferrule.megatron import cpu_compat, te_compat

    assert set(cpu_compat.PATCH_NAMES) | set(te_compat.PATCH_NAMES) == set(EXPECTED_UPSTREAM)
    assert not set(cpu_compat.PATCH_NAMES) & set(te_compat.PATCH_NAMES)
    from ferrule.megatron.patching import MEGATRON_CORE_VERSION

    assert MEGATRON_CORE_VERSION == "0.16.1"
    import megatron.core

    assert megatron.core.__version__ == MEGATRON_CORE_VERSION, (
        "megatron-core changed: re-run this test file and retire the patches upstream fixed"
    )


@pytest.mark.parametrize("name", sorted(EXPECTED_UPSTREAM))
def test_upstream_still_needs_patch(probe, name):
    exc_type, message, site = EXPECTED_UPSTREAM[name]
    upstream = probe[name]["upstream"]
    assert upstream != "ok", f"upstream megatron-core no longer needs patch {name!r}: retire it"
    assert upstream.startswith(exc_type + ":"), upstream
    assert message in upstream, upstream
    assert site in upstream, upstream


@pytest.mark.parametrize("name", sorted(EXPECTED_UPSTREAM))
def test_patch_makes_it_work(probe, name):
    assert probe[name]["patched"] == "ok", probe[name]["patched"]


@pytest.mark.parametrize("name", sorted(EXPECTED_UPSTREAM))
def test_docstring_documents_the_upstream_error(name):
    patch = _patch(name)
    exc_type, message, _ = EXPECTED_UPSTREAM[name]
    reason = " ".join(patch.reason.split())
    assert "Upstream" in reason and patch.upstream_site
    if name == "gloo_scatter_contiguous":  # upstream raises nothing: the values are silently wrong
        assert "without an error" in reason
    else:
        assert exc_type in reason and message.split(" ")[0] in reason, reason


def test_apply_is_idempotent_and_revertible():
    from ferrule.megatron import cpu_compat

    before = cpu_compat.applied()
    original = torch.cuda.current_device
    try:
        first = cpu_compat.apply()
        patched = torch.cuda.current_device
        assert cpu_compat.apply() == first == cpu_compat.PATCH_NAMES
        assert torch.cuda.current_device is patched  # not wrapped twice
        assert torch.cuda.current_device() == "cpu"
        with pytest.raises(ValueError, match="unknown patch names"):
            cpu_compat.apply(exclude=["no_such_patch"])
    finally:
        cpu_compat.revert([n for n in cpu_compat.PATCH_NAMES if n not in before])
    if not before:
        assert torch.cuda.current_device is original


def test_type_name_lie_is_scoped():
    """Outside the listed optimizer functions a CPU tensor still reports its true type."""
    from ferrule.megatron import cpu_compat
    from ferrule.megatron.cpu_compat_literals import _CudaTypeNameMode

    cpu_compat.apply()
    assert torch.zeros(2).type() == "torch.FloatTensor"
    with _CudaTypeNameMode():
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(2).type() == "torch.FloatTensor"
