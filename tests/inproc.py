"""Run the ``ferrule`` console entry point in the test's own process.

``run_ferrule(["convert", ...])`` calls :func:`ferrule.cli.main` (the console script's function:
typer's app plus the one-line user-error translation, exit code 2) with ``sys.argv`` set, and
returns a :class:`subprocess.CompletedProcess` like the ``subprocess.run([sys.executable, "-c",
"from ferrule.cli import main; main()", ...])`` it replaces, without the 15-30 s interpreter start
(torch, transformers, megatron-core). What a subprocess would isolate is restored afterwards:
``os.environ`` (``env`` replaces it for the call, as ``subprocess.run(env=...)`` does), the working
directory, ``sys.argv``, ferrule's plugin registry (rebuilt from the call's environment, so
``FERRULE_PLUGINS`` applies), torch's thread count and the SIGINT / SIGTERM handlers.

Tests whose subject is process behaviour (signals, kill -9, exit of a crashed rank, a fresh
interpreter's imports, console-script installation) keep a subprocess: tests/test_process_policy.py
lists them.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path


@contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """Run a block as a child process started with ``env`` would see it, then undo it.

    ``os.environ`` is replaced by ``env`` (None: kept), the entries of its ``PYTHONPATH`` go in front of
    ``sys.path`` (so plugin packages made discoverable by ``tests/fixture_plugins.plugin_env`` load),
    ferrule's plugin registry is rebuilt from it; afterwards the environment, ``sys.path``, the registry,
    the working directory, torch's thread count and the SIGINT / SIGTERM handlers are restored, and
    every module imported from those ``PYTHONPATH`` entries is dropped from ``sys.modules`` (a fixture
    plugin that reads a variable at import time reads it again next time).
    """
    import torch

    from ferrule import registry

    saved_env, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
    saved_threads = torch.get_num_threads()
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    extra = []
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
            extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
            sys.path[:0] = extra
            if extra:
                import importlib

                importlib.invalidate_caches()
        registry.reset_registry()
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
        for s, h in saved_handlers.items():
            signal.signal(s, h)
        roots = tuple(str(Path(p).resolve()) for p in extra)
        if roots:
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(roots):
                    del sys.modules[name]
        registry.reset_registry()


def run_ferrule(args: list[str | Path], *, env: dict[str, str] | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``ferrule ARGS`` in-process; returns ``CompletedProcess(args, returncode, stdout, stderr)``.

    Args:
        args: the command line after ``ferrule``.
        env: the environment for the call (a full mapping, as ``subprocess.run``'s ``env``); None keeps
            the current one.
        cwd: working directory for the call.

    Returns:
        returncode: 0, the ``SystemExit`` code (2 for a user error), or 1 for an uncaught exception
        (its traceback in ``stderr``, as Python prints it).
    """
    from ferrule.cli import main

    argv = ["ferrule", *[str(a) for a in args]]
    saved_argv = list(sys.argv)
    out, err = io.StringIO(), io.StringIO()
    rc = 0
    with environment(env):
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = argv
        try:
            with redirect_stdout(out), redirect_stderr(err):
                try:
                    main()
                except SystemExit as exc:
                    code = exc.code
                    if code is None:
                        rc = 0
                    elif isinstance(code, int):
                        rc = code
                    else:
                        print(code, file=sys.stderr)
                        rc = 1
                except Exception:  # what an uncaught exception does to a process (pytest's own
                    traceback.print_exc()  # BaseExceptions, a timeout's Failed and Ctrl-C, pass through)
                    rc = 1
        finally:
            sys.argv = saved_argv
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
