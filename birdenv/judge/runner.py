"""Running one instance's statements and test code as the official evaluator does.

:class:`Runner` binds the official helpers to the current phase's session and deadlines and
memoises read-only results; the test code's output is captured per thread with a bound, and an
instance deadline interrupts Python test code (SIGALRM, main thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import io
import re
import signal
import sqlite3
import sys
import threading
import time
import types
from typing import Any

from birdenv.judge.official import (
    TEST_CALL,
    TEST_PRELUDE,
    check_sql_function_usage,
    preprocess_results,
    remove_comments,
    remove_distinct,
    remove_round,
)
from birdenv.replicas.guard import authorizer
from birdenv.replicas.session import MAX_ROWS, Session, run_statement
from birdenv.tasks import Task

__all__ = ["Phase", "Runner"]


@functools.lru_cache(maxsize=4096)
def _compiled(source: str) -> types.CodeType:
    """A test's source as the official evaluator runs it, compiled once per process (a judge
    runs the same tests in both phases and for every prediction)."""
    return compile(TEST_PRELUDE + source + TEST_CALL, "<string>", "exec")


# Captured test output kept per verdict; the rest is dropped, never buffered.
_MAX_CAPTURE = 64 << 10


class _Deadline(Exception):
    """Raised inside test code when the instance's deadline passes."""


@dataclasses.dataclass
class Phase:
    execution_error: bool = False
    timeout: bool = False
    assertion_error: bool = False
    passed: int = 0
    total: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.execution_error or self.timeout or self.assertion_error)


# Actions that only read: a statement made of these alone leaves the database as it found it.
_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
# Page cache of a judge session, in KiB.
_JUDGE_CACHE_KIB = 32768
# Functions whose result is not a function of the database state alone.
_VOLATILE_FUNCTIONS = frozenset(
    {"random", "randomblob", "changes", "total_changes", "last_insert_rowid", "sqlite_offset"}
)
# The evaluator's own per-statement settings: they change no data.
_PRELUDE_PRAGMAS = frozenset({"journal_mode", "synchronous"})
_VOLATILE_TEXT = re.compile(r"now|current_", re.IGNORECASE)


