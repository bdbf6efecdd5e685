"""Where the suite's CPU goes: per-test CPU seconds beside ``--durations``' wall seconds.

Wall time on a shared 2-core machine says as much about the neighbours as about a test; CPU time does
not. With ``--cpu-report=N`` (``.ci/run`` passes 30) each test's CPU seconds are measured in its worker,
setup to teardown: the worker's own (``time.process_time``), its reaped children's
(``getrusage(RUSAGE_CHILDREN)``: a spawned CLI, a ``torchrun``) and its live descendants' (psutil: the
2-rank pool's ranks, a server's threads). The terminal summary lists the N tests with the most CPU,
the sum over every test, and how busy the whole machine was over the run (``/proc/stat``: the share of
its cores that did work, from any process), which says whether more workers could help: a suite whose
tests keep the cores busy gains nothing from a third worker; one that waits (sleeps, timeouts,
interpreters blocked on each other) does.

Figures are approximate: a descendant that ends between two readings without being reaped by the
worker loses its last slice, and CPU that the pool ranks spend after a job (their reset) is counted to
the next test of that worker.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_START = "_ferrule_cpu_start"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", type=int, default=0, metavar="N",
                     help="list the N tests that used the most CPU seconds (worker, children, pool ranks), "
                          "the total, and how busy the machine's cores were over the run (tests/cpu_report.py)")


def _process_tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (with theirs)."""
    import psutil

    own = time.process_time()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own + reaped.ru_utime + reaped.ru_stime
    try:
        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += t.user + t.system + t.children_user + t.children_system
    except psutil.Error:
        pass
    return total


def _machine_busy() -> tuple[float, float]:
    """``(busy, total)`` jiffies of every core since boot (``/proc/stat``'s first line); ``(0, 0)`` elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("cpu_report"):
        setattr(item, _START, _process_tree_cpu())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    start = getattr(item, _START, None)
    if call.when == "teardown" and start is not None:
        outcome.get_result().user_properties.append(("cpu_s", round(_process_tree_cpu() - start, 2)))


class _Collector:
    def __init__(self, top: int) -> None:
        self.top = top
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.machine_start = _machine_busy()
        self.t0 = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.wall[report.nodeid] = self.wall.get(report.nodeid, 0.0) + report.duration
        for key, value in report.user_properties:
            if key == "cpu_s":
                self.cpu[report.nodeid] = float(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        tr.write_sep("=", f"most CPU: {self.top} tests (tests/cpu_report.py)")
        for nodeid, cpu in sorted(self.cpu.items(), key=lambda kv: -kv[1])[: self.top]:
            tr.write_line(f"{cpu:8.1f} s CPU {self.wall.get(nodeid, 0.0):8.1f} s wall  {nodeid}")
        busy0, total0 = self.machine_start
        busy1, total1 = _machine_busy()
        cores = os.cpu_count() or 1
        elapsed = time.monotonic() - self.t0
        share = (busy1 - busy0) / (total1 - total0) if total1 > total0 else float("nan")
        tr.write_line(f"tests' CPU, summed: {sum(self.cpu.values()):.0f} s over {len(self.cpu)} tests; "
                      f"their wall, summed: {sum(self.wall.values()):.0f} s; run: {elapsed:.0f} s on {cores} cores, "
                      f"machine busy {share:.0%} of its cores (every process)")


def pytest_configure(config: pytest.Config) -> None:
    top = config.getoption("cpu_report")
    if top and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) reports
        config.pluginmanager.register(_Collector(top), "ferrule_cpu_report")
