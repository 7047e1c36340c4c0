"""Soak: many trajectories through a 32-worker async vector env, nothing leaks, nobody escapes.

A scripted policy plays every episode: a read of the task's data, DDL that creates a table under a
name every trajectory shares, a write of a marker unique to the trajectory, one hostile statement
drawn from the committed catalogue (fast cases only), an isolation check (the table holds exactly
this trajectory's two markers and nobody else's), then a submission of the task's issue SQL that
the judge scores. Recorded: trajectories/s, p50/p99 latency of one vector step, and open fds,
resident memory (workers plus this process) and the pool root's disk at start and end, plus the
same figures every ``SOAK_EVERY`` trajectories (a leak grows with the count; warm-up does not).

The default mix drops two costs that measure task content rather than the environment
(:func:`test_soak_profile`, 256 trajectories in one process: the issue SQL as the opening read took
about 40 % of the time, and one task, ``movie_platform_022``, whose issue SQL deletes most of a
100k-row table, 38-60 %; in a lock-step vector env every other worker waits for it). The read is
a cheap ``SELECT`` of the task's first table instead, and that task is left out; the mix still
reads, writes, does DDL and hostile statements, and every trajectory is judged. ``SOAK_HEAVY=1``
restores both.

Parameters (environment): ``SOAK_TRAJECTORIES`` (default 20000), ``SOAK_WORKERS`` (default 32),
``SOAK_SEED``, ``SOAK_EVERY`` (default 1000), ``SOAK_HEAVY``, ``SOAK_REPORT`` (a JSON file).
Marked slow: ``SOAK_TRAJECTORIES=1000 pytest benchmarks/test_soak.py -m slow -s``.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import statistics
import time
from contextlib import closing
from pathlib import Path

import gymnasium
import numpy as np
import pytest

import birdenv  # noqa: F401 - registers the environments
from birdenv.replicas.placement import default_sessions_dir
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec

CATALOGUE = Path(__file__).parent.parent / "tests" / "fixtures" / "hostile" / "catalogue.jsonl"
# Hostile statements cheap enough to run thousands of times and that leave the soak table alone.
SOAK_CATEGORIES = ("file_access", "state_escape", "encoding")
_SPARE = ("drop-table", "query-only", "foreign-keys-cascade", "temp-table-shadow")
SMALL_DBS = ("hospital_records", "school_district", "movie_platform")
# Issue SQL that rewrites most of a large table: ~1.1 s per trajectory on an idle core.
HEAVY_TASKS = ("movie_platform_022",)


def _hostile() -> list[str]:
    rows = [json.loads(line) for line in CATALOGUE.read_text(encoding="utf-8").splitlines()]
    return [
        r["sql"]
        for r in rows
        if r["category"] in SOAK_CATEGORIES
        and "sql" in r
        and not r.get("setup")
        and r["id"] not in _SPARE
    ]


def _tree_stats(pids: list[int]) -> tuple[int, int]:
    """(open fds, resident bytes) summed over ``pids``."""
    fds = rss = 0
    for pid in pids:
        try:
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
        except FileNotFoundError:
            continue
    return fds, rss


def _first_table(db_path: Path) -> str:
    """The first table of a task's database, for the opening read."""
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name LIMIT 1"
        ).fetchone()
    return row[0]


def _disk(root: Path) -> int:
    """Allocated bytes of the sessions' files (bases are materialised once, on first use)."""
    folders = (default_sessions_dir(root), root / "sessions")  # memory, and the disk fallback
    return sum(p.stat().st_blocks * 512 for f in folders for p in f.rglob("*") if p.is_file())


PHASES = ("read", "ddl", "write", "hostile", "isolation check", "submit")


