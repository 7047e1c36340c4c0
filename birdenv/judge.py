"""The official BIRD-CRITIC-SQLite evaluation, exactly, and faster.

:func:`judge` gives the verdict the official evaluator gives, including its quirks:

1. A fresh state; ``preprocess_sql`` (errors ignored, the first one stops it); the *issue* SQL; the
   tests. If the issue SQL passes every test, the instance fails whatever was predicted.
2. A fresh state again; ``preprocess_sql``; the prediction, one list element per ``execute``,
   committed after each, the first error stops it and fails the instance (two statements in one
   string is such an error); then every test on the same connection (the default ``ex_base`` test
   when the task has none). Any failed assertion or exception fails the instance.
3. ``clean_up_sql``, errors ignored.

What differs is only how: states are copy-on-write sessions from a
:class:`~birdenv.replicas.ReplicaPool` instead of file copies, statements run in-process, every
statement can have a deadline (the official evaluator has none) and the instance has an overall
deadline (the official 180 s), and test code's output is captured with a bound.

Test code runs with the official helper names in scope: ``perform_query_on_sqlite_databases``,
``execute_queries``, ``ex_base``, ``check_sql_function_usage``, ``remove_distinct``,
``remove_comments``, ``remove_round``, ``preprocess_results``, ``pred_query_result`` and ``date``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import math
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from birdenv.errors import BirdEnvError
from birdenv.judge_cache import (
    IssueOutcome,
    JudgeCache,
    cache_key,
    cacheable_task,
    schedule_key,
)
from birdenv.replicas.guard import authorizer
from birdenv.replicas.pool import ReplicaPool, default_pool, default_root
from birdenv.replicas.session import MAX_ROWS, Limits, Session, run_statement
from birdenv.tasks import Task, split_sql_field
from birdenv.workers import KILL_GRACE, supervised_map

__all__ = [
    "DEFAULT_TEST",
    "INSTANCE_TIMEOUT",
    "Verdict",
    "check_sql_function_usage",
    "judge",
    "judge_many",
    "preprocess_results",
    "remove_comments",
    "remove_distinct",
    "remove_round",
]

#: The official evaluator's per-instance limit, in seconds.
INSTANCE_TIMEOUT = 180.0
#: The test used when a task has none, as the official evaluator defines it.
DEFAULT_TEST = """
def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):
    pred_sqls = remove_comments(pred_sqls)
    sol_sqls = remove_comments(sol_sqls)
    pred_sqls = remove_distinct(pred_sqls)
    pred_sqls = remove_round(pred_sqls)
    sol_sqls = remove_distinct(sol_sqls)
    sol_sqls = remove_round(sol_sqls)
    result = ex_base(pred_sqls, sol_sqls, db_path, conn, conditions)
    assert result == 1, f"ex_base returned {result} but expected 1."
    return result
