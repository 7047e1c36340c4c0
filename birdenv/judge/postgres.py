"""The official BIRD-CRITIC PostgreSQL evaluation, on a fresh clone per instance.

:func:`judge_pg` gives the verdict the official PostgreSQL evaluator gives, phase by phase:

1. A fresh database (here a clone leased from a :class:`TaskDatabases` pool, where the official
   evaluator drops and recreates the database from its template afterwards, under a lock per
   database); ``preprocess_sql``, the first error stopping it, errors ignored.
2. The prediction, one statement at a time on the same connection, each committed, the first
   error (or timeout) stopping it and failing the instance; each statement gets a 60 s
   ``statement_timeout`` (15 s when it contains ``WITH RECURSIVE``).
3. If it ran, every test in the task's ``test_cases`` (``efficiency`` tasks compare the issue SQL
   with the prediction instead of the prediction with the gold). A task without tests passes
   whenever its prediction runs: the official PostgreSQL evaluator has no default test and no
   issue phase.
4. ``clean_up_sql``, errors ignored; the clone is dropped.

Test code runs with the official names in scope, written here from their documented behaviour:
``perform_query_on_postgresql_databases``, ``execute_queries``, ``ex_base``,
``performance_compare_by_qep``, ``check_sql_function_usage``, ``remove_distinct``,
``preprocess_results``, ``pred_query_result`` and ``date``; it is called as
``test_case(pred_sqls, sol_sqls, db_name, conn)``.

:class:`TaskDatabases` gives tasks their databases: the template of a task's SQLite file (the
bundled suites' six databases, converted by :mod:`birdenv.postgres.convert`), or, for the official
layout on a server that already holds them, ``{db_id}_template``.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import io
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from birdenv.judge.instance import Verdict
from birdenv.judge.official import check_sql_function_usage
from birdenv.postgres import DatabasePool, Lease, PgSession
from birdenv.postgres.convert import sqlite_template
from birdenv.postgres.server import psycopg
from birdenv.postgres.session import run_pg_statement
from birdenv.replicas.session import Limits
from birdenv.tasks import Task, split_sql_field

__all__ = [
    "STATEMENT_TIMEOUT",
    "TaskDatabases",
    "default_task_databases",
    "judge_pg",
    "judge_pg_many",
    "names_its_database",
    "preprocess_results",
    "remove_distinct",
    "validate_pg_tasks",
]

#: The official evaluator's ``statement_timeout``, and the one for ``WITH RECURSIVE`` statements.
STATEMENT_TIMEOUT = 60.0
RECURSIVE_TIMEOUT = 15.0
#: Rows the official evaluator keeps of any statement's result.
MAX_ROWS = 10_000


class TaskDatabases:
    """Databases for PostgreSQL tasks: a :class:`~birdenv.postgres.DatabasePool` and each task's
    template (see the module's docstring). ``session(task)`` leases a clone with the task's
    ``preprocess_sql`` applied, as :meth:`birdenv.replicas.ReplicaPool.session` does on SQLite."""

    def __init__(self, pool: DatabasePool | None = None, **pool_options: Any) -> None:
        self.pool = pool or DatabasePool(**pool_options)
        self._owns = pool is None
        self._templates: dict[Any, str] = {}
        self._coming: collections.Counter[Any] = collections.Counter()
        self._lock = threading.Lock()

    @staticmethod
    def _key(task: Task) -> tuple[str, str]:
        return (task.db_id, str(task.db_dir))

    def expect(self, tasks: Iterable[Task]) -> None:
        """Say that one lease of each of ``tasks`` will follow
        (:meth:`~birdenv.postgres.DatabasePool.expect`: no ready clone is left over to drop
        when a batch of judgements ends)."""
        known: collections.Counter[str] = collections.Counter()
        with self._lock:
            for task in tasks:
                key = self._key(task)
                if key in self._templates:
                    known[self._templates[key]] += 1
                else:  # told to the pool once the template is known (template_for)
                    self._coming[key] += 1
        for template, leases in known.items():
            self.pool.expect(template, leases)

    def template_for(self, task: Task) -> str:
        """The template database of ``task`` (made from its SQLite file on first use)."""
        key = self._key(task)
        with self._lock:
            name = self._templates.get(key)
        if name is not None:
            return name
        if task.db_dir is None:
            name = f"{task.db_id}_template"  # the official layout, on the server already
        else:
            name = self.pool.template(sqlite_template(task.db_path, task.db_id))
        with self._lock:
            self._templates[key] = name
            coming = self._coming.pop(key, 0)
        if coming:
            self.pool.expect(name, coming)
        else:
            self.pool.warm(name)
        return name

    def lease(self, task: Task, *, named: bool = False) -> Lease:
        """A fresh clone of ``task``'s database; ``named``: a clone that answers to the name
        ``task.db_id`` (:meth:`~birdenv.postgres.DatabasePool.lease_as`: one at a time per
        name)."""
        template = self.template_for(task)
        if named:
            return self.pool.lease_as(template, task.db_id)
        return self.pool.lease(template)

    def session(
        self, task: Task, *, limits: Limits | None = None, exclusive: bool = True
    ) -> PgSession:
        """A trajectory's session on a fresh clone with ``preprocess_sql`` applied (errors raise
        :class:`~birdenv.errors.PreprocessError`); ``exclusive`` is accepted for the SQLite
        pool's signature (a clone is always the trajectory's own)."""
        session = PgSession(
            self.pool, self.lease(task), limits=limits or Limits(), task_id=task.instance_id
        )
        try:
            for sql in task.preprocess_sql:
                session.prepare(sql)
        except BaseException:
            session.close()
            raise
        return session

    def close(self) -> None:
        """Close the pool if this object made it."""
        if self._owns:
            self.pool.close()


_DEFAULT: TaskDatabases | None = None
_DEFAULT_LOCK = threading.Lock()


def default_task_databases() -> TaskDatabases:
    """The process's :class:`TaskDatabases`, on the process's default pool: a forked process
    (an environment worker), whose default pool is its own, gets its own too. Its copy of the
    parent's held the parent's pool and leased the parent's ready clones, and the first of the
    two to release one dropped it and its role under the other."""
    # the pool needs psycopg (the postgres extra): imported when first used
    from birdenv.postgres import default_database_pool

    pool = default_database_pool()
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT.pool is not pool:
            _DEFAULT = TaskDatabases(pool)
        return _DEFAULT


def _new_lock_in_child() -> None:
    # A thread of the parent may have held the lock when it forked: the child's copy would stay
    # held for ever.
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


# -- the official helpers ------------------------------------------------------------------------
def remove_distinct(sql_list: list[str]) -> list[str]:
    """Drop every whole word DISTINCT, in any case, keeping the whitespace around it.

    >>> remove_distinct(["SELECT DISTINCT a FROM t", "SELECT COUNT(distinct a) FROM t"])
    ['SELECT  a FROM t', 'SELECT COUNT( a) FROM t']
    """
    return [re.sub(r"\bDISTINCT\b", "", sql, flags=re.IGNORECASE) for sql in sql_list]


def preprocess_results(results: Any) -> list[tuple[Any, ...]]:
    """Dates and datetimes as ``YYYY-MM-DD``; everything else as it is (no rounding on
    PostgreSQL).

    >>> preprocess_results([(datetime.date(2024, 1, 2), 1.005)])
    [('2024-01-02', 1.005)]
    """
    return [
        tuple(
            item.strftime("%Y-%m-%d")
            if isinstance(item, (datetime.date, datetime.datetime))
            else item
            for item in row
        )
        for row in results
    ]


def _timeout(sql: str) -> float:
    return RECURSIVE_TIMEOUT if "WITH RECURSIVE" in sql.upper() else STATEMENT_TIMEOUT


class _Helpers:
    """The official helper functions bound to one instance's clone and connection."""

    def __init__(self, databases: TaskDatabases, lease: Lease, limit: float | None) -> None:
        self.databases, self.lease, self.limit = databases, lease, limit
        self.opened: list[Any] = []

    def timeout(self, sql: str) -> float | None:
        official = _timeout(sql)
        return official if self.limit is None else min(official, self.limit)

    def perform_query_on_postgresql_databases(
        self, query: str, db_name: str, conn: Any = None
    ) -> tuple[Any, Any]:
        if conn is None:  # the official code borrows a pooled connection to the database
            conn = self.databases.pool.connect(self.lease)
            self.opened.append(conn)
        rows, _, _ = run_pg_statement(
            conn, query, timeout=self.timeout(query), max_rows=MAX_ROWS, max_result_bytes=None
        )
        return rows, conn

    def execute_queries(
        self,
        queries: list[str],
        db_name: str,
        conn: Any,
        logger: Any = None,
        section_title: str = "",
    ) -> tuple[Any, bool, bool]:
        result, error, timed_out = None, False, False
        for query in queries:
            try:
                result, conn = self.perform_query_on_postgresql_databases(query, db_name, conn)
            except psycopg().errors.QueryCanceled:
                timed_out = True
                break
            except Exception:  # the official evaluator counts every other failure as an error
                error = True
                break
        return result, error, timed_out

    def ex_base(self, pred_sqls: list[str], sol_sqls: list[str], db_name: str, conn: Any) -> int:
        if not pred_sqls or not sol_sqls:
            return 0
        predicted, pred_error, pred_timeout = self.execute_queries(pred_sqls, db_name, conn)
        gold, gold_error, gold_timeout = self.execute_queries(sol_sqls, db_name, conn)
        if pred_error or pred_timeout or gold_error or gold_timeout:
            return 0
        if not predicted or not gold:
            return 0
        return int(set(preprocess_results(predicted)) == set(preprocess_results(gold)))

    def performance_compare_by_qep(
        self, old_sqls: list[str], sol_sqls: list[str], db_name: str, conn: Any
    ) -> int:
        if not old_sqls or not sol_sqls:
            return 0

        def cost(sql_list: list[str]) -> float:
            total = 0.0
            for sql in sql_list:
                if (
                    not sql.strip()
                    .upper()
                    .startswith(("SELECT", "INSERT", "UPDATE", "DELETE", "WITH"))
                ):
                    with contextlib.suppress(Exception):
                        self.perform_query_on_postgresql_databases(sql, db_name, conn)
                    continue
                try:
                    rows, _ = self.perform_query_on_postgresql_databases(
                        f"EXPLAIN (FORMAT JSON) {sql}", db_name, conn
                    )
                    if not rows:
                        continue
                    plan = rows[0][0]
                    if isinstance(plan, str):
                        plan = json.loads(plan)
                    part = (
                        plan[0].get("Plan", {}).get("Total Cost", 0.0)
                        if isinstance(plan, list) and plan
                        else 0.0
                    )
                    total += float(part)
                except Exception:  # the official helper prints and goes on
                    continue
            return total

        costs = []
        for sqls in (old_sqls, sol_sqls):
            try:
                self.perform_query_on_postgresql_databases("BEGIN", db_name, conn)
                costs.append(cost(sqls))
            finally:
                self.perform_query_on_postgresql_databases("ROLLBACK", db_name, conn)
        return 1 if costs[1] < costs[0] else 0

    def namespace(self, result: Any) -> dict[str, Any]:
        return {
            "perform_query_on_postgresql_databases": self.perform_query_on_postgresql_databases,
            "execute_queries": self.execute_queries,
            "ex_base": self.ex_base,
            "performance_compare_by_qep": self.performance_compare_by_qep,
            "check_sql_function_usage": check_sql_function_usage,
            "remove_distinct": remove_distinct,
            "preprocess_results": preprocess_results,
            "pred_query_result": result,
            "date": datetime.date,
        }

    def close(self) -> None:
        for conn in self.opened:
            with contextlib.suppress(Exception):
                conn.close()


