"""Fuzz campaign: the copy-on-write overlay against a private full copy, statement by statement.

A hypothesis state machine builds a base with a random ``page_size`` (512 … 65536) and a random
journal mode *on the base* (the rollback header or WAL's), opens several sessions on it and
interleaves random statements over them: DDL (CREATE/ALTER/DROP, indexes, WITHOUT ROWID), writes,
blobs that span many pages, VACUUM (also with a new page size), ``auto_vacuum``, transactions with
ROLLBACK and SAVEPOINTs, TEMP tables, a small page cache that forces spills mid-transaction,
journal-mode switches (DELETE, TRUNCATE, PERSIST, MEMORY, WAL, OFF) and checkpoints, and session
reopens. Each session has a reference: plain ``sqlite3`` on ``shutil.copy`` of the same base, sent
the same statements. After every step every session must give the reference's results and errors,
the same contents, schema and ``PRAGMA integrity_check``, and the base's bytes must be unchanged.

Four drivers: ``vfs`` (raw connections on :func:`birdenv.replicas.overlay.session_uri`, explicit
transactions, every pragma), ``vfs-shared`` (the same, with the sessions' pages in one shared,
content-addressed store) and the replica pool's ``overlay`` and ``copy`` strategies (statements
through :meth:`Session.execute`, the evaluator's way, with shared pages and shared results; the
invariant reads the sessions through ``execute`` too, so sessions in the same state share those
results; the reference runs them with :func:`run_statement` under the same guard).

Default run: a few examples (``FUZZ_EXAMPLES``, default 30; about 10 s). The campaign is the slow
test: it runs for ``FUZZ_MINUTES`` (default 30), records every failure, and prints the counts::

    FUZZ_MINUTES=30 nice -n 10 pytest tests/test_overlay_fuzz.py -m slow -s

Findings are kept below as explicit regression tests with their minimal sequences.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from birdenv.replicas import ReplicaPool, overlay
from birdenv.replicas.guard import authorizer
from birdenv.replicas.session import Limits, run_statement
from birdenv.suites import file_sha256
from birdenv.tasks import parse_task

pytestmark = pytest.mark.skipif(
    not overlay.available(), reason=f"overlay VFS unavailable: {overlay.unavailable_reason()}"
)

PAGE_SIZES = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
JOURNAL_MODES = ["DELETE", "TRUNCATE", "PERSIST", "MEMORY", "WAL", "OFF"]
DRIVERS = ["vfs", "vfs-shared", "overlay", "copy"]
RAW = ("vfs", "vfs-shared")  # raw connections: explicit transactions, every pragma
MAX_SESSIONS = 3

BASE_SQL = """
CREATE TABLE parent (id INTEGER PRIMARY KEY, name TEXT NOT NULL, blob BLOB);
CREATE TABLE child (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent_id INTEGER REFERENCES parent(id) ON DELETE CASCADE,
    v REAL, note TEXT);
CREATE INDEX child_parent ON child(parent_id);
CREATE TABLE kv (k TEXT PRIMARY KEY, v) WITHOUT ROWID;
CREATE VIEW heavy AS SELECT parent_id, count(*) AS n FROM child GROUP BY parent_id;
CREATE TRIGGER child_note AFTER INSERT ON child WHEN new.note IS NULL
BEGIN UPDATE child SET note = 'auto' || new.id WHERE id = new.id; END;
"""


def build_base(path: Path, page_size: int, journal_mode: str, rows: int, blob: int) -> Path:
    """A deterministic base with ``page_size`` and, in its header, ``journal_mode``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(f"PRAGMA page_size = {page_size}")
        conn.execute("PRAGMA synchronous = OFF")
        conn.executescript(BASE_SQL)
        conn.execute("BEGIN")
        for i in range(1, rows + 1):
            conn.execute(
                "INSERT INTO parent VALUES (?, ?, ?)",
                (i, f"p{i}", bytes([i % 251]) * (blob if i % 4 == 0 else 7 * i)),
            )
            for j in range(3):
                conn.execute(
                    "INSERT INTO child (parent_id, v, note) VALUES (?, ?, ?)",
                    (i, i * 1.5 + j, None if j == 2 else "n" * (i + j)),
                )
            conn.execute("INSERT INTO kv VALUES (?, ?)", (f"k{i:03d}", i * i))
        conn.execute("COMMIT")
        if journal_mode == "WAL":
            conn.execute("PRAGMA journal_mode = WAL")  # header bytes 18/19 = 2
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------ the statements

