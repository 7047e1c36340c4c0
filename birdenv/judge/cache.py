"""What the judge may remember across instances: the issue phase's outcome and pristine results.

The first phase of the official evaluation (a fresh state, ``preprocess_sql``, the issue SQL, the
tests) does not depend on the prediction: for a given task on a given base it has one outcome,
whoever is judged. The read-only results the judge memoises on the pristine state (the gold's
result, which the default test computes in the issue phase) are likewise fixed. RL training
judges the same task thousands of times and evaluations judge the same suite again and again, so
:class:`JudgeCache` keeps both, in memory and in a small SQLite file beside the replica store's
bases, keyed by everything they depend on: the base's content hash, the task fields the issue
phase reads, the statement deadline, and the source of the judging code itself (a changed judge
never reuses an old entry).

Entries are written only for outcomes that are reproducible: no deadline passed, no volatile SQL
(``random()``, ``'now'`` ...) ran, and no test code touches clocks, randomness or the environment
(:func:`cacheable_task`). The file also keeps how long each task last took to judge, which
:func:`~birdenv.judge.judge_many` reads to start the slowest first. A cache that cannot be read
or written (corrupt, locked, read-only, disk full) is skipped: it is an optimisation and never
changes or fails a verdict.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
from pathlib import Path
from typing import Any

from birdenv.tasks import Task

__all__ = [
    "CACHE_FILE",
    "IssueOutcome",
    "JudgeCache",
    "cache_key",
    "cacheable_task",
    "schedule_key",
]

log = logging.getLogger(__name__)

#: The cache file, in the replica pool's root (beside ``bases/``).
CACHE_FILE = "judge-cache.sqlite"
# Entries kept in memory per process, and the largest memo (serialised) worth storing.
_MEMORY_ENTRIES = 2048
_MAX_MEMO_BYTES = 4 << 20
# SQLite's answers to a lock held by another connection: transient, unlike a corrupt file.
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

# Test code that may not give the same outcome twice: clocks, randomness, the process environment.
_UNSTABLE_TEST = re.compile(
    r"\b(random|uuid|time|datetime|now|today|os|sys|environ|getpid|open|secrets)\b"
)

_HERE = Path(__file__).resolve().parent
_SOURCES = (
    *sorted(_HERE.glob("*.py")),
    _HERE.parent / "replicas" / "session.py",
    _HERE.parent / "replicas" / "guard.py",
)
# The judging code's own fingerprint: an entry made by other code is never reused.
_CODE_HASH = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES)).hexdigest()


@dataclasses.dataclass
class IssueOutcome:
    """The issue phase's result for one task, and the pristine-state results it memoised."""

    issue_passed: bool
    memo: dict[str, list[tuple[Any, ...]]]


def cacheable_task(task: Task) -> bool:
    """Whether the task's tests are deterministic enough for their outcome to be remembered."""
    return not any(_UNSTABLE_TEST.search(source) for source in task.test_cases)


