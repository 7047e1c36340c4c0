"""Result sharing between sibling trajectories: read-only results keyed by the exact state.

A trajectory's state is its base plus the exact sequence of statements that changed it, with what
each of them answered; :func:`initial_state` and :func:`advance` fold that history into a digest.
A statement that SQLite's authorizer saw do nothing but read tables and call deterministic built-in
functions, run outside a transaction, leaves the state as it was; its result (rows, columns, caps
and errors alike) is a function of that state and the statement, so a :class:`ResultCache` may
hand it to any later trajectory of the pool whose digest is the same, without running it again.

What keeps this exact, each rule load-bearing:

- everything else is a change, pragmas and TEMP objects included, and so is any statement run
  inside a transaction (an error there rolls the transaction back);
- a change that is not a function of the state and the statement ends sharing for its trajectory:
  a volatile function (``random()``, ``'now'``, ``changes()``... anything not on
  :data:`DETERMINISTIC_FUNCTIONS`), a table written whose column defaults are not literals
  (``DEFAULT (random())``, ``CURRENT_TIMESTAMP``: SQLite does not show them to the authorizer), a
  rowid table at the largest rowid (SQLite then picks new rowids at random), a timeout, or a
  transient error (locks, memory, disk);
- a statement SQLite did not prepare again (its statement cache) is classified as it was when it
  was prepared; one whose classification is unknown counts as a volatile change;
- a session used through anything but :meth:`~birdenv.replicas.session.Session.execute` (its
  connection, another connection) stops sharing: its history is no longer known.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import sqlite3
import threading
from typing import Any

from birdenv.replicas.guard import authorizer

__all__ = [
    "DETERMINISTIC_FUNCTIONS",
    "ResultCache",
    "StatementWatch",
    "advance",
    "initial_state",
    "is_transient",
]

#: Built-in functions whose value depends on their arguments alone (SQLite 3.40: core, aggregate,
#: window, math and JSON functions). Date and time functions are left out: any of them may be
#: given ``'now'``, by the statement or by a value it reads.
DETERMINISTIC_FUNCTIONS = frozenset(
    {
        # core scalar functions
        "abs",
        "char",
        "coalesce",
        "format",
        "glob",
        "hex",
        "ifnull",
        "iif",
        "instr",
        "length",
        "like",
        "likelihood",
        "likely",
        "lower",
        "ltrim",
        "max",
        "min",
        "nullif",
        "printf",
        "quote",
        "replace",
        "round",
        "rtrim",
        "sign",
        "soundex",
        "substr",
        "substring",
        "trim",
        "typeof",
        "unhex",
        "unicode",
        "unlikely",
        "upper",
        "zeroblob",
        "concat",
        "concat_ws",
        "octet_length",
        # aggregate and window functions
        "avg",
        "count",
        "group_concat",
        "string_agg",
        "sum",
        "total",
        "row_number",
        "rank",
        "dense_rank",
        "percent_rank",
        "cume_dist",
        "ntile",
        "lag",
        "lead",
        "first_value",
        "last_value",
        "nth_value",
        # math functions
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "ceil",
        "ceiling",
        "cos",
        "cosh",
        "degrees",
        "exp",
        "floor",
        "ln",
        "log",
        "log10",
        "log2",
        "mod",
        "pi",
        "pow",
        "power",
        "radians",
        "sin",
        "sinh",
        "sqrt",
        "tan",
        "tanh",
        "trunc",
        # JSON functions and operators
        "json",
        "json_array",
        "json_array_length",
        "json_extract",
        "json_insert",
        "json_object",
        "json_patch",
        "json_remove",
        "json_replace",
        "json_set",
        "json_type",
        "json_valid",
        "json_quote",
        "json_group_array",
        "json_group_object",
        "->",
        "->>",
    }
)
# Virtual tables whose rows describe the connection or the file layout, not the data. (Table-valued
# pragmas need no entry: SQLite authorizes them as pragmas, which are changes.)
_VOLATILE_TABLES = frozenset({"sqlite_stmt", "dbstat", "sqlite_dbpage"})
_READS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_WRITES = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE})
# Errors that say how the machine was doing, not what the statement means.
_TRANSIENT = re.compile(
    r"locked|busy|interrupt|out of memory|memoryerror|disk|full|i/o|timed out", re.IGNORECASE
)
# A column default SQLite evaluates to the same value every time.
_LITERAL = re.compile(
    r"""(?ix)\s*(?: null | true | false | [+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?
    | 0x[0-9a-f]+ | '(?:[^']|'')*' | x'[0-9a-f]*' )\s*"""
)
_MAX_ROWID = (1 << 63) - 1
# How many statements' classifications a session remembers: more than the 128 prepared statements
# Python's sqlite3 keeps per connection, so a statement it reuses is always remembered.
_MEMO = 256


def initial_state(*parts: object) -> bytes:
    """The digest of a fresh state: its base's content hash and every setting that shapes results."""
    h = hashlib.sha256(b"birdenv-state-1")
    for part in parts:
        h.update(b"\0" + repr(part).encode("utf-8", "surrogatepass"))
    return h.digest()


def advance(state: bytes, sql: str, *outcome: object) -> bytes:
    """The digest after ``sql`` changed ``state``, answering ``outcome`` (its error, its changes)."""
    h = hashlib.sha256(state)
    h.update(b"\0" + sql.encode("utf-8", "surrogatepass") + b"\0")
    h.update(repr(outcome).encode("utf-8", "surrogatepass"))
    return h.digest()