N = st.integers(0, 40)
TABLES = st.sampled_from(["parent", "child", "kv", "extra", "t_new", "tmp_t"])


def _blob(n: int, size: int) -> str:
    # Deterministic content (randomblob would differ between the session and its reference).
    return f"CAST(printf('%.*c', {size}, char(65 + {n} % 26)) AS BLOB)"


@st.composite
def statements(draw: st.DrawFn, driver: str) -> list[str]:
    """One step: usually one statement, sometimes a short sequence (e.g. page_size + VACUUM)."""
    n = draw(N)
    size = draw(st.sampled_from([10, 600, 5000, 70_000, 300_000]))
    k = draw(st.integers(2, 5))
    options = [
        f"INSERT INTO parent (name, blob) VALUES ('x{n}', {_blob(n, size)})",
        f"INSERT INTO child (parent_id, v, note) VALUES ({n}, {n}.25, NULL)",
        f"INSERT INTO child (parent_id, v, note) SELECT parent_id, v + 1, note FROM child "
        f"WHERE id % {k} = 0 LIMIT {n}",
        f"INSERT OR REPLACE INTO kv VALUES ('k{n:03d}', {_blob(n, size // 10 + 1)})",
        f"UPDATE parent SET blob = {_blob(n, size)} WHERE id % {k} = {n % k}",
        f"UPDATE child SET v = v * 2, note = note || '{n}' WHERE parent_id % {k} = 1",
        f"DELETE FROM parent WHERE id % {k} = {n % k}",
        f"DELETE FROM child WHERE id > {n * 3}",
        f"DELETE FROM kv WHERE k < 'k{n:03d}'",
        "CREATE TABLE IF NOT EXISTS extra (a INTEGER PRIMARY KEY, b TEXT, c BLOB)",
        f"INSERT INTO extra (b, c) VALUES ('e{n}', zeroblob({size}))",
        f"CREATE TABLE IF NOT EXISTS t_new AS SELECT id, name, length(blob) AS l FROM parent "
        f"WHERE id > {n}",
        "DROP TABLE IF EXISTS extra",
        "DROP TABLE IF EXISTS t_new",
        f"ALTER TABLE parent ADD COLUMN c{n} TEXT DEFAULT 'd{n}'",
        f"ALTER TABLE parent DROP COLUMN c{n}",
        "ALTER TABLE t_new RENAME TO t_renamed",
        "ALTER TABLE t_renamed RENAME TO t_new",
        "ALTER TABLE child RENAME COLUMN note TO remark",
        "ALTER TABLE child RENAME COLUMN remark TO note",
        f"CREATE INDEX IF NOT EXISTS ix_{n % 4} ON child(v, note)",
        f"CREATE UNIQUE INDEX IF NOT EXISTS ux_{n % 3} ON parent(name)",
        f"DROP INDEX IF EXISTS ix_{n % 4}",
        f"DROP INDEX IF EXISTS ux_{n % 3}",
        "CREATE TEMP TABLE IF NOT EXISTS tmp_t (x INTEGER, y BLOB)",
        f"INSERT INTO tmp_t VALUES ({n}, {_blob(n, size)})",
        "DROP TABLE IF EXISTS temp.tmp_t",
        "VACUUM",
        "PRAGMA foreign_keys = ON",
        "PRAGMA foreign_keys = OFF",
        "PRAGMA integrity_check",
        "BEGIN",
        "BEGIN IMMEDIATE",
        "COMMIT",
        "ROLLBACK",
        f"SAVEPOINT sp{n % 3}",
        f"ROLLBACK TO sp{n % 3}",
        f"RELEASE sp{n % 3}",
    ]
    if driver in RAW:
        # The pool's sessions force WAL before every statement (as the evaluator does) and keep
        # the guard, so journal modes, page sizes and cache sizes are the raw VFS's business.
        options += [
            f"PRAGMA journal_mode = {draw(st.sampled_from(JOURNAL_MODES))}",
            f"PRAGMA journal_mode = {draw(st.sampled_from(JOURNAL_MODES))}",
            f"PRAGMA wal_checkpoint({draw(st.sampled_from(['PASSIVE', 'FULL', 'RESTART', 'TRUNCATE']))})",
            f"PRAGMA cache_size = {draw(st.sampled_from([2, 10, 2000]))}",
            f"PRAGMA auto_vacuum = {draw(st.sampled_from(['NONE', 'FULL', 'INCREMENTAL']))}",
            f"PRAGMA incremental_vacuum({n % 5})",
            f"PRAGMA secure_delete = {draw(st.sampled_from(['ON', 'OFF']))}",
            f"PRAGMA journal_size_limit = {draw(st.sampled_from([0, 4096, -1]))}",
        ]
    if draw(st.integers(0, 9)) == 0:
        seq = [f"PRAGMA page_size = {draw(st.sampled_from(PAGE_SIZES))}", "VACUUM"]
        if driver in RAW and draw(st.booleans()):
            seq.insert(0, "PRAGMA journal_mode = DELETE")  # WAL forbids a page size change
        return seq
    if draw(st.integers(0, 7)) == 0:  # a small transaction that is rolled back
        body = [draw(st.sampled_from(options[:12])) for _ in range(draw(st.integers(1, 4)))]
        return ["BEGIN", *body, draw(st.sampled_from(["ROLLBACK", "COMMIT"]))]
    return [draw(st.sampled_from(options))]


