"""PostgreSQL: a reset that leases a ready clone against the official evaluator's reset
(terminate the database's backends, ``dropdb``, ``createdb --template``), side by side in one run,
on the bundled bank_finance database; the disk a trajectory's clone takes; trajectories that only
read, sharing one clone, against one clone each; and the judge with its concurrency against the
same judge under the official wrapper's schedule.

    .venv/bin/python -m pytest benchmarks/test_postgres.py -m "" --benchmark-only -p no:xdist
"""

from __future__ import annotations

import collections
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from birdenv.judge.postgres import TaskDatabases, judge_pg_many
from birdenv.postgres import DatabasePool, Lease, PgSession, PrivateCluster, Server, find_bindir
from birdenv.postgres.session import run_pg_statement
from birdenv.postgres.templates import OWNER_ROLE
from birdenv.replicas import Limits
from birdenv.tasks import load_tasks

psycopg = pytest.importorskip("psycopg")
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


def _official_reset(server: Server, name: str, template: str, owner: str | None = None) -> None:
    """The official evaluator's reset of database ``name``: terminate its backends, ``dropdb``,
    ``createdb --template`` (the server's default strategy), with the same client programs."""
    kwargs = server.connect_kwargs("postgres")
    common = ["-h", kwargs["host"], "-p", str(kwargs["port"]), "-U", kwargs["user"]]
    bindir = find_bindir()
    terminate = (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    )
    subprocess.run(
        [str(bindir / "psql"), *common, "-d", "postgres", "-c", terminate],
        check=True,
        capture_output=True,
    )
    subprocess.run([str(bindir / "dropdb"), "--if-exists", *common, name], check=True)
    owned = ["-O", owner] if owner else []
    subprocess.run(
        [str(bindir / "createdb"), *common, *owned, name, "--template", template], check=True
    )


