"""Replica benchmarks (issue 3): spatial efficiency, reset latency, read overhead, concurrency.

Run: ``.venv/bin/python -m pytest benchmarks/test_replicas.py --benchmark-only -q`` (add ``-m ""``
for the slow ones: 2048 rollouts and a >= 500 MB database). Ratios against the baselines are
measured side by side in the same test and stored in ``benchmark.extra_info``; the baselines are
plain code in this file, so nothing in ``birdenv`` can make them look better or worse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import random
import re
import shutil
import sqlite3
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import interleaved_medians, overlay_or_skip

from birdenv.replicas import ReplicaPool, Session
from birdenv.replicas.placement import disk_usage
from birdenv.replicas.session import run_statement
from birdenv.tasks import Task

# -- the shape of agentic GRPO -----------------------------------------------------------------
TASKS_PER_STEP = 64
ROLLOUTS_PER_TASK = 4
OPEN_PER_STEP = TASKS_PER_STEP * ROLLOUTS_PER_TASK  # 256 trajectories open at each step's peak
#: Default rollouts: two steps, enough to see slots reused; ``BIRDENV_BENCH_ROLLOUTS`` overrides.
DEFAULT_ROLLOUTS = int(os.environ.get("BIRDENV_BENCH_ROLLOUTS", "512"))
#: Materialise the baselines' full copies instead of counting them (slow: ~0.4 s per 165 MB copy).
PHYSICAL = os.environ.get("BIRDENV_BENCH_PHYSICAL", "") == "1"
_WAL_SUFFIXES = ("", "-journal", "-wal", "-shm")


def _tables(template: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{template}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    finally:
        conn.close()


def _named_tables(task: Task, tables: list[str]) -> list[str]:
    """The tables the issue SQL names (all of them when it names none)."""
    text = " ".join(task.issue_sql).lower()
    return [t for t in tables if re.search(rf'\b"?{re.escape(t.lower())}"?\b', text)] or tables


def script(task: Task, tables: list[str]) -> list[str]:
    """The scripted trajectory after preprocess: three exploratory SELECTs, the issue SQL, the gold SQL.

    The exploration looks at the table the issue SQL names first (what an agent would do).
    """
    table = _named_tables(task, tables)[0]
    return [
        "SELECT name, type FROM sqlite_master ORDER BY name",
        f'SELECT * FROM "{table}" LIMIT 5',
        f'SELECT COUNT(*) FROM "{table}"',
        *task.issue_sql,
        *task.sol_sql,
    ]


def schedule(tasks: list[Task], rollouts: int, rng: random.Random) -> list[list[Task]]:
    """Steps of 64 distinct tasks x 4 rollouts each (the trajectories open at each step's peak)."""
    if rollouts % OPEN_PER_STEP:
        raise ValueError(f"rollouts must be a multiple of {OPEN_PER_STEP}")
    return [
        [t for t in rng.sample(tasks, TASKS_PER_STEP) for _ in range(ROLLOUTS_PER_TASK)]
        for _ in range(rollouts // OPEN_PER_STEP)
    ]


def run_turns(trajectories: list[tuple[Callable[[str], Any], list[str]]], sample: Callable) -> int:
    """Run every trajectory turn by turn, interleaved (as a vector env steps), sampling disk use."""
    peak = sample()
    for turn in range(max(len(sqls) for _, sqls in trajectories)):
        for execute, sqls in trajectories:
            if turn < len(sqls):
                execute(sqls[turn])
        peak = max(peak, sample())
    return peak


def run_ours(
    pool: ReplicaPool, steps: list[list[Task]], tables: dict[str, list[str]], at_peak: dict
) -> int:
    """Every step on the pool; returns the peak bytes its root held (bases + session files) and
    leaves ``pool.stats()`` of that moment in ``at_peak``."""
    peak = 0

    def sample() -> int:
        stats = pool.stats()
        if stats["bytes_on_disk"] > at_peak.get("bytes_on_disk", -1):
            at_peak.clear()
            at_peak.update(stats)
        return stats["bytes_on_disk"]

    for step in steps:
        sessions: list[Session] = [
            pool.session(task, exclusive=True) for task in step
        ]  # as BirdCriticEnv leases them
        try:
            peak = max(
                peak,
                run_turns(
                    [
                        (s.execute, script(t, tables[t.db_id]))
                        for s, t in zip(sessions, step, strict=True)
                    ],
                    sample,
                ),
            )
        finally:
            for s in sessions:
                s.close()
    return peak


class ReferencePool:
    """The reference implementation's scheme, as plain code.

    A pool of full file copies per database, one slot per concurrent trajectory on it (so it grows
    to the peak concurrency), and every acquire re-copies the template over the slot with
    ``shutil.copyfile``; statements run like the official evaluator's (``run_statement``).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.slots: dict[str, list[Path]] = {}
        self.free: dict[str, list[Path]] = {}
        self.busy: set[Path] = set()
        self.copies = 0

    def acquire(self, task: Task) -> tuple[Path, sqlite3.Connection]:
        free = self.free.setdefault(task.db_id, [])
        if free:
            slot = free.pop()
        else:
            slot = self.root / f"{task.db_id}-{len(self.slots.setdefault(task.db_id, []))}.sqlite"
            self.slots[task.db_id].append(slot)
        for suffix in _WAL_SUFFIXES[1:]:
            Path(f"{slot}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(task.db_path, slot)
        slot.chmod(0o644)
        self.copies += 1
        self.busy.add(slot)
        conn = sqlite3.connect(slot, check_same_thread=False)
        for sql in task.preprocess_sql:
            run_statement(conn, sql)
        return slot, conn

    def release(self, task: Task, slot: Path, conn: sqlite3.Connection) -> None:
        conn.close()
        self.busy.discard(slot)
        self.free[task.db_id].append(slot)

    def files(self, slots: list[Path] | set[Path]) -> list[Path]:
        return [Path(f"{s}{suffix}") for s in slots for suffix in _WAL_SUFFIXES]

    def n_slots(self) -> int:
        return sum(len(v) for v in self.slots.values())


def _official(conn: sqlite3.Connection) -> Callable[[str], Any]:
    def execute(sql: str) -> Any:
        with contextlib.suppress(sqlite3.Error):
            return run_statement(conn, sql)
        return None

    return execute


def run_reference(
    ref: ReferencePool, steps: list[list[Task]], tables: dict[str, list[str]]
) -> tuple[int, int]:
    """Every step on the reference pool; returns (its peak bytes, peak of the copies in use).

    The copies in use at a step's peak are exactly what the one-full-copy-per-rollout scheme holds
    (a full copy plus its WAL per open trajectory), so both baselines come from one physical run.
    """
    peak_pool = peak_in_use = 0
    for step in steps:
        leases = [(task, *ref.acquire(task)) for task in step]
        try:
            run_turns(
                [(_official(conn), script(t, tables[t.db_id])) for t, _, conn in leases],
                lambda: 0,
            )
            peak_pool = max(
                peak_pool, disk_usage(ref.files([s for v in ref.slots.values() for s in v]))
            )
            peak_in_use = max(peak_in_use, disk_usage(ref.files(ref.busy)))
        finally:
            for task, slot, conn in leases:
                ref.release(task, slot, conn)
    return peak_pool, peak_in_use


def counted_baselines(steps: list[list[Task]], sizes: dict[str, int]) -> tuple[int, int, int]:
    """Both baselines' peak bytes and slot count from the measured size of each database.

    A full copy occupies the allocated blocks of its template (its WAL comes on top, so these
    figures favour the baselines). Returns (one copy per open trajectory at the worst step, the
    reference pool's slots at their peak, the reference pool's number of slots).
    """
    per_step = [Counter(t.db_id for t in step) for step in steps]
    per_rollout = max(sum(sizes[d] * n for d, n in c.items()) for c in per_step)
    slots = {d: max(c.get(d, 0) for c in per_step) for d in sizes}
    return per_rollout, sum(sizes[d] * n for d, n in slots.items()), sum(slots.values())


def _spatial(
    benchmark,
    tasks: list[Task],
    rollouts: int,
    rng: random.Random,
    tmp: Path,
    physical: bool,
    share_pages: bool = True,
) -> None:
    overlay_or_skip()
    steps = schedule(tasks, rollouts, rng)
    tables = {t.db_id: _tables(t.db_path) for t in tasks}
    sizes = {t.db_id: disk_usage([t.db_path]) for t in tasks}
    # Distinct bases the schedule touches: what a free overlay would still have to store.
    used = {t.db_id for step in steps for t in step}
    bases_bytes = sum(sizes[d] for d in used)

    pool = ReplicaPool(root=tmp / "ours", strategy="overlay", share_pages=share_pages)
    at_peak: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        peak = benchmark.pedantic(
            run_ours, args=(pool, steps, tables, at_peak), rounds=1, iterations=1
        )
        ours_seconds = time.perf_counter() - start
        stats = pool.stats()
        bases_materialised = len(pool.store.bases())
    finally:
        pool.close()

    per_rollout, reference, slots = counted_baselines(steps, {d: sizes[d] for d in used})
    info: dict[str, Any] = {}
    if physical:
        # Materialise the baselines for real: every acquire re-copies a full file.
        ref = ReferencePool(tmp / "reference")
        start = time.perf_counter()
        reference, per_rollout = run_reference(ref, steps, tables)
        info.update(
            baselines="physical",
            reference_seconds=time.perf_counter() - start,
            reference_full_copies_made=ref.copies,
        )
        slots = ref.n_slots()
        shutil.rmtree(ref.root, ignore_errors=True)
    else:
        info.update(baselines="counted", reference_full_copies_made=rollouts)

    # Numerator of both efficiency figures: one full copy per open trajectory, at the peak.
    baseline = per_rollout
    info.update(
        rollouts=rollouts,
        steps=len(steps),
        open_per_step=OPEN_PER_STEP,
        rollouts_per_db=dict(Counter(t.db_id for step in steps for t in step)),
        baseline_bytes=baseline,
        bases_bytes=bases_bytes,
        spatial_limit=baseline / bases_bytes,
        # ours
        peak_bytes=peak,
        session_bytes_at_peak=peak - bases_bytes,
        spatial_efficiency=baseline / peak,
        efficiency_over_limit=bases_bytes / peak,
        replica_reuse=rollouts / bases_materialised,
        full_replicas=bases_materialised,
        sessions_peak=stats["peak_sessions"],
        mean_reset_ms=stats["mean_reset_ms"],
        seconds=ours_seconds,
        share_pages=share_pages,
        # at the peak: distinct changed pages held, and what the sessions' changes would take
        # with one copy each
        pages_stored_bytes_at_peak=at_peak.get("pages_stored_bytes"),
        pages_mapped_bytes_at_peak=at_peak.get("pages_mapped_bytes"),
        # the reference scheme: its replicas are the slot files (each acquire re-copies one)
        reference_peak_bytes=reference,
        reference_spatial_efficiency=baseline / reference,
        reference_replica_reuse=rollouts / slots,
        reference_full_replicas=slots,
        # one full copy per rollout
        per_rollout_peak_bytes=per_rollout,
        per_rollout_spatial_efficiency=1.0,
        per_rollout_replica_reuse=1.0,
        per_rollout_full_replicas=rollouts,
    )
    info["goal_replica_reuse_met"] = info["replica_reuse"] >= 100
    info["goal_spatial_efficiency_met"] = info["efficiency_over_limit"] >= 0.8
    info["goal_spatial_efficiency_0_9_met"] = info["efficiency_over_limit"] >= 0.9
    benchmark.extra_info.update(info)


SHARE_PAGES = pytest.mark.parametrize(
    "share_pages", [True, False], ids=["shared-pages", "private-pages"]
)


@SHARE_PAGES
def test_spatial_efficiency(benchmark, all_tasks, rng, tmp_path, share_pages) -> None:
    """Agentic GRPO shape, default size (``BIRDENV_BENCH_ROLLOUTS``, 512): steps of 64 x 4."""
    _spatial(
        benchmark, all_tasks, DEFAULT_ROLLOUTS, rng, tmp_path, PHYSICAL, share_pages=share_pages
    )


@pytest.mark.slow
@SHARE_PAGES
def test_spatial_efficiency_2048(benchmark, all_tasks, rng, tmp_path, share_pages) -> None:
    """The full figure of the issue: 2048 rollouts (8 steps of 64 tasks x 4 rollouts)."""
    _spatial(benchmark, all_tasks, 2048, rng, tmp_path, PHYSICAL, share_pages=share_pages)


@pytest.mark.slow
def test_spatial_efficiency_physical_baselines(benchmark, all_tasks, rng, tmp_path) -> None:
    """The default size with both baselines materialised for real (full copies on disk)."""
    _spatial(benchmark, all_tasks, DEFAULT_ROLLOUTS, rng, tmp_path, physical=True)


# -- 1b. what sharing costs a written page --------------------------------------------------------
#: Write statements on hospital_records (4 KB pages): one row, and every 50th row of a table.
POINT_WRITES = [
    f"UPDATE lab_results SET value = value + 1 WHERE lab_id = {1 + 7919 * i % 53403}"
    for i in range(300)
]
BULK_WRITES = [
    f"UPDATE lab_results SET value = value + 1 WHERE lab_id % 50 = {i}" for i in range(30)
]


def test_page_write_cost(benchmark, db_paths, tmp_path) -> None:
    """The hashing cost per written page, and a write statement end to end (``Session.execute``:
    the evaluator's prelude, the statement, commit, checkpoint) with shared pages, as the first
    session to write the pages and as a sibling that finds them all stored, against private
    pages; the three timed in alternation, statement by statement."""
    overlay_or_skip()
    from birdenv.replicas.native import _overlay

    hash_us = {unit: 1e6 * _overlay._hash_cost(unit, 100_000) for unit in (1024, 4096, 65536)}
    template = db_paths["hospital_records"]
    with (
        ReplicaPool(root=tmp_path / "shared", strategy="overlay") as shared,
        ReplicaPool(root=tmp_path / "private", strategy="overlay", share_pages=False) as private,
    ):
        first = shared.open_base(shared.store.base_for(template), exclusive=True)
        sibling = shared.open_base(shared.store.base_for(template), exclusive=True)
        alone = private.open_base(private.store.base_for(template), exclusive=True)
        sessions = {"shared_first": first, "shared_sibling": sibling, "private": alone}
        times: dict[str, dict[str, list[float]]] = {}
        pages: dict[str, float] = {}
        for kind, statements in (("point", POINT_WRITES), ("bulk", BULK_WRITES)):
            times[kind] = {name: [] for name in sessions}
            written = shared.stats()["pages_written"]
            for sql in statements:
                for name, session in sessions.items():
                    start = time.perf_counter()
                    assert session.execute(sql).ok
                    times[kind][name].append(time.perf_counter() - start)
            # pages the two shared sessions wrote per statement, each
            pages[kind] = (shared.stats()["pages_written"] - written) / (2 * len(statements))
        stats = shared.stats()
        assert stats["pages_mapped_bytes"] == 2 * stats["pages_stored_bytes"]
        benchmark.pedantic(lambda: first.execute(POINT_WRITES[0]), rounds=20, iterations=1)
    info: dict[str, Any] = {f"hash_us_per_{unit}_page": us for unit, us in hash_us.items()}
    info["hash_gb_per_s_4096"] = 4096 / hash_us[4096] / 1e3
    for kind, by_name in times.items():
        med = {name: statistics.median(ts) for name, ts in by_name.items()}
        info[f"{kind}_pages_per_statement"] = pages[kind]
        for name, seconds in med.items():
            info[f"{kind}_{name}_ms"] = 1000 * seconds
        for name in ("shared_first", "shared_sibling"):
            info[f"{kind}_{name}_ratio"] = med[name] / med["private"]
            info[f"{kind}_{name}_us_per_page"] = (
                1e6 * (med[name] - med["private"]) / max(pages[kind], 1)
            )
    benchmark.extra_info.update(info)


# -- 1c. result sharing between sibling rollouts -------------------------------------------------
STAGE4_TASKS_PER_STEP = 8
STAGE4_STEPS = 4
STAGE4_TURNS = 5  # execute_sql turns per rollout (the reference stage 4 allows at most 5)
SCHEMA_QUERY = "SELECT type, name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name"


def rollout_turns(task: Task, tables: list[str], rng: random.Random) -> list[str]:
    """One rollout's ``execute_sql`` turns, drawn the way a sampling policy explores.

    Turn 1 is the schema listing with probability 0.8 (what the smoke run's rollouts open with),
    else a look at a table. Each later turn: with probability 0.35 the next statement of the issue
    SQL (reproduce the problem), 0.35 an exploration (5 or 10 rows, a count, or the columns of a
    table the issue names, or the schema again), 0.3 the next statement of the gold fix (which may
    write: then siblings' states part ways).
    """
    named = _named_tables(task, tables)
    explore = [SCHEMA_QUERY]
    for table in named[:3]:
        explore += [
            f'SELECT * FROM "{table}" LIMIT 5',
            f'SELECT * FROM "{table}" LIMIT 10',
            f'SELECT COUNT(*) FROM "{table}"',
            f'PRAGMA table_info("{table}")',
        ]
    issue, gold = list(task.issue_sql), list(task.sol_sql)
    turns = [SCHEMA_QUERY if rng.random() < 0.8 else rng.choice(explore[1:] or explore)]
    while len(turns) < STAGE4_TURNS:
        draw = rng.random()
        if draw < 0.35 and issue:
            turns.append(issue.pop(0))
        elif draw < 0.65 or not gold:
            turns.append(rng.choice(explore))
        else:
            turns.append(gold.pop(0))
    return turns


def _stage4(pool: ReplicaPool, plan: list[list[tuple[Task, list[str]]]]) -> dict[str, float]:
    """Every step's rollouts turn by turn (as a vector env steps them); SQL seconds and counts."""
    sql_seconds = calls = shared = 0
    for step in plan:
        sessions = [pool.session(task, exclusive=True) for task, _ in step]  # as the env leases
        try:
            for turn in range(STAGE4_TURNS):
                for session, (_, turns) in zip(sessions, step, strict=True):
                    result = session.execute(turns[turn])
                    sql_seconds += result.elapsed
                    calls += 1
                    shared += result.shared
        finally:
            for session in sessions:
                session.close()
    return {"sql_seconds": sql_seconds, "calls": calls, "shared": shared}


@pytest.mark.parametrize("group", [4, 16])
def test_result_sharing_stage4(benchmark, all_tasks, rng, tmp_path, group) -> None:
    """Stage-4 shape: steps of 8 tasks x G rollouts of 5 ``execute_sql`` turns (drawn by
    :func:`rollout_turns`, each rollout its own seed), run turn by turn on a pool that shares
    results and on one that does not; the same rollouts on both, steps alternating between them."""
    tables = {t.db_id: _tables(t.db_path) for t in all_tasks}
    plan = [
        [
            (task, rollout_turns(task, tables[task.db_id], random.Random(rng.random())))
            for task in rng.sample(all_tasks, STAGE4_TASKS_PER_STEP)
            for _ in range(group)
        ]
        for _ in range(STAGE4_STEPS)
    ]
    totals = {True: Counter(), False: Counter()}
    with (
        ReplicaPool(root=tmp_path / "shared") as on,
        ReplicaPool(root=tmp_path / "alone", share_results=False) as off,
    ):
        for step in plan:
            for share, pool in ((True, on), (False, off)):
                totals[share].update(_stage4(pool, [step]))
        stats = on.stats()
        benchmark.pedantic(_stage4, args=(on, plan[:1]), rounds=1, iterations=1)
    reads = stats["results_lookups"]
    benchmark.extra_info.update(
        group=group,
        rollouts=STAGE4_STEPS * STAGE4_TASKS_PER_STEP * group,
        execute_calls=totals[True]["calls"],
        shared_results=totals[True]["shared"],
        hit_rate=totals[True]["shared"] / totals[True]["calls"],
        hit_rate_of_lookups=stats["results_hits"] / reads if reads else 0.0,
        sql_seconds_shared=totals[True]["sql_seconds"],
        sql_seconds_unshared=totals[False]["sql_seconds"],
        sql_time_saved=1 - totals[True]["sql_seconds"] / totals[False]["sql_seconds"],
        sql_speedup=totals[False]["sql_seconds"] / totals[True]["sql_seconds"],
        cache_saved_seconds=stats["results_saved_seconds"],
        cache_bytes=stats["results_bytes"],
        cache_entries=stats["results_entries"],
    )


# -- 2. reset latency vs database size ---------------------------------------------------------
def _largest_table(path: Path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        return max(tables, key=lambda t: conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0])
    finally:
        conn.close()


@dataclasses.dataclass
class ResetTimes:
    """Per-cycle seconds of a read-only trajectory's reset, split the way the pool pays them."""

    release: list[float]  # close + delete the session's files (what pool.stats() calls a reset)
    lease: list[float]  # open a fresh session on the same base

    def median_ms(self) -> dict[str, float]:
        return {
            "release_ms": 1000 * statistics.median(self.release),
            "lease_ms": 1000 * statistics.median(self.lease),
            "recycle_ms": 1000
            * statistics.median(a + b for a, b in zip(self.release, self.lease, strict=True)),
        }


def reset_times(pool: ReplicaPool, template: Path, cycles: int) -> ResetTimes:
    """``cycles`` read-only trajectories on ``template``, timing each release and each new lease."""
    base = pool.store.base_for(template)
    read = f'SELECT * FROM "{_largest_table(template)}" LIMIT 20'
    times = ResetTimes([], [])
    session = pool.open_base(base)
    for _ in range(cycles):
        assert session.execute(read).ok
        start = time.perf_counter()
        session.close()
        mid = time.perf_counter()
        session = pool.open_base(base)
        end = time.perf_counter()
        times.release.append(mid - start)
        times.lease.append(end - mid)
    session.close()
    return times


@pytest.fixture(scope="session")
def big_db(tmp_path_factory) -> Path:
    """A generated database of >= 500 MB (one table of 4 KB rows plus an index)."""
    path = tmp_path_factory.mktemp("big") / "big_template.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("CREATE TABLE blobs (id INTEGER PRIMARY KEY, k INTEGER, payload BLOB)")
    conn.execute("BEGIN")
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 132000) "
        "INSERT INTO blobs SELECT i, i * 7919 % 132000, randomblob(4000) FROM n"
    )
    conn.execute("COMMIT")
    conn.execute("CREATE INDEX blobs_k ON blobs (k)")
    conn.close()
    assert path.stat().st_size >= 500 << 20
    return path


def _reset_benchmark(benchmark, strategy: str, small: Path, large: Path, tmp: Path) -> None:
    if strategy == "overlay":
        overlay_or_skip()
    # The copy strategy pays ~0.4 s per 165 MB per cycle; fewer cycles keep it bounded.
    cycles = 200 if strategy == "overlay" else max(5, int(40e6 / large.stat().st_size) + 5)
    with ReplicaPool(root=tmp / strategy, strategy=strategy) as pool:
        small_t = reset_times(pool, small, cycles).median_ms()
        large_t = reset_times(pool, large, cycles).median_ms()
        base = pool.store.base_for(large)
        read = f'SELECT * FROM "{_largest_table(large)}" LIMIT 20'
        holder = [pool.open_base(base)]

        def read_only_trajectory() -> None:
            assert holder[0].execute(read).ok

        def recycle() -> None:
            holder[0].close()
            holder[0] = pool.open_base(base)

        benchmark.pedantic(recycle, setup=read_only_trajectory, rounds=cycles, iterations=1)
        holder[0].close()
        stats = pool.stats()
    benchmark.extra_info.update(
        strategy=strategy,
        small_db=small.name,
        small_bytes=small.stat().st_size,
        large_db=large.name,
        large_bytes=large.stat().st_size,
        cycles=cycles,
        **{f"small_{k}": v for k, v in small_t.items()},
        **{f"large_{k}": v for k, v in large_t.items()},
        release_ratio=large_t["release_ms"] / small_t["release_ms"],
        recycle_ratio=large_t["recycle_ms"] / small_t["recycle_ms"],
        pool_mean_reset_ms=stats["mean_reset_ms"],
        goal_flat_met=large_t["release_ms"] <= 2 * small_t["release_ms"],
        goal_1ms_met=large_t["release_ms"] <= 1.0,
    )


@pytest.mark.parametrize("strategy", ["overlay", "copy"])
def test_reset_latency(benchmark, strategy, db_paths, tmp_path) -> None:
    """Smallest bundled database vs the largest (retail_orders, ~165 MB)."""
    by_size = sorted(db_paths.values(), key=lambda p: p.stat().st_size)
    _reset_benchmark(benchmark, strategy, by_size[0], by_size[-1], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["overlay", "copy"])
def test_reset_latency_500mb(benchmark, strategy, db_paths, big_db, tmp_path) -> None:
    """Smallest bundled database vs a generated >= 500 MB one."""
    small = min(db_paths.values(), key=lambda p: p.stat().st_size)
    _reset_benchmark(benchmark, strategy, small, big_db, tmp_path)


# -- 3. read overhead --------------------------------------------------------------------------
def query_mix(conn: sqlite3.Connection, keys: list[int]) -> None:
    """Scan, GROUP BY, point lookups, index lookups and a join on retail_orders."""
    conn.execute(
        "SELECT COUNT(*), SUM(total_amount) FROM orders WHERE payment_method = 'card'"
    ).fetchall()
    conn.execute(
        "SELECT status, COUNT(*), AVG(total_amount) FROM orders GROUP BY status"
    ).fetchall()
    for k in keys:
        conn.execute("SELECT * FROM customers WHERE customer_id = ?", (k,)).fetchall()
    for k in keys:
        conn.execute(
            "SELECT order_id, total_amount FROM orders WHERE customer_id = ?", (k,)
        ).fetchall()
    conn.execute(
        "SELECT c.state, COUNT(*), SUM(oi.quantity * oi.unit_price) FROM customers AS c "
        "JOIN orders AS o ON o.customer_id = c.customer_id "
        "JOIN order_items AS oi ON oi.order_id = o.order_id "
        "WHERE o.order_ts >= '2024-06-01' AND o.order_ts < '2024-07-01' GROUP BY c.state"
    ).fetchall()


def _dirty(execute: Callable[[str], Any], chunk: int) -> None:
    """Change ``chunk`` in 1000 rows of order_items and of orders.

    The values must really change: SQLite skips writing a cell whose bytes are identical, so
    ``SET x = x`` would leave the overlay empty.
    """
    execute(
        f"UPDATE order_items SET unit_price = unit_price + 0.01 WHERE order_item_id % 1000 < {chunk}"
    )
    execute(f"UPDATE orders SET shipping_fee = shipping_fee + 0.01 WHERE order_id % 1000 < {chunk}")


@pytest.mark.parametrize("dirty_mb", [0, 50])
def test_read_overhead(benchmark, dirty_mb, db_paths, private_copy, tmp_path) -> None:
    """The mix on an overlay session vs on a private copy of the same state (goal <= 1.15x)."""
    overlay_or_skip()
    template = db_paths["retail_orders"]
    keys = random.Random(7).sample(range(1, 150_001), 200)
    with ReplicaPool(root=tmp_path / "ours", strategy="overlay") as pool:
        session = pool.open_base(pool.store.base_for(template))
        copy = private_copy(template)
        dirty_bytes = 0
        if dirty_mb:
            # Grow the overlay step by step until its private file holds >= dirty_mb, applying
            # the same statements to the copy so both hold the same state.
            for chunk in (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000):
                _dirty(lambda s: run_statement(session.conn, s), chunk)
                _dirty(lambda s: run_statement(copy, s), chunk)
                run_statement(session.conn, "PRAGMA wal_checkpoint(TRUNCATE)")
                # with shared pages the session's changed pages are in the pool's page store
                dirty_bytes = pool.stats().get("pages_mapped_bytes") or disk_usage(
                    [p for p in session.path.parent.glob(f"{session.path.name}*")]
                )
                if dirty_bytes >= dirty_mb << 20:
                    break
            run_statement(copy, "PRAGMA wal_checkpoint(TRUNCATE)")
        medians = interleaved_medians(
            {
                "overlay": lambda: query_mix(session.conn, keys),
                "copy": lambda: query_mix(copy, keys),
            },
            rounds=7,
        )
        benchmark.pedantic(query_mix, args=(session.conn, keys), rounds=5, iterations=1)
        session.close()
    ratio = medians["overlay"] / medians["copy"]
    benchmark.extra_info.update(
        dirty_mb_target=dirty_mb,
        session_private_bytes=dirty_bytes,
        overlay_ms=1000 * medians["overlay"],
        copy_ms=1000 * medians["copy"],
        ratio=ratio,
        goal_met=ratio <= 1.15,
    )


# -- 4. concurrency ----------------------------------------------------------------------------
def _concurrency_worker(
    root: str, strategy: str, task: Task, n_sessions: int, rounds: int, barrier, out
) -> None:
    """One process: ``n_sessions`` sessions, then ``rounds`` of read, read, write, write on each."""
    table = _largest_table(task.db_path)
    rng = random.Random(os.getpid())
    with ReplicaPool(root=root, strategy=strategy) as pool:
        start = time.perf_counter()
        sessions = [pool.session(task) for _ in range(n_sessions)]
        n_rows = sessions[0].execute(f'SELECT MAX(rowid) FROM "{table}"').rows[0][0]
        for s in sessions:
            assert s.execute("CREATE TABLE bench_log (id INTEGER PRIMARY KEY, note TEXT)").ok
        setup = time.perf_counter() - start
        barrier.wait()
        start = time.perf_counter()
        ops = errors = 0
        for r in range(rounds):
            for i, s in enumerate(sessions):
                k = rng.randrange(1, n_rows)
                for sql in (
                    f'SELECT * FROM "{table}" WHERE rowid = {k}',
                    f'SELECT COUNT(*) FROM "{table}" WHERE rowid BETWEEN {k} AND {k + 500}',
                    f"INSERT INTO bench_log (note) VALUES ('round {r} session {i}')",
                    f'UPDATE "{table}" SET rowid = rowid WHERE rowid = {k}',
                ):
                    errors += not s.execute(sql).ok
                    ops += 1
        work = time.perf_counter() - start
        # Isolation check: every session sees only its own log rows.
        for s in sessions:
            assert s.execute("SELECT COUNT(*) FROM bench_log").rows[0][0] == rounds
        peak_bytes = pool.stats()["bytes_on_disk"]
        for s in sessions:
            s.close()
    out.put((setup, work, ops, errors, peak_bytes))


def run_concurrency(
    root: Path, strategy: str, task: Task, processes: int, per_process: int, rounds: int
) -> dict[str, float]:
    """Start the worker processes together; throughput over the slowest worker's time."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(
            target=_concurrency_worker,
            args=(str(root), strategy, task, per_process, rounds, barrier, out),
        )
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    setup = max(r[0] for r in results)
    work = max(r[1] for r in results)
    ops = sum(r[2] for r in results)
    return {
        "setup_s": setup,
        "work_s": work,
        "ops": ops,
        "errors": sum(r[3] for r in results),
        "ops_per_s": ops / work,
        "ops_per_s_with_setup": ops / (setup + work),
        "bytes_on_disk_per_process": max(r[4] for r in results),
    }


@pytest.mark.parametrize(
    "db_id", ["hospital_records", pytest.param("retail_orders", marks=pytest.mark.slow)]
)
def test_concurrency(benchmark, db_id, all_tasks, tmp_path) -> None:
    """64 sessions across 4 processes, interleaved reads and writes: overlay vs copy."""
    overlay_or_skip()
    task = next(t for t in all_tasks if t.db_id == db_id and not t.preprocess_sql)
    shape = {"processes": 4, "per_process": 16, "rounds": 20}
    copy = run_concurrency(tmp_path / "copy", "copy", task, **shape)
    ours = benchmark.pedantic(
        run_concurrency,
        args=(tmp_path / "overlay", "overlay", task),
        kwargs=shape,
        rounds=1,
        iterations=1,
    )
    benchmark.extra_info.update(
        db_id=db_id,
        **shape,
        **{f"overlay_{k}": v for k, v in ours.items()},
        **{f"copy_{k}": v for k, v in copy.items()},
        throughput_ratio=ours["ops_per_s"] / copy["ops_per_s"],
        throughput_ratio_with_setup=ours["ops_per_s_with_setup"] / copy["ops_per_s_with_setup"],
    )
