"""PostgreSQL: a reset that leases a ready clone against the official evaluator's reset
(terminate the database's backends, ``dropdb``, ``createdb --template``), side by side in one run,
on the bundled bank_finance database; and the disk a trajectory's clone takes.

    .venv/bin/python -m pytest benchmarks/test_postgres.py -m "" --benchmark-only -p no:xdist
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from birdenv.judge.postgres import TaskDatabases
from birdenv.postgres import DatabasePool, PrivateCluster, find_bindir
from birdenv.tasks import load_tasks

pytest.importorskip("psycopg")
ROUNDS = 20


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[DatabasePool, str]]:
    with DatabasePool(ready=ROUNDS + 2, workers=2) as pool:
        task = next(t for t in load_tasks("critic-mini-pg") if t.db_id == "bank_finance")
        template = TaskDatabases(pool).template_for(task)
        yield pool, template


def test_lease_a_ready_clone(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    pool, template = setup
    pool.warm(template)
    pool.drain()
    leases = []
    benchmark.group = "reset: one fresh database for a trajectory"
    benchmark.pedantic(lambda: leases.append(pool.lease(template)), rounds=ROUNDS, iterations=1)
    for lease in leases:
        pool.release(lease)
    pool.drain()


def test_a_session_on_a_ready_clone(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    """What an environment's reset waits for: a lease and the trajectory's connection."""
    from birdenv.postgres import PgSession
    from birdenv.replicas import Limits

    pool, template = setup
    pool.warm(template)
    pool.drain()
    sessions = []
    benchmark.group = "reset: one fresh database for a trajectory"
    benchmark.pedantic(
        lambda: sessions.append(PgSession(pool, pool.lease(template), limits=Limits())),
        rounds=ROUNDS,
        iterations=1,
    )
    for session in sessions:
        session.close()
    pool.drain()


def test_the_official_reset(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    pool, template = setup
    server = pool.server
    if not isinstance(server, PrivateCluster):
        pytest.skip("measured on the project's own cluster")
    kwargs = server.connect_kwargs("postgres")
    common = ["-h", kwargs["host"], "-p", str(kwargs["port"]), "-U", kwargs["user"]]
    bindir = find_bindir()
    with server.admin() as admin:  # the official layout: {db} made from {db}_template
        admin.execute("DROP DATABASE IF EXISTS bench_official WITH (FORCE)")
        admin.execute(f'CREATE DATABASE bench_official TEMPLATE "{template}"')
        admin.execute("DROP DATABASE IF EXISTS bench_official_template WITH (FORCE)")
        admin.execute(f'CREATE DATABASE bench_official_template TEMPLATE "{template}"')

    def reset() -> None:
        terminate = (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = 'bench_official' AND pid <> pg_backend_pid()"
        )
        subprocess.run(
            ["psql", *common, "-d", "postgres", "-c", terminate], check=True, capture_output=True
        )
        subprocess.run(
            [str(bindir / "dropdb"), "--if-exists", *common, "bench_official"], check=True
        )
        subprocess.run(
            [
                str(bindir / "createdb"),
                *common,
                "bench_official",
                "--template",
                "bench_official_template",
            ],
            check=True,
        )

    benchmark.group = "reset: one fresh database for a trajectory"
    try:
        benchmark.pedantic(reset, rounds=ROUNDS // 2, iterations=1)
    finally:
        with server.admin() as admin:
            admin.execute("DROP DATABASE IF EXISTS bench_official WITH (FORCE)")
            admin.execute("DROP DATABASE IF EXISTS bench_official_template WITH (FORCE)")


def test_disk_per_trajectory(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    pool, template = setup
    lease = pool.lease(template)
    try:
        with pool.server.admin() as admin:
            size = lambda name: admin.execute(  # noqa: E731
                "SELECT pg_database_size(%s)", (name,)
            ).fetchone()[0]
            benchmark.extra_info["clone_bytes"] = size(lease.name)
            benchmark.extra_info["template_bytes"] = size(template)
            benchmark.group = "disk: one trajectory's clone"
            benchmark.pedantic(lambda: size(lease.name), rounds=1, iterations=1)
    finally:
        pool.release(lease)


@pytest.mark.parametrize("processes", [1, 4])
def test_judge_throughput(benchmark: Any, processes: int) -> None:
    """The judge on the 136 predictions the official evaluator's verdicts were recorded for
    (tests/fixtures/pg_official_verdicts.jsonl): instances at once, each on its own clone."""
    import json
    from pathlib import Path

    from birdenv.judge.postgres import judge_pg_many

    fixture = Path(__file__).parents[1] / "tests" / "fixtures" / "pg_official_verdicts.jsonl"
    rows = [json.loads(line) for line in fixture.read_text().splitlines()]
    tasks = {t.instance_id: t for t in load_tasks("critic-mini-pg") + load_tasks("gym-mini-pg")}
    jobs = [(tasks[r["instance_id"]], r["pred_sqls"]) for r in rows]
    benchmark.group = "judge: 136 PostgreSQL predictions"
    verdicts = benchmark.pedantic(
        lambda: list(judge_pg_many(jobs, processes=processes, statement_timeout=None)),
        rounds=1,
        iterations=1,
    )
    benchmark.extra_info["agree"] = sum(
        v.status == r["official"] for v, r in zip(verdicts, rows, strict=True)
    )


def test_64_concurrent_trajectories(benchmark: Any) -> None:
    """64 trajectories on one host at once, each on its own clone of bank_finance: one turn of
    all of them (a write, then a read of what it wrote) from 64 threads; the clones' disk."""
    from concurrent.futures import ThreadPoolExecutor

    from birdenv.postgres import PgSession
    from birdenv.replicas import Limits

    with DatabasePool(ready=64, workers=4) as pool:
        task = next(t for t in load_tasks("critic-mini-pg") if t.db_id == "bank_finance")
        template = TaskDatabases(pool).template_for(task)
        pool.warm(template)
        pool.drain()
        sessions = [PgSession(pool, pool.lease(template), limits=Limits()) for _ in range(64)]
        try:

            def turn(i: int) -> bool:
                session = sessions[i]
                wrote = session.execute(f"UPDATE accounts SET balance = {i} WHERE account_id = 1")
                read = session.execute("SELECT balance FROM accounts WHERE account_id = 1")
                return wrote.ok and read.rows == [(float(i),)]

            with ThreadPoolExecutor(64) as threads:
                benchmark.group = "64 concurrent trajectories"
                isolated = benchmark.pedantic(
                    lambda: all(threads.map(turn, range(64))), rounds=5, iterations=1
                )
            assert isolated
            with pool.server.admin() as admin:
                benchmark.extra_info["disk_bytes_64_clones"] = sum(
                    admin.execute("SELECT pg_database_size(%s)", (s.db_name,)).fetchone()[0]
                    for s in sessions
                )
        finally:
            for session in sessions:
                session.close()