# A writer in another process that dies without closing: it loads only the VFS (not the package,
# for speed), runs the script on the session and then on the reference, prints whether both
# answered alike, and exits with the transaction (and its spilled pages) left behind.
_EXTENSION = getattr(importlib.util.find_spec("birdenv.replicas.native._overlay"), "origin", None)
CRASH_CHILD = """
import importlib.util, json, os, sqlite3, sys
spec = importlib.util.spec_from_file_location("_overlay", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
ext.register("birdoverlay")
script = json.loads(sys.stdin.read())
frames = sys.argv[2] == "True"  # as in raw_execute
answers = []
for target in sys.argv[3:]:
    conn = sqlite3.connect(target, uri=target.startswith("file:"), isolation_level=None, timeout=0)
    side = []
    for sql in script:
        try:
            rows = conn.execute(sql).fetchall()
        except sqlite3.Error as exc:
            side.append(("error", type(exc).__name__, str(exc), conn.in_transaction))
            continue
        if not frames and "wal_checkpoint" in sql.lower():
            rows = [(busy, log == done) for busy, log, done in rows]
        side.append(("rows", rows, conn.in_transaction))
    answers.append(side)
sys.stdout.write(repr(answers[0] == answers[1]) + repr(answers))
sys.stdout.flush()
os._exit(0)
"""


# ------------------------------------------------------------------------ views and drivers


def view(conn: sqlite3.Connection | Callable[[str], list]) -> list:
    """Everything observable: schema, every table's rows (sorted), TEMP objects, integrity.

    ``conn`` is a connection, or a function that answers a query with its rows."""
    out: list = []

    def q(sql: str) -> list:
        if callable(conn) and not isinstance(conn, sqlite3.Connection):
            return conn(sql)
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.Error as exc:
            return [("error", str(exc))]

    for schema in ("main", "temp"):
        master = q(f"SELECT type, name, tbl_name, sql FROM {schema}.sqlite_master ORDER BY name")
        out.append(master)
        for row in master:
            if row[0] == "table" and not str(row[1]).startswith("sqlite_"):
                rows = q(f'SELECT * FROM {schema}."{row[1]}"')
                out.append((row[1], sorted(rows, key=repr)))
    out.append(q("SELECT * FROM sqlite_sequence ORDER BY name"))
    out.append(q("PRAGMA integrity_check"))
    out.append(q("PRAGMA page_size"))
    out.append(q("PRAGMA main.page_count"))
    out.append(q("PRAGMA freelist_count"))
    out.append(q("PRAGMA auto_vacuum"))
    return out


def session_view(session) -> list:
    """:func:`view` of a pool session, read through ``Session.execute`` (so results are shared
    between sessions in the same state, and the session stays eligible for sharing)."""

    def q(sql: str) -> list:
        result = session.execute(sql)
        return result.rows if result.error is None else [("error", result.error)]

    return view(q)


