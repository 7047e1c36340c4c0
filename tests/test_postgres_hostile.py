"""PostgreSQL against a hostile agent: no statement may change shared state, outlive its bound,
starve another trajectory or wedge its own session."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from birdenv.postgres import (
    DatabasePool,
    PgSession,
    PrivateCluster,
    RoleLimits,
    Template,
)
from birdenv.postgres.templates import OWNER_ROLE
from birdenv.replicas.session import Limits

psycopg = pytest.importorskip("psycopg")


def _session(pool: DatabasePool, template: str, **limits: Any) -> PgSession:
    return PgSession(pool, pool.lease(template), limits=Limits(**limits))


def _shared_state(pool: DatabasePool, template: str) -> list[Any]:
    """What a trajectory must never change: the template's catalog entry, comment and settings,
    the owner role, its memberships and settings, the administrator's database."""
    with pool.server.admin() as admin:
        return [
            admin.execute(
                "SELECT datname, datistemplate, datallowconn, datconnlimit, "
                "pg_get_userbyid(datdba), shobj_description(oid, 'pg_database'), ARRAY(SELECT "
                "DISTINCT a.grantee::regrole::text FROM aclexplode(datacl) a "
                "WHERE a.grantee NOT IN (0, datdba)) "
                "FROM pg_database WHERE datname IN (%s, 'postgres') ORDER BY 1",
                (template,),
            ).fetchall(),
            admin.execute(
                "SELECT rolname, rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolconfig "
                "FROM pg_roles WHERE rolname IN (%s, current_user) ORDER BY 1",
                (OWNER_ROLE,),
            ).fetchall(),
            admin.execute(
                "SELECT count(*) FROM pg_auth_members a JOIN pg_roles r ON r.oid = a.roleid "
                "WHERE r.rolname = %s",
                (OWNER_ROLE,),
            ).fetchall(),
            admin.execute(
                "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d "
                "ON d.oid = s.setdatabase WHERE d.datname IN (%s, 'postgres')",
                (template,),
            ).fetchall(),
        ]


def _attacks(template: str) -> list[str]:
    here = "DO $$BEGIN EXECUTE format('{}', current_database()); END$$"
    return [
        here.format("ALTER DATABASE %I IS_TEMPLATE true"),
        here.format("ALTER DATABASE %I CONNECTION LIMIT 0"),
        here.format("ALTER DATABASE %I SET work_mem = ''1GB''"),
        here.format("COMMENT ON DATABASE %I IS ''mine''"),
        here.format("ALTER DATABASE %I OWNER TO CURRENT_USER"),
        f'GRANT CONNECT ON DATABASE "{template}" TO CURRENT_USER',
        f"REASSIGN OWNED BY {OWNER_ROLE} TO CURRENT_USER",
        f'ALTER DATABASE "{template}" IS_TEMPLATE false',
        f'ALTER DATABASE "{template}" ALLOW_CONNECTIONS true',
        f'ALTER DATABASE "{template}" CONNECTION LIMIT 0',
        f"ALTER DATABASE \"{template}\" SET work_mem = '1GB'",
        f"COMMENT ON DATABASE \"{template}\" IS 'mine'",
        f'ALTER DATABASE "{template}" RENAME TO stolen',
        "ALTER DATABASE postgres SET statement_timeout = 0",
        f"GRANT {OWNER_ROLE} TO CURRENT_USER",
        f"SET ROLE {OWNER_ROLE}",
        f"ALTER ROLE {OWNER_ROLE} LOGIN",
        f"ALTER ROLE {OWNER_ROLE} SET work_mem = '1GB'",
        f"DROP OWNED BY {OWNER_ROLE}",
    ]