# redirect_stdout swaps a process-wide stream: one test's output capture at a time.
_STDOUT = threading.Lock()


def _run_test(code: str, helpers: _Helpers, result: Any, args: tuple[Any, ...]) -> str | None:
    """Run one test's source; None when it passed, else the official message."""
    env = helpers.namespace(result)
    local = dict(zip(("pred_sqls", "sol_sqls", "db_name", "conn"), args, strict=True))
    source = (
        "from datetime import date\n"
        + code
        + "\n__test_case_result__ = test_case(pred_sqls, sol_sqls, db_name, conn)"
    )
    with _STDOUT, contextlib.redirect_stdout(io.StringIO()):
        try:
            exec(source, env, local)
        except AssertionError as exc:
            return f"Test case failed due to assertion error: {exc}"
        except Exception as exc:
            return f"Test case failed due to error: {exc}"
    return None


def names_its_database(task: Task, preds: list[str]) -> bool:
    """Whether the instance's SQL or tests name its database (``db_id`` as a word: a
    three-part name, ``table_catalog = 'db_id'``, ``ALTER DATABASE db_id``): such an instance is
    judged on a clone named ``db_id``, as the official evaluator's database is named; the others
    on clones of their own names, any number at once.

    >>> from birdenv.tasks import parse_task
    >>> task = parse_task({"instance_id": "t", "db_id": "shop", "query": "", "sol_sql": []})
    >>> names_its_database(task, ["SELECT * FROM shop.public.orders"])
    True
    >>> names_its_database(task, ["SELECT * FROM shop_orders"])
    False
    """
    word = re.compile(rf"\b{re.escape(task.db_id)}\b", re.IGNORECASE)
    texts = (
        *preds, *task.sol_sql, *task.issue_sql, *task.preprocess_sql, *task.clean_up_sql,
        *task.test_cases,
    )  # fmt: skip
    return any(word.search(text) for text in texts)