def raw_execute(conn: sqlite3.Connection, sql: str, *, frames: bool = True) -> tuple:
    """What a raw connection answers to ``sql``: its rows, or its error.

    ``frames=False``: a checkpoint's WAL frame counts are left out (whether it was blocked, and
    whether it checkpointed every frame, stay). How many frames a transaction writes depends on
    how its page cache spilled, which depends on which pages SQLite reads in place: a session
    reading in place maps only the pages it has not changed, its reference every page, and plain
    SQLite itself writes other counts for other cache sizes
    (``test_finding_wal_frame_counts_follow_the_page_cache``).
    """
    try:
        rows = conn.execute(sql).fetchall()
    except sqlite3.Error as exc:
        return ("error", type(exc).__name__, str(exc), conn.in_transaction)
    if not frames and "wal_checkpoint" in sql.lower():
        rows = [(busy, log == done) for busy, log, done in rows]
    return ("rows", rows, conn.in_transaction)


def pool_reference_execute(conn: sqlite3.Connection, sql: str) -> tuple:
    """The reference side of a pool session: the evaluator's execution, under the same guard."""
    try:
        rows, _cols, _trunc = run_statement(conn, sql, max_rows=10**6, max_other_rows=10**6)
        return ("rows", rows or [])
    except (sqlite3.Error, ValueError, OverflowError) as exc:
        return ("error", str(exc))


