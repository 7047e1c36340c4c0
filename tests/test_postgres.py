"""PostgreSQL: the project's own cluster, the pool of clones, sessions, limits, the agent's role,
isolation as a property, and a server killed during an episode."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from birdenv.postgres import (
    DatabasePool,
    PgSession,
    PostgresNotFoundError,
    PostgresServerError,
    PrivateCluster,
    Template,
    find_bindir,
)
from birdenv.postgres.session import run_pg_statement
from birdenv.replicas.session import Limits

psycopg = pytest.importorskip("psycopg")


def _session(pool: DatabasePool, template: str, **limits: Any) -> PgSession:
    return PgSession(pool, pool.lease(template), limits=Limits(**limits))


def _owner_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def test_the_private_cluster_listens_on_its_socket_alone_as_an_unprivileged_user(
    pg_pool: DatabasePool,
) -> None:
    server = pg_pool.server
    assert isinstance(server, PrivateCluster), "BIRDENV_PG_DSN is set: the test expects none"
    with server.admin() as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        assert conn.execute("SHOW unix_socket_directories").fetchone() == (str(server.socket_dir),)
    assert (server.socket_dir.stat().st_mode & 0o777) == 0o700
    pid = server.postmaster_pid()
    assert pid is not None
    if os.geteuid() == 0:
        assert _owner_uid(pid) != 0
    assert server.description.startswith("private cluster ")


def test_a_lease_is_fresh_its_writes_persist_and_nobody_else_sees_them(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    with _session(pg_pool, pg_shop) as a, _session(pg_pool, pg_shop) as b:
        assert a.db_name != b.db_name
        assert a.execute("INSERT INTO customers VALUES (9, 'Zed', 'Oslo', '2024-01-01')").ok
        assert a.execute("CREATE TABLE notes (n int)").ok
        assert a.execute("SELECT count(*) FROM customers").rows == [(4,)]
        assert b.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert "does not exist" in b.execute("SELECT * FROM notes").error
        # an uncommitted ALTER in one trajectory cannot block another's SELECT: they are apart
        assert a.execute("DROP TABLE orders CASCADE").ok
        assert b.execute("SELECT count(*) FROM orders").rows == [(4,)]
    with _session(pg_pool, pg_shop) as c:  # the template never changed
        assert c.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert c.execute("SELECT count(*) FROM orders").rows == [(4,)]


def test_statements_follow_the_official_evaluator_commit_per_statement(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    with _session(pg_pool, pg_shop) as s:
        assert s.execute("BEGIN").ok  # a warning: each statement is committed
        assert s.execute("UPDATE customers SET city = 'Nice' WHERE id = 1").ok
        assert s.execute("ROLLBACK").ok
        assert s.execute("SELECT city FROM customers WHERE id = 1").rows == [("Nice",)]
        assert "transaction block" in s.execute("VACUUM").error
        failed = s.execute("INSERT INTO orders VALUES (1, 1, 'x', 1)")
        assert "duplicate key" in failed.error
        assert s.execute("SELECT count(*) FROM orders").rows == [(4,)]  # still usable
        # several statements in one string: the last one's rows, as psycopg2 gives them
        both = s.execute("SELECT 1 AS a; SELECT 2 AS b")
        assert (both.columns, both.rows) == (["b"], [(2,)])
        assert s.execute("INSERT INTO notes VALUES (1)").error.startswith('relation "notes"')


def test_every_statement_is_bounded(pg_pool: DatabasePool, pg_shop: str) -> None:
    with _session(pg_pool, pg_shop, statement_timeout=0.5, max_rows=50, max_result_bytes=2000) as s:
        slow = s.execute("SELECT pg_sleep(30)")
        # Cut at its deadline, not slept to its end: half the 30 s it would take, however slow
        # the machine.
        assert slow.timed_out and slow.elapsed < 15, slow
        huge = s.execute("SELECT g FROM generate_series(1, 100000000) g")
        assert huge.timed_out  # the function's rows are made before the first is sent
        many = s.execute("SELECT g FROM generate_series(1, 300000) g", timeout=20)
        assert many.ok and many.truncated and many.rowcount == 50
        wide = s.execute("SELECT repeat('x', 500) FROM generate_series(1, 100)")
        assert wide.truncated and wide.rowcount < 10
        endless = s.execute(
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
        )
        assert endless.timed_out or "temporary file size exceeds" in endless.error
        assert "permission denied" in s.execute("SET temp_file_limit = '100GB'").error
        assert s.execute("SELECT 1").rows == [(1,)]  # the session goes on


@pytest.mark.parametrize(
    "sql",
    [
        "COPY customers TO PROGRAM 'id'",
        "ALTER SYSTEM SET work_mem = '1GB'",
        "SELECT lo_import('/etc/passwd')",
        "CREATE EXTENSION dblink",
        "CREATE FUNCTION f() RETURNS int LANGUAGE c AS 'libc.so.6', 'getpid'",  # untrusted
        "CREATE FUNCTION g() RETURNS int LANGUAGE internal AS 'now'",
        "CREATE DATABASE other",
        "CREATE ROLE other",
        "SET ROLE birdenv",
        "COPY customers FROM '/etc/passwd'",
        "SELECT pg_read_file('/etc/passwd')",
    ],
)
def test_the_server_refuses_what_only_a_superuser_may_do(
    pg_pool: DatabasePool, pg_shop: str, sql: str
) -> None:
    with _session(pg_pool, pg_shop) as s, s.connect() as own:
        own.autocommit = True  # refused for want of privilege, not for the transaction block
        with pytest.raises(psycopg.Error) as refused:
            own.execute(sql)
        message = str(refused.value).lower()
        assert any(
            word in message
            for word in ("permission denied", "must be superuser", "is not available")
        ), message
        if "is not available" in message:  # not even installed on this server
            assert "dblink" in sql


def test_no_trajectory_can_end_or_block_another(pg_pool: DatabasePool, pg_shop: str) -> None:
    with _session(pg_pool, pg_shop) as a, _session(pg_pool, pg_shop) as b:
        (pid,) = b.execute("SELECT pg_backend_pid()").rows[0]
        (mine,) = a.execute("SELECT pg_backend_pid()").rows[0]
        refused = a.execute(f"SELECT pg_terminate_backend({pid})")
        assert "must be a member of the role" in refused.error
        assert "permission denied" in a.execute(f"SELECT pg_cancel_backend({pid})").error or (
            "must be a member" in a.execute(f"SELECT pg_cancel_backend({pid})").error
        )
        assert (
            "permission denied" in a.execute("LOCK TABLE pg_authid IN ACCESS EXCLUSIVE MODE").error
        )
        # a lock a trajectory may take ends with its statement (each statement is committed)
        assert a.execute("LOCK TABLE pg_database IN ACCESS SHARE MODE").ok
        assert b.execute("SELECT 1").rows == [(1,)]
        # ending its own connection is an observation, and the trajectory goes on on its database
        assert a.execute("CREATE TABLE kept (n int)").ok
        ended = a.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        assert "a new one is open on the same database" in ended.error
        assert a.execute("SELECT count(*) FROM kept").rows == [(0,)]
        (mine,) = a.execute("SELECT pg_backend_pid()").rows[0]
        with pg_pool.server.admin() as admin:
            assert admin.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s", (mine,)
            ).fetchone() == (0,)


def test_leases_are_ready_and_released_clones_are_dropped(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    pg_pool.warm(pg_shop)
    pg_pool.drain()
    assert pg_pool.stats()["ready"] >= 2
    with pg_pool.server.admin() as conn:
        existing = {name for (name,) in conn.execute("SELECT datname FROM pg_database")}
    lease = pg_pool.lease(pg_shop)
    assert lease.name in existing  # a ready clone, not a CREATE DATABASE
    pg_pool.release(lease)
    pg_pool.drain()
    with pg_pool.server.admin() as conn:
        gone = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (lease.name,)
        ).fetchone()
        assert gone == (0,)
        assert conn.execute(
            "SELECT datallowconn, datistemplate FROM pg_database WHERE datname = %s", (pg_shop,)
        ).fetchone() == (False, True)


# -- isolation as a property --------------------------------------------------------------------
SESSIONS = 4
STATEMENTS = st.sampled_from(
    [
        "INSERT INTO customers (id, name, city, joined) VALUES (100 + {n}, 'P{n}', 'X', '2024')",
        "UPDATE orders SET total = coalesce(total, 0) + {n} WHERE id = 1 + {n} % 4",
        "DELETE FROM orders WHERE id = 1 + {n} % 4",
        "CREATE TABLE IF NOT EXISTS notes (n integer)",
        "INSERT INTO notes VALUES ({n})",
        "CREATE SEQUENCE IF NOT EXISTS s",
        "SELECT nextval('s')",
        "DELETE FROM customers WHERE id = 1 + {n} % 3",
        "ALTER TABLE customers ADD COLUMN IF NOT EXISTS extra integer DEFAULT {n}",
        "BEGIN",
        "ROLLBACK",
    ]
)
CHECK = [
    "SELECT * FROM customers ORDER BY id",
    "SELECT id, customer_id, total FROM orders ORDER BY id",
    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
    "SELECT last_value FROM s",
]


def _reference_view(conn: Any) -> list:
    out = []
    for sql in CHECK:
        try:
            out.append(
                run_pg_statement(conn, sql, timeout=None, max_rows=10_000, max_result_bytes=None)[0]
            )
        except psycopg.Error as exc:
            out.append(str(exc).strip())
    return out


def _session_view(session: PgSession) -> list:
    results = [session.execute(sql) for sql in CHECK]
    return [r.rows if r.error is None else r.error for r in results]


class Interleavings(RuleBasedStateMachine):
    """Each rule runs one statement on one session and on that session's reference clone,
    driven by a plain connection the official way."""

    pool: DatabasePool
    template: str

    @initialize()
    def open_sessions(self) -> None:
        self.sessions = [_session(self.pool, self.template) for _ in range(SESSIONS)]
        self.leases = [self.pool.lease(self.template) for _ in range(SESSIONS)]
        self.refs = [self.pool.connect(lease) for lease in self.leases]

    @rule(which=st.integers(0, SESSIONS - 1), statement=STATEMENTS, n=st.integers(0, 20))
    def execute(self, which: int, statement: str, n: int) -> None:
        sql = statement.format(n=n)
        got = self.sessions[which].execute(sql).error
        try:
            run_pg_statement(
                self.refs[which], sql, timeout=None, max_rows=10_000, max_result_bytes=None
            )
            expected = None
        except psycopg.Error as exc:
            expected = str(exc).strip()
        assert got == expected, (sql, got, expected)

    @invariant()
    def every_session_sees_only_its_own_state(self) -> None:
        if not hasattr(self, "sessions"):
            return
        for session, ref in zip(self.sessions, self.refs, strict=True):
            assert _session_view(session) == _reference_view(ref)

    def teardown(self) -> None:
        for session in getattr(self, "sessions", []):
            session.close()
        for ref, lease in zip(getattr(self, "refs", []), getattr(self, "leases", []), strict=True):
            ref.close()
            self.pool.release(lease)


def test_isolation_holds_under_random_interleavings(pg_pool: DatabasePool, pg_shop: str) -> None:
    class Bound(Interleavings):
        pool = pg_pool
        template = pg_shop

    Bound.TestCase.settings = settings(
        max_examples=3,
        stateful_step_count=15,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    Bound.TestCase().runTest()


# -- faults -------------------------------------------------------------------------------------
def test_a_server_killed_during_an_episode_is_a_clear_error_then_the_pool_recovers(
    own_cluster: Any,
) -> None:
    # Its own cluster: killing the shared one would end other tests' sessions.
    server = own_cluster("cluster")
    server.ensure_running()
    try:
        with DatabasePool(server, ready=0) as pool:  # nothing restarts it behind the test
            template = pool.template(
                Template("kill", "k1", lambda db: db.execute("CREATE TABLE t AS SELECT 1 AS x"))
            )
            session = _session(pool, template)
            assert session.execute("INSERT INTO t VALUES (2)").ok
            pid = server.postmaster_pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(PostgresServerError, match=r"connection to .* was lost"):
                for _ in range(50):  # the backend notices its postmaster's death at once or soon
                    session.execute("SELECT 1")
                    time.sleep(0.05)
            session.close()
            with _session(pool, template) as again:  # restarted; the template is intact
                assert again.execute("SELECT x FROM t").rows == [(1,)]
            assert server.postmaster_pid() not in (None, pid)
    finally:
        server.close()


def test_doctor_names_the_server_and_a_missing_one_says_how_to_install_it(
    pg_pool: DatabasePool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from birdenv.cli import main

    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("postgresql"))
    assert "private cluster" in line and "running" in line
    monkeypatch.setenv("BIRDENV_PG_BINDIR", "/nonexistent")
    with pytest.raises(PostgresNotFoundError, match="install PostgreSQL"):
        find_bindir()
    assert main(["doctor"]) == 0
    assert "unavailable: BIRDENV_PG_BINDIR" in capsys.readouterr().out


# -- SQLite files as templates --------------------------------------------------------------------
def test_a_sqlite_file_becomes_a_template_with_the_same_rows_keys_and_views(
    pg_pool: DatabasePool, tmp_path: Path
) -> None:
    import sqlite3

    from birdenv.postgres.convert import sqlite_template
    from tests.conftest import build_shop

    path = build_shop(tmp_path)
    with sqlite3.connect(path) as extra:
        extra.executescript(
            """
            CREATE TABLE "Notes" ("noteId" INTEGER PRIMARY KEY, body TEXT, data BLOB,
                made TEXT DEFAULT CURRENT_TIMESTAMP, score REAL CHECK (score >= 0));
            INSERT INTO "Notes" (body, data, score) VALUES ('', x'00ff', 1.5), (NULL, NULL, 0.1);
            CREATE UNIQUE INDEX notes_body ON "Notes" (body);
            """
        )
    template = sqlite_template(path)
    assert template.key == "shop"
    name = pg_pool.template(template)
    assert pg_pool.template(sqlite_template(path)) == name  # by content hash: made once
    source = sqlite3.connect(path)
    with _session(pg_pool, name) as s:
        for table in ("customers", "orders", '"Notes"'):
            columns = "*" if table != '"Notes"' else '"noteId", body, data, score'
            want = source.execute(f"SELECT {columns} FROM {table} ORDER BY 1").fetchall()
            got = s.execute(f"SELECT {columns} FROM {table} ORDER BY 1").rows
            assert [
                tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in got
            ] == want
        assert s.execute("SELECT count(*) FROM big_orders").rows == [(2,)]
        assert s.execute('SELECT body IS NULL FROM "Notes" ORDER BY "noteId"').rows == [
            (False,),
            (True,),
        ]
        # the identity column numbers new rows after the largest key, as SQLite's rowid does
        assert s.execute("INSERT INTO customers (name) VALUES ('New')").ok
        assert s.execute("SELECT max(id) FROM customers").rows == [(4,)]
        assert (
            "violates check constraint"
            in s.execute('INSERT INTO "Notes" (score) VALUES (-1)').error
        )
        assert "duplicate key" in s.execute("""INSERT INTO "Notes" (body) VALUES ('')""").error
        assert s.execute("DELETE FROM customers WHERE id = 1").ok  # ON DELETE CASCADE
        assert s.execute("SELECT count(*) FROM orders WHERE customer_id = 1").rows == [(0,)]
        assert "foreign key" in s.execute("INSERT INTO orders VALUES (9, 99, 'x', 1)").error
    source.close()


def test_clones_leaked_by_a_crashed_process_are_dropped_at_the_next_start(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    import subprocess

    from birdenv.postgres.clones import clone_name

    dead = subprocess.Popen(["true"])  # a process id that no longer runs
    dead.wait()
    name = clone_name(dead.pid)
    with pg_pool.server.admin() as admin:
        admin.execute(f"CREATE ROLE {name} LOGIN")
        admin.execute(f'CREATE DATABASE {name} TEMPLATE "{pg_shop}" OWNER {name}')
    DatabasePool(pg_pool.server, ready=0).close()  # a pool starting on the same server
    with pg_pool.server.admin() as admin:
        assert admin.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (name,)
        ).fetchone() == (0,)
        assert admin.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname = %s", (name,)
        ).fetchone() == (0,)


def test_a_removed_cluster_leaves_no_process_and_no_folder(own_cluster: Any) -> None:
    """A cluster made for a while is removed whole: its server, and its folder, which, as root,
    lies outside the test's ``tmp_path`` (the server's user cannot reach that)."""
    from birdenv.postgres.server import process_alive

    cluster = own_cluster("brief")
    cluster.ensure_running()
    pid = cluster.postmaster_pid()
    assert pid is not None and cluster.root.is_dir()
    cluster.remove()
    assert cluster.postmaster_pid() is None and not cluster.root.exists()
    assert not cluster.socket_dir.exists()
    assert not process_alive(pid)
    # What the process's exit hook calls: the use ended with the removal (it once opened the
    # removed folder's lock and printed a FileNotFoundError at every test run's exit).
    cluster.close()
    assert not cluster.root.exists()


def test_an_external_server_named_by_a_dsn(own_cluster: Any) -> None:
    """``pg_dsn=``: a server the project did not start (here a second cluster, reached by its DSN
    only), with its default clone strategy and the same roles and limits."""
    import gymnasium as gym

    from birdenv.postgres import ExternalServer

    other = own_cluster("other")
    other.ensure_running()
    try:
        dsn = f"host={other.socket_dir} port={other.port} user=birdenv dbname=postgres"
        server = ExternalServer(dsn)
        assert (
            "external server" in server.description and str(other.socket_dir) in server.description
        )
        with DatabasePool(server, ready=0) as pool:
            assert pool.strategy is None  # the server's own CREATE DATABASE strategy
            template = pool.template(
                Template("ext", "e1", lambda db: db.execute("CREATE TABLE t AS SELECT 1 AS x"))
            )
            with _session(pool, template) as s:
                assert s.execute("INSERT INTO t VALUES (2)").ok
                assert "permission denied" in s.execute("SET ROLE birdenv").error
        env = gym.make("BirdCritic-PostgreSQL-v0", pg_dsn=dsn, pool_options={"ready": 0})
        try:
            env.reset(options={"task_id": "pg_bank_interval"})
            observation = env.step(
                '<tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT current_database()"}}</tool_call>'
            )[0]
            assert "bc_" in observation
        finally:
            env.close()
        with other.admin() as admin:  # the env's databases were made there, and dropped
            assert admin.execute(
                "SELECT count(*) FROM pg_database WHERE datname LIKE 'bt\\_bank%'"
            ).fetchone() == (1,)
    finally:
        other.close()


def test_too_many_connections_is_a_clear_error_not_a_hang(own_cluster: Any) -> None:
    server = own_cluster("small", max_connections=8)
    server.ensure_running()
    held: list[Any] = []
    try:
        with DatabasePool(server, ready=0) as pool:
            template = pool.template(
                Template("few", "f1", lambda db: db.execute("CREATE TABLE t (x int)"))
            )
            start = time.monotonic()
            with pytest.raises(PostgresServerError, match="max_connections is reached"):
                for _ in range(20):  # 8 slots, 3 of them kept for superusers
                    held.append(_session(pool, template))
            assert time.monotonic() - start < 60 and len(held) >= 2
            for session in held:
                session.close()
            held.clear()
            with _session(pool, template) as again:  # slots freed: leases work again
                assert again.execute("SELECT count(*) FROM t").rows == [(0,)]
    finally:
        for session in held:
            session.close()
        server.close()


def test_a_forked_process_does_not_lease_from_its_parents_default_pool() -> None:
    """An environment worker forked from a process whose default pool holds ready clones makes a
    pool of its own: leasing from its copy of the parent's, both would lease one clone, and the
    first to release it would drop it (and its role) under the other."""
    from birdenv.judge.postgres import default_task_databases
    from birdenv.postgres.pool import current_database_pool, default_database_pool

    parent = default_database_pool()
    assert current_database_pool() is parent
    judged = default_task_databases()  # the judge's, which wraps the default pool
    assert judged.pool is parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports, and ends without running the parent's exit hooks
        own = current_database_pool() is None
        # the judge's, asked for in the child: on a pool of the child's own
        own_judge = default_task_databases().pool is not parent
        own_judge = own_judge and default_task_databases().pool is current_database_pool()
        default_task_databases().pool.close()
        os.write(write, b"own" if own and own_judge else b"parent's")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"own"
    os.close(read)
