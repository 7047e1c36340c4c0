"""Shared fixtures and helpers of the benchmarks (``make bench``; never part of ``make test``).

The bundled suites are built on first use into ``$BIRDENV_HOME`` (when it is unset, the root
``conftest.py`` points it into the temporary directory, never a user's cache). Every benchmark leases sessions from its
own pool root under pytest's ``tmp_path``, so byte counts see only that benchmark's files.
"""

from __future__ import annotations

import random
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The Ray benchmarks run in a private network namespace, as the Ray tests do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from private_network import (  # noqa: F401
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)

from birdenv.replicas import overlay
from birdenv.tasks import Task, load_tasks

#: The strategies a benchmark compares: ours (the copy-on-write overlay) and the copy fallback.
STRATEGIES = ("overlay", "copy")


def overlay_or_skip() -> None:
    """Skip a benchmark that needs the overlay where it cannot register (figures would be wrong)."""
    if not overlay.available():
        pytest.skip(f"overlay unavailable: {overlay.unavailable_reason()}")


@pytest.fixture(scope="session")
def all_tasks() -> list[Task]:
    """Every task of the bundled suites (gym-mini + critic-mini), databases built."""
    return load_tasks("gym-mini") + load_tasks("critic-mini")


@pytest.fixture(scope="session")
def db_paths(all_tasks: list[Task]) -> dict[str, Path]:
    """Every bundled database template by ``db_id``, including those without tasks."""
    db_dir = all_tasks[0].db_dir
    assert db_dir is not None
    return {p.name: p / f"{p.name}_template.sqlite" for p in sorted(db_dir.iterdir()) if p.is_dir()}


@pytest.fixture
def rng() -> random.Random:
    """A fixed seed: every run draws the same tasks in the same order."""
    return random.Random(20240521)


@pytest.fixture
def private_copy(tmp_path: Path) -> Iterator[Callable[[Path], sqlite3.Connection]]:
    """Make a private full copy of a database and open it the way the official evaluator does."""
    import shutil

    conns: list[sqlite3.Connection] = []

    def make(template: Path) -> sqlite3.Connection:
        path = tmp_path / f"private-{len(conns)}-{template.name}"
        shutil.copyfile(template, path)
        path.chmod(0o644)
        conn = sqlite3.connect(path, check_same_thread=False)
        conns.append(conn)
        return conn

    yield make
    for conn in conns:
        conn.close()


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of each function, timed in alternation so drift hits all of them alike.

    ``clock=time.thread_time`` counts only the CPU time of the calling thread: on a machine shared
    with other jobs, the time a call spends waiting for a core is then not counted as its own.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