def is_transient(error: str | None) -> bool:
    """Whether an error message is about resources or timing rather than the statement."""
    return error is not None and _TRANSIENT.search(error) is not None


@dataclasses.dataclass(frozen=True)
class Effect:
    """What one statement did, as the authorizer saw it while SQLite prepared it."""

    changes: bool
    volatile: bool
    written: frozenset[tuple[str, str]]


_UNKNOWN = Effect(changes=True, volatile=True, written=frozenset())


class StatementWatch:
    """A session's authorizer: the session guard, plus a record of what each statement does.

    Call :meth:`begin` right before the statement runs and :meth:`effect` right after.
    """

    __slots__ = ("_changes", "_memo", "_seen", "_volatile", "_written")

    def __init__(self) -> None:
        self._memo: collections.OrderedDict[str, Effect] = collections.OrderedDict()
        self.begin()

    def begin(self) -> None:
        """Forget the previous statement."""
        self._seen = self._changes = self._volatile = False
        self._written: set[tuple[str, str]] = set()

    def __call__(
        self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None
    ) -> int:
        verdict = authorizer(action, arg1, arg2, db, source)
        self._seen = True
        if action in _READS:
            if action == sqlite3.SQLITE_READ and (arg1 or "").lower() in _VOLATILE_TABLES:
                self._volatile = True
        elif action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() not in DETERMINISTIC_FUNCTIONS:
                self._volatile = True
        else:
            self._changes = True
            if action in _WRITES and arg1 is not None:
                self._written.add((db or "main", arg1))
        return verdict

    def effect(self, sql: str) -> Effect:
        """What ``sql`` did; remembered, for when SQLite reuses its prepared statement."""
        if not self._seen:
            effect = self._memo.get(sql, _UNKNOWN)
            if effect is not _UNKNOWN:
                self._memo.move_to_end(sql)
            return effect
        effect = Effect(self._changes, self._volatile, frozenset(self._written))
        self._memo[sql] = effect
        self._memo.move_to_end(sql)
        if len(self._memo) > _MEMO:
            self._memo.popitem(last=False)
        return effect


def volatile_tables(conn: sqlite3.Connection, written: frozenset[tuple[str, str]]) -> bool:
    """Whether writing any of these tables may store values that are not a function of the
    statement: a column default that is not a literal, or a rowid table at the largest rowid."""
    for db, table in written:
        try:
            defaults = conn.execute(
                "SELECT dflt_value FROM pragma_table_xinfo(?, ?)", (table, db)
            ).fetchall()
        except sqlite3.Error:
            return True
        if any(d is not None and not _LITERAL.fullmatch(d) for (d,) in defaults):
            return True
        try:
            (top,) = conn.execute(f'SELECT max(rowid) FROM "{db}"."{table}"').fetchone()
        except sqlite3.Error:
            continue  # WITHOUT ROWID, or a view written through its triggers
        if top == _MAX_ROWID:
            return True
    return False


class ResultCache:
    """Read-only results by (state, statement, deadline): bounded in bytes, safe across threads.

    One per replica pool (so one per process): the G rollouts of a task that reach the same state
    run each read-only statement once, also when they reach it at the same moment in several
    threads (the first runs it, the others wait for its result). Least recently used entries go
    first; a result larger than a sixteenth of the budget is not kept.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._stats = {"lookups": 0, "hits": 0, "stored": 0, "evicted": 0, "saved_seconds": 0.0}
        # Statements being run: key -> [the running thread's id, the Event its waiters wait on
        # (made by the first waiter: an uncontended miss makes none)].
        self._flights: dict[Any, list[Any]] = {}

    def get(self, key: Any, timeout: float | None = None) -> Any | None:
        """The result stored under ``key`` (the caller copies what it hands out), or None: run it.

        While another thread runs the same statement on the same state, wait for its result (up
        to ``timeout`` seconds). A caller that got None and runs the statement calls
        :meth:`release` afterwards, whether or not it :meth:`put` a result.
        """
        with self._lock:
            self._stats["lookups"] += 1
            hit = self._hit(key)
            if hit is not None:
                return hit
            flight = self._flights.get(key)
            if flight is None:
                self._flights[key] = [threading.get_ident(), None]
                return None
            if flight[0] == threading.get_ident():
                return None  # this thread is running it already (for another session): no wait
            if flight[1] is None:
                flight[1] = threading.Event()
            done = flight[1]
        # A change, an error that is not shared or a volatile statement leaves nothing to find:
        # the waiter then runs it itself, as it would have without waiting.
        done.wait(timeout)
        with self._lock:
            return self._hit(key)

    def _hit(self, key: Any) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._stats["hits"] += 1
        self._stats["saved_seconds"] += entry[0].elapsed
        return entry[0]

    def release(self, key: Any) -> None:
        """End the calling thread's run of ``key`` (see :meth:`get`), waking whoever waits on it."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is None or flight[0] != threading.get_ident():
                return
            del self._flights[key]
        if flight[1] is not None:
            flight[1].set()

    def put(self, key: Any, result: Any, size: int) -> None:
        """Keep ``result`` (about ``size`` bytes) under ``key``, evicting what it must."""
        if size > self.max_bytes // 16:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (result, size)
            self._bytes += size
            self._stats["stored"] += 1
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
                self._stats["evicted"] += 1

    def stats(self) -> dict[str, Any]:
        """Lookups, hits, results stored and evicted, bytes held, seconds of SQL not run again."""
        with self._lock:
            return {**self._stats, "entries": len(self._entries), "bytes": self._bytes}