def _turn(
    task: Task | None,
    phase: int,
    marker: str,
    heavy: bool,
    first_table: dict[str, str],
    hostile: list[str],
    rng: random.Random,
) -> str:
    """The scripted policy's turn ``phase`` (see :data:`PHASES`) of a trajectory on ``task``."""
    if phase == 0:
        if heavy or task is None:
            return format_tool_call("execute_sql", sql=task.issue_sql[0] if task else "SELECT 1")
        return format_tool_call(
            "execute_sql", sql=f'SELECT * FROM "{first_table[task.db_id]}" LIMIT 5'
        )
    if phase == 1:
        return format_tool_call("execute_sql", sql=f"CREATE TABLE soak_t AS SELECT '{marker}' AS m")
    if phase == 2:
        return format_tool_call("execute_sql", sql=f"INSERT INTO soak_t VALUES ('{marker}')")
    if phase == 3:
        return format_tool_call("execute_sql", sql=rng.choice(hostile))
    if phase == 4:
        return format_tool_call(
            "execute_sql", sql=f"SELECT count(*), sum(m <> '{marker}') FROM main.soak_t"
        )
    return format_tool_call("submit_solution", sql_list=list(task.issue_sql) if task else [])


def _soak_tasks(heavy: bool) -> list[Task]:
    return [
        t
        for t in load_tasks("critic-mini")
        if t.db_id in SMALL_DBS and (heavy or t.instance_id not in HEAVY_TASKS)
    ]


@pytest.mark.slow
def test_soak_profile(tmp_path: Path) -> None:
    """Where a trajectory's time goes: the soak's policy in one env in this process, timed per
    turn kind and per task (``SOAK_PROFILE_TRAJECTORIES``, default 256; ``SOAK_HEAVY``)::

        SOAK_HEAVY=1 pytest benchmarks/test_soak.py::test_soak_profile -m slow -s
    """
    total = int(os.environ.get("SOAK_PROFILE_TRAJECTORIES", "256"))
    heavy = os.environ.get("SOAK_HEAVY", "") not in ("", "0")
    tasks = _soak_tasks(heavy)
    by_id = {t.instance_id: t for t in tasks}
    first_table = {t.db_id: _first_table(t.db_path) for t in tasks}
    hostile, rng = _hostile(), random.Random(0)
    env = gymnasium.make(
        "BirdCritic-SQLite-v0",
        tasks=tasks,
        pool_options={"root": str(tmp_path / "replicas")},
        statement_timeout=2.0,
        max_episode_steps=8,
    )
    by_phase: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    by_task: dict[str, list[float]] = {}
    submitted = 0
    started = time.perf_counter()
    for episode in range(total):
        t0 = time.perf_counter()
        _obs, info = env.reset(seed=episode)
        by_phase["reset"] = by_phase.get("reset", 0.0) + time.perf_counter() - t0
        task = by_id[info["task_id"]]
        spent = 0.0
        for phase, name in enumerate(PHASES):
            t0 = time.perf_counter()
            turn = _turn(task, phase, f"p{episode}", heavy, first_table, hostile, rng)
            _obs, _reward, terminated, truncated, _info = env.step(turn)
            dt = time.perf_counter() - t0
            by_phase[name] += dt
            spent += dt
            if terminated or truncated:
                submitted += name == "submit"
                break
        by_task.setdefault(task.instance_id, []).append(spent)
    elapsed = time.perf_counter() - started
    env.close()
    print(f"\nSOAK-PROFILE {total} trajectories, one process: {total / elapsed:.2f}/s")
    for name, seconds in by_phase.items():
        print(f"  {name:16s} {seconds:7.1f} s {100 * seconds / elapsed:5.1f} %")
    costly = sorted(by_task.items(), key=lambda kv: -sum(kv[1]))[:8]
    for task_id, spent_list in costly:
        share = 100 * sum(spent_list) / elapsed
        mean_ms = 1000 * sum(spent_list) / len(spent_list)
        print(f"  {task_id:24s} n={len(spent_list):3d} mean {mean_ms:7.1f} ms, {share:4.1f} %")
    assert submitted == total


