"""Run the ``ferrule`` console entry point in the test's own process.

``run_ferrule(["convert", ...])`` calls :func:`ferrule.cli.main` (the console script's function:
typer's app plus the one-line user-error translation, exit code 2) with ``sys.argv`` set, and
returns a :class:`subprocess.CompletedProcess` like the ``subprocess.run([sys.executable, "-c",
"from ferrule.cli import main; main()", ...])`` it replaces, without the 15-30 s interpreter start
(torch, transformers, megatron-core). What a subprocess would isolate is restored afterwards:
``os.environ`` (``env`` replaces it for the call, as ``subprocess.run(env=...)`` does), the working
directory, ``sys.argv``, ferrule's plugin registry (rebuilt from the call's environment, so
``FERRULE_PLUGINS`` applies), torch's thread count, the SIGINT / SIGTERM handlers, logger levels and
transformers' progress bars. What the call prints is caught as a process's output would be: file
descriptors 1 and 2 as well as ``sys.stdout`` / ``sys.stderr`` (C++ messages such as torch's
``[rank0]:`` lines included), warnings shown under Python's default filters (``PYTHONWARNINGS`` of
the call's environment applied) and log records of level WARNING and above on stderr, as Python's
last-resort handler would print them. Two things differ from a fresh process: a module already
imported is not imported again (its import-time output is not repeated), and the commands that
plugins mount through ``register_commands`` are those of the test session's first import of
``ferrule.cli``.

Tests whose subject is process behaviour (signals, kill -9, exit of a crashed rank, a fresh
interpreter's imports, console-script installation) keep a subprocess: tests/test_process_policy.py
lists them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

#: Python's default warning filters (``python -W`` unset), most specific last as ``warnings.filters`` holds them
_PROCESS_DEFAULT_FILTERS = (("ignore", ResourceWarning), ("ignore", ImportWarning),
                            ("ignore", PendingDeprecationWarning), ("ignore", DeprecationWarning))


@contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """Run a block as a child process started with ``env`` would see it, then undo it.

    ``os.environ`` is replaced by ``env`` (None: kept), the entries of its ``PYTHONPATH`` go in front of
    ``sys.path`` (so plugin packages made discoverable by ``tests/fixture_plugins.plugin_env`` load),
    ferrule's plugin registry is rebuilt from it; afterwards the environment, ``sys.path``, the registry,
    the working directory, torch's thread count, the SIGINT / SIGTERM handlers, every logger's level and
    transformers' progress-bar switch are restored, and every module imported from those ``PYTHONPATH``
    entries is dropped from ``sys.modules`` (a fixture plugin that reads a variable at import time reads
    it again next time).
    """
    import torch
    from transformers.utils import logging as hf_logging

    from ferrule.contract import registry
    saved_env, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
    saved_threads = torch.get_num_threads()
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
                    if isinstance(lg, logging.Logger)}
    saved_root_level = logging.root.level
    saved_bars = hf_logging.is_progress_bar_enabled()
    extra: list[str] = []
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
        for name, lg in list(logging.root.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                lg.setLevel(saved_levels.get(name, logging.NOTSET))
        logging.root.setLevel(saved_root_level)
        (hf_logging.enable_progress_bar if saved_bars else hf_logging.disable_progress_bar)()
        roots = tuple(str(Path(p).resolve()) for p in extra)
        if roots:
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(roots):
                    del sys.modules[name]
        registry.reset_registry()


@contextmanager
def _process_output(out_file, err_file) -> Iterator[None]:
    """Point fds 1 / 2 and ``sys.stdout`` / ``sys.stderr`` at the two files; show warnings and WARNING+
    log records on stderr as a fresh process would."""
    sys.stdout.flush(), sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    handler = logging.StreamHandler(err_file)
    handler.setLevel(logging.WARNING)
    try:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        logging.root.addHandler(handler)
        with redirect_stdout(out_file), redirect_stderr(err_file), warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category in _PROCESS_DEFAULT_FILTERS:
                warnings.simplefilter(action, category)
            for spec in filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")):
                warnings._setoption(spec)  # exactly how the interpreter applies -W / PYTHONWARNINGS
            warnings.showwarning = _show_on_stderr  # not pytest's recorder
            yield
    finally:
        logging.root.removeHandler(handler)
        for f in (out_file, err_file):
            f.flush()
        os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0]), os.close(saved_fds[1])


def _show_on_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


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
        (its traceback in ``stderr``, as Python prints it). pytest's own exceptions (a timeout's
        ``Failed``, Ctrl-C) are not caught.
    """
    from ferrule.cli import main

    argv = ["ferrule", *[str(a) for a in args]]
    saved_argv = list(sys.argv)
    rc = 0
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out, \
            tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        with environment(env):
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = argv
            try:
                with _process_output(out, err):
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
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(argv, rc, out.read(), err.read())