def judge_pg(
    task: Task,
    sql_list: list[str] | str,
    *,
    pool: TaskDatabases | None = None,
    statement_timeout: float | None = STATEMENT_TIMEOUT,
) -> Verdict:
    """The official PostgreSQL verdict on ``sql_list`` for ``task`` (see the module's docstring).

    ``statement_timeout`` caps the official per-statement timeouts (``None``: the official ones).
    """
    databases = pool if isinstance(pool, TaskDatabases) else default_task_databases()
    preds = split_sql_field(sql_list) if isinstance(sql_list, str) else list(sql_list)
    started = time.monotonic()
    total = len(task.test_cases)
    try:
        lease = databases.lease(task, named=names_its_database(task, preds))
    except Exception as exc:
        return Verdict(
            task.instance_id, "failed", "setup", f"{type(exc).__name__}: {exc}", 0, total
        )
    helpers = _Helpers(databases, lease, statement_timeout)
    conn = None
    try:
        conn = databases.pool.connect(lease)
        helpers.execute_queries(task.preprocess_sql, lease.database, conn)
        result, error, timed_out = helpers.execute_queries(preds, lease.database, conn)
        passed, failed, message = 0, [], None
        if not error and not timed_out and task.test_cases:
            pair = (task.issue_sql, preds) if task.efficiency else (preds, task.sol_sql)
            for i, code in enumerate(task.test_cases, 1):
                outcome = _run_test(code, helpers, result, (*pair, lease.database, conn))
                if outcome is None:
                    passed += 1
                else:
                    failed.append(f"test_{i}")
                    message = message or outcome
        helpers.execute_queries(task.clean_up_sql, lease.database, conn)
    finally:
        helpers.close()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        databases.pool.release(lease)
    timings = {"total": time.monotonic() - started}
    if error or timed_out:
        phase = "timeout" if timed_out else "prediction"
        return Verdict(
            task.instance_id,
            "failed",
            phase,
            f"the prediction's statements: {phase}",
            0,
            total,
            timings=timings,
        )
    if failed:
        return Verdict(
            task.instance_id, "failed", "tests", message, passed, total, failed, timings=timings
        )
    return Verdict(task.instance_id, "success", None, None, passed, total, timings=timings)


