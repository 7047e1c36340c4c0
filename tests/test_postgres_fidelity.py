"""The PostgreSQL judge gives the official verdict on the shapes models submit.

Each case is one the official evaluator (psycopg2, each statement executed, committed, then its
rows fetched) decides one way and a psycopg 3 session could decide the other: empty and
comment-only statements, values psycopg2 reads differently (``DateStyle``, ``'infinity'``, a time
zone Python does not know), a data-modifying ``WITH`` whose result passes the row cap. The
official verdict of each is stated with the case; the same shapes are among the fixtures of the
agreement test (``tests/test_postgres_env.py``), labelled by the official evaluator itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from birdenv.judge.postgres import TaskDatabases, judge_pg
from birdenv.postgres import DatabasePool, PgSession
from birdenv.postgres.session import run_pg_statement
from birdenv.replicas.session import Limits
from birdenv.tasks import Task, load_tasks

pytest.importorskip("psycopg")

EX_BASE = (
    "\ndef test_case(pred_sqls, sol_sqls, db_name, conn):\n"
    "    result = ex_base(pred_sqls, sol_sqls, db_name, conn)\n"
    "    assert result == 1, f'ex_base returned {result} but expected 1.'\n"
    "    return result"
)


@pytest.fixture(scope="module")
def databases(pg_pool: DatabasePool) -> TaskDatabases:
    return TaskDatabases(pg_pool)


@pytest.fixture(scope="module")
def task() -> Task:
    """A bundled PostgreSQL task on bank_finance (its gold and tests are replaced per case)."""
    return next(t for t in load_tasks("critic-mini-pg") if t.db_id == "bank_finance")


def _verdict(databases: TaskDatabases, task: Task, gold: list[str], pred: list[str]) -> str:
    case = dataclasses.replace(task, sol_sql=gold, test_cases=[EX_BASE], preprocess_sql=[])
    return judge_pg(case, pred, pool=databases, statement_timeout=None).status


# -- empty and comment-only statements -----------------------------------------------------------
@pytest.mark.parametrize(
    ("pred", "official"),
    [
        (["-- check the ids first", "SELECT 1"], "failed"),  # psycopg2: an empty query
        (["/* nothing */", "SELECT 1"], "failed"),
        (["SELECT 1", ";"], "failed"),
        (["SELECT 1", "  "], "failed"),
        (["SELECT 1; -- checked"], "success"),  # a comment after a statement is no statement
        (["-- the fix:\nSELECT 1"], "success"),
    ],
)
def test_a_statement_with_nothing_to_run_fails_as_with_psycopg2(
    databases: TaskDatabases, task: Task, pred: list[str], official: str
) -> None:
    assert _verdict(databases, task, ["SELECT 1"], pred) == official


def test_a_session_says_a_comment_alone_is_an_empty_query(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    with PgSession(pg_pool, pg_pool.lease(pg_shop), limits=Limits()) as session:
        for sql in ("-- note", "", ";", "/* c */"):
            assert session.execute(sql).error == "can't execute an empty query"
        assert session.execute("SELECT 1 -- note").rows == [(1,)]


# -- values as psycopg2 reads them -----------------------------------------------------------------
def test_after_a_non_iso_datestyle_a_date_cannot_be_read(
    databases: TaskDatabases, task: Task
) -> None:
    gold = ["SELECT date '2024-01-02'"]
    pred = ["SET datestyle = 'SQL, DMY'", "SELECT date '2024-01-02'"]
    assert _verdict(databases, task, gold, pred) == "failed"  # psycopg2: unable to parse date
    # a datestyle that keeps the ISO output reads as before
    assert _verdict(databases, task, gold, ["SET datestyle = 'ISO, DMY'", *gold]) == "success"


@pytest.mark.parametrize("kind", ["date", "timestamp", "timestamptz"])
def test_infinity_reads_as_the_largest_value(
    databases: TaskDatabases, task: Task, kind: str
) -> None:
    # psycopg2 reads 'infinity' as date.max / datetime.max, where psycopg 3 raises
    gold = [f"SELECT '-infinity'::{kind}, 'infinity'::{kind}"]
    assert _verdict(databases, task, gold, gold) == "success"


def test_a_timestamptz_keeps_the_offset_of_a_zone_python_does_not_know(
    databases: TaskDatabases, task: Task
) -> None:
    # The server names the zone '<+09>-09'; psycopg2 keeps the +09 it prints, so the day is the
    # 2nd (psycopg 3, not knowing the zone, reads it in UTC: the 1st).
    pred = [
        "SET TIME ZONE INTERVAL '+09:00' HOUR TO MINUTE",
        "SELECT timestamptz '2024-01-01 20:00+00'",
    ]
    assert _verdict(databases, task, ["SELECT date '2024-01-02'"], pred) == "success"


def test_a_session_reads_values_as_psycopg2(pg_pool: DatabasePool, pg_shop: str) -> None:
    import datetime

    with PgSession(pg_pool, pg_pool.lease(pg_shop), limits=Limits()) as session:
        row = session.execute(
            "SELECT 'infinity'::date, '11111111-2222-3333-4444-555555555555'::uuid, "
            "'10.1.2.3'::inet, interval '1 year 2 mons 3 days 04:05:06.5', time '24:00'"
        ).rows[0]
        assert row == (
            datetime.date.max,
            "11111111-2222-3333-4444-555555555555",
            "10.1.2.3",
            datetime.timedelta(days=428, seconds=14706, microseconds=500000),
            datetime.time(0, 0),
        )
        assert session.execute("SET intervalstyle = 'iso_8601'").ok
        unreadable = session.execute("SELECT interval '1 day'")
        assert "iso_8601 intervalstyle currently not supported" in unreadable.error
        # the statement was committed before its rows failed to read, as with psycopg2
        assert session.execute("SET datestyle = 'German'").ok
        failed = session.execute(
            "WITH u AS (UPDATE customers SET city = 'Oslo' WHERE id = 1 RETURNING now()::date) "
            "SELECT * FROM u"
        )
        assert "unable to parse date" in failed.error
        assert session.execute("SELECT city FROM customers WHERE id = 1").rows == [("Oslo",)]


# -- the row cap bounds what comes back, never what is done ----------------------------------------
def test_a_data_modifying_with_over_the_row_cap_is_committed_whole(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    lease = pg_pool.lease(pg_shop)
    conn: Any = pg_pool.connect(lease)
    try:
        sql = "WITH u AS (UPDATE customers SET city = 'Lyon' RETURNING id) SELECT id FROM u"
        rows, columns, truncated = run_pg_statement(
            conn, sql, timeout=10, max_rows=2, max_result_bytes=None
        )
        assert (len(rows), columns, truncated) == (2, ["id"], True)
        count = "SELECT count(*) FROM customers WHERE city = 'Lyon'"
        assert run_pg_statement(conn, count, timeout=10, max_rows=5, max_result_bytes=None)[0] == [
            (3,)
        ]
    finally:
        conn.close()
        pg_pool.release(lease)
    with PgSession(pg_pool, pg_pool.lease(pg_shop), limits=Limits(max_rows=1)) as session:
        cut = session.execute("DELETE FROM orders RETURNING id")
        assert cut.ok and cut.truncated and cut.rowcount == 1
        assert session.execute("SELECT count(*) FROM orders").rows == [(0,)]
        # a failure after the cap is the statement's failure, as when every row is read
        failed = session.execute("SELECT 1 / (3 - g) FROM generate_series(1, 5) g")
        assert "division by zero" in failed.error


def test_the_judge_keeps_the_writes_of_a_with_that_returns_more_than_it_keeps(
    databases: TaskDatabases, task: Task
) -> None:
    # 10,001 rows come back (the official cap is 10,000): every row is updated all the same
    # (ex_base runs the prediction a second time, so it must run twice)
    pred = [
        "CREATE TABLE IF NOT EXISTS marks AS SELECT g AS id, false AS seen FROM generate_series(1, 10001) g",
        "WITH u AS (UPDATE marks SET seen = true RETURNING id) SELECT id FROM u",
        "SELECT count(*) FROM marks WHERE seen",
    ]
    assert _verdict(databases, task, ["SELECT 10001::bigint"], pred) == "success"


# -- drops keep pace with leases -------------------------------------------------------------------
def test_released_clones_waiting_for_their_drop_stay_within_the_backlog(pg_shop: str) -> None:
    with DatabasePool(ready=0, workers=1, backlog=2) as pool:
        leases = [pool.lease(pg_shop) for _ in range(10)]
        names = [lease.name for lease in leases]
        for lease in leases:  # as fast as a caller can: drops of 10 clones cannot keep up
            pool.release(lease)
            assert pool.stats()["dropping"] <= 2
        with pool.server.admin() as admin:
            left = admin.execute(
                "SELECT count(*) FROM pg_database WHERE datname = ANY(%s)", (names,)
            ).fetchone()[0]
        assert left <= 2
        pool.drain()
        assert pool.stats()["dropping"] == 0


# -- the database's name ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gold", "pred"),
    [
        (["SELECT count(*) FROM loans"], ["SELECT count(*) FROM bank_finance.public.loans"]),
        (
            ["SELECT 1::bigint"],
            [
                "SELECT count(*) FROM information_schema.tables "
                "WHERE table_catalog = 'bank_finance' AND table_name = 'loans'"
            ],
        ),
        (["SELECT 'bank_finance'::name"], ["SELECT current_database()"]),
    ],
)
def test_sql_that_names_its_database_runs_in_a_database_of_that_name(
    databases: TaskDatabases, task: Task, gold: list[str], pred: list[str]
) -> None:
    # The official evaluator runs in a database named db_id; an instance whose SQL names it is
    # judged on a clone of that name (the last case names it in the gold).
    assert _verdict(databases, task, gold, pred) == "success"


def test_instances_that_name_one_database_take_the_name_in_turn(
    databases: TaskDatabases, task: Task
) -> None:
    from birdenv.judge.postgres import judge_pg_many

    case = dataclasses.replace(
        task, sol_sql=["SELECT count(*) FROM loans"], test_cases=[EX_BASE], preprocess_sql=[]
    )
    named = ["SELECT count(*) FROM bank_finance.public.loans"]
    jobs = [(case, named), (case, ["SELECT count(*) FROM loans"])] * 3
    verdicts = list(judge_pg_many(jobs, processes=4, pool=databases, statement_timeout=None))
    assert [v.status for v in verdicts] == ["success"] * 6
    with databases.pool.server.admin() as admin:  # the name is free again
        assert not admin.execute(
            "SELECT 1 FROM pg_database WHERE datname = 'bank_finance'"
        ).fetchone()


def test_a_batch_of_judgements_leaves_no_ready_clone_behind(task: Task) -> None:
    from birdenv.judge.postgres import judge_pg_many

    case = dataclasses.replace(task, test_cases=[EX_BASE], preprocess_sql=[])
    with DatabasePool(ready=2) as pool:
        databases = TaskDatabases(pool)
        verdicts = list(judge_pg_many([(case, case.sol_sql)] * 3, processes=2, pool=databases))
        assert [v.status for v in verdicts] == ["success"] * 3
        pool.drain()
        # clones are made for the leases still to come, none for a lease that will not come
        assert pool.stats() == {"ready": 0, "pending": 0, "leased": 0, "dropping": 0}


def test_a_name_held_by_a_process_that_died_is_taken_back(
    databases: TaskDatabases, task: Task
) -> None:
    import subprocess
    import sys

    crash = (
        "import os\n"
        "from birdenv.judge.postgres import TaskDatabases\n"
        "from birdenv.postgres import DatabasePool\n"
        "from birdenv.tasks import load_tasks\n"
        "task = next(t for t in load_tasks('critic-mini-pg') if t.db_id == 'bank_finance')\n"
        "lease = TaskDatabases(DatabasePool(ready=0)).lease(task, named=True)\n"
        "print(lease.name, lease.database, flush=True)\n"
        "os._exit(0)  # killed while it holds the name: nothing is released\n"
    )
    held = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, check=True)
    clone, name = held.stdout.split()
    assert name == "bank_finance"
    gold, pred = ["SELECT count(*) FROM loans"], ["SELECT count(*) FROM bank_finance.public.loans"]
    assert _verdict(databases, task, gold, pred) == "success"  # not a wait for the dead process
    with databases.pool.server.admin() as admin:
        assert not admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (clone,)).fetchone()
