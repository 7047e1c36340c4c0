"""A trajectory's session on PostgreSQL: one persistent connection to its own clone.

Statements run the way the official BIRD-CRITIC PostgreSQL evaluator runs them: on a connection
that is not in autocommit mode, each statement is executed and then committed (so an agent's
``BEGIN`` is a warning and ``VACUUM`` is refused inside the implicit transaction, as there), its
rows are fetched up to the row cap, and an error rolls back that statement alone. Before each
statement the session sets ``statement_timeout`` again (an agent may change it); the pool's
watchdog bounds its time and locks even when the statement lifts it
(:mod:`birdenv.postgres.watchdog`). Results obey the same caps as SQLite sessions, by the same rule
(:data:`birdenv.replicas.session.Limits`): every statement string, whatever its shape (comments,
parentheses, several statements), is read from the server one row at a time, and rows past the
caps are dropped as they arrive, so a huge result never reaches this process whole; the statement
itself runs to its end (or its timeout) and is committed, as there: a cap bounds what comes back,
never what is done. ``COPY ... FROM STDIN`` and ``COPY ... TO STDOUT`` are refused with an error
that says so (the session goes on).

Everything else the server enforces: the session's role owns its clone's contents and nothing
more (:mod:`birdenv.postgres.pool`).
"""

from __future__ import annotations

import time
from typing import Any

from birdenv.errors import PreprocessError, SessionClosedError
from birdenv.postgres.pool import DatabasePool, Lease
from birdenv.postgres.server import PostgresServerError, psycopg
from birdenv.postgres.values import raise_unreadable
from birdenv.postgres.watchdog import Breach, watchdog_of
from birdenv.replicas.session import Limits, Result, fetch_capped

__all__ = ["PgSession", "run_pg_statement"]

# Added to a statement's timeout before the watchdog cancels it: statement_timeout, which the
# watchdog stands in for when a session lifted it, says so in its own words first.
_WATCHDOG_MARGIN = 0.5
_COPY_REFUSED = (
    "COPY ... {} is not available here: the agent's connection carries only SQL and its "
    "results (read rows with SELECT; write them with INSERT)"
)


def _generators() -> Any:
    """psycopg's generators (``fetch``, ``send`` and ``Wait``), imported on first use."""
    # the postgres extra: imported only where used
    from psycopg import generators

    return generators


class _Reader:
    """The results of one query string sent with the simple protocol in single-row mode: every
    statement's rows arrive one at a time, so no more than the caps ever stays in this process,
    whatever the shape of the string (comments, parentheses, several statements). ``peeked``: the
    row read past the row cap of the last statement (psycopg2 reads it too)."""

    def __init__(self, conn: Any) -> None:
        # the postgres extra: imported only where used
        from psycopg import pq
        from psycopg.adapt import Transformer

        self.status = pq.ExecStatus
        self.conn = conn
        self.pgconn = conn.pgconn
        self.encoding = conn.info.encoding
        self.tx = Transformer(conn)
        self.error: BaseException | None = None
        self.copy: str | None = None
        self.peeked: list[tuple[Any, ...]] = []

    def _next(self) -> Any:
        try:
            return self.conn.wait(_generators().fetch(self.pgconn))
        except psycopg().Error:
            if self.error is not None:  # the connection ended after saying why: that is the error
                raise self.error from None
            raise

    def run(
        self, sql: str, max_rows: int, max_bytes: int | None
    ) -> tuple[list[tuple[Any, ...]] | None, list[str], bool]:
        """Send ``sql``, read every result to the end; the last statement's ``(rows, columns,
        truncated)``. The first error is raised once the connection is idle again."""
        if "\x00" in sql:  # libpq would send the text before it alone; psycopg2 refuses it so
            raise ValueError("A string literal cannot contain NUL (0x00) characters.")
        self.pgconn.send_query(sql.encode(self.encoding))
        self.pgconn.set_single_row_mode()
        self.conn.wait(_generators().send(self.pgconn))
        kept: tuple[list[tuple[Any, ...]] | None, list[str], bool] = (None, [], False)
        result = self._next()
        while result is not None:
            status = result.status
            if status in (self.status.SINGLE_TUPLE, self.status.TUPLES_OK):
                kept, result = self._rows(result, max_rows, max_bytes)
                continue
            if status == self.status.FATAL_ERROR and self.error is None:
                self.error = psycopg().errors.error_from_result(result, encoding=self.encoding)
            elif status == self.status.COPY_IN:
                self.copy = "FROM STDIN"
                self.pgconn.put_copy_end(_COPY_REFUSED.format(self.copy).encode())
                self.conn.wait(_generators().send(self.pgconn))
            elif status == self.status.COPY_OUT:
                self.copy = "TO STDOUT"
                self.conn.cancel_safe()
                self.conn.wait(_skip_copy(self.pgconn))
            elif status == self.status.EMPTY_QUERY and self.error is None:
                # What the server answers to a string with no statement in it: psycopg2's error.
                self.error = psycopg().ProgrammingError("can't execute an empty query")
            elif status == self.status.COMMAND_OK:
                kept, self.peeked = (None, [], False), []
            result = self._next()
        if self.copy is not None:
            raise psycopg().ProgrammingError(_COPY_REFUSED.format(self.copy))
        if self.error is not None:
            raise self.error
        return kept

    def _rows(
        self, result: Any, max_rows: int, max_bytes: int | None
    ) -> tuple[tuple[list[tuple[Any, ...]], list[str], bool], Any]:
        """One statement's rows, from its first result on, cut at the caps; the next statement's
        first result."""
        columns = [result.fname(i).decode(self.encoding) for i in range(result.nfields)]
        statement = _StatementRows(self, result)
        rows, truncated = fetch_capped(statement, max_rows, max_bytes)
        self.peeked = statement.peeked
        return (rows, columns, truncated), statement.skip()