def judge_pg_many(
    jobs: Iterable[tuple[Task, list[str] | str]],
    *,
    processes: int | None = None,
    statement_timeout: float | None = STATEMENT_TIMEOUT,
    pool: TaskDatabases | None = None,
) -> Iterator[Verdict]:
    """:func:`judge_pg` of many pairs, verdicts in order, ``processes`` at once (threads: each
    instance waits on its own server backend, so instances run in parallel, also on one
    database, where the official evaluator holds a lock per database); ``pool`` as for
    :func:`judge_pg`."""
    pairs = list(jobs)
    (pool if isinstance(pool, TaskDatabases) else default_task_databases()).expect(
        task for task, _ in pairs
    )
    with ThreadPoolExecutor(max(1, processes or 1)) as executor:
        futures = [
            executor.submit(judge_pg, task, sqls, pool=pool, statement_timeout=statement_timeout)
            for task, sqls in pairs
        ]
        for future in futures:
            yield future.result()


def validate_pg_tasks(tasks: list[Task], *, processes: int = 1) -> list[str]:
    """Problems of a PostgreSQL debugging task set, one line each (empty when it is sound): every
    gold must pass and every issue SQL must fail (the official PostgreSQL evaluator has no issue
    phase to check the second, so it is judged as a prediction of its own)."""
    jobs = [(t, t.sol_sql) for t in tasks] + [(t, t.issue_sql) for t in tasks]
    verdicts = list(judge_pg_many(jobs, processes=processes))
    problems = []
    for task, gold, issue in zip(
        tasks, verdicts[: len(tasks)], verdicts[len(tasks) :], strict=True
    ):
        if not task.issue_sql:
            problems.append(f"{task.instance_id}: has no issue_sql")
        elif not gold.passed:
            problems.append(f"{task.instance_id}: gold fails ({gold.phase}): {gold.error}")
        elif issue.passed:
            problems.append(f"{task.instance_id}: issue_sql passes the tests")
    return problems
