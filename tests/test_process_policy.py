"""Which tests may start a process of their own (issue 39).

An interpreter that imports torch, transformers and megatron-core costs 15-30 s on the 2-core CI
machine, so a test runs a CLI in-process (tests/inproc.py: ``run_ferrule``, ``environment``) and a
2-rank job in the session's pool (tests/dist_pool.py: the ``dist_pool`` fixture). A process of its
own is for tests whose subject is process behaviour: signals and kills, what a fresh interpreter
imports, a fresh venv, torchrun's or the product's own launcher, a real server. :data:`ALLOWED`
lists each such place with its reason; the scan below (every subprocess / os.system / fork / exec /
spawn / multiprocessing / asyncio launch in the test folders, under any import alias) fails on a place missing from the list, and on a
listed place that no longer starts a process, so the list stays the truth.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FOLDERS = ("tests", "plugins", "examples")

#: "file::top-level function" -> why that place needs a process of its own.
ALLOWED: dict[str, str] = {
    "tests/dist_pool.py::DistPool": "the session's 2-rank gloo pool itself (one torchrun for every 2-rank job)",
    "tests/test_checkpoint_faults.py::test_no_process_outlives_a_ferrule_train_killed_inside_a_checkpoint_save":
        "kill -9 of `ferrule train` inside a save: no child process may outlive it",
    "tests/test_cli_errors.py::test_a_bug_keeps_its_traceback":
        "the console script's own exit code and traceback for an uncaught exception (a command added to the app)",
    "tests/test_convert_faults.py::test_no_rank_outlives_a_killed_multi_rank_conversion":
        "kill of a multi-rank `ferrule convert`: no rank may outlive it",
    "tests/test_convert_faults.py::test_a_one_rank_conversion_stopped_by_sigterm_leaves_no_temporary_folder_or_lock":
        "SIGTERM to `ferrule convert`",
    "tests/test_convert_faults.py::test_lora_export_into_an_out_another_writer_holds_is_refused_naming_it":
        "another process holding OUT's lock",
    "tests/test_preemption.py::_start": "SIGTERM / SIGUSR1 to `ferrule train` (preemption)",
    "tests/test_engine_save_script.py::test_save_and_load_without_main_guard":
        "a user's plain script without `if __name__ == '__main__'` (the script is __main__)",
    "tests/test_fixture_families.py::test_fixture_families_pass_the_kit_at_tp1_and_tp2":
        "a plugin author's own pytest session running the kit over installed fixture plugins",
    "tests/test_gpu.py::test_split_invariance_nccl_bf16": "NCCL over GPUs (the pool's ranks are gloo on the CPU)",
    "tests/test_mapping.py::test_module_imports_no_torch": "what a fresh interpreter imports",
    "tests/test_mapping.py::test_mapping_package_has_no_import_cycle": "what a fresh interpreter imports",
    "tests/test_megatron_cpu_compat.py::probe": "megatron-core without ferrule's process-wide CPU patches",
    "tests/test_megatron_patch_conditions.py::test_te_patches_apply_on_a_cuda_machine_without_te":
        "a simulated CUDA machine: process-wide patches decided at import",
    "tests/test_megatron_runtime.py::test_plugin_variant_modules_import_no_torch": "what a fresh interpreter imports",
    "tests/test_packaging.py::_run": "a wheel built and installed into a fresh venv",
    "tests/test_rl_distributed.py::_one_process":
        "on a machine with CUDA: the one-rank referee with CUDA hidden (ferrule's device backend is fixed per "
        "process); without CUDA it runs in the test's process",
    "tests/test_rl_distributed.py::_launch_worker": "NCCL over two GPUs (CPU runs use the pool)",
    "tests/test_rl_distributed.py::test_a_rank_that_raises_stops_the_job_with_its_message":
        "torchrun ending both ranks when one raises",
    "tests/test_rl_e2e.py::test_cli_ctrl_c_saves_and_resumes": "SIGINT to `ferrule train`",
    "tests/test_rl_sglang.py::test_release_stops_a_launched_server_and_restores_sigterm":
        "a launched server process is stopped",
    "tests/test_rl_sglang.py::test_sigterm_stops_the_launched_server_then_the_process_dies_of_it": "SIGTERM",
    "tests/test_rollout_embedded.py::test_train_engine_first_then_embedded_engine":
        "import order of the CPU patches in a fresh interpreter",
    "tests/test_run_folder.py::_holder": "another process holding a lock",
    "tests/test_run_folder.py::test_the_files_the_docs_create_are_gitignored": "git check-ignore (not Python)",
    "tests/test_serve_protocol.py::test_ferrule_serve_command_on_loopback": "the real `ferrule serve` process",
    "tests/test_shared_rows.py::test_last_rounds_mistral_plugin_loads_with_a_warning_and_passes_check":
        "the warning as `ferrule plugins` prints it on a process's stderr (no torch import: ~1 s)",
    "tests/test_shared_rows.py::test_plugins_never_lists_an_incomplete_family_as_validated":
        "`ferrule plugins` with non-strict loading in its own process (no torch import: ~1 s)",
}


#: module -> the calls of it that start a process
LAUNCH_CALLS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp",
           "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
           "spawnle", "spawnlp", "spawnlpe"},
    "multiprocessing": {"Process", "Pool", "get_context"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "spawn", "start_processes"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}


def _launch_names(tree: ast.AST) -> tuple[dict[str, set[str]], set[str]]:
    """This file's names for the modules of :data:`LAUNCH_CALLS` (``import subprocess as sp``) and the
    launch functions it imported by name (``from subprocess import run``)."""
    modules: dict[str, set[str]] = {}
    functions: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in LAUNCH_CALLS:
                    modules[alias.asname or alias.name] = LAUNCH_CALLS[alias.name]
        elif isinstance(node, ast.ImportFrom) and node.module in LAUNCH_CALLS:
            for alias in node.names:
                if alias.name in LAUNCH_CALLS[node.module]:
                    functions.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "multiprocessing"
                                                                               for a in node.names):
            for alias in node.names:
                if alias.name == "multiprocessing":
                    modules[alias.asname or alias.name] = LAUNCH_CALLS["torch.multiprocessing"]
    return modules, functions


def _process_launches() -> set[str]:
    """``file::top-level function`` of every process launch in the test folders (subprocess, os.system /
    fork / exec / spawn, multiprocessing, asyncio subprocesses; under any import alias), the test fixtures'
    own packages and the 2-rank worker programs under ``dist/`` (which run inside a launch) excluded."""
    found = set()
    for folder in TEST_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/tests/" not in f"/{rel}" or "/fixtures/" in rel or "/dist/" in rel or "/build/" in rel:
                continue
            tree = ast.parse(path.read_text())
            modules, functions = _launch_names(tree)
            for node in tree.body:
                for call in ast.walk(node):
                    if not isinstance(call, ast.Call):
                        continue
                    func = call.func
                    hit = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                           and func.attr in modules.get(func.value.id, ())) or (
                           isinstance(func, ast.Name) and func.id in functions)
                    if hit:
                        found.add(f"{rel}::{getattr(node, 'name', '<module>')}")
    return found


def test_only_process_behaviour_tests_start_a_process():
    found = _process_launches()
    unlisted = sorted(found - ALLOWED.keys())
    assert not unlisted, ("these start a process of their own; run the CLI in-process (tests/inproc.py) or the "
                          "2-rank job in the `dist_pool` fixture, or, if process behaviour is the subject, add the "
                          f"place to ALLOWED with its reason: {unlisted}")
    stale = sorted(ALLOWED.keys() - found)
    assert not stale, f"ALLOWED names places that start no process any more; remove them: {stale}"


def test_the_scan_sees_a_launch(tmp_path, monkeypatch):
    """The scan is not blind: planted launches under other names are found under their functions, and
    calls that start nothing are not."""
    planted = tmp_path / "tests" / "test_planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "import os\nimport subprocess as sp\nfrom subprocess import Popen as P\nimport multiprocessing as mp\n"
        "from torch import multiprocessing as tmp\nimport asyncio\n\n"
        "def test_a():\n    sp.run(['true'])\n\n"
        "def test_b():\n    P(['true'])\n\n"
        "def test_c():\n    os.system('true')\n\n"
        "def test_d():\n    mp.get_context('spawn').Process(target=print)\n\n"
        "def test_e():\n    tmp.start_processes(print)\n\n"
        "async def test_f():\n    await asyncio.create_subprocess_exec('true')\n\n"
        "def test_quiet():\n    os.getcwd(); sp.CompletedProcess([], 0)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _process_launches() == {f"tests/test_planted.py::test_{x}" for x in "abcdef"}