@pytest.mark.slow
def test_soak(tmp_path: Path) -> None:
    total = int(os.environ.get("SOAK_TRAJECTORIES", "20000"))
    workers = int(os.environ.get("SOAK_WORKERS", "32"))
    rng = random.Random(int(os.environ.get("SOAK_SEED", "0")))
    every = int(os.environ.get("SOAK_EVERY", "1000"))
    heavy = os.environ.get("SOAK_HEAVY", "") not in ("", "0")
    tasks = _soak_tasks(heavy)
    first_table = {t.db_id: _first_table(t.db_path) for t in tasks}
    by_id = {t.instance_id: t for t in tasks}
    hostile = _hostile()
    root = tmp_path / "replicas"
    envs = make_vec(
        workers,
        tasks=tasks,
        pool_options={"root": str(root)},
        statement_timeout=2.0,
        seed=0,
        max_episode_steps=8,
    )
    pids = [os.getpid()] + [p.pid for p in envs.processes]
    phase = [0] * workers
    marker = [""] * workers
    counter = 0
    done_trajectories = violations = 0
    latencies: list[float] = []
    autoreset = np.zeros(workers, dtype=bool)
    # A first round warms every worker (pools, bases, imports) before the start figures.
    start_stats = None
    started = time.perf_counter()
    obs, infos = envs.reset(seed=0)
    current = list(infos["task_id"])

    def action(i: int) -> str:
        nonlocal counter
        if phase[i] == 0:
            counter += 1
            marker[i] = f"w{i}-t{counter}"
        return _turn(by_id.get(current[i]), phase[i], marker[i], heavy, first_table, hostile, rng)

    checkpoints: list[dict] = []
    next_report = every
    while done_trajectories < total:
        if start_stats is None and done_trajectories >= workers:
            start_stats = (*_tree_stats(pids), _disk(root), done_trajectories, time.perf_counter())
        if done_trajectories >= next_report:
            next_report += every
            fds, rss = _tree_stats(pids)
            point = {
                "trajectories": done_trajectories,
                "seconds": round(time.perf_counter() - started, 1),
                "fds": fds,
                "rss_mb": round(rss / 2**20),
                "sessions_disk_mb": round(_disk(root) / 2**20, 1),
                "violations": violations,
            }
            checkpoints.append(point)
            print("SOAK-PROGRESS " + json.dumps(point), flush=True)
        actions = [action(i) if not autoreset[i] else "" for i in range(workers)]
        t0 = time.perf_counter()
        obs, _rewards, terminated, truncated, infos = envs.step(actions)
        latencies.append(time.perf_counter() - t0)
        for i in range(workers):
            if autoreset[i]:  # this step started a new episode; its obs is the new prompt
                phase[i] = 0
                current[i] = infos["task_id"][i]
                continue
            if phase[i] == 4 and "| 2 | 0 |" not in obs[i]:
                violations += 1
                print(f"isolation check failed in worker {i} ({marker[i]}): {obs[i][:300]}")
            phase[i] += 1
            if terminated[i] or truncated[i]:
                done_trajectories += 1
        autoreset = terminated | truncated
    elapsed = time.perf_counter() - started
    end = (*_tree_stats(pids), _disk(root))
    envs.close()
    assert start_stats is not None
    fds0, rss0, disk0, done0, t_start = start_stats
    measured = done_trajectories - done0
    rate = measured / (time.perf_counter() - t_start)
    report = {
        "trajectories": done_trajectories,
        "workers": workers,
        "seconds": round(elapsed, 1),
        "trajectories_per_s": round(rate, 2),
        "vector_step_p50_ms": round(1000 * statistics.median(latencies), 1),
        "vector_step_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 1),
        "fds_start_end": (fds0, end[0]),
        "rss_mb_start_end": (round(rss0 / 2**20), round(end[1] / 2**20)),
        "sessions_disk_mb_start_end": (round(disk0 / 2**20, 1), round(end[2] / 2**20, 1)),
        "bases_mb": round(
            sum(p.stat().st_size for p in (root / "bases").glob("*.sqlite")) / 2**20, 1
        ),
        "isolation_violations": violations,
        "heavy_mix": heavy,
        "checkpoints": checkpoints,
    }
    print("\nSOAK " + json.dumps(report))
    out = os.environ.get("SOAK_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    assert violations == 0
    assert abs(end[0] - fds0) <= 2 * workers, report
    assert end[2] <= disk0 + (8 << 20), report