def test_the_official_reset(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    pool, template = setup
    server = pool.server
    if not isinstance(server, PrivateCluster):
        pytest.skip("measured on the project's own cluster")
    with server.admin() as admin:  # the official layout: {db} made from {db}_template
        admin.execute("DROP DATABASE IF EXISTS bench_official WITH (FORCE)")
        admin.execute(f'CREATE DATABASE bench_official TEMPLATE "{template}"')
        admin.execute("DROP DATABASE IF EXISTS bench_official_template WITH (FORCE)")
        admin.execute(f'CREATE DATABASE bench_official_template TEMPLATE "{template}"')
    benchmark.group = "reset: one fresh database for a trajectory"
    try:
        benchmark.pedantic(
            lambda: _official_reset(server, "bench_official", "bench_official_template"),
            rounds=ROUNDS // 2,
            iterations=1,
        )
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


# -- trajectories that only read: one shared clone against one clone each ----------------------
# What each trajectory runs: two short reads (short trajectories are where the scheme could pay:
# the pool must then make clones as fast as they are used), committed one by one.
READS = (
    "SELECT count(*) FROM accounts",
    "SELECT balance FROM accounts WHERE account_id = 1",
)
# Functions that hold a lock across statements, by which one reader could block another.
_SESSION_LOCKS = ", ".join(
    f"{fn}({args})"
    for fn in ("pg_advisory_lock", "pg_advisory_lock_shared")
    for args in ("bigint", "integer, integer")
)


class SharedReaders:
    """One clone shared by trajectories that only read (the scheme measured, not shipped): each
    trajectory logs in as a role of its own (no trajectory sees or signals another's backend),
    a member of a role that may only ``SELECT``; the clone is read-only by default
    (``ALTER DATABASE ... SET default_transaction_read_only``, which an agent can ``SET`` off,
    so what enforces it is the privileges: no write, no ``TEMP``, no ``CREATE`` in a schema, no
    session-level advisory lock)."""

    def __init__(self, pool: DatabasePool, template: str) -> None:
        self.pool, self.lease = pool, pool.lease(template)
        self.group = f"{self.lease.name}_r"
        self._count = 0
        self._lock = threading.Lock()
        self._admin = pool.server.admin()  # kept: roles come and go with trajectories
        with pool.server.admin(self.lease.name) as admin:
            admin.execute(f"CREATE ROLE {self.group} NOLOGIN")
            admin.execute(f"GRANT CONNECT ON DATABASE {self.lease.name} TO {self.group}")
            admin.execute(f"GRANT USAGE ON SCHEMA public TO {self.group}")
            admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {self.group}")
            admin.execute(f"REVOKE EXECUTE ON FUNCTION {_SESSION_LOCKS} FROM PUBLIC")
            admin.execute(
                f"ALTER DATABASE {self.lease.name} SET default_transaction_read_only = on"
            )

    def start(self) -> tuple[str, Any]:
        """A trajectory's role and its connection."""
        with self._lock:
            self._count += 1
            role = f"{self.group}{self._count}"
            self._admin.execute(f"CREATE ROLE {role} LOGIN IN ROLE {self.group}")
        conn = psycopg.connect(**self.pool.server.connect_kwargs(self.lease.name, user=role))
        return role, conn

    def end(self, role: str, conn: Any) -> None:
        conn.close()
        with self._lock:
            self._admin.execute(f"DROP ROLE {role}")

    def close(self) -> None:
        with self._admin as admin:
            admin.execute(f"DROP DATABASE {self.lease.name} WITH (FORCE)")  # before its roles
            for (role,) in admin.execute(
                "SELECT rolname FROM pg_roles WHERE rolname LIKE %s", (self.group + "%",)
            ).fetchall():
                admin.execute(f"DROP ROLE {role}")
        self.pool.release(self.lease)


def _read(conn: Any) -> list[Any]:
    return [
        run_pg_statement(conn, sql, timeout=30, max_rows=1000, max_result_bytes=None)[0]
        for sql in READS
    ]


def _check_refused(readers: SharedReaders) -> None:
    """What makes the shared scheme sound to measure: the server, not the client, refuses a
    reader's writes, even once it has turned ``default_transaction_read_only`` off."""
    role, conn = readers.start()
    other, other_conn = readers.start()
    try:
        run_pg_statement(
            conn,
            "SET default_transaction_read_only = off",
            timeout=30,
            max_rows=1,
            max_result_bytes=None,
        )
        for sql in (
            "DELETE FROM accounts",
            "CREATE TEMP TABLE scratch (x int)",
            "CREATE TABLE scratch (x int)",
            "SELECT pg_advisory_lock(1)",
            "SELECT * FROM accounts FOR SHARE",
            f"SELECT pg_terminate_backend({other_conn.info.backend_pid})",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                run_pg_statement(conn, sql, timeout=30, max_rows=10, max_result_bytes=None)
        assert _read(other_conn) == _read(conn)
    finally:
        readers.end(role, conn)
        readers.end(other, other_conn)


def test_start_a_reader_on_a_shared_clone(benchmark: Any, setup: tuple[DatabasePool, str]) -> None:
    """What a reset of a read-only trajectory would wait for: its role, and its connection."""
    pool, template = setup
    readers = SharedReaders(pool, template)
    started: list[tuple[str, Any]] = []
    benchmark.group = "reset: one fresh database for a trajectory"
    try:
        benchmark.pedantic(lambda: started.append(readers.start()), rounds=ROUNDS, iterations=1)
        for role, conn in started:
            readers.end(role, conn)
    finally:
        readers.close()


@pytest.mark.parametrize("scheme", ["own clone", "shared clone"])
def test_read_only_trajectories_back_to_back(benchmark: Any, scheme: str) -> None:
    """64 short trajectories that only read (start, two reads, end), one after another, as
    fast as they come: each on a clone of its own from a pool with its default settings (two
    clones ready, two background workers), or all on one shared clone (:class:`SharedReaders`)."""
    trajectories = 64
    with DatabasePool() as pool:
        task = next(t for t in load_tasks("critic-mini-pg") if t.db_id == "bank_finance")
        template = TaskDatabases(pool).template_for(task)
        pool.warm(template)
        pool.drain()
        benchmark.group = "read-only trajectories: 64 back to back"
        if scheme == "own clone":

            def run() -> None:
                for _ in range(trajectories):
                    with PgSession(pool, pool.lease(template), limits=Limits()) as session:
                        assert all(session.execute(sql).ok for sql in READS)

            benchmark.pedantic(run, rounds=1, iterations=1)
            with pool.server.admin() as admin:
                size = admin.execute("SELECT pg_database_size(%s)", (template,)).fetchone()[0]
            benchmark.extra_info["disk_bytes_per_concurrent_trajectory"] = size
        else:
            readers = SharedReaders(pool, template)
            try:
                _check_refused(readers)

                def run() -> None:
                    for _ in range(trajectories):
                        role, conn = readers.start()
                        _read(conn)
                        readers.end(role, conn)

                benchmark.pedantic(run, rounds=1, iterations=1)
            finally:
                readers.close()
            benchmark.extra_info["disk_bytes_per_concurrent_trajectory"] = 0
        started = time.monotonic()
        pool.drain()  # the own-clone scheme's drops, still running in the background
        benchmark.extra_info["background_work_left_s"] = round(time.monotonic() - started, 2)


FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "pg_official_verdicts.jsonl"


def _predictions() -> tuple[list[dict[str, Any]], list[tuple[Any, list[str]]]]:
    """The 136 predictions the official evaluator's verdicts were recorded for, as judge jobs."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    tasks = {t.instance_id: t for t in load_tasks("critic-mini-pg") + load_tasks("gym-mini-pg")}
    return rows, [(tasks[r["instance_id"]], r["pred_sqls"]) for r in rows]


@pytest.mark.parametrize("processes", [1, 4])
def test_judge_throughput(benchmark: Any, processes: int) -> None:
    """The judge on the 136 predictions the official evaluator's verdicts were recorded for
    (tests/fixtures/pg_official_verdicts.jsonl): instances at once, each on its own clone."""
    rows, jobs = _predictions()
    benchmark.group = "judge: 136 PostgreSQL predictions"
    verdicts = benchmark.pedantic(
        lambda: list(judge_pg_many(jobs, processes=processes, statement_timeout=None)),
        rounds=1,
        iterations=1,
    )
    benchmark.extra_info["agree"] = sum(
        v.status == r["official"] for v, r in zip(verdicts, rows, strict=True)
    )


class OfficialSchedule(DatabasePool):
    """The official wrapper's schedule around this project's judge: one database per template
    (the official images' ``{db}``, owned by a login role of its name), held under that
    database's lock from an instance's lease to its release, and released by the official reset
    (terminate, ``dropdb``, ``createdb --template``) before the next instance may take it. The
    wrapper's extra second of sleep inside the lock after each instance is left out."""

    def __init__(self) -> None:
        super().__init__(ready=0)
        self._locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._names: dict[str, str] = {}
        self._make = threading.Lock()

    def lease(self, template: str) -> Lease:
        with self._make:
            name = self._names.get(template)
            if name is None:
                name = f"bench_official_{len(self._names)}"
                with self.server.admin() as admin:
                    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                    admin.execute(f"DROP ROLE IF EXISTS {name}")
                    admin.execute(f"CREATE ROLE {name} LOGIN IN ROLE {OWNER_ROLE}")
                    admin.execute(f'CREATE DATABASE {name} TEMPLATE "{template}" OWNER {name}')
                self._names[template] = name
        self._locks[template].acquire()
        return Lease(name, template)

    def release(self, lease: Lease) -> None:
        try:
            _official_reset(self.server, lease.name, lease.template, owner=lease.name)
        finally:
            self._locks[lease.template].release()

    def close(self) -> None:
        with self.server.admin() as admin:
            for name in self._names.values():
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                admin.execute(f"DROP ROLE IF EXISTS {name}")
        super().close()


def test_judge_under_the_official_schedule(benchmark: Any) -> None:
    """The same judge and predictions as test_judge_throughput, four instances at once, but
    scheduled as the official wrapper does: one instance per database at a time (56 of the 136
    are on bank_finance), the official reset after each."""
    rows, jobs = _predictions()
    with OfficialSchedule() as schedule:
        databases = TaskDatabases(schedule)
        for task, _ in jobs:  # templates made before the clock starts, as for the pool
            databases.template_for(task)
        benchmark.group = "judge: 136 PostgreSQL predictions"
        verdicts = benchmark.pedantic(
            lambda: list(judge_pg_many(jobs, processes=4, statement_timeout=None, pool=databases)),
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


def test_the_hostile_catalogue(benchmark: Any) -> None:
    """The hostile catalogue (``tests/test_postgres_hostile.py``: 80 statements in eight classes:
    shared state, time, locks, memory, results, COPY, escapes, other trajectories) played in two
    concurrent trajectories under a 2 s statement timeout, beside a bystander that keeps writing
    and reading its own clone; every bound and the shared state are checked as in the test.
    Recorded: the whole run, and the longest statement of each class."""
    import hashlib

    from birdenv.postgres import Template
    from tests.conftest import SHOP_SQL
    from tests.test_postgres_hostile import CATALOGUE, CATALOGUE_BOUND, run_catalogue

    with DatabasePool(ready=4) as pool:
        digest = hashlib.sha256(SHOP_SQL.encode()).hexdigest()
        template = pool.template(Template("shop", digest, lambda db: db.execute(SHOP_SQL)))
        benchmark.group = "hostile catalogue"
        longest = benchmark.pedantic(
            lambda: run_catalogue(pool, template, CATALOGUE), rounds=1, iterations=1
        )
    benchmark.extra_info.update(
        statements=sum(map(len, CATALOGUE.values())),
        bound_s=CATALOGUE_BOUND,
        **{f"longest_{name.replace(' ', '_')}_s": round(t, 2) for name, t in longest.items()},
    )
    print(f"\nhostile catalogue: {benchmark.extra_info}")