class Campaign(RuleBasedStateMachine):
    """Sessions on one base, each beside its private-copy reference; compared after every step."""

    examples = 0
    steps = 0
    other_rules = 0  # reopens, second connections and crashed writers that ran

    def __init__(self) -> None:
        super().__init__()
        self.tmp: Path | None = None
        self.sessions: list = []
        self.refs: list[sqlite3.Connection] = []
        self.log: list[str] = []

    @initialize(
        page_size=st.sampled_from(PAGE_SIZES),
        base_journal=st.sampled_from(["DELETE", "WAL"]),
        rows=st.integers(0, 30),
        blob=st.sampled_from([100, 3000, 70_000]),
        driver=st.sampled_from(DRIVERS),
        count=st.integers(1, MAX_SESSIONS),
        journal=st.sampled_from(JOURNAL_MODES),
        in_place=st.booleans(),
    )
    def build(self, page_size, base_journal, rows, blob, driver, count, journal, in_place) -> None:
        type(self).examples += 1
        self.tmp = Path(tempfile.mkdtemp(prefix="ovlfuzz-", dir=os.environ.get("FUZZ_TMP")))
        self.driver = driver
        template = build_base(
            self.tmp / "dbs" / "fz" / "fz_template.sqlite", page_size, base_journal, rows, blob
        )
        self.pages = self.tmp / "pages" if driver == "vfs-shared" else None
        if driver in RAW:
            self.base_path = template
            self.pool = None
        else:
            # no byte cap: the invariant's views are compared with uncapped reads
            limits = Limits(statement_timeout=30, max_rows=10**6, max_result_bytes=None)
            self.pool = ReplicaPool(root=self.tmp / "replicas", strategy=driver, limits=limits)
            self.task = parse_task({"instance_id": "fz", "db_id": "fz"}, db_dir=self.tmp / "dbs")
            self.base_path = self.pool.store.base_for(self.task.db_path).path
        self.base_sha = file_sha256(self.base_path)
        # Raw connections read unchanged base pages in place (mmap) in half the examples, the
        # pool's sessions always (the pool sets it); their references then map their copies too.
        # Such examples compare no WAL frame counts (see raw_execute) and use no journal_mode=OFF
        # (see _defined).
        self.in_place = in_place and driver in RAW
        self.prelude = ["PRAGMA synchronous = OFF"]
        if self.in_place:
            self.prelude.append(f"PRAGMA mmap_size = {1 << 30}")
        self.journal = "MEMORY" if self.in_place and journal == "OFF" else journal
        for i in range(count):
            self._open(i)

    def _open(self, i: int) -> None:
        ref_path = self.tmp / f"ref-{i}.sqlite"
        if not ref_path.exists():
            shutil.copy(self.base_path, ref_path)
            ref_path.chmod(0o644)
        if self.driver in RAW:
            uri = overlay.session_uri(self.tmp / f"s-{i}.db", self.base_path, pages=self.pages)
            pair = [
                sqlite3.connect(uri, uri=True, isolation_level=None),
                sqlite3.connect(ref_path, isolation_level=None),
            ]
            # synchronous=OFF: fsyncs would dominate the run time. Compared, not assumed to work: a rollback under journal_mode=OFF (undefined in
            # SQLite) can leave both a session and its reference malformed, identically.
            for sql in (*self.prelude, f"PRAGMA journal_mode = {self.journal}"):
                answers = [raw_execute(conn, sql) for conn in pair]
                assert answers[0] == answers[1], (sql, answers)
        else:
            session = self.pool.session(self.task)
            ref = sqlite3.connect(ref_path)
            ref.set_authorizer(authorizer)
            ref.execute("PRAGMA secure_delete = OFF")
            pair = [session, ref]
        if i < len(self.sessions):
            self.sessions[i], self.refs[i] = pair
        else:
            self.sessions.append(pair[0])
            self.refs.append(pair[1])

    def _defined(self, sql: str) -> str:
        """``sql``, with journal mode OFF made MEMORY where connections read in place (finding 4).

        A ROLLBACK without a journal is undefined in SQLite: what stays behind depends on which
        pages had spilled, and a session reading in place spills at other moments than its
        reference. Elsewhere OFF is compared exactly (finding 1)."""
        return sql.replace("journal_mode = OFF", "journal_mode = MEMORY") if self.in_place else sql

    @staticmethod
    def _journaled(sql: str, journal: str) -> str:
        """``sql``, with journal modes that keep no journal on disk (MEMORY, OFF) made ``journal``.

        A process that dies inside a transaction leaves a hot journal to recover from, except under
        those, where what stays behind is undefined in SQLite (finding 5)."""
        for mode in ("MEMORY", "OFF"):
            sql = sql.replace(f"journal_mode = {mode}", f"journal_mode = {journal}")
        return sql

    def _view(self, i: int) -> list:
        s = self.sessions[i]
        return view(s) if isinstance(s, sqlite3.Connection) else session_view(s)

    @rule(data=st.data(), which=st.integers(0, MAX_SESSIONS - 1))
    def step(self, data: st.DataObject, which: int) -> None:
        if not self.sessions:
            return
        which %= len(self.sessions)
        type(self).steps += 1
        for sql in map(self._defined, data.draw(statements(self.driver))):
            self.log.append(f"{which}: {sql}")
            if self.driver in RAW:
                got = raw_execute(self.sessions[which], sql, frames=not self.in_place)
                expected = raw_execute(self.refs[which], sql, frames=not self.in_place)
            else:
                result = self.sessions[which].execute(sql)
                got = ("rows", result.rows) if result.error is None else ("error", result.error)
                expected = pool_reference_execute(self.refs[which], sql)
                if got[0] == "error" and expected[0] == "error":
                    # The session reworded a guard denial (the reference says only "not authorized").
                    got = ("error", got[1][: len(expected[1])])
            assert got == expected, (sql, got, expected)

    @rule(which=st.integers(0, MAX_SESSIONS - 1))
    def reopen(self, which: int) -> None:
        """Close a session and its reference (an open transaction rolls back) and reopen both."""
        if self.driver not in RAW or not self.sessions:
            return
        which %= len(self.sessions)
        self.log.append(f"{which}: <reopen>")
        type(self).other_rules += 1
        self.sessions[which].close()
        self.refs[which].close()
        self._open(which)

    @rule(data=st.data(), which=st.integers(0, MAX_SESSIONS - 1))
    def second_connection(self, data: st.DataObject, which: int) -> None:
        """Another connection on the same session (as test code gets one) runs one statement.

        It must see what the reference's second connection sees, and the session's first
        connection must then see that connection's committed writes (the side file's generation).
        """
        if self.driver not in RAW or not self.sessions:
            return
        which %= len(self.sessions)
        sql = self._defined(data.draw(statements(self.driver))[0])
        self.log.append(f"{which}: <second connection> {sql}")
        type(self).other_rules += 1
        uri = overlay.session_uri(self.tmp / f"s-{which}.db", self.base_path, pages=self.pages)
        # timeout=0: a lock the first connection holds is an immediate, comparable "locked" error
        pair = [
            sqlite3.connect(uri, uri=True, isolation_level=None, timeout=0),
            sqlite3.connect(self.tmp / f"ref-{which}.sqlite", isolation_level=None, timeout=0),
        ]
        try:
            for setting in self.prelude:
                answers = [raw_execute(conn, setting) for conn in pair]
                assert answers[0] == answers[1], (setting, answers)
            answers = [
                (raw_execute(conn, sql, frames=not self.in_place), view(conn)) for conn in pair
            ]
            assert answers[0] == answers[1], (sql, answers[0], answers[1])
        finally:
            for conn in pair:
                conn.close()

    @rule(
        data=st.data(),
        which=st.integers(0, MAX_SESSIONS - 1),
        journal=st.sampled_from(["DELETE", "TRUNCATE", "PERSIST", "WAL"]),
    )
    def crash_mid_transaction(self, data: st.DataObject, which: int, journal: str) -> None:
        """Another process writes to the session (and to the reference) inside a transaction
        with a tiny page cache, so pages spill before commit, then dies without closing.

        The next access must recover the last committed state from the hot journal (or ignore
        the WAL's uncommitted frames), exactly as the reference does. (Not with shared pages: such
        a session lives in its process, and another process is refused.)
        """
        if self.driver != "vfs" or not self.sessions or os.name != "posix":
            return
        which %= len(self.sessions)
        body = [
            self._journaled(data.draw(statements(self.driver))[0], journal)
            for _ in range(data.draw(st.integers(1, 4)))
        ]
        commit = data.draw(st.booleans())
        self.log.append(f"{which}: <crash {journal} commit={commit}> {body}")
        type(self).other_rules += 1
        uri = overlay.session_uri(self.tmp / f"s-{which}.db", self.base_path)
        ref_path = self.tmp / f"ref-{which}.sqlite"
        script = [
            *self.prelude,
            f"PRAGMA journal_mode = {journal}",
            "PRAGMA cache_size = 2",
            "BEGIN",
            *body,
            "COMMIT" if commit else "SELECT 1",
        ]
        # A fresh interpreter, not fork(): SQLite's per-process lock and shared-memory state must
        # not be inherited from this process's open connections.
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                CRASH_CHILD,
                _EXTENSION,
                str(not self.in_place),
                uri,
                str(ref_path),
            ],
            input=json.dumps(script),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.stdout.startswith("True"), (child.stdout, child.stderr[-3000:])

    @invariant()
    def sessions_match_their_references(self) -> None:
        for i, ref in enumerate(self.refs):
            got, expected = self._view(i), view(ref)
            assert got == expected, (i, got, expected)
        if self.tmp is not None:
            assert file_sha256(self.base_path) == self.base_sha, "the base changed"

    def teardown(self) -> None:
        try:
            for i in range(len(self.sessions)):
                if self.driver in RAW:
                    # Reopened from disk, each session must still match its reference.
                    self.sessions[i].close()
                    self.refs[i].close()
                    self._open(i)
                    assert view(self.sessions[i]) == view(self.refs[i]), i
                    self.sessions[i].close()
                    self.refs[i].close()
                    overlay.discard(self.tmp / f"s-{i}.db")
                else:
                    self.sessions[i].close()
                    self.refs[i].close()
            if self.pool is not None:
                self.pool.close()
            if self.tmp is not None:
                assert file_sha256(self.base_path) == self.base_sha, "the base changed"
                leftovers = [p.name for p in self.tmp.glob("s-*")]
                leftovers += [p.name for p in self.tmp.glob("pages-*")]
                assert not leftovers, leftovers
                stores = [s for s in overlay.page_stores() if s["pages"].startswith(str(self.tmp))]
                assert not stores, stores
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------ findings, kept