"""
# What the official evaluator prepends to every test's source.
_TEST_PRELUDE = "import datetime\nfrom datetime import date\n"
_TEST_CALL = "\n__test_case_result__ = test_case(pred_sqls, sol_sqls, db_path, conn, **kwargs)"
# Captured test output kept per verdict; the rest is dropped, never buffered.
_MAX_CAPTURE = 64 << 10


# -- the official text transforms, written from their documented behaviour ------------------
def remove_comments(sql_list: list[str]) -> list[str]:
    """Drop ``/* */`` comments and ``--`` comments that end with a newline; squeeze blank lines.

    A ``--`` comment on the last line (no newline after it) stays, as in the official helper.

    >>> remove_comments(["SELECT 1 -- one\\nFROM t /* x */"])
    ['SELECT 1 \\nFROM t']
    """
    cleaned = []
    for sql in sql_list:
        sql = re.sub(r"/\*.*?\*/", "", sql, flags=re.DOTALL)
        sql = re.sub(r"--.*?(\r\n|\r|\n)", r"\1", sql)
        sql = re.sub(r"\n\s*\n+", "\n", sql)
        cleaned.append(sql.strip())
    return cleaned


def remove_distinct(sql_list: list[str]) -> list[str]:
    """Drop every space-separated token that is the word DISTINCT, in any case.

    >>> remove_distinct(["SELECT DISTINCT a FROM t", "SELECT COUNT(DISTINCT a) FROM t"])
    ['SELECT a FROM t', 'SELECT COUNT(DISTINCT a) FROM t']
    """
    return [" ".join(t for t in sql.split(" ") if t.lower() != "distinct") for sql in sql_list]


_ROUND = re.compile(r"ROUND\s*\(", re.IGNORECASE)


def _matching_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _first_argument_end(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        char = text[i]
        if char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                return i
            depth -= 1
        elif char == "," and depth == 0:
            return i
    return len(text)


def remove_round(sql_list: list[str]) -> list[str]:
    """Replace every ``ROUND(x, n)`` (nested too, any case) by its first argument ``x``.

    Matching is textual, like the official helper: no word boundary, parentheses in strings count.

    >>> remove_round(["SELECT ROUND(ROUND(price, 2), 1) FROM t"])
    ['SELECT price FROM t']
    """
    cleaned = []
    for sql in sql_list:
        while match := _ROUND.search(sql):
            open_at = match.end() - 1
            close_at = _matching_paren(sql, open_at)
            if close_at == -1:
                break
            argument = sql[open_at + 1 : _first_argument_end(sql, open_at + 1)].strip()
            sql = sql[: match.start()] + argument + sql[close_at + 1 :]
        cleaned.append(sql)
    return cleaned


def _round_value(item: Any, places: int) -> Any:
    if isinstance(item, Decimal):
        return item.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    if isinstance(item, float):
        return round(item, places)
    if isinstance(item, (list, tuple)):
        return type(item)(_round_value(x, places) for x in item)
    if isinstance(item, dict):
        return {k: _round_value(v, places) for k, v in item.items()}
    return item


def preprocess_results(results: Any, decimal_places: int = 2) -> list[tuple[Any, ...]]:
    """Normalise result rows for comparison: dates as ``YYYY-MM-DD``, floats rounded, JSON for
    dicts and lists.

    >>> preprocess_results([(1.005, "a"), (2.0, None)])
    [(1.0, 'a'), (2.0, None)]
    """
    processed = []
    for row in results:
        items = []
        for item in row:
            if isinstance(item, (datetime.date, datetime.datetime)):
                items.append(item.strftime("%Y-%m-%d"))
                continue
            item = _round_value(item, decimal_places)
            items.append(
                json.dumps(item, sort_keys=True) if isinstance(item, (dict, list)) else item
            )
        processed.append(tuple(items))
    return processed


def check_sql_function_usage(sqls: list[str], required_keywords: list[str]) -> int:
    """1 if every keyword occurs (case-insensitively) somewhere in the SQL, else 0.

    >>> check_sql_function_usage(["SELECT strftime('%Y', d) FROM t"], ["STRFTIME"])
    1
    """
    if not sqls:
        return 0
    combined = " ".join(sql.lower() for sql in sqls)
    return int(all(kw.lower() in combined for kw in required_keywords))


# -- verdicts ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    """The judge's decision on one instance.

    ``status`` is ``"success"`` or ``"failed"``; ``phase`` says where it failed: ``"issue"`` (the
    issue SQL passed every test, so the task cannot be judged), ``"prediction"`` (a predicted
    statement raised), ``"timeout"`` (a deadline passed), ``"tests"`` (a test failed) or
    ``"setup"`` (the database could not be prepared); ``tests_passed``/``tests_total`` count the
    tests of the prediction phase (the default test counts as one); ``issue_cached`` is true when
    the issue phase's outcome came from the :mod:`birdenv.judge_cache` instead of running again.
    """

    instance_id: str
    status: str
    phase: str | None = None
    error: str | None = None
    tests_passed: int = 0
    tests_total: int = 0
    failed_tests: list[str] = dataclasses.field(default_factory=list)
    issue_passed: bool = False
    issue_cached: bool = False
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when the instance succeeded."""
        return self.status == "success"

    @property
    def fraction(self) -> float:
        """Tests passed ÷ tests run in the prediction phase (0 when it never reached the tests)."""
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict (``instance_id``, ``status`` and the details)."""
        return dataclasses.asdict(self)


class _Deadline(Exception):
    """Raised inside test code when the instance's deadline passes."""


