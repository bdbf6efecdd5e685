"""Test-suite setup, shared by every test folder in ``testpaths`` (tests/, plugins/qwen/tests/,
examples/ferrule-llama/tests/): it sits at the repository root so that a plugin's own tests
(kept beside the plugin) get the same environment and fixtures.

- Only the in-tree plugins and the example out-of-tree package are visible
  (``FERRULE_PLUGINS=qwen,inkling,inkling2,llama,environments``), so another installed third-party plugin cannot change
  what these tests see; tests that need others set it.
- The conformance kit ``ferrule.conformance.kit`` runs over the in-tree families; the fixture plugins
  under tests/fixtures run it in a subprocess (tests/test_fixture_families.py).
- The process-wide registry is rebuilt around every test.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("FERRULE_PLUGINS", "qwen,inkling,inkling2,llama,environments")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest-xdist: one core's share of threads per worker
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

pytest_plugins = ["ferrule.conformance.kit", "cpu_report"]  # cpu_report: --cpu-report=N (tests/cpu_report.py)

# Fixture plugin packages carry their own kit tests; tests/test_fixture_families.py runs them in a
# subprocess where the fixtures are discoverable (tests/fixture_plugins.py).
collect_ignore_glob = ["tests/fixtures/*"]


ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))  # the shared helpers (inproc, dist_pool, fixture_plugins) for every test folder


@pytest.fixture(scope="session")
def dist_pool():
    """The session's 2-rank gloo worker pool (tests/dist_pool.py): ``dist_pool.run([WORKER, *args])``
    replaces a ``torchrun --nproc-per-node 2 WORKER args`` launch, without its two interpreter starts."""
    from dist_pool import DistPool

    pool = DistPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ferrule_kit_tp2_launch(dist_pool):
    """The conformance kit's TP=2 launch (``FamilyConformance.tp2_results``) as a job of the session's pool:
    one kit class's TP=2 families without a ``torchrun`` of their own (two interpreter starts each)."""
    return dist_pool.run