def test_nothing_a_trajectory_runs_changes_a_template_a_role_or_a_database_setting(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    before = _shared_state(pg_pool, pg_shop)
    with _session(pg_pool, pg_shop) as s:
        for sql in _attacks(pg_shop):
            result = s.execute(sql)
            if sql.startswith("GRANT CONNECT"):  # a warning: "no privileges were granted"
                continue
            assert result.error is not None, f"allowed: {sql}"
            assert any(
                word in result.error for word in ("must be", "must have", "permission denied")
            ), result.error
        # what lives inside its own clone is its own to change
        for sql in (
            "CREATE SCHEMA scratch",
            "CREATE TABLE scratch.t (n int)",
            "ALTER TABLE customers ADD COLUMN note text",
            "CREATE INDEX ON orders (total)",
            "TRUNCATE orders",
            "DROP TABLE orders CASCADE",
            "CREATE TEMP TABLE tmp AS SELECT 1 AS n",
            "CREATE FUNCTION one() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        ):
            assert s.execute(sql).ok, sql
    assert _shared_state(pg_pool, pg_shop) == before
    pg_pool.drain()  # its clone and role are dropped in the background, without an error
    with _session(pg_pool, pg_shop) as again:  # the next lease: fresh, from the intact template
        assert again.execute("SELECT count(*) FROM orders").rows == [(4,)]
    DatabasePool(pg_pool.server, ready=0).close()  # a new process's pool starts


def test_a_new_pool_repairs_its_templates_and_says_so_in_one_line(
    own_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Templates and the owner role damaged as an older version's agent could: the next pool
    repairs what it can in place, drops the template that was opened to connections (rebuilt
    from its source on next use) and logs one line; leases then work on the original data."""
    server = own_cluster("cluster")
    server.ensure_running()
    kept = Template("kept", "a1", lambda db: db.execute("CREATE TABLE t AS SELECT 1 AS x"))
    opened = Template("opened", "b2", lambda db: db.execute("CREATE TABLE t AS SELECT 2 AS x"))
    try:
        with DatabasePool(server, ready=0) as pool:
            names = pool.template(kept), pool.template(opened)
            clean = _shared_state(pool, names[0])
        with server.admin() as admin:
            admin.execute("CREATE ROLE intruder LOGIN")
            admin.execute(f"GRANT {OWNER_ROLE} TO intruder")
            admin.execute(f'GRANT CONNECT ON DATABASE "{names[0]}" TO intruder')
            admin.execute(f'ALTER DATABASE "{names[0]}" CONNECTION LIMIT 0')
            admin.execute(f"ALTER DATABASE \"{names[0]}\" SET work_mem = '1GB'")
            admin.execute(f'ALTER DATABASE "{names[0]}" OWNER TO intruder')
            admin.execute(f'ALTER DATABASE "{names[0]}" IS_TEMPLATE false')
            admin.execute(f'ALTER DATABASE "{names[1]}" ALLOW_CONNECTIONS true')
        caplog.set_level(logging.WARNING, logger="birdenv.postgres.pool")
        with DatabasePool(server, ready=0) as pool:
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1, lines
            assert "repaired" in lines[0] and f"dropped {names[1]}" in lines[0], lines[0]
            assert _shared_state(pool, names[0]) == clean
            with server.admin() as admin:
                admin.execute("DROP ROLE intruder")  # nothing of the pool depends on it now
            assert pool.template(opened) == names[1]  # rebuilt from its source
            for template, value in zip(names, (1, 2), strict=True):
                with _session(pool, template) as s:
                    assert s.execute("SELECT x FROM t").rows == [(value,)]
        caplog.clear()
        DatabasePool(server, ready=0).close()
        assert not caplog.records  # nothing differed: nothing said
    finally:
        server.close()


# -- time: a bound the session cannot lift ------------------------------------------------------
SPIN = "DO $$BEGIN LOOP END LOOP; END$$"
# Catches the cancel (and statement_timeout) and goes on: only terminating the backend ends it.
STUBBORN = (
    "DO $$BEGIN LOOP BEGIN PERFORM pg_sleep(10); "
    "EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP; END$$"
)


def test_a_session_cannot_lift_its_time_bound(pg_pool: DatabasePool, pg_shop: str) -> None:
    with _session(pg_pool, pg_shop, statement_timeout=0.5) as s:
        for sql in (
            "SET statement_timeout = 0; SELECT pg_sleep(8)",
            f"SET statement_timeout = 0; {SPIN}",
        ):
            result = s.execute(sql)
            assert result.timed_out and result.elapsed < 4, (sql, result)
            assert s.execute("SELECT 1").rows == [(1,)]
        assert s.execute("CREATE TABLE kept (n int)").ok
        stubborn = s.execute(STUBBORN)
        assert stubborn.timed_out and stubborn.elapsed < 8, stubborn
        assert "its connection was ended" in stubborn.error
        assert "a new one is open on the same database" in stubborn.error
        assert s.execute("SELECT count(*) FROM kept").rows == [(0,)]


def test_the_judge_cannot_lift_its_time_bound() -> None:
    import time

    from birdenv.judge.postgres import judge_pg
    from birdenv.tasks import load_tasks

    task = load_tasks("critic-mini-pg")[0]
    judge_pg(task, ["SELECT 1"])  # its template made, outside the time measured
    start = time.monotonic()
    verdict = judge_pg(
        task, ["SET statement_timeout = 0; SELECT pg_sleep(12)"], statement_timeout=1
    )
    assert verdict.phase == "timeout", verdict
    assert time.monotonic() - start < 8


def test_a_statement_whose_client_died_is_ended(pg_pool: DatabasePool, pg_shop: str) -> None:
    """A process killed in the middle of an endless statement that lifted statement_timeout:
    its backend notices the closed socket (client_connection_check_interval) and ends."""
    import subprocess
    import sys
    import time

    lease = pg_pool.lease(pg_shop)
    try:
        kwargs = pg_pool.server.connect_kwargs(lease.name, user=lease.name)
        script = (
            "import sys, psycopg\n"
            f"conn = psycopg.connect(**{kwargs!r}, autocommit=True)\n"
            "print(conn.info.backend_pid, flush=True)\n"
            f"conn.execute('SET statement_timeout = 0; {SPIN}')\n"
        )
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        time.sleep(0.5)
        child.kill()
        child.wait()
        with pg_pool.server.admin() as admin:
            for _ in range(100):
                if not admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone():
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"backend {pid} still runs 10 s after its client died")
    finally:
        pg_pool.release(lease)


# -- locks, memory and results: per trajectory -------------------------------------------------
def test_one_trajectory_cannot_fill_the_lock_table(pg_pool: DatabasePool, pg_shop: str) -> None:
    with _session(pg_pool, pg_shop) as a, _session(pg_pool, pg_shop) as bystander:
        for n, sql in enumerate(
            (
                "SELECT count(pg_advisory_lock(i)) FROM generate_series(1, 40000) i",
                "SELECT count(pg_advisory_xact_lock(i)) FROM generate_series(1, 40000) i",
                "SELECT count(pg_try_advisory_lock_shared(i)) FROM generate_series(1, 40000) i",
            )
        ):
            assert "permission denied for function" in a.execute(sql).error
            assert bystander.execute(f"INSERT INTO customers VALUES ({7 + n}, 'B', 'X', '2024')").ok
            assert bystander.execute("CREATE TABLE IF NOT EXISTS b (n int)").ok
            with pg_pool.server.admin() as admin:  # new connections are not refused
                assert admin.execute("SELECT 1").fetchone() == (1,)
    few = DatabasePool(pg_pool.server, ready=0, role_limits=RoleLimits(max_locks=100))
    with few, _session(few, pg_shop) as s, _session(few, pg_shop) as bystander:
        many = s.execute(
            "CREATE TABLE p (n int) PARTITION BY LIST (n); DO $$BEGIN FOR i IN 1..3000 LOOP "
            "EXECUTE format('CREATE TABLE p%s PARTITION OF p FOR VALUES IN (%s)', i, i); "
            "END LOOP; END$$"
        )
        assert "held more than 100 locks" in many.error, many
        assert s.execute("SELECT count(*) FROM orders").rows == [(4,)]
        assert bystander.execute("SELECT count(*) FROM orders").rows == [(4,)]


def test_one_backend_cannot_take_the_machine_s_memory(pg_pool: DatabasePool, pg_shop: str) -> None:
    with _session(pg_pool, pg_shop, statement_timeout=30) as s, _session(pg_pool, pg_shop) as b:
        # 1.5 GB of rows sorted in memory: past the default bound of 1 GiB per backend
        hog = s.execute(
            "SET work_mem = '100GB'; SELECT count(*) FROM (SELECT repeat('x', 1000000) || g "
            "AS v FROM generate_series(1, 1500) g ORDER BY v) s"
        )
        assert hog.error is not None and "out of memory" in hog.error, hog
        assert s.execute("SELECT count(*) FROM orders").rows == [(4,)]
        assert b.execute("SELECT count(*) FROM orders").rows == [(4,)]


def _peak_growth(run: Any) -> int:
    """Bytes this process's resident memory peaked above where it was, while ``run()`` ran."""

    def status(key: str) -> int:
        line = next(
            x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key)
        )
        return int(line.split()[1]) << 10

    import ctypes

    # Memory freed earlier goes back to the system first: reused, it would not show as growth.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


@pytest.mark.parametrize(
    "sql",
    [
        "/**/ SELECT repeat('x', 10000) FROM generate_series(1, 15000)",
        "(SELECT repeat('x', 10000) FROM generate_series(1, 15000))",
        "SELECT 1; SELECT repeat('x', 10000) FROM generate_series(1, 15000)",
        "CREATE TABLE w AS SELECT repeat('x', 10000) AS v FROM generate_series(1, 15000); "
        "DELETE FROM w RETURNING v",
    ],
)
def test_no_statement_shape_brings_its_whole_result_back(
    pg_pool: DatabasePool, pg_shop: str, sql: str
) -> None:
    """150 MB of rows, in shapes that are not one plain SELECT: what reaches this process stays
    near the caps, and the statement still runs to its end."""
    with _session(pg_pool, pg_shop, statement_timeout=60) as s:
        result: list[Any] = []
        grown = _peak_growth(lambda: result.append(s.execute(sql)))
        assert result[0].ok and result[0].truncated and len(result[0].rows) < 500, result[0]
        assert grown < 60 << 20, f"{grown >> 20} MB"


@pytest.mark.parametrize(
    "sql",
    ["COPY customers TO STDOUT", "COPY customers FROM STDIN", "SELECT 1; COPY orders TO STDOUT"],
)
def test_copy_through_the_client_is_a_clear_error_and_the_session_goes_on(
    pg_pool: DatabasePool, pg_shop: str, sql: str
) -> None:
    with _session(pg_pool, pg_shop) as s:
        refused = s.execute(sql)
        assert "is not available here" in refused.error and "SELECT" in refused.error, refused
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert s.execute("INSERT INTO customers VALUES (8, 'C', 'X', '2024')").ok


# -- birdenv serve: PostgreSQL suites, what clients see, start-up and signals ---------------------
def _strings(value: Any) -> Iterator[str]:
    """Every string inside a decoded JSON message, keys and values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _secrets(task: Any) -> list[str]:
    """The gold SQL and the tests of ``task``, but what its prompt gives anyway."""
    given = " ".join([task.query, *task.issue_sql, *task.preprocess_sql])
    return [s.strip() for s in [*task.sol_sql, *task.test_cases] if s.strip() not in given]


def _serve(*options: str) -> tuple[Any, int, str]:
    """``birdenv serve`` on a free port of 127.0.0.1: its process, its port, its banner (the first
    line it prints, read as soon as it comes)."""
    import select
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(Path(sys.executable).with_name("birdenv")), "serve", "--port", str(port)]
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert select.select([process.stdout], [], [], 180)[0], "no banner in 180 s"
    return process, port, process.stdout.readline()


def _talk(port: int) -> Any:
    """A raw WebSocket to the server, and ``send(kind, **data)``, which returns the decoded
    answer and keeps every answer in ``send.seen``."""
    import json

    from websockets.sync.client import connect

    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=60)
    seen: list[Any] = []

    def send(kind: str, **data: Any) -> dict[str, Any]:
        ws.send(json.dumps({"type": kind, "data": data}))
        seen.append(json.loads(ws.recv(timeout=120)))
        return seen[-1]

    send.seen = seen  # type: ignore[attr-defined]
    return ws, send


# A task whose test's assertion message quotes the gold result, as official tests often do.
GOLD_ROW = "Zanzibar-7731"
GOLD_TASK = {
    "instance_id": "gold",
    "db_id": "shop",
    "query": "Which code is it?",
    "issue_sql": ["SELECT 'wrong' AS code"],
    "sol_sql": [f"SELECT '{GOLD_ROW}' AS code"],
    "test_cases": [
        "def test_case(pred_sqls, sol_sqls, db_name, conn):\n"
        "    pred, _ = perform_query_on_postgresql_databases(pred_sqls[0], db_name, conn)\n"
        "    gold, _ = perform_query_on_postgresql_databases(sol_sqls[0], db_name, conn)\n"
        "    assert pred == gold, f'expected {gold}, got {pred}'\n"
    ],
}


def _episode(send: Any, task: Any) -> None:
    """A whole episode that fails, with every kind of answer: a read, an error, a malformed turn,
    a wrong submission, a turn after the end, an unknown task and the state."""
    from birdenv.tools import format_tool_call

    prompt = send("reset", task_id=task.instance_id)
    assert prompt.get("type") != "error", str(prompt)[:2000]
    where = send("step", text=format_tool_call("execute_sql", sql="SELECT current_database()"))
    assert "bc_" in where["data"]["observation"]["text"]  # a clone on PostgreSQL
    send("step", text=format_tool_call("execute_sql", sql="SELECT * FROM no_such_table"))
    send("step", text="no tool call at all")
    done = send("step", text=format_tool_call("submit_solution", sql_list=task.issue_sql))
    assert done["data"]["done"] and done["data"]["observation"]["verdict"] is not None
    send("step", text=format_tool_call("execute_sql", sql="SELECT 1"))
    send("reset", task_id="no-such-task")
    send("state")
    seen = "\n".join(s for m in send.seen for s in _strings(m))
    assert _secrets(task)
    for secret in [*_secrets(task), GOLD_ROW]:
        assert secret not in seen, secret[:200]


@pytest.mark.parametrize(
    "stop", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_serve_plays_postgresql_shows_no_answer_and_a_signal_stops_it_cleanly(
    stop: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``birdenv serve`` on PostgreSQL tasks (a small task file), with a cluster of its own: the
    banner comes once the port accepts connections; an episode plays on a clone and none of its
    messages, errors included, carries the gold SQL or a test; with an episode open, the signal
    closes the session, drops the clones and stops the cluster, and says so in one line."""
    pytest.importorskip("openenv")
    import json
    import socket

    from birdenv.tasks import load_tasks
    from birdenv.tools import format_tool_call
    from tests.conftest import SHOP_TASKS, build_shop

    build_shop(tmp_path / "dbs")
    path = tmp_path / "tasks.jsonl"
    rows = [{**t, "dialect": "PostgreSQL"} for t in [*SHOP_TASKS, GOLD_TASK]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = next(t for t in load_tasks(path, db_dir=tmp_path / "dbs") if t.instance_id == "gold")
    monkeypatch.setenv("BIRDENV_HOME", str(tmp_path / "home"))
    process, port, banner = _serve("--tasks", str(path), "--db-dir", str(tmp_path / "dbs"))
    cluster = PrivateCluster()
    try:
        assert banner.startswith("birdenv: serving critic tasks on"), banner
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening already
        ws, send = _talk(port)
        with ws:
            _episode(send, task)
            send("reset", task_id=task.instance_id)  # left open for the signal to find
            send("step", text=format_tool_call("execute_sql", sql="CREATE TABLE mine (n int)"))
            process.send_signal(stop)
            assert process.wait(60) == 128 + stop
        out = process.stdout.read()
        assert f"stopped by {signal.Signals(stop).name}" in out and "Traceback" not in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert cluster.postmaster_pid() is None, "the cluster it started still runs"
    cluster.ensure_running()
    try:
        with cluster.admin() as admin:
            left = admin.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE 'bc\\_%' UNION ALL "
                "SELECT rolname FROM pg_roles WHERE rolname LIKE 'bc\\_%'"
            ).fetchall()
        assert left == [], left
    finally:
        cluster.close()
        cluster.remove()  # its folder, moved out of the unreachable tmp_path, would outlive it


@pytest.mark.slow
def test_serve_plays_the_critic_mini_pg_suite_and_no_message_carries_an_answer() -> None:
    """``birdenv serve --suite critic-mini-pg`` (the bundled suite, on the shared cluster)."""
    pytest.importorskip("openenv")
    from birdenv.judge.postgres import default_task_databases
    from birdenv.tasks import load_tasks

    task = load_tasks("critic-mini-pg")[0]
    default_task_databases().template_for(task)  # made before, not timed by the server's start
    process, port, banner = _serve("--suite", "critic-mini-pg", "--max-turns", "10")
    try:
        assert banner.startswith("birdenv: serving critic tasks on"), banner
        ws, send = _talk(port)
        with ws:
            _episode(send, task)
    finally:
        process.kill()
        process.wait()


# -- the hostile catalogue ------------------------------------------------------------------------
_DO = "DO $$BEGIN EXECUTE format('{}', current_database()); END$$"
#: Statements an attacker would try, by class; ``{template}`` is the clone's template. Each must
#: end within its bound, leave its own session usable and change nothing another trajectory or a
#: later process sees.
CATALOGUE: dict[str, list[str]] = {
    "shared state": [
        _DO.format("ALTER DATABASE %I IS_TEMPLATE true"),
        _DO.format("ALTER DATABASE %I CONNECTION LIMIT 0"),
        _DO.format("ALTER DATABASE %I SET statement_timeout = 0"),
        _DO.format("ALTER DATABASE %I ALLOW_CONNECTIONS false"),
        _DO.format("COMMENT ON DATABASE %I IS ''x''"),
        _DO.format("ALTER DATABASE %I RENAME TO stolen"),
        'GRANT CONNECT ON DATABASE "{template}" TO CURRENT_USER',
        'ALTER DATABASE "{template}" IS_TEMPLATE false',
        'ALTER DATABASE "{template}" ALLOW_CONNECTIONS true',
        'ALTER DATABASE "{template}" CONNECTION LIMIT 0',
        "ALTER DATABASE \"{template}\" SET work_mem = '1GB'",
        "COMMENT ON DATABASE \"{template}\" IS 'x'",
        'ALTER DATABASE "{template}" OWNER TO CURRENT_USER',
        f"REASSIGN OWNED BY {OWNER_ROLE} TO CURRENT_USER",
        f"DROP OWNED BY {OWNER_ROLE}",
        f"GRANT {OWNER_ROLE} TO CURRENT_USER",
        f"SET ROLE {OWNER_ROLE}",
        f"ALTER ROLE {OWNER_ROLE} LOGIN SUPERUSER",
        "ALTER ROLE birdenv NOLOGIN",
        "ALTER DATABASE postgres SET statement_timeout = 0",
        "CREATE ROLE mine LOGIN",
        "SET ROLE birdenv",
        "SET SESSION AUTHORIZATION birdenv",
    ],
    "time": [
        "SET statement_timeout = 0; SELECT pg_sleep(30)",
        "SET LOCAL statement_timeout = 0; SELECT pg_sleep(30)",
        f"SET statement_timeout = 0; {SPIN}",
        STUBBORN,
        "SET statement_timeout = 0; WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 "
        "FROM r) SELECT count(*) FROM r",
        "SET client_connection_check_interval = 0; SET statement_timeout = 0; SELECT pg_sleep(30)",
        "DO $$BEGIN PERFORM set_config('statement_timeout', '0', false); "
        "PERFORM pg_sleep(30); END$$",
        "SET idle_in_transaction_session_timeout = 0; SET lock_timeout = 0; SELECT pg_sleep(30)",
    ],
    "locks": [
        "SELECT count(pg_advisory_lock(i)) FROM generate_series(1, 40000) i",
        "SELECT count(pg_advisory_xact_lock(i)) FROM generate_series(1, 40000) i",
        "SELECT count(pg_try_advisory_lock(i)) FROM generate_series(1, 40000) i",
        "SELECT pg_advisory_lock_shared(1)",
        "CREATE TABLE p (n int) PARTITION BY LIST (n); DO $$BEGIN FOR i IN 1..4000 LOOP "
        "EXECUTE format('CREATE TABLE p%s PARTITION OF p FOR VALUES IN (%s)', i, i); "
        "END LOOP; END$$",
        "LOCK TABLE pg_authid IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE pg_database IN ACCESS EXCLUSIVE MODE",
    ],
    "memory": [
        "SET work_mem = '100GB'; SELECT count(*) FROM (SELECT repeat('x', 1000000) || g AS v "
        "FROM generate_series(1, 1500) g ORDER BY v) s",
        "SELECT count(*) FROM (SELECT array_agg(repeat('x', 1000000)) FROM "
        "generate_series(1, 1100)) s",
        "SET work_mem = '100GB'; SET hash_mem_multiplier = 1000; SELECT count(*) FROM (SELECT "
        "g % 3000000 AS k, repeat('x', 200) FROM generate_series(1, 6000000) g) s GROUP BY k "
        "LIMIT 1",
        "SET temp_file_limit = '100GB'",
        "SET maintenance_work_mem = '100GB'; CREATE INDEX ON customers (name)",
    ],
    "results": [
        "/**/ SELECT g, 'row' FROM generate_series(1, 30000) g",
        "SELECT 1; (SELECT g FROM generate_series(1, 30000) g)",
        "/**/ SELECT repeat('x', 10000) FROM generate_series(1, 15000)",
        "(SELECT repeat('x', 10000) FROM generate_series(1, 15000))",
        "SELECT 1; SELECT repeat('x', 10000) FROM generate_series(1, 15000)",
        "  -- note\nSELECT repeat('x', 10000) FROM generate_series(1, 15000)",
        "WITH t AS (SELECT repeat('x', 10000) v FROM generate_series(1, 15000)) SELECT * FROM t",
        "VALUES (repeat('x', 5000000)), (repeat('y', 5000000))",
        "CREATE TEMP TABLE w AS SELECT repeat('x', 10000) AS v FROM generate_series(1, 15000); "
        "DELETE FROM w RETURNING v",
        "EXPLAIN (ANALYZE, VERBOSE) SELECT repeat('x', 100) FROM generate_series(1, 100000)",
    ],
    "copy": [
        "COPY customers TO STDOUT",
        "COPY customers FROM STDIN",
        "COPY (SELECT repeat('x', 10000) FROM generate_series(1, 15000)) TO STDOUT",
        "SELECT 1; COPY orders FROM STDIN; SELECT 2",
        "COPY customers TO STDOUT WITH (FORMAT binary)",
    ],
    "escapes": [
        "COPY customers TO PROGRAM 'id'",
        "COPY customers FROM '/etc/passwd'",
        "COPY customers TO '/tmp/stolen'",
        "SELECT pg_read_file('/etc/passwd')",
        "SELECT pg_ls_dir('.')",
        "SELECT lo_import('/etc/passwd')",
        "SELECT lo_export(1, '/tmp/stolen')",
        "ALTER SYSTEM SET work_mem = '1GB'",
        "CREATE EXTENSION dblink",
        "CREATE FUNCTION f() RETURNS int LANGUAGE c AS 'libc.so.6', 'getpid'",
        "CREATE FUNCTION g() RETURNS int LANGUAGE internal AS 'now'",
        "SELECT pg_reload_conf()",
        "SELECT pg_rotate_logfile()",
        "PREPARE TRANSACTION 'x'",
        "CREATE DATABASE other",
        "CHECKPOINT",
    ],
    "others": [
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
        "SELECT datname FROM pg_database",
        "SELECT query FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
        "NOTIFY everyone, 'hello'",
        "SELECT pg_terminate_backend(pg_backend_pid())",
    ],
}
# A fast subset for the default run: of every class, statements that neither wait for a
# deadline nor move hundreds of megabytes (one of the time class does: the watchdog's own test).
FAST = {
    name: [
        s
        for s in statements
        if ("30)" not in s and SPIN not in s and s != STUBBORN) and ("repeat(" not in s)
    ][:4]
    for name, statements in CATALOGUE.items()
}
#: The statement timeout the catalogue runs under, and the most any statement may take: the
#: timeout, the watchdog's margin and grace, and room for a loaded machine.
CATALOGUE_TIMEOUT = 2.0
CATALOGUE_BOUND = CATALOGUE_TIMEOUT + 0.5 + 2.0 + 6.0


def run_catalogue(
    pool: DatabasePool, template: str, catalogue: dict[str, list[str]], trajectories: int = 2
) -> dict[str, float]:
    """Play ``catalogue`` in ``trajectories`` concurrent sessions beside a bystander that keeps
    reading and writing its own clone; check every bound (see :data:`CATALOGUE`) and that the
    shared state is unchanged. Return the longest time any statement of each class took."""
    import threading
    import time

    before = _shared_state(pool, template)
    longest: dict[str, float] = dict.fromkeys(catalogue, 0.0)
    failures: list[str] = []
    stop = threading.Event()
    bystander_failures: list[str] = []

    def attack() -> None:
        with _session(pool, template, statement_timeout=CATALOGUE_TIMEOUT) as s:
            for name, statements in catalogue.items():
                for sql in statements:
                    result = s.execute(sql.replace("{template}", template))
                    longest[name] = max(longest[name], result.elapsed)
                    if result.elapsed > CATALOGUE_BOUND:
                        failures.append(f"{sql[:60]}: {result.elapsed:.1f} s")
                    if name == "shared state" and result.ok and "GRANT CONNECT" not in sql:
                        failures.append(f"allowed: {sql[:60]}")
                    after = s.execute("SELECT count(*) FROM orders")
                    if after.error is not None:
                        failures.append(f"unusable after {sql[:60]}: {after.error}")

    def bystand() -> None:
        with _session(pool, template, statement_timeout=30) as s:
            n = 0
            while not stop.is_set():
                n += 1
                for sql in (
                    f"INSERT INTO customers VALUES ({100 + n}, 'B', 'X', '2024')",
                    "SELECT count(*) FROM customers",
                ):
                    result = s.execute(sql)
                    if result.error is not None or result.elapsed > 5:
                        bystander_failures.append(f"{sql}: {result.error} {result.elapsed:.1f}")
                time.sleep(0.05)

    watcher = threading.Thread(target=bystand)
    watcher.start()
    attackers = [threading.Thread(target=attack) for _ in range(trajectories)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join()
    stop.set()
    watcher.join()
    assert not failures, failures
    assert not bystander_failures, bystander_failures
    assert _shared_state(pool, template) == before
    return longest


def _fresh_process_plays(pool: DatabasePool, template: str) -> None:
    """A new process leases ``template`` and finds its original data."""
    import subprocess
    import sys

    script = (
        "from birdenv.postgres import DatabasePool, PgSession\n"
        "from birdenv.replicas.session import Limits\n"
        "with DatabasePool(ready=0) as pool, PgSession(pool, pool.lease("
        f"{template!r}), limits=Limits()) as s:\n"
        "    print(s.execute('SELECT count(*) FROM customers').rows,"
        " s.execute('SELECT count(*) FROM orders').rows)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "[(3,)] [(4,)]", done.stdout + done.stderr


def test_the_catalogue_s_fast_statements_in_two_trajectories(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    assert sum(map(len, FAST.values())) >= 20 and all(FAST.values())
    run_catalogue(pg_pool, pg_shop, FAST)
    with _session(pg_pool, pg_shop) as s:  # the next lease plays on the original data
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert s.execute("SELECT count(*) FROM orders").rows == [(4,)]


@pytest.mark.slow
def test_the_whole_catalogue_in_two_trajectories(pg_pool: DatabasePool, pg_shop: str) -> None:
    assert sum(map(len, CATALOGUE.values())) >= 60
    longest = run_catalogue(pg_pool, pg_shop, CATALOGUE)
    assert max(longest.values()) <= CATALOGUE_BOUND
    pg_pool.drain()
    _fresh_process_plays(pg_pool, pg_shop)


def test_a_nul_character_is_a_clear_error_not_a_cut_statement(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    with _session(pg_pool, pg_shop) as s:
        cut = s.execute("DELETE FROM orders\x00; SELECT 1")
        assert "NUL" in cut.error, cut
        assert s.execute("SELECT count(*) FROM orders").rows == [(4,)]  # nothing ran