def _both(tmp: Path, base: Path, script: list[str], then: list[str]) -> list:
    """Run ``script`` on an overlay session and on a private copy, close both (an open transaction
    rolls back), reopen and run ``then``; return both sides' answers."""
    shutil.copy(base, tmp / "ref.sqlite")
    uri = overlay.session_uri(tmp / "s.db", base)
    out = []
    for target, kw in ((uri, {"uri": True}), (tmp / "ref.sqlite", {})):
        with closing(sqlite3.connect(target, isolation_level=None, **kw)) as conn:
            first = [raw_execute(conn, sql) for sql in script]
        with closing(sqlite3.connect(target, isolation_level=None, **kw)) as conn:
            out.append((first, [raw_execute(conn, sql) for sql in then]))
    return out


def test_finding_rollback_under_journal_off_corrupts_both_alike(tmp_path: Path) -> None:
    """Campaign finding 1 (a harness assumption, not an overlay fault): closing a connection with
    an open transaction under ``journal_mode=OFF`` rolls back without a journal, which SQLite
    leaves undefined; spilled pages stay and the schema is malformed. The overlay must do exactly
    what a private copy does, and the base must not change."""
    base = build_base(tmp_path / "b.sqlite", 512, "DELETE", 26, 100)
    before = file_sha256(base)
    session, reference = _both(
        tmp_path,
        base,
        [
            "PRAGMA synchronous = OFF",
            "PRAGMA journal_mode = OFF",
            "BEGIN",
            "CREATE TABLE t_new AS SELECT id, name FROM parent WHERE id > 37",
            f"UPDATE parent SET blob = {_blob(23, 300_000)} WHERE id % 4 = 3",
        ],
        ["PRAGMA integrity_check", "SELECT count(*) FROM parent"],
    )
    assert session == reference
    assert "malformed" in str(session[1][0])  # the undefined case really happened
    assert file_sha256(base) == before


