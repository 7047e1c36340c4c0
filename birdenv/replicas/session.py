"""A trajectory's session: one persistent stdlib ``sqlite3`` connection on a private state.

Statements run exactly the way the official BIRD-CRITIC evaluator runs them (see
:func:`run_statement`), so what an agent sees while exploring is what the judge will see. Every
statement is bounded: a deadline (progress handler), a row cap, a byte cap on the result, the
strategy's own cap on the session's private disk, and the process's file descriptors (running out
is a :class:`~birdenv.errors.DescriptorLimitError`, never SQLite's bare "unable to open"). A
read-only result may come from a sibling trajectory that was in exactly the same state
(:mod:`birdenv.replicas.results`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from birdenv.errors import BirdEnvError, SessionClosedError
from birdenv.replicas import descriptors
from birdenv.replicas.guard import authorizer
from birdenv.replicas.results import (
    ResultCache,
    StatementWatch,
    advance,
    is_transient,
    volatile_tables,
)

__all__ = [
    "MAX_ROWS",
    "MAX_VALUE_BYTES",
    "Limits",
    "Result",
    "Session",
    "StatementTimeout",
    "apply_settings",
    "deadline_handler",
    "fetch_capped",
    "run_statement",
]

#: The official evaluator returns at most this many rows for SELECT/WITH statements.
MAX_ROWS = 10_000
#: Largest string or blob one value may hold in a session ("string or blob too big" beyond).
MAX_VALUE_BYTES = 64 << 20
# How many SQLite VM instructions run between deadline checks: cheap, and fine-grained enough
# that a runaway statement stops within milliseconds of its deadline.
_PROGRESS_STEPS = 2_000


class StatementTimeout(BirdEnvError, sqlite3.OperationalError):
    """A statement ran past its deadline and was interrupted (an SQLite error, as an interrupt is)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds applied to every statement of a session.

    ``statement_timeout`` in seconds (``None``: no deadline); ``max_rows`` rows kept per result
    (the official cap); ``max_result_bytes`` approximate bytes of a result kept (``None``: no cap);
    ``max_session_bytes`` bytes the session may write to its private disk (``None``: no cap).
    """

    statement_timeout: float | None = 30.0
    max_rows: int = MAX_ROWS
    max_result_bytes: int | None = 4 << 20
    max_session_bytes: int | None = 1 << 30

    def __post_init__(self) -> None:
        if self.statement_timeout is not None and self.statement_timeout <= 0:
            raise ValueError("statement_timeout must be positive seconds or None")
        if self.max_rows < 1:
            raise ValueError("max_rows must be at least 1")


@dataclasses.dataclass
class Result:
    """What one statement produced: rows and columns, or the SQLite error message."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
    rowcount: int
    truncated: bool
    error: str | None
    elapsed: float
    timed_out: bool = False
    #: The statement did not run: a sibling trajectory in the same state ran it (``elapsed`` is
    #: then the time the lookup took).
    shared: bool = False

    @property
    def ok(self) -> bool:
        """True when the statement ran without error."""
        return self.error is None


# length_hint(value, 8): the length of a str or bytes value, 8 for a number or NULL. Mapped in C
# over a row, a third of the time of a Python-level loop; this runs for every row of every result.
_EIGHTS = itertools.repeat(8)


_FIRST = operator.itemgetter(0)  # a column's name in cursor.description


def _row_bytes(row: tuple[Any, ...]) -> int:
    return sum(map(operator.length_hint, row, _EIGHTS)) + 8


def _rows_bytes(rows: list[tuple[Any, ...]]) -> int:
    """:func:`_row_bytes` summed over ``rows``: the rule ``birdenv.replicas.native._sizes.batch_bytes`` follows."""
    return sum(map(_row_bytes, rows))


# Every fetched batch is counted: in C a value costs a type check, where length_hint looks up two
# special methods for every number and NULL (~1 us of a one-row step's 14). Without a C compiler at
# install time the rule counts.
try:
    from birdenv.replicas.native import _sizes
