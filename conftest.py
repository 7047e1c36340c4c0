"""Settings for every pytest run in this repository: tests, doctests and benchmarks.

Nothing a run writes may land in the user's caches (``~/.cache/birdenv``, the Hugging Face
caches). Before anything is imported, every cache left to its default points into one directory
under the system's temporary directory, per user, kept between runs so that the bundled databases
are built once (under a file lock: concurrent runs share them safely). A cache named in the
environment (``BIRDENV_HOME=...``) is the caller's choice and is kept. Worker processes and
command-line tests inherit these variables.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

_HOME = Path(tempfile.gettempdir()) / f"birdenv-tests-{os.getuid()}"
os.environ.setdefault("BIRDENV_HOME", str(_HOME))
os.environ.setdefault("HF_HOME", str(_HOME / "huggingface"))
os.environ.setdefault("XDG_CACHE_HOME", str(_HOME / "cache"))

# Hypothesis' defaults judge a test by the machine's speed: a 200 ms deadline per example, and a
# health check failing a strategy that generates slowly. On a shared, loaded machine both fail
# tests whose behaviour is right. Two profiles, chosen by HYPOTHESIS_PROFILE (make test and CI set
# `ci`; inherited by every process a test starts) or pytest's --hypothesis-profile:
# - ci: no deadline, no too_slow check, and the same examples every run (derandomize), so a
#   failure seen there is seen again by the same command; the failing example is printed with
#   the @reproduce_failure blob.
# - dev (the default): no deadline either (a deadline is a wall-clock guess), but fresh examples
#   each run, remembered in Hypothesis' example database, and the health checks kept, so that a
#   strategy written too slow is noticed while it is written.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The adapters of other RL frameworks import them at module level; where a framework is not
# installed (the main .venv: verl pins transformers below the training stack's), its module is not
# collected for doctests. The .venv-adapters lane of `make test` has them all.
collect_ignore = [
    f"birdenv/integrations/{name}.py"
    for name, module in (("verl", "verl"), ("openenv", "openenv"), ("skyrl", "skyrl_gym"))
    if importlib.util.find_spec(module) is None
]


# -- Long modules first -------------------------------------------------------------------------
# make test runs each lane's modules on two workers, a module whole on one (--dist loadscope), in
# collection order (--no-loadscope-reorder). pytest-xdist's own order, by number of tests, put the
# long modules of a few tests (a curriculum, a learning run) last, and a lane ended with one worker
# on them while the other sat idle. The modules marked ``long`` go first, in file order; the short
# ones fill in behind them.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the modules marked ``long`` ahead of the others, each module's order kept."""
    long_modules = {item.path for item in items if item.get_closest_marker("long") is not None}
    items.sort(key=lambda item: item.path not in long_modules)


# -- CPU time by test: what a test costs, whatever the load beside it ---------------------------
# pytest's --durations are wall times, which a loaded machine inflates by turns. The CPU time of a
# test's process and of the processes it waited for is the same on a busy machine as on an idle
# one (a process it leaves to others, such as a server's, is not counted).
_CPU_AT = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that were waited for, in seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="show the N test phases (setup, call, teardown) that took the most CPU time",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[object]:
    item.stash[_CPU_AT] = _cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[pytest.TestReport]:
    """Each phase's report carries the CPU time it took in ``user_properties``, which
    pytest-xdist sends from its workers."""
    report = yield
    now = _cpu_seconds()
    if _CPU_AT in item.stash:
        report.user_properties.append(("cpu_s", now - item.stash[_CPU_AT]))
    item.stash[_CPU_AT] = now
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    count = config.getoption("--cpu-durations")
    if not count:
        return
    phases = [
        (dict(report.user_properties)["cpu_s"], report.when, report.nodeid)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and "cpu_s" in dict(report.user_properties)
    ]
    terminalreporter.write_sep("=", f"most CPU time: {count} test phases")
    for seconds, when, nodeid in sorted(phases, reverse=True)[:count]:
        terminalreporter.write_line(f"{seconds:8.1f} CPU-s {when:<8} {nodeid}")
    total = sum(seconds for seconds, _, _ in phases)
    terminalreporter.write_line(f"{total:8.1f} CPU-s in all {len(phases)} test phases")