class Runner:
    """Runs one instance's statements and tests with the official helper semantics.

    Read-only results are memoised per instance. Both phases start from the same state (a fresh
    copy plus ``preprocess_sql``), and until something writes, a deterministic read-only statement
    returns the same rows every time it runs; the official evaluator runs the gold, the issue SQL
    and the prediction two or three times each (its default test re-runs them). The authorizer
    sees every action of every statement, so any write, DDL, pragma, transaction or volatile
    function makes the state "dirty" and switches the memo off until the next fresh state.
    """

    def __init__(self, deadline: float, statement_timeout: float | None) -> None:
        self.deadline = deadline
        self.statement_timeout = statement_timeout
        self.session: Session | None = None
        self.extra_connections: list[sqlite3.Connection] = []
        self.memo: dict[str, list[tuple[Any, ...]]] = {}
        self.memo_enabled = True
        self.dirty = False
        self.volatile = False  # a volatile function or 'now' ran since the last fresh state
        self.ever_volatile = False  # ... at any time in this instance
        self._touched = False  # set by the authorizer when the running statement did more than read

    def authorizer(self, action: int, arg1: Any, arg2: Any, db: Any, source: Any) -> int:
        """The session guard, plus a record of whether anything but reading happened."""
        verdict = authorizer(action, arg1, arg2, db, source)
        if action in _READ_ACTIONS:
            return verdict
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in _VOLATILE_FUNCTIONS:
                self._touched = self.volatile = self.ever_volatile = True
            return verdict
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _PRELUDE_PRAGMAS:
            return verdict
        self._touched = True
        return verdict

    def fresh_state(self, session: Session) -> None:
        """A new phase's session: watch its connection, and trust the memo again."""
        self.session = session
        session.conn.set_authorizer(self.authorizer)
        # A judge holds at most two sessions at a time, so it can afford a page cache that keeps
        # a task's tables in memory while the prediction and then the tests scan them (SQLite's
        # default is 2 MB; a result never depends on it).
        session.conn.execute(f"PRAGMA cache_size = -{_JUDGE_CACHE_KIB}")
        self.dirty = self.volatile = False

    def after_preprocess(self) -> None:
        """``preprocess_sql`` ran: its writes are part of the state both phases start from."""
        # Unless it was volatile (random data, 'now'...): then the two phases may not start
        # equal, and nothing is memoised for this instance.
        if self.volatile:
            self.memo_enabled = False
        self.dirty = False

    def _statement_deadline(self) -> float:
        if self.statement_timeout is None:
            return self.deadline
        return min(self.deadline, time.monotonic() + self.statement_timeout)

    # The official helpers, bound to the current session and deadlines.
    def perform_query_on_sqlite_databases(
        self,
        query: str,
        db_path: str,
        conn: sqlite3.Connection | None = None,
        query_timeout: int = 30,
    ) -> tuple[Any, sqlite3.Connection]:
        if conn is None:
            assert self.session is not None
            conn = self.session.connect()
            conn.set_authorizer(self.authorizer)
            self.extra_connections.append(conn)
        usable = self.memo_enabled and not self.dirty and not conn.in_transaction
        if usable and query in self.memo:
            return list(self.memo[query]), conn
        self._touched = False
        try:
            rows, _, _ = run_statement(
                conn, query, max_rows=MAX_ROWS, deadline=self._statement_deadline()
            )
        except BaseException:
            self.dirty = self.dirty or self._touched
            raise
        if _VOLATILE_TEXT.search(query):
            self.volatile = self.ever_volatile = True
        if self._touched or self.volatile:
            self.dirty = True
        elif usable and rows is not None:
            self.memo[query] = list(rows)
        return rows, conn

    def execute_queries(
        self,
        queries: Any,
        db_path: str,
        conn: sqlite3.Connection | None,
        logger: Any = None,
        section_title: str = "",
        return_error: bool = False,
    ) -> tuple:
        result = None
        execution_error = timeout_error = False
        message = ""
        if isinstance(queries, str):
            queries = [queries]
        for i, query in enumerate(queries, 1):
            try:
                result, conn = self.perform_query_on_sqlite_databases(query, db_path, conn)
            except sqlite3.OperationalError as exc:
                text = str(exc).lower()
                if (
                    "database is locked" in text
                    or "timeout" in text
                    or "complex query skipped" in text
                ):
                    timeout_error = True
                    message += f"Timeout/Skip error executing query {i}: {exc}\n"
                else:
                    execution_error = True
                    message += f"OperationalError executing query {i}: {exc}\n"
                break
            except sqlite3.Error as exc:
                execution_error = True
                message += f"SQLite Error executing query {i}: {exc}\n"
                break
            except Exception as exc:
                execution_error = True
                message += f"Generic error executing query {i}: {exc}\n"
                break
        if return_error:
            return result, execution_error, timeout_error, message
        return result, execution_error, timeout_error

    def ex_base(
        self,
        pred_sqls: list[str],
        sol_sqls: list[str],
        db_path: str,
        conn: sqlite3.Connection,
        conditions: dict | None = None,
    ) -> int:
        if not pred_sqls or not sol_sqls:
            return 0
        predicted, pred_err, pred_to = self.execute_queries(pred_sqls, db_path, conn, None, "")
        gold, gold_err, gold_to = self.execute_queries(sol_sqls, db_path, conn, None, "")
        if pred_err or pred_to or gold_err or gold_to:
            return 0
        predicted = preprocess_results(predicted)
        gold = preprocess_results(gold)
        if not predicted or not gold:
            return 0
        if conditions is not None and conditions.get("order", False):
            return int(predicted == gold)
        return int(set(predicted) == set(gold))

    def close_extra_connections(self) -> None:
        while self.extra_connections:
            self.extra_connections.pop().close()

    def namespace(self, pred_query_result: Any) -> dict[str, Any]:
        return {
            "perform_query_on_sqlite_databases": self.perform_query_on_sqlite_databases,
            "execute_queries": self.execute_queries,
            "ex_base": self.ex_base,
            "check_sql_function_usage": check_sql_function_usage,
            "remove_distinct": remove_distinct,
            "remove_comments": remove_comments,
            "remove_round": remove_round,
            "preprocess_results": preprocess_results,
            "pred_query_result": pred_query_result,
            "date": datetime.date,
        }

    def run_test(
        self, source: str, result: Any, pred_sqls: list[str], task: Task, conn
    ) -> str | None:
        """Run one test's source; None when it passed, else the reason it failed."""
        assert self.session is not None
        global_env = self.namespace(result)
        # Separate globals and locals, as the official evaluator: names the test source defines
        # at top level are not visible inside test_case.
        local_env = {
            "conn": conn,
            "pred_sqls": pred_sqls,
            "sol_sqls": list(task.sol_sql),
            "db_path": self.session.db_path,
            "kwargs": {"conditions": task.conditions},
        }
        sink = _BoundedText(_MAX_CAPTURE)
        try:
            with _capture_stdout(sink), _alarm(self.deadline):
                exec(_compiled(source), global_env, local_env)
        except AssertionError as exc:
            return f"Test case failed due to assertion error: {exc}"
        except _Deadline:
            return "timeout: the instance deadline passed while a test was running"
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: test code must not end the judge
            return f"Test case failed due to error: {exc}"
        return None

    def evaluation_phase(self, statements: list[str], task: Task, tests: list[str]) -> Phase:
        assert self.session is not None
        conn = self.session.conn
        phase = Phase(total=len(tests))
        result, phase.execution_error, phase.timeout, message = self.execute_queries(
            statements, self.session.db_path, conn, None, "", return_error=True
        )
        if message:
            phase.errors.append(message.strip())
        if phase.execution_error or phase.timeout:
            return phase
        for i, source in enumerate(tests, 1):
            failure = self.run_test(source, result, statements, task, conn)
            if failure is None:
                phase.passed += 1
                continue
            phase.failed.append(f"test_{i}")
            phase.errors.append(failure)
            if failure.startswith("timeout"):
                phase.timeout = True
        phase.assertion_error = bool(phase.failed) and not phase.timeout
        return phase


