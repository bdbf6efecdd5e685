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

It also says what the 2-rank pools (tests/dist_pool.py) cost, per worker: their starts (the test that paid each,
and its seconds), the failed jobs they recovered from, each kill with its reason, and the most OS threads a
rank had after a job's reset (and that job's test: a leak of process groups shows there first); a start is two
interpreters, ~25 s on the CI machine.

Figures are approximate: a descendant that ends between two readings without being reaped by the
worker loses its last slice, and CPU that the pool ranks spend after a job (their reset) is counted to
the next test of that worker.
"""

from __future__ import annotations

import os
import resource
import sys
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
    pool = sys.modules.get("dist_pool")  # pool ranks killed rather than reaped (tests/dist_pool.py)
    return total + getattr(pool, "RETIRED_CPU_S", 0.0)


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


def _pool_events() -> dict | None:
    """This process's 2-rank pool events (tests/dist_pool.py ``EVENTS``), None if it had no pool."""
    pool = sys.modules.get("dist_pool")
    events = getattr(pool, "EVENTS", None)
    return events if events and any(events.values()) else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand its pool events to the controller (``workeroutput``)."""
    config = session.config
    if config.getoption("cpu_report") and hasattr(config, "workeroutput"):
        events = _pool_events()
        if events:
            import json

            config.workeroutput["ferrule_dist_pool"] = json.dumps(events)


def _pool_lines(worker: str, events: dict) -> list[str]:
    starts = events["starts"]
    lines = [f"2-rank pool, {worker}: {len(starts)} start(s), {sum(s for _, s in starts):.0f} s; "
             f"{len(events['recoveries'])} failed job(s) recovered; {len(events['kills'])} kill(s)"]
    lines += [f"    start {secs:5.1f} s  {test}" for test, secs in starts]
    lines += [f"    kill: {reason}  {test}" for reason, test in events["kills"]]
    if events.get("peak_threads"):
        threads, test = events["peak_threads"]
        lines.append(f"    most threads in a rank after a job: {threads}  {test}")
    return lines


class _Collector:
    def __init__(self, top: int) -> None:
        self.top = top
        self.pools: dict[str, dict] = {}
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.machine_start = _machine_busy()
        self.t0 = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.wall[report.nodeid] = self.wall.get(report.nodeid, 0.0) + report.duration
        for key, value in report.user_properties:
            if key == "cpu_s":
                self.cpu[report.nodeid] = float(value)

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's
    def pytest_testnodedown(self, node, error) -> None:
        import json

        data = getattr(node, "workeroutput", {}).get("ferrule_dist_pool")
        if data:
            self.pools[node.workerinput.get("workerid", "?")] = json.loads(data)

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
        own = _pool_events()  # a run without xdist: this process's pool
        for worker, events in sorted({**({"this process": own} if own else {}), **self.pools}.items()):
            for line in _pool_lines(worker, events):
                tr.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    top = config.getoption("cpu_report")
    if top and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) reports
        config.pluginmanager.register(_Collector(top), "ferrule_cpu_report")