def cache_key(task: Task, base_sha256: str, statement_timeout: float | None) -> str:
    """The key of a task's issue-phase outcome: every input the phase reads, hashed."""
    material = [
        _CODE_HASH,
        base_sha256,
        list(task.preprocess_sql),
        list(task.issue_sql),
        list(task.sol_sql),
        list(task.test_cases),
        task.conditions,
        statement_timeout,
    ]
    blob = json.dumps(material, sort_keys=True, ensure_ascii=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


def schedule_key(task: Task) -> str:
    """The key under which the time a task took to judge is remembered, to schedule it next time.

    Cheap to compute (no base content hash): the timing is a hint for ordering work, never part
    of a verdict.
    """
    material = [
        task.instance_id,
        task.db_id,
        list(task.preprocess_sql),
        list(task.issue_sql),
        list(task.sol_sql),
        list(task.test_cases),
    ]
    return hashlib.sha256(json.dumps(material, ensure_ascii=True).encode()).hexdigest()


def _encode_value(value: Any) -> Any:
    # SQLite gives None, int, float, str or bytes; JSON has no bytes.
    return {"b": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _decode_value(value: Any) -> Any:
    return base64.b64decode(value["b"]) if isinstance(value, dict) else value


def _encode_memo(memo: dict[str, list[tuple[Any, ...]]]) -> str:
    return json.dumps(
        {sql: [[_encode_value(v) for v in row] for row in rows] for sql, rows in memo.items()}
    )


def _decode_memo(text: str) -> dict[str, list[tuple[Any, ...]]]:
    return {
        sql: [tuple(_decode_value(v) for v in row) for row in rows]
        for sql, rows in json.loads(text).items()
    }


class JudgeCache:
    """Issue-phase outcomes by :func:`cache_key`, in memory and in ``{root}/judge-cache.sqlite``.

    ``persistent=False`` keeps them in this process only. One instance per pool root and process
    (:meth:`for_root`); safe to share between threads and between processes on one root.
    """

    def __init__(self, root: str | Path, *, persistent: bool = True) -> None:
        self.path = Path(root) / CACHE_FILE
        self.persistent = persistent
        self._memory: collections.OrderedDict[str, IssueOutcome] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self.hits = self.misses = 0

    @classmethod
    def for_root(cls, root: str | Path, *, persistent: bool = True) -> JudgeCache:
        """This process's cache for a pool root (connections are not shared across a fork)."""
        key = (str(Path(root).resolve()), os.getpid(), persistent)
        with _CACHES_LOCK:
            cache = _CACHES.get(key)
            if cache is None:
                cache = _CACHES[key] = cls(root, persistent=persistent)
            return cache

    def _db(self) -> sqlite3.Connection | None:
        if not self.persistent:
            return None
        if self._conn is None:
            conn = None
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # A short wait: a busy cache is skipped, never waited on for long.
                conn = sqlite3.connect(self.path, timeout=1, check_same_thread=False)
                # Opening writes only what is missing (the mode, the tables): a file already set
                # up opens with reads alone, which WAL never blocks, however busy its writers.
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode = WAL")
                tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
                if not {"issue_outcome", "judge_seconds"} <= tables:
                    conn.execute(
                        "CREATE TABLE IF NOT EXISTS issue_outcome "
                        "(key TEXT PRIMARY KEY, issue_passed INTEGER NOT NULL, memo TEXT NOT NULL)"
                    )
                    conn.execute(
                        "CREATE TABLE IF NOT EXISTS judge_seconds "
                        "(key TEXT PRIMARY KEY, seconds REAL NOT NULL)"
                    )
                    conn.commit()
            except (sqlite3.Error, OSError) as exc:
                if conn is not None:
                    conn.close()
                if getattr(exc, "sqlite_errorcode", None) in _BUSY:
                    # Another process is setting it up or writing: skipped now, opened next time.
                    log.info("judge cache %s busy, skipped this time: %s", self.path, exc)
                    return None
                log.warning("judge cache %s unusable, kept in memory only: %s", self.path, exc)
                self.persistent = False
                return None
            self._conn = conn
        return self._conn

    def get(self, key: str) -> IssueOutcome | None:
        """The remembered outcome for ``key``, or None."""
        with self._lock:
            outcome = self._memory.get(key)
            if outcome is not None:
                self._memory.move_to_end(key)
                self.hits += 1
                return outcome
            db = self._db()
            row = None
            if db is not None:
                try:
                    row = db.execute(
                        "SELECT issue_passed, memo FROM issue_outcome WHERE key = ?", (key,)
                    ).fetchone()
                    if row is not None:
                        outcome = IssueOutcome(bool(row[0]), _decode_memo(row[1]))
                except (sqlite3.Error, ValueError, TypeError) as exc:
                    log.warning("judge cache %s unreadable, ignored: %s", self.path, exc)
                    outcome = None
            if outcome is None:
                self.misses += 1
                return None
            self.hits += 1
            self._remember(key, outcome)
            return outcome

    def put(self, key: str, outcome: IssueOutcome) -> None:
        """Remember ``outcome`` (its memo only when it is small enough to be worth keeping)."""
        memo_text = _encode_memo(outcome.memo)
        if len(memo_text) > _MAX_MEMO_BYTES:
            outcome, memo_text = IssueOutcome(outcome.issue_passed, {}), "{}"
        with self._lock:
            self._remember(key, outcome)
            db = self._db()
            if db is None:
                return
            try:
                with db:
                    db.execute(
                        "INSERT OR REPLACE INTO issue_outcome VALUES (?, ?, ?)",
                        (key, int(outcome.issue_passed), memo_text),
                    )
            except sqlite3.Error as exc:
                log.warning("judge cache %s not written: %s", self.path, exc)

    def judge_seconds(self, keys: list[str]) -> dict[str, float]:
        """How long judging took the last time, for the :func:`schedule_key` keys known."""
        with self._lock:
            db = self._db()
            if db is None or not keys:
                return {}
            try:
                found: dict[str, float] = {}
                for start in range(0, len(keys), 500):  # under SQLite's bound-parameter limit
                    chunk = keys[start : start + 500]
                    found.update(
                        db.execute(
                            "SELECT key, seconds FROM judge_seconds "
                            f"WHERE key IN ({','.join('?' * len(chunk))})",
                            chunk,
                        ).fetchall()
                    )
                return found
            except sqlite3.Error as exc:
                log.warning("judge cache %s unreadable, ignored: %s", self.path, exc)
                return {}

    def record_judge_seconds(self, seconds: dict[str, float]) -> None:
        """Remember how long judging took, by :func:`schedule_key`."""
        with self._lock:
            db = self._db()
            if db is None or not seconds:
                return
            try:
                with db:
                    db.executemany(
                        "INSERT OR REPLACE INTO judge_seconds VALUES (?, ?)", seconds.items()
                    )
            except sqlite3.Error as exc:
                log.warning("judge cache %s not written: %s", self.path, exc)

    def _remember(self, key: str, outcome: IssueOutcome) -> None:
        self._memory[key] = outcome
        self._memory.move_to_end(key)
        while len(self._memory) > _MEMORY_ENTRIES:
            self._memory.popitem(last=False)


_CACHES: dict[tuple[str, int, bool], JudgeCache] = {}
_CACHES_LOCK = threading.Lock()
