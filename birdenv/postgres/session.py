"""A trajectory's session on PostgreSQL: one persistent connection to its own clone.

Statements run the way the official BIRD-CRITIC PostgreSQL evaluator runs them: on a connection
that is not in autocommit mode, each statement is executed and then committed (so an agent's
``BEGIN`` is a warning and ``VACUUM`` is refused inside the implicit transaction, as there), its
rows are fetched up to the row cap, and an error rolls back that statement alone. Before each
statement the session sets ``statement_timeout`` again (an agent may change it). Results obey the
same caps as SQLite sessions, by the same rule (:data:`birdenv.replicas.session.Limits`): rows
are read from the server as they come and those past a cap are dropped as they arrive, so a huge
result never reaches this process whole; the statement itself runs to its end (or its timeout)
and is committed, as there: a cap bounds what comes back, never what is done.

Everything else the server enforces: the session's role owns its clone and nothing more
(:mod:`birdenv.postgres.pool`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

from birdenv.errors import PreprocessError, SessionClosedError
from birdenv.postgres.pool import DatabasePool, Lease
from birdenv.postgres.server import PostgresServerError, psycopg
from birdenv.postgres.values import raise_unreadable
from birdenv.replicas.session import Limits, Result, fetch_capped

__all__ = ["PgSession", "run_pg_statement"]

# Where a statement starts with one of these, its rows are streamed (and cut at the caps); other
# statements (and several in one string) are executed whole, as the official evaluator does.
_STREAMED = ("select", "with", "values", "table")


class _Rows:
    """A row iterator with the ``fetchmany``/``fetchone`` face :func:`fetch_capped` reads; it
    keeps the row ``fetchone`` read last (psycopg2 reads one row past the cap)."""

    def __init__(self, rows: Iterator[tuple[Any, ...]]) -> None:
        self._rows = rows
        self.peeked: list[tuple[Any, ...]] = []

    def fetchmany(self, size: int) -> list[tuple[Any, ...]]:
        return list(islice(self._rows, size))

    def fetchone(self) -> tuple[Any, ...] | None:
        row = next(self._rows, None)
        self.peeked = [] if row is None else [row]
        return row

    def drain(self) -> None:
        """Read the rest, keeping nothing."""
        for _ in self._rows:
            pass


def _single(sql: str) -> bool:
    """Whether ``sql`` is one statement for certain (no ``;`` but at its end)."""
    return ";" not in sql.rstrip().rstrip(";")


def run_pg_statement(
    conn: Any,
    sql: str,
    *,
    timeout: float | None,
    max_rows: int,
    max_result_bytes: int | None,
) -> tuple[list[tuple[Any, ...]] | None, list[str], bool]:
    """Run one statement the official way (see the module's docstring) and return ``(rows,
    columns, truncated)``; ``rows`` is None for a statement that returns none. Errors (the
    server's, timeouts as ``QueryCanceled``) are raised after the statement is rolled back.

    As psycopg2 in the official evaluator: a string with no statement (empty, blank or only
    comments) is an error, ``can't execute an empty query``; a statement whose result passes the
    caps runs to its end and is committed (the caps bound what comes back, never what the
    statement does: an ``UPDATE ... RETURNING`` in a ``WITH`` updates every row); values are
    read as psycopg2 reads them (:mod:`birdenv.postgres.values`), and a value psycopg2 cannot
    read among the rows it would fetch raises once the statement is committed."""
    cursor = conn.cursor()
    try:
        millis = 0 if timeout is None else max(1, int(timeout * 1000))
        cursor.execute(f"SET statement_timeout = {millis}")
        if sql.lstrip()[:6].lower().startswith(_STREAMED) and _single(sql):
            stream = _Rows(iter(cursor.stream(sql)))
            try:
                rows, truncated = fetch_capped(stream, max_rows, max_result_bytes)
                if truncated:
                    stream.drain()  # the statement runs to its end, as when nothing is cut
            except psycopg().ProgrammingError as exc:
                if "didn't produce a result" not in str(exc):
                    raise
                rows, truncated = None, False  # e.g. WITH ... INSERT without RETURNING
            columns = [c.name for c in cursor.description or ()]
            conn.commit()
            raise_unreadable((rows or []) + stream.peeked)
            return rows, columns, truncated
        cursor.execute(sql)
        result = cursor.pgresult  # what the server answers to a string with no statement in it:
        if result is not None and result.status == psycopg().pq.ExecStatus.EMPTY_QUERY:
            raise psycopg().ProgrammingError("can't execute an empty query")
        while cursor.nextset():  # several statements: the last one's result, as psycopg2 gives
            pass
        conn.commit()
        if cursor.description is None:
            return None, [], False
        columns = [c.name for c in cursor.description]
        fetched = _Rows(iter(cursor))
        rows, truncated = fetch_capped(fetched, max_rows, max_result_bytes)
        raise_unreadable(rows + fetched.peeked)
        return rows, columns, truncated
    except BaseException:
        if not conn.closed:
            conn.rollback()
        raise
    finally:
        cursor.close()


class PgSession:
    """One trajectory's clone and its persistent connection (:meth:`DatabasePool.lease`).

    ``execute(sql) -> Result`` as :class:`birdenv.replicas.session.Session`; ``db_name`` names the
    clone (what test code gets as ``db_name``); :meth:`connect` opens another connection on it.
    Use it as a context manager: closing drops the clone in the background.
    """

    def __init__(
        self, pool: DatabasePool, lease: Lease, *, limits: Limits, task_id: str | None = None
    ) -> None:
        self.pool = pool
        self.lease = lease
        self.limits = limits
        self.task_id = task_id
        try:
            self._conn: Any = pool.connect(lease)
        except BaseException:
            pool.release(lease)  # e.g. out of connections or disk: the clone is not kept
            raise

    @property
    def db_name(self) -> str:
        """The clone's database name."""
        return self.lease.name

    @property
    def conn(self) -> Any:
        """The session's persistent ``psycopg`` connection."""
        return self._live()

    @property
    def closed(self) -> bool:
        """Whether the session has been closed."""
        return self._conn is None

    def connect(self) -> Any:
        """Another connection to this session's clone, as its role."""
        self._live()
        return self.pool.connect(self.lease)

    def _live(self) -> Any:
        if self._conn is None:
            raise SessionClosedError("this session is closed; lease a new one from the pool")
        return self._conn

    def _lost(self, exc: BaseException) -> PostgresServerError:
        return PostgresServerError(
            f"the connection to {self.db_name} was lost ({str(exc).strip()}); the server "
            "stopped or restarted (killed, or out of disk space): this episode cannot go on, "
            "reset starts a new one"
        )

    def prepare(self, sql: str) -> None:
        """Run one statement that sets up the starting state (a task's ``preprocess_sql``), with
        no deadline; errors raise :class:`~birdenv.errors.PreprocessError`."""
        conn = self._live()
        try:
            run_pg_statement(
                conn, sql, timeout=None, max_rows=self.limits.max_rows, max_result_bytes=None
            )
        except psycopg().Error as exc:
            if conn.closed:
                raise self._lost(exc) from exc
            raise PreprocessError(
                f"preprocess_sql failed on {self.db_name}: {exc}".strip()
            ) from exc

    def execute(self, sql: str, *, timeout: float | None = None) -> Result:
        """Run one statement; its errors and timeouts come back in the :class:`Result` (a
        statement that ends its own connection too: a new one is opened). A server that stopped
        or restarted under the statement raises :class:`PostgresServerError`."""
        conn = self._live()
        limit = timeout if timeout is not None else self.limits.statement_timeout
        start = time.monotonic()
        try:
            rows, columns, truncated = run_pg_statement(
                conn,
                sql,
                timeout=limit,
                max_rows=self.limits.max_rows,
                max_result_bytes=self.limits.max_result_bytes,
            )
        except psycopg().errors.QueryCanceled as exc:
            if conn.closed:
                raise self._lost(exc) from exc
            return Result(
                [],
                [],
                -1,
                False,
                f"statement timed out after {limit:g} s ({str(exc).strip()})",
                time.monotonic() - start,
                timed_out=True,
            )
        except psycopg().Error as exc:
            message = str(exc).strip() or type(exc).__name__
            if conn.closed:
                if not isinstance(exc, psycopg().errors.AdminShutdown):
                    # Not ended by a statement of its own: the server crashed (a backend that
                    # cannot write its WAL on a full disk takes every session down) or stopped.
                    raise self._lost(exc) from exc
                message = self._reconnect(exc, message)
            return Result([], [], -1, False, message, time.monotonic() - start)
        except (ValueError, MemoryError) as exc:  # NUL characters; a value too large to build
            return Result(
                [], [], -1, False, f"{type(exc).__name__}: {exc}", time.monotonic() - start
            )
        rows = rows or []
        return Result(columns, rows, len(rows), truncated, None, time.monotonic() - start)

    def _reconnect(self, exc: BaseException, message: str) -> str:
        """After the statement ended its own connection (``pg_terminate_backend`` of itself):
        a new connection to the same clone, and the observation that says so. Raises
        :class:`PostgresServerError` when the server itself is gone."""
        try:
            self._conn = self.pool.connect(self.lease)
        except PostgresServerError as lost:
            raise self._lost(exc) from lost
        return (
            f"{message}\n(the statement ended this session's connection; a new one is open on "
            "the same database: its tables are as they were, session settings and temporary "
            "tables are gone)"
        )

    def close(self) -> None:
        """Close the connection and drop the clone in the background (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.close()
        finally:
            self.pool.release(self.lease)

    def __enter__(self) -> PgSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<PgSession {self.task_id or ''} {self.db_name} {'closed' if self.closed else 'open'}>"
        )