class _StatementRows:
    """One statement's rows as they arrive, with the ``fetchmany``/``fetchone`` face
    :func:`~birdenv.replicas.session.fetch_capped` reads; :meth:`skip` drops the rest."""

    def __init__(self, reader: _Reader, result: Any) -> None:
        self.reader = reader
        self.result = result
        self.first = True
        self.peeked: list[tuple[Any, ...]] = []

    def fetchone(self) -> tuple[Any, ...] | None:
        row = self._load()
        self.peeked = [] if row is None else [row]
        return row

    def _load(self) -> tuple[Any, ...] | None:
        result = self.result
        if result is None or result.status != self.reader.status.SINGLE_TUPLE:
            return None
        self.reader.tx.set_pgresult(result, set_loaders=self.first)
        self.first = False
        row = self.reader.tx.load_row(0, tuple)
        self.result = self.reader._next()
        return row

    def fetchmany(self, size: int) -> list[tuple[Any, ...]]:
        rows = []
        while len(rows) < size and (row := self._load()) is not None:
            rows.append(row)
        return rows

    def skip(self) -> Any:
        """Read the statement's remaining rows without keeping them; the next result."""
        while self.result is not None and self.result.status == self.reader.status.SINGLE_TUPLE:
            self.result = self.reader._next()
        if self.result is not None and self.result.status == self.reader.status.TUPLES_OK:
            self.result = self.reader._next()  # the statement's end: its row count
        return self.result


def _skip_copy(pgconn: Any) -> Any:
    """Read a ``COPY ... TO STDOUT``'s data to its end and drop it (a psycopg generator)."""
    while True:
        nbytes, _ = pgconn.get_copy_data(1)
        if nbytes == -1:
            return
        if nbytes == 0:
            while not (yield _generators().Wait.R):
                continue
            pgconn.consume_input()
        elif nbytes < -1:
            raise psycopg().OperationalError(pgconn.error_message.decode(errors="replace"))


def _breach_error(breach: Breach | None, exc: BaseException, watchdog: Any) -> BaseException:
    """The error a statement that the watchdog ended gives: its own, or one naming the bound."""
    if breach is None or breach.bound is None:
        return exc
    ended = (
        "; it did not stop when cancelled, so its connection was ended" if breach.terminated else ""
    )
    if breach.bound == "locks":
        return psycopg().errors.ProgramLimitExceeded(
            f"the statement held more than {watchdog.max_locks} locks, the bound of one "
            f"trajectory's session, and was cancelled{ended}"
        )
    return psycopg().errors.QueryCanceled(f"canceling statement: its time was up{ended}")


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
    server's, timeouts as ``QueryCanceled``) are raised after the statement is rolled back; so is
    ``COPY ... FROM STDIN`` / ``TO STDOUT``, refused with a message that says so. On a connection
    of a :class:`~birdenv.postgres.pool.DatabasePool`, its watchdog bounds the statement's time
    and locks whatever the statement sets (:mod:`birdenv.postgres.watchdog`).

    As psycopg2 in the official evaluator: a string with no statement (empty, blank or only
    comments) is an error, ``can't execute an empty query``; a statement whose result passes the
    caps runs to its end and is committed (the caps bound what comes back, never what the
    statement does: an ``UPDATE ... RETURNING`` in a ``WITH`` updates every row); values are
    read as psycopg2 reads them (:mod:`birdenv.postgres.values`), and a value psycopg2 cannot
    read among the rows it would fetch raises once the statement is committed."""
    watchdog = watchdog_of(conn)
    cursor = conn.cursor()
    breach: Breach | None = None
    try:
        millis = 0 if timeout is None else max(1, int(timeout * 1000))
        cursor.execute(f"SET statement_timeout = {millis}")  # also opens the transaction
        reader = _Reader(conn)
        if watchdog is None:
            rows, columns, truncated = reader.run(sql, max_rows, max_result_bytes)
        else:
            limit = None if timeout is None else timeout + _WATCHDOG_MARGIN
            with watchdog.statement(conn, limit) as breach:
                rows, columns, truncated = reader.run(sql, max_rows, max_result_bytes)
        conn.commit()
        raise_unreadable((rows or []) + reader.peeked)
        return rows, columns, truncated
    except psycopg().Error as exc:
        if not conn.closed:
            conn.rollback()
        error = _breach_error(breach, exc, watchdog)
        if error is exc:
            raise
        raise error from exc
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
        return self.lease.database

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
            message = f"statement timed out after {limit:g} s ({str(exc).strip()})"
            if conn.closed:  # it did not stop when cancelled: the watchdog ended its backend
                message = self._reconnect(exc, message)
            return Result([], [], -1, False, message, time.monotonic() - start, timed_out=True)
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
            f"{message}\n(this session's connection was ended; a new one is open on "
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