@dataclasses.dataclass
class _Phase:
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


class _Runner:
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
                exec(_TEST_PRELUDE + source + _TEST_CALL, global_env, local_env)
        except AssertionError as exc:
            return f"Test case failed due to assertion error: {exc}"
        except _Deadline:
            return "timeout: the instance deadline passed while a test was running"
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: test code must not end the judge
            return f"Test case failed due to error: {exc}"
        return None

    def evaluation_phase(self, statements: list[str], task: Task, tests: list[str]) -> _Phase:
        assert self.session is not None
        conn = self.session.conn
        phase = _Phase(total=len(tests))
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


#: Sessions the judge leases: its own deadlines per statement, no byte cap on results.
JUDGE_LIMITS = Limits(statement_timeout=None, max_result_bytes=None)


def judge(
    task: Task,
    pred_sqls: list[str] | str,
    *,
    pool: ReplicaPool | None = None,
    statement_timeout: float | None = None,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
) -> Verdict:
    """Judge a prediction for ``task`` exactly as the official BIRD-CRITIC-SQLite evaluator does.

    ``pred_sqls`` is the list of statements (a string is split on ``[split]``, as the official
    reader does). ``statement_timeout`` bounds each statement (default: only the instance
    deadline, like the official evaluator); ``instance_timeout`` bounds the whole instance.
    ``cache=True`` reuses the issue phase's outcome (it does not depend on the prediction) from
    :class:`~birdenv.judge_cache.JudgeCache` in the pool's root when a reproducible run left one,
    and records it otherwise; ``False`` always runs both phases. Problems with the prediction are
    verdicts, never exceptions; a missing database is a ``"setup"`` failure.
    """
    pool = pool or default_pool()
    statements = split_sql_field(pred_sqls)
    tests = list(task.test_cases) or [DEFAULT_TEST]
    runner = _Runner(time.monotonic() + instance_timeout, statement_timeout)
    verdict = Verdict(instance_id=task.instance_id, status="failed", tests_total=len(tests))
    started = time.perf_counter()
    try:
        store, key = None, None
        if cache and task.issue_sql and cacheable_task(task):
            store = JudgeCache.for_root(pool.root)
            key = cache_key(task, pool.store.base_for(task.db_path).sha256, statement_timeout)
            outcome = store.get(key)
            if outcome is not None:
                verdict.issue_passed, verdict.issue_cached = outcome.issue_passed, True
                runner.memo = dict(outcome.memo)
        if task.issue_sql and not verdict.issue_cached:
            with pool.session(task, preprocess=False, limits=JUDGE_LIMITS) as session:
                runner.fresh_state(session)
                runner.execute_queries(task.preprocess_sql, session.db_path, session.conn)
                runner.after_preprocess()
                issue_phase = runner.evaluation_phase(list(task.issue_sql), task, tests)
                runner.close_extra_connections()
            verdict.timings["issue"] = time.perf_counter() - started
            verdict.issue_passed = issue_phase.clean
            # Remember only what would come out the same again: no deadline, nothing volatile.
            if store is not None and not issue_phase.timeout and not runner.ever_volatile:
                memo = runner.memo if runner.memo_enabled else {}
                store.put(key, IssueOutcome(verdict.issue_passed, dict(memo)))
        mark = time.perf_counter()
        with pool.session(task, preprocess=False, limits=JUDGE_LIMITS) as session:
            runner.fresh_state(session)
            runner.execute_queries(task.preprocess_sql, session.db_path, session.conn)
            runner.after_preprocess()
            phase = runner.evaluation_phase(statements, task, tests)
            if task.clean_up_sql:
                runner.execute_queries(task.clean_up_sql, session.db_path, session.conn)
            runner.close_extra_connections()
        verdict.timings["prediction"] = time.perf_counter() - mark
    except (BirdEnvError, sqlite3.Error, OSError) as exc:
        verdict.phase, verdict.error = "setup", f"{type(exc).__name__}: {exc}"
        verdict.timings["total"] = time.perf_counter() - started
        return verdict
    verdict.tests_passed, verdict.failed_tests = phase.passed, phase.failed
    errors = list(phase.errors)
    if verdict.issue_passed:
        errors.insert(0, "issue_sql passed all tests: the task does not demonstrate a problem")
        verdict.phase = "issue"
    elif phase.timeout:
        verdict.phase = "timeout"
    elif phase.execution_error:
        verdict.phase = "prediction"
    elif phase.assertion_error:
        verdict.phase = "tests"
    else:
        verdict.status = "success"
    verdict.error = "\n".join(errors) or None
    verdict.timings["total"] = time.perf_counter() - started
    return verdict