def test_finding_wal_frame_counts_follow_the_page_cache(tmp_path: Path) -> None:
    """Campaign finding 3 (why a checkpoint's frame counts are compared only where session and
    reference read alike): a session reading in place reported 7 WAL frames where its reference
    reported 6, contents equal. Plain SQLite does the same on two copies of one database sent the
    same transaction, when only their page caches differ: how many frames a transaction writes
    follows how its cache spilled. Contents and checkpoints agree all the same."""
    base = build_base(tmp_path / "b.sqlite", 1024, "DELETE", 30, 3000)
    answers = []
    for cache in (2, 2000):
        copy = tmp_path / f"copy-{cache}.sqlite"
        shutil.copy(base, copy)
        with closing(sqlite3.connect(copy, isolation_level=None)) as conn:
            for sql in ("PRAGMA synchronous = OFF", "PRAGMA journal_mode = WAL"):
                conn.execute(sql)
            conn.execute(f"PRAGMA cache_size = {cache}")
            conn.execute("BEGIN")
            conn.execute(f"UPDATE parent SET blob = {_blob(7, 5000)} WHERE id % 3 = 0")
            conn.execute("INSERT INTO parent (name, blob) SELECT name || 'x', blob FROM parent")
            conn.execute(f"UPDATE parent SET blob = {_blob(9, 2000)} WHERE id % 5 = 1")
            conn.execute("COMMIT")
            frames = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            answers.append((frames, view(conn)))
    (small, small_view), (large, large_view) = answers
    assert small_view == large_view
    assert small != large  # e.g. [(0, 115, 115)] against [(0, 114, 114)]
    assert [(busy, log == done) for busy, log, done in small + large] == [(0, True), (0, True)]


def test_finding_rollback_under_journal_off_follows_the_mapped_pages(tmp_path: Path) -> None:
    """Campaign finding 4 (why examples that read in place use no journal_mode=OFF): after a
    ROLLBACK without a journal (undefined in SQLite, finding 1), a session reading in place was
    intact where its reference was left with a broken index. Plain SQLite does that too, on two
    copies of one database sent the same statements, when only ``mmap_size`` differs."""
    base = build_base(tmp_path / "b.sqlite", 512, "DELETE", 0, 100)
    checks = []
    for mmap in (0, 1 << 30):
        copy = tmp_path / f"copy-{mmap}.sqlite"
        shutil.copy(base, copy)
        with closing(sqlite3.connect(copy, isolation_level=None)) as conn:
            for sql in [
                "PRAGMA synchronous = OFF",
                f"PRAGMA mmap_size = {mmap}",
                "PRAGMA journal_mode = OFF",
                "PRAGMA page_size = 1024",
                "VACUUM",
                "PRAGMA cache_size = 2",
                "BEGIN",
                f"INSERT INTO parent (name, blob) VALUES ('x0', {_blob(0, 10)})",
                "INSERT INTO child (parent_id, v, note) VALUES (0, 0.25, NULL)",
                "CREATE TABLE t_new AS SELECT id, name, length(blob) AS l FROM parent",
                "ROLLBACK",
            ]:
                conn.execute(sql).fetchall()
            checks.append(conn.execute("PRAGMA integrity_check").fetchall())
    unmapped, mapped = checks
    assert unmapped == [("ok",)]
    assert mapped != unmapped  # e.g. "row 1 missing from index child_parent"