except ImportError:
    _batch_bytes = _rows_bytes
else:
    _batch_bytes = _sizes.batch_bytes


def _result_bytes(sql: str, result: Result) -> int:
    """About how much memory a stored result holds (rows sampled: results run to 10,000 rows)."""
    rows = result.rows
    sample = rows[:: max(1, len(rows) // 32)]
    per_row = _batch_bytes(sample) / len(sample) + 56 if sample else 0
    return 256 + len(sql) + sum(len(c) for c in result.columns) + int(per_row * len(rows))


def fetch_capped(cursor: Any, max_rows: int, max_bytes: int | None) -> tuple[list, bool]:
    """Fetch at most ``max_rows`` rows and about ``max_bytes``; say whether more were left.

    The one cap rule of every session: ``cursor`` is anything with DB-API ``fetchmany`` and
    ``fetchone`` (a ``sqlite3`` cursor, a PostgreSQL session's row stream)."""
    rows: list[tuple[Any, ...]] = []
    size = 0
    while len(rows) < max_rows:
        want = min(512, max_rows - len(rows))
        batch = cursor.fetchmany(want)
        if max_bytes is not None:
            grown = size + _batch_bytes(batch)
            if grown > max_bytes:  # the batch crosses the cap: keep the rows before the crossing
                for i, row in enumerate(batch):
                    size += _row_bytes(row)
                    if size > max_bytes:
                        return rows + batch[:i], True
            size = grown
        if len(batch) < want:  # the statement is done: asking again would return nothing
            return (rows + batch if rows else batch), False
        rows += batch
    return rows, cursor.fetchone() is not None


def _check_descriptors(exc: sqlite3.Error) -> None:
    """Raise :class:`DescriptorLimitError` when ``exc`` is SQLite failing to open a file because
    the process is out of descriptors (SQLite itself only says "unable to open database file")."""
    if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_CANTOPEN and (
        descriptors.exhausted()
    ):
        raise descriptors.limit_error("cannot run a statement") from exc


def apply_settings(conn: sqlite3.Connection) -> bool:
    """Issue the two settings the official evaluator issues before every statement,
    ``journal_mode=WAL`` then ``synchronous=OFF``; True when the connection is in WAL mode."""
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("PRAGMA synchronous = OFF")
    except sqlite3.Error as exc:
        _check_descriptors(exc)  # the first switch to WAL opens the -wal and -shm files
        raise
    return mode == ("wal",)


def run_statement(
    conn: sqlite3.Connection,
    sql: str,
    *,
    settings: bool = True,
    max_rows: int = MAX_ROWS,
    max_other_rows: int | None = None,
    max_result_bytes: int | None = None,
    deadline: float | None = None,
    watched: bool = False,
) -> tuple[list[tuple[Any, ...]] | None, list[str], bool]:
    """Run one statement the way the official evaluator does, and return ``(rows, columns, truncated)``.

    Before each statement the connection is set to ``journal_mode=WAL`` and ``synchronous=OFF``
    (:func:`apply_settings`, outside the error handling, as the official code does, so those can
    fail too; ``settings=False`` skips them, for a caller that knows they would change nothing);
    statements starting with ``select``/``with`` are fetched and capped; anything else is committed
    and then fetched (``None`` if fetching fails; the official code keeps every row, so
    ``max_other_rows`` is ``None`` when judging and a cap in sessions); an error rolls back and
    propagates. ``deadline`` is a ``time.monotonic()`` instant past which the statement is
    interrupted with :class:`StatementTimeout`; ``watched=True`` says that a progress handler of
    the caller's already interrupts ``conn`` at ``deadline`` (:func:`deadline_handler`). Running out
    of file descriptors raises :class:`~birdenv.errors.DescriptorLimitError`.
    """
    if settings:
        apply_settings(conn)
    install = deadline is not None and not watched
    if install:
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    cursor = conn.cursor()
    try:
        cursor.execute(sql)
        columns = list(map(_FIRST, cursor.description or ()))
        # The official test, sql.strip().lower().startswith(...), on the first six characters
        # only: the same answer (lowering a character never makes or unmakes these ASCII words)
        # without two copies of a long statement.
        if sql.lstrip()[:6].lower().startswith(("select", "with")):
            rows, truncated = fetch_capped(cursor, max_rows, max_result_bytes)
            return rows, columns, truncated
        conn.commit()
        try:
            rows, truncated = fetch_capped(cursor, max_other_rows or sys.maxsize, max_result_bytes)
        except sqlite3.Error:
            return None, columns, False
        return rows, columns, truncated
    except sqlite3.Error as exc:
        conn.rollback()
        if deadline is not None and time.monotonic() > deadline and "interrupt" in str(exc):
            raise StatementTimeout(f"statement timeout: deadline exceeded ({exc})") from exc
        _check_descriptors(exc)  # e.g. a sort or a TEMP table needing a temporary file
        raise
    finally:
        cursor.close()
        if install:
            conn.set_progress_handler(None, 0)


def deadline_handler(conn: sqlite3.Connection) -> list[float | None]:
    """Install on ``conn`` a progress handler that interrupts a statement once the instant in the
    returned one-item list has passed (``time.monotonic()``; ``None``: no deadline).

    What :func:`run_statement` does around each statement given a ``deadline``, set up once: a
    caller that runs many statements sets the list's item before each and passes
    ``watched=True``, saving two calls into SQLite and a new function per statement.
    """
    deadline: list[float | None] = [None]

    def expired() -> int:
        at = deadline[0]
        return at is not None and time.monotonic() > at

    conn.set_progress_handler(expired, _PROGRESS_STEPS)
    return deadline


class Session:
    """One trajectory's database state and its persistent connection.

    Created by :meth:`birdenv.replicas.ReplicaPool.session`; use it as a context manager. Writes
    persist across :meth:`execute` calls (and TEMP tables, pragmas and open transactions with them)
    and are invisible to every other session. ``conn`` is an ordinary ``sqlite3.Connection``.

    Given a ``results`` cache and the digest of its starting ``state``, :meth:`execute` hands out
    the stored result of a read-only statement a trajectory in the same state already ran, and
    stores its own. Using ``conn`` or :meth:`connect` ends that for the session: its state is then
    no longer the history of its statements. ``connect(exclusive)`` opens a connection on the
    state, holding its lock for its whole life when ``exclusive`` (the session's own connection,
    for a session nobody else opens).
    """

    def __init__(
        self,
        *,
        path: Path,
        connect: Callable[[bool], sqlite3.Connection],
        limits: Limits,
        release: Callable[[Session], None],
        task_id: str | None = None,
        exclusive: bool = False,
        results: ResultCache | None = None,
        state: bytes | None = None,
    ) -> None:
        self.path = path
        self.limits = limits
        self.task_id = task_id
        self._connect = connect
        self._release = release
        # True while the official settings are known to be in force (see execute()); a connection
        # nobody else has touched is the only one whose settings can be known.
        self._settled = False
        self._alone = True
        # True until anything but this class has run on the connection (see _settings()).
        self._untouched = True
        self._results = results
        self._state = state if results is not None else None
        self._watch = StatementWatch() if self._state is not None else None
        self._conn: sqlite3.Connection | None = self._guarded(
            self._watch or authorizer, exclusive=exclusive
        )
        # The deadline the connection's own progress handler enforces; None once the connection
        # has been handed out, whose holder may replace the handler (run_statement then installs
        # one around each statement).
        self._deadline: list[float | None] | None = deadline_handler(self._conn)

    @property
    def db_path(self) -> str:
        """A path naming this session's state (what the judge passes to test code as ``db_path``)."""
        return str(self.path)

    @property
    def conn(self) -> sqlite3.Connection:
        """The session's persistent connection (statements run on it are not tracked: using it
        ends result sharing for this session)."""
        if self._conn is None:
            raise SessionClosedError("this session is closed; lease a new one from the pool")
        self._settled = self._untouched = False  # whoever holds it may change any setting
        self._deadline = None  # ... and the progress handler
        self._state = None
        return self._conn

    @property
    def closed(self) -> bool:
        """Whether the session has been closed."""
        return self._conn is None

    def connect(self) -> sqlite3.Connection:
        """Open another guarded connection on this session's state (e.g. for test code); this ends
        result sharing for the session."""
        # It can switch the state's journal mode under the session's connection, at any time.
        self._alone = self._settled = self._untouched = False
        self._state = None
        return self._guarded(authorizer)

    def _guarded(self, guard: Callable[..., int], *, exclusive: bool = False) -> sqlite3.Connection:
        conn = self._connect(exclusive)
        conn.set_authorizer(guard)
        # The deadline cannot interrupt one function call: bound the size of any single value
        # (printf('%.*c', 9e8, 'x') would otherwise build a gigabyte before the next check).
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        return conn

    def prepare(self, sql: str) -> None:
        """Run one statement that sets up the trajectory's starting state (a task's
        ``preprocess_sql``), the evaluator's way and with no deadline; errors raise."""
        conn = self._live()
        changes = conn.total_changes
        watch = self._watch if self._state is not None else None
        self._settled = False  # a setup statement may change any setting
        try:
            if watch is not None:
                watch.begin()  # a failing setting counts as a change of this statement's
            self._settings(conn)
            if watch is not None:
                watch.begin()
            run_statement(conn, sql, settings=False)
        except (sqlite3.Error, ValueError, OverflowError) as exc:
            self._track(sql, None, str(exc), changes, conn.in_transaction)
            raise
        except BaseException:
            self._state = None  # what it changed is unknown
            raise
        self._track(sql, None, None, changes, conn.in_transaction)

    def _settings(self, conn: sqlite3.Connection) -> bool:
        """:func:`apply_settings`, the first time without a journal file."""
        if self._untouched:
            self._untouched = False
            # A fresh state is in rollback mode, and its switch to WAL rewrites the header in a
            # transaction that creates, writes and deletes a journal file: ~10 system calls of
            # every episode's first statement. Journaled in memory, that transaction touches no
            # file. Nothing can tell: nothing has run on the connection yet, and no statement runs
            # before the switch has succeeded (every session's files support WAL, so a switch
            # that fails raises: the statement does not run, and the next one switches again).
            conn.execute("PRAGMA journal_mode = MEMORY")
        return apply_settings(conn)

    def execute(self, sql: str, *, timeout: float | None = None) -> Result:
        """Run one statement; errors and timeouts come back in the :class:`Result`, never raised.

        Running out of file descriptors is the host's fault, not the statement's: it raises
        :class:`~birdenv.errors.DescriptorLimitError`.
        """
        conn = self._live()
        limit = timeout if timeout is not None else self.limits.statement_timeout
        start = time.monotonic()
        key = None
        if self._state is not None and not conn.in_transaction:
            key = (self._state, sql, limit)
            hit = self._results.get(key, limit)  # type: ignore[union-attr]
            if hit is not None:
                return dataclasses.replace(
                    hit,
                    rows=list(hit.rows),
                    columns=list(hit.columns),
                    elapsed=time.monotonic() - start,
                    shared=True,
                )
        watch = self._watch if self._state is not None else None
        if watch is not None:  # what tracking compares the statement's effect with
            in_transaction, changes = conn.in_transaction, conn.total_changes
        try:
            result = self._run(conn, sql, limit, start, watch)
            if watch is not None:
                self._track(sql, result, result.error, changes, in_transaction, key)
        except BaseException:
            self._state = None  # what it changed is unknown
            raise
        finally:
            if key is not None:
                self._results.release(key)  # type: ignore[union-attr]
        if not result.columns and result.error is None and not conn.in_transaction:
            # Every statement runs in WAL mode (as the official evaluator sets it). Checkpointing
            # into the session file and truncating the WAL after a write keeps each changed page
            # on disk once, not twice; it changes no result.
            # main. only: an unqualified checkpoint also visits the TEMP database and fails with
            # "database table is locked" after CREATE TEMP TABLE ... AS SELECT.
            with contextlib.suppress(sqlite3.Error):  # an optimisation: never the statement's error
                conn.execute("PRAGMA main.wal_checkpoint(TRUNCATE)")
        return result

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SessionClosedError("this session is closed; lease a new one from the pool")
        return self._conn

    def _run(
        self,
        conn: sqlite3.Connection,
        sql: str,
        limit: float | None,
        start: float,
        watch: StatementWatch | None,
    ) -> Result:
        deadline = start + limit if limit is not None else None
        # The official settings are issued before every statement. Once they are in force, issuing
        # them again changes nothing until a statement changes them, and only a PRAGMA can (on
        # this connection: others are ruled out by _alone): ~7 us saved per statement.
        settled, self._settled = self._settled, False
        watched = self._deadline
        try:
            if watch is not None:
                watch.begin()  # a failing setting counts as a change of this statement's
            if not settled:
                settled = self._settings(conn)
            if watch is not None:
                watch.begin()
            if watched is not None:
                watched[0] = deadline
            rows, columns, truncated = run_statement(
                conn,
                sql,
                settings=False,
                max_rows=self.limits.max_rows,
                max_other_rows=self.limits.max_rows,
                max_result_bytes=self.limits.max_result_bytes,
                deadline=deadline,
                watched=watched is not None,
            )
        except StatementTimeout:
            return Result(
                [],
                [],
                -1,
                False,
                f"statement timed out after {limit:g} s",
                time.monotonic() - start,
                timed_out=True,
            )
        except (sqlite3.Error, ValueError, OverflowError, MemoryError) as exc:
            # ValueError: NUL characters; OverflowError: huge integers bound; MemoryError: a
            # result too large to build. All are the statement's fault, not the caller's.
            return Result([], [], -1, False, _message(exc), time.monotonic() - start)
        finally:
            if watched is not None:
                watched[0] = None
            self._settled = (
                settled and self._alone and isinstance(sql, str) and "pragma" not in sql.lower()
            )
        rows = rows or []
        return Result(columns, rows, len(rows), truncated, None, time.monotonic() - start)

    def _track(
        self,
        sql: str,
        result: Result | None,
        error: str | None,
        changes: int,
        in_transaction: bool,
        key: Any = None,
    ) -> None:
        """Share a read-only result, or fold a change into the state (see :mod:`.results`)."""
        if self._state is None or self._watch is None or self._conn is None:
            return
        effect = self._watch.effect(sql)
        conn = self._conn
        changed = (
            effect.changes or in_transaction or conn.in_transaction or conn.total_changes != changes
        )
        timed_out = result is not None and result.timed_out
        if not changed:
            if (
                key is not None
                and result is not None
                and not (effect.volatile or timed_out or is_transient(error))
            ):
                # stored apart from what the caller gets, so that nothing the caller does to its
                # result reaches a sibling
                kept = dataclasses.replace(
                    result, rows=tuple(result.rows), columns=tuple(result.columns)
                )
                self._results.put(key, kept, _result_bytes(sql, result))  # type: ignore[union-attr]
            return
        if (
            effect.volatile
            or timed_out
            or is_transient(error)
            or volatile_tables(conn, effect.written)
        ):
            self._state = None  # this trajectory's state is its own from now on
            return
        self._state = advance(self._state, sql, error, conn.total_changes - changes)

    def close(self) -> None:
        """Close the connection and give the state back to the pool (idempotent)."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            conn.close()
        finally:
            self._release(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Session {self.task_id or ''} {self.path.name} {state}>"


# SQLite's own words for an authorizer denial, which do not say why.
_DENIED = ("not authorized", "authorization denied")


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if text.startswith(_DENIED):
        return (
            f"{text}: the session guard forbids attaching files, VACUUM INTO, extensions "
            "and file-location pragmas; a session reads and writes only its own database"
        )
    return text if isinstance(exc, sqlite3.Error) else f"{type(exc).__name__}: {text}"