def _judge_job(
    pool: ReplicaPool, job: tuple[Task, list[str] | str, bool, float | None, float]
) -> Verdict:
    """One :func:`judge_many` instance, in a worker (module level: workers get it by name)."""
    task, pred_sqls, cache, statement_timeout, instance_timeout = job
    return judge(
        task,
        pred_sqls,
        pool=pool,
        statement_timeout=statement_timeout,
        instance_timeout=instance_timeout,
        cache=cache,
    )


def _unjudged(job: tuple[Task, Any, Any, Any, Any], phase: str, why: str) -> Verdict:
    """The verdict of an instance whose worker was killed or died."""
    task = job[0]
    return Verdict(
        instance_id=task.instance_id,
        status="failed",
        phase=phase,
        error=why,
        tests_total=len(task.test_cases) or 1,
    )


def judge_many(
    jobs: Iterable[tuple[Task, list[str] | str]],
    *,
    processes: int = 1,
    statement_timeout: float | None = None,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
) -> Iterator[Verdict]:
    """Judge many ``(task, pred_sqls)`` pairs, in order, in ``processes`` supervised workers.

    Every instance runs in a worker process (:func:`birdenv.workers.supervised_map`), as the
    official evaluator runs each in a subprocess: a worker still busy ``instance_timeout`` (+2 s)
    after it started an instance is killed (test code can swallow the in-process deadline; only a
    process boundary bounds it), the instance gets a ``"timeout"`` verdict, and a new worker takes
    over; a worker that dies gives its instance a ``"crash"`` verdict. The rest of the run
    continues either way.

    With ``cache=True`` instances start longest first, by the time their task took to judge last
    time (kept beside the issue-phase cache; never-judged tasks start before all others): a run
    ends when its slowest instance does, so that one should not start last. ``cache=False``
    remembers nothing and starts them in input order. Verdicts come out in input order either way.

    Raises :class:`~birdenv.errors.WorkerStartError` when a worker dies before it is ready: that
    is a setup problem (most often a script that calls this without an ``if __name__ ==
    "__main__":`` guard), not a verdict.
    """
    work = [(task, pred, cache, statement_timeout, instance_timeout) for task, pred in jobs]
    order, timings = None, None
    if cache and work:
        timings = JudgeCache.for_root(default_root())
        keys = [schedule_key(job[0]) for job in work]
        seconds = timings.judge_seconds(keys)
        # Unknown tasks go first (they may be slow); the rest longest first; ties in input order.
        order = sorted(range(len(work)), key=lambda i: -seconds.get(keys[i], math.inf))
    judged: dict[str, float] = {}
    try:
        verdicts = supervised_map(
            _judge_job,
            work,
            processes=processes,
            kill_after=instance_timeout + KILL_GRACE,
            failed=_unjudged,
            order=order,
            # Workers fork from a server that has imported the judge once, not each on its own.
            preload=["birdenv.judge"],
        )
        for index, verdict in enumerate(verdicts):
            if timings is not None:  # a killed instance took at least its deadline
                judged[keys[index]] = verdict.timings.get("total", instance_timeout + KILL_GRACE)
            yield verdict
    finally:
        if timings is not None:
            timings.record_judge_seconds(judged)
