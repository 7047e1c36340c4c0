"""Bounds on PostgreSQL statements that hold whatever the session sets.

Inside its session an agent may ``SET statement_timeout = 0``, catch ``query_canceled`` in
PL/pgSQL, or take thousands of locks in one statement: the server's own settings are the session's
to change. A :class:`Watchdog` (one per :class:`~birdenv.postgres.pool.DatabasePool`, a thread of
the process that runs the sessions) enforces from outside the session, through the pool's
administrator connection:

- **time**: at a statement's deadline it cancels the statement (``pg_cancel_backend``, as
  ``statement_timeout`` would); a statement still running ``grace`` seconds later has its backend
  terminated (``pg_terminate_backend``): the session opens a new connection and says so;
- **locks**: while a statement runs longer than ``interval``, it counts the locks its backend holds
  (``pg_locks``) every ``interval`` seconds and cancels the statement past ``max_locks``.

Memory is bounded by the server itself (the private cluster's ``max_backend_memory``), and the
result a statement sends back by its reader (:func:`birdenv.postgres.session.run_pg_statement`).
A statement ended by the watchdog comes back as an error naming the bound
(:meth:`Watchdog.statement` records the breach; the reader turns it into the error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["Breach", "Watchdog", "watchdog_of"]

# The watchdog of each connection a pool opened (a connection opened otherwise has none).
_WATCHED: weakref.WeakKeyDictionary[Any, Watchdog] = weakref.WeakKeyDictionary()


def watchdog_of(conn: Any) -> Watchdog | None:
    """The watchdog that guards ``conn``'s statements, if a pool registered it."""
    return _WATCHED.get(conn)


@dataclasses.dataclass
class Breach:
    """One running statement as the watchdog sees it, and what it did to it: ``bound`` is None, or
    the bound it broke, ``"time"`` / ``"locks"``, once cancelled; ``terminated`` once its backend was ended."""

    pid: int
    deadline: float | None
    started: float
    bound: str | None = None
    cancelled_at: float | None = None
    terminated: bool = False


class Watchdog:
    """Time and lock bounds on the statements of the connections registered with it (see the
    module's docstring). ``admin()`` opens an administrator's autocommit connection;
    ``max_locks`` and ``grace`` as in :class:`~birdenv.postgres.pool.RoleLimits`; ``interval``:
    seconds between two looks at the running statements."""

    def __init__(self, admin: Any, *, max_locks: int, grace: float, interval: float = 0.1) -> None:
        self._open_admin = admin
        self.max_locks = max_locks
        self.grace = grace
        self.interval = interval
        self._cond = threading.Condition()
        self._running: dict[int, Breach] = {}
        self._thread: threading.Thread | None = None
        self._admin: Any = None
        self._closed = False

    def register(self, conn: Any) -> None:
        """Guard the statements that :func:`~birdenv.postgres.session.run_pg_statement` runs on
        ``conn``."""
        _WATCHED[conn] = self

    @contextlib.contextmanager
    def statement(self, conn: Any, timeout: float | None) -> Iterator[Breach]:
        """Watch one statement running on ``conn`` for ``timeout`` seconds (None: no deadline);
        the :class:`Breach` says what the watchdog did to it."""
        now = time.monotonic()
        entry = Breach(conn.info.backend_pid, None if timeout is None else now + timeout, now)
        with self._cond:
            self._running[id(entry)] = entry
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._loop, name="birdenv-pg-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield entry
        finally:
            # Under the lock: the watchdog acts on a statement only while it is registered, so a
            # cancel never reaches the session's next statement.
            with self._cond:
                del self._running[id(entry)]

    def close(self) -> None:
        """Stop the thread and close its connection (idempotent)."""
        with self._cond:
            self._closed = True
            thread, self._thread = self._thread, None
            self._cond.notify()
        if thread is not None:
            thread.join()
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._running:
                    self._cond.wait()
                    continue
                entries = list(self._running.values())
            now = time.monotonic()
            for entry in entries:
                if entry.bound is None and entry.deadline is not None and now >= entry.deadline:
                    self._act(entry, "time", "pg_cancel_backend")
                elif (
                    entry.cancelled_at is not None
                    and not entry.terminated
                    and now >= entry.cancelled_at + self.grace
                ):
                    self._act(entry, entry.bound, "pg_terminate_backend")
            watched = [e for e in entries if e.bound is None and now - e.started >= self.interval]
            if watched:
                for entry, count in self._lock_counts(watched):
                    if count > self.max_locks:
                        self._act(entry, "locks", "pg_cancel_backend")
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.interval)

    def _query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run ``sql`` on the watchdog's administrator connection (opened again after the server
        went away); nothing on failure: the next look tries again."""
        try:
            if self._admin is None or self._admin.closed:
                self._admin = self._open_admin()
            return self._admin.execute(sql, params).fetchall()
        except Exception:
            self._admin = None
            return []

    def _lock_counts(self, entries: list[Breach]) -> list[tuple[Breach, int]]:
        rows = self._query(
            "SELECT pid, count(*) FROM pg_locks WHERE pid = ANY(%s) GROUP BY pid",
            ([e.pid for e in entries],),
        )
        counts = dict(rows)
        return [(e, counts.get(e.pid, 0)) for e in entries]

    def _act(self, entry: Breach, bound: str | None, function: str) -> None:
        with self._cond:
            if id(entry) not in self._running:
                return  # the statement ended meanwhile
            if function == "pg_terminate_backend":
                entry.terminated = True
            else:
                entry.bound, entry.cancelled_at = bound, time.monotonic()
            self._query(f"SELECT {function}(%s)", (entry.pid,))