@pytest.fixture
def pooled_ranks(dist_pool, monkeypatch):
    """2-rank conversion workers (``ferrule convert --tp 2``, ``ferrule check --tp 2``) run in the session's
    pool instead of two spawned interpreters (~20-40 s each call on this machine): ``workers._run`` with
    ``world == 2`` becomes a pool job (tests/dist/rank_call.py) that runs the same ``_spawn_entry`` per rank,
    with this process's environment, and turns a rank's report into the same exception
    (``workers.rank_error``). The ranks' output is copied to this process's stdout / stderr, where spawned
    ranks would write it. The spawn itself (kill -9, SIGTERM, a rank that dies) stays covered by the tests
    that do not use this fixture (tests/test_convert_faults.py, test_convert.py's multi-rank round trips)."""
    import pickle
    import shutil

    from ferrule.converters import checkpoint, workers

    spawn = workers._run

    def run(world, fn, args, tmp):
        if world != dist_pool.nproc:
            return spawn(world, fn, args, tmp)
        err_dir = Path(tmp).with_name(Path(tmp).name + "-ranks")
        err_dir.mkdir(exist_ok=True)
        try:
            call = err_dir / "call.pkl"
            call.write_bytes(pickle.dumps((fn, args, str(err_dir), world)))
            env = {k: v for k, v in os.environ.items() if k not in workers._DIST_KEYS}
            proc = dist_pool.run([str(ROOT / "tests" / "dist" / "rank_call.py"), str(call)],
                                 env=dict(env, OMP_NUM_THREADS="1"), timeout=900)
            sys.stdout.write(proc.stdout), sys.stderr.write(proc.stderr)
            if proc.returncode != 0:
                raise workers.rank_error(err_dir, RuntimeError(f"pool ranks exited {proc.returncode}:\n"
                                                                 f"{proc.stderr[-3000:]}"))
        finally:
            shutil.rmtree(err_dir, ignore_errors=True)

    monkeypatch.setattr(workers, "_run", run)
    monkeypatch.setattr(checkpoint, "_run", run)
    return dist_pool


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core, at most one per 6 GiB of memory (a worker
    with torch, transformers and megatron-core loaded, plus the 2-rank pool it may start, holds 3-5 GiB)."""
    import psutil

    return max(1, min(os.cpu_count() or 1, psutil.virtual_memory().total // (6 << 30)))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _schedule_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``--dist loadgroup``: its file, or the test itself for the
    files of :data:`SPLIT_FILES` (an ``@group`` suffix that pytest-xdist may have added is ignored)."""
    nodeid = nodeid.split("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid
    path = nodeid.split("::")[0]
    return nodeid if path in SPLIT_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (pyproject's addopts) with whole files as its groups (:func:`_schedule_unit`): a
    file's tests run in one worker, in file order, sharing its module and class fixtures. The units are
    taken from the test ids in the controller: pytest-xdist's own ``xdist_group`` marker works by renaming
    each test's id, which pytest 9.2 no longer lets a plugin do (``Item._nodeid`` is not read any more),
    so with it every test became its own unit and each file's module fixtures were set up in both workers
    (the cpu_compat probe, the kit's TP=1 run: ~45 s each, twice)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _schedule_unit(nodeid)

    return FileScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Schedule whole files (``pytest_xdist_make_scheduler``; the tests of :data:`SPLIT_FILES` one by one),
    the files known to take longest first (:data:`SLOW_FILES`; ``--no-loadscope-reorder`` keeps this
    order), so that the last file to finish is a short one. Tests of end-to-end files get the
    ``integration`` marker."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    for item in items:
        path = item.nodeid.split("::")[0]
        if (path in INTEGRATION_FILES or path.startswith("tests/test_serve")  # live in-process servers
                or "dist_pool" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slow") is not None):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept
    _check_gpu_markers(items)


#: the longest files, longest first (per-file sums of a full run's junit times on the 2-core machine,
#: 2026-12-06; the README's main job added where its 2 steps took ~2 min); a new file that takes more
#: than a minute belongs here
SLOW_FILES: list[str] = [
    "tests/test_cli_check.py", "tests/test_lora_inkling2.py", "examples/ferrule-llama/tests/test_real_smollm2.py",
    "tests/test_rl_distributed.py", "tests/test_megatron_runtime.py", "tests/test_convert_faults.py", "tests/test_serve_load.py",
    "tests/test_fixture_families.py", "tests/test_gptoss_family.py", "tests/test_conformance.py", "tests/test_train_engine.py", "tests/test_rl_sglang.py", "tests/test_preemption.py",
    "tests/test_packaging.py", "examples/ferrule-llama/tests/test_llama_conformance.py", "tests/test_rl_e2e.py",
    "tests/test_export_dtype.py", "tests/test_checkpoint_faults.py", "tests/test_megatron_cpu_compat.py",
    "plugins/qwen/tests/test_qwen_chat_golden.py", "tests/test_serve_protocol.py", "tests/test_rl_lora.py",
    "tests/test_rollout_embedded.py", "tests/test_serve_storage.py", "tests/test_routing_replay.py", "tests/test_serve_inkling2.py", "tests/test_run_folder.py", "tests/test_convert.py",
    "tests/test_lora.py", "plugins/qwen/tests/test_qwen_parity.py", "tests/test_lora_peft_import.py", "tests/test_moe_tp.py", "tests/test_serve_faults.py",
    "tests/test_engine_save_script.py", "tests/test_serve.py", "tests/test_convert_mxfp8.py",
    "plugins/inkling/tests/test_inkling_convert.py", "examples/ferrule-llama/tests/test_assets.py",
]

#: long files whose tests share no costly module fixture: each test is scheduled on its own (the
#: file's tests together would be the run's long pole: test_cli_check.py took ~970 s of one worker)
SPLIT_FILES = frozenset({"tests/test_cli_check.py", "tests/test_convert_faults.py", "tests/test_rl_distributed.py",
                         "examples/ferrule-llama/tests/test_real_smollm2.py"})

#: files of end-to-end runs (GRPO through the launcher, the conformance kit over whole families, killed
#: multi-rank conversions, packaging into a fresh venv): marked ``integration`` with the service's files
#: (``tests/test_serve*``: a live server each), every test that uses the 2-rank pool and every test
#: marked ``slow``; ``pytest -m "not integration"`` is the fast development loop (README)
INTEGRATION_FILES = frozenset({
    "tests/test_rl_e2e.py", "tests/test_rl_distributed.py", "tests/test_rl_lora.py", "tests/test_rl_sglang.py",
    "plugins/inkling/tests/test_inkling_rl.py", "plugins/inkling/tests/test_inkling_mm_rl.py", "plugins/inkling2/tests/test_inkling2_mm_rl.py",
    "tests/test_checkpoint_faults.py", "tests/test_convert_faults.py", "tests/test_run_folder.py", "tests/test_train_ux.py",
    "tests/test_metrics_sinks.py", "tests/test_export_dtype.py", "tests/test_colocate.py",
    "tests/test_fixture_families.py", "tests/test_conformance.py", "tests/test_packaging.py",
    "tests/test_cli_check.py", "tests/test_serve_protocol.py", "tests/test_serve_load.py",
    "examples/ferrule-llama/tests/test_llama_conformance.py", "examples/ferrule-llama/tests/test_real_smollm2.py",
})


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_from_an_earlier_file():
    """Each file starts as a fresh process would: without a default process group or megatron groups that
    an earlier file in this worker left initialized (an engine built in-process keeps them). With pytest-xdist
    the files a worker runs, and their order, vary; a leftover group made ``hf_to_torch_dist`` take its
    multi-process branch (it never joins a caller's group) and lose its ``progress`` calls in
    tests/test_convert_mxfp8.py. Tests of one file keep what the file's fixtures set up."""
    fastapi_models = sys.modules.get("fastapi.dependencies.models")
    if fastapi_models is not None:  # its lru_caches (callable classification) keep every in-process server's route
        caches = [f for f in vars(fastapi_models).values() if hasattr(f, "cache_clear")]  # closures, and through
        if any(f.cache_info().currsize for f in caches):  # them its engines with their process groups' gloo threads
            for f in caches:
                f.cache_clear()
            gc.collect()
    if "ferrule.megatron.parallel" in sys.modules:  # megatron's groups, the rotary caches holding models, the default group
        sys.modules["ferrule.megatron.parallel"].destroy_distributed()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
    yield


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ferrule.contract import registry
    registry.reset_registry()
    yield
    registry.reset_registry()


def _check_gpu_markers(items):
    """Every test that skips for want of CUDA carries the ``gpu`` marker, so that ``pytest -m gpu``
    on a GPU machine runs all of them (README "Tests"). Checked where such a skip fires (machines
    without CUDA, CI): a ``skipif`` whose condition holds and whose reason names CUDA or a GPU."""
    import torch

    if torch.cuda.is_available():  # here skips naming CUDA are CPU-only tests skipping for its presence
        return
    unmarked = []
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            continue
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", "")).lower()
            condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
            if condition is True and ("cuda" in reason or "gpu" in reason):
                unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError("tests that need CUDA lack @pytest.mark.gpu (add it, so `pytest -m gpu` runs them): "
                                + ", ".join(unmarked[:10]))