def test_finding_a_crash_under_journal_memory_follows_the_mapped_pages(tmp_path: Path) -> None:
    """Campaign finding 5 (why the crash rule keeps a journal on disk): a process that died inside
    a transaction under ``journal_mode=MEMORY``, after its pages spilled, left nothing to roll
    back with; a session reading in place then showed the committed rows where its reference
    showed the dead transaction's row. Plain SQLite does that too, on two copies of one database
    sent the same, when only the reader's ``mmap_size`` differs: SQLite leaves such a crash
    undefined."""
    base = build_base(tmp_path / "b.sqlite", 512, "DELETE", 0, 100)
    crash = (
        "import os, sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "for sql in ['PRAGMA cache_size = 2', 'BEGIN', 'PRAGMA journal_mode = MEMORY',\n"
        "            'INSERT INTO child (parent_id, v, note) VALUES (0, 0.25, NULL)']:\n"
        "    conn.execute(sql).fetchall()\n"
        "os._exit(0)\n"
    )
    rows = []
    for mmap in (0, 1 << 30):
        copy = tmp_path / f"copy-{mmap}.sqlite"
        shutil.copy(base, copy)
        with closing(sqlite3.connect(copy, isolation_level=None)) as conn:
            conn.execute(f"PRAGMA mmap_size = {mmap}")
            view(conn)  # reads every table, as the campaign's invariant does
            subprocess.run([sys.executable, "-c", crash, str(copy)], check=True, timeout=120)
            rows.append(conn.execute("SELECT v FROM child").fetchall())
    unmapped, mapped = rows
    assert unmapped == []
    assert mapped == [(0.25,)]  # the dead transaction's row


def run_campaign(examples: int, steps: int = 30, seed: int | None = None) -> None:
    """Run ``examples`` random examples of :class:`Campaign` (raises on the first failure)."""
    run_state_machine_as_test(
        Campaign,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=seed is not None,
            database=None,
            print_blob=True,
        ),
    )


def test_overlay_matches_private_copy_under_random_sequences() -> None:
    before = Campaign.examples
    run_campaign(int(os.environ.get("FUZZ_EXAMPLES", "30")), steps=25)
    assert Campaign.examples - before >= 1


@pytest.mark.slow
def test_fuzz_campaign() -> None:
    """``FUZZ_MINUTES`` of fuzzing in batches; every failure is recorded, then reported at once."""
    minutes = float(os.environ.get("FUZZ_MINUTES", "30"))
    end = time.monotonic() + 60 * minutes
    failures: list[str] = []
    batches = 0
    start_examples, start_steps, start_other = (
        Campaign.examples,
        Campaign.steps,
        Campaign.other_rules,
    )
    while time.monotonic() < end:
        batches += 1
        try:
            run_campaign(20, steps=40)
        except Exception as exc:  # keep fuzzing: record the (shrunk) failure and go on
            text = "".join(traceback.format_exception(exc))
            failures.append(text)
            # the error first (a long example's steps would push it out of the tail), then the
            # steps and the line that replays it
            print(
                f"\nFUZZ FAILURE {len(failures)}: {type(exc).__name__}: {str(exc)[:4000]}\n"
                f"{text[-6000:]}",
                flush=True,
            )
        print(
            f"FUZZ batch {batches}: {Campaign.examples - start_examples} examples, "
            f"{Campaign.steps - start_steps} steps, {Campaign.other_rules - start_other} other "
            f"rules, {len(failures)} failures",
            flush=True,
        )
    print(
        f"\nFUZZ {minutes:g} min: {Campaign.examples - start_examples} examples, "
        f"{Campaign.steps - start_steps} steps, {Campaign.other_rules - start_other} other rules, "
        f"{len(failures)} failures"
    )
    assert not failures, failures[0]