class _BoundedText(io.TextIOBase):
    """A text sink that keeps the first ``limit`` characters and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.size = limit, [], 0

    def write(self, text: str) -> int:
        if self.size < self.limit:
            self.parts.append(text[: self.limit - self.size])
        self.size += len(text)
        return len(text)


class _StdoutRouter(io.TextIOBase):
    """``sys.stdout`` that sends each thread's writes to that thread's sink, if it has one.

    ``contextlib.redirect_stdout`` swaps a process-wide object: two threads judging at once would
    restore each other's sinks and leave the real stdout lost. Routing per thread avoids that.
    """

    def __init__(self, real: Any) -> None:
        self.real = real
        self.local = threading.local()

    def write(self, text: str) -> int:
        sink = getattr(self.local, "sink", None)
        return (sink if sink is not None else self.real).write(text)

    def flush(self) -> None:
        if getattr(self.local, "sink", None) is None:
            self.real.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno ... of the real stream
        return getattr(self.real, name)


_router_lock = threading.Lock()


@contextlib.contextmanager
def _capture_stdout(sink: io.TextIOBase):
    """Send this thread's ``print`` output to ``sink`` while test code runs."""
    with _router_lock:
        if not isinstance(sys.stdout, _StdoutRouter):
            sys.stdout = _StdoutRouter(sys.stdout)
        router = sys.stdout
    router.local.sink = sink
    try:
        yield
    finally:
        router.local.sink = None


@contextlib.contextmanager
def _alarm(deadline: float):
    """Interrupt Python test code at ``deadline`` (SIGALRM, main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _Deadline()

    def fire(signum, frame):
        raise _Deadline()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, remaining)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
