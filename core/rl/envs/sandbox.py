"""A sandboxed Python tool: run model-written code in a fresh interpreter with time and memory limits.

The code runs in ``python -I -S`` (isolated: no user site, no environment-variable configuration)
in a temporary working folder, with:

- ``RLIMIT_AS`` = ``memory_mb`` MiB of address space and ``RLIMIT_CPU`` = ``ceil(timeout_s)`` CPU
  seconds (POSIX ``setrlimit`` in the child before ``exec``); the parent kills the child after
  ``timeout_s`` seconds of wall time;
- no network: the child replaces ``socket.socket``, ``socket.create_connection`` and
  ``socket.getaddrinfo`` with functions that raise before the code runs. This is a guard against
  accidents, not a security boundary against hostile code (that needs a network namespace or a
  container); run untrusted policies' code in such a sandbox.
- an empty environment (``PATH`` only) and ``RLIMIT_NPROC`` unchanged.

The tool's answer is the child's stdout (cut to ``max_output_chars``), or one line naming the
limit it hit / the exception it raised: an observation for the model, never an exception here.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

from ferrule import envs

__all__ = ["run_python"]

_PRELUDE = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the ferrule python tool")
_s.socket = _s.create_connection = _s.getaddrinfo = _no_network
del _s, _no_network
"""


def _limits(memory_mb: int, cpu_s: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    return apply


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000) -> str:
    """Run ``code`` in a sandboxed interpreter and return what the model sees.

    Args:
        code: Python source (the model's tool argument).
        timeout_s: wall-clock limit in seconds (also the CPU-time limit, rounded up).
        memory_mb: address-space limit in MiB.
        max_output_chars: stdout/stderr kept (characters).

    Returns:
        stdout (stripped), ``"error: ..."`` with the last line of the traceback, or
        ``"error: timed out after N s"`` / ``"error: memory limit (N MiB) exceeded"``.
    """
    if not isinstance(code, str) or not code.strip():
        return "error: no code given; pass {\"code\": \"print(...)\"}"
    import math

    with tempfile.TemporaryDirectory(prefix="ferrule-pytool-") as cwd:
        try:
            proc = subprocess.run([sys.executable, "-I", "-S", "-c", _PRELUDE + code], cwd=cwd,
                                  env=envs.bare_child_env(), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout_s,
                                  preexec_fn=_limits(memory_mb, max(1, math.ceil(timeout_s))))
        except subprocess.TimeoutExpired:
            return f"error: timed out after {timeout_s:g} s"
    out, err = proc.stdout.strip(), proc.stderr.strip()
    if proc.returncode == 0:
        return out[:max_output_chars] if out else "(no output; print the result)"
    last = err.splitlines()[-1] if err else f"exit status {proc.returncode}"
    if "MemoryError" in last:
        return f"error: memory limit ({memory_mb} MiB) exceeded"
    if proc.returncode < 0:
        return f"error: killed by signal {-proc.returncode} (time or memory limit)"
    return f"error: {last[:max_output_chars]}"
