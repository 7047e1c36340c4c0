"""Isolation as a property: random interleavings of writes and reads over many sessions, in two
processes, each session checked after every step against its own private reference copy.

The pools share changed pages and results (their defaults): sessions are read through
``Session.execute``, so those in the same state share the checks' results."""

from __future__ import annotations

import multiprocessing
import shutil
import sqlite3
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from birdenv.replicas import ReplicaPool, Session
from birdenv.replicas.session import run_statement
from birdenv.suites import file_sha256
from birdenv.tasks import parse_task
from tests.conftest import build_shop

SESSIONS = 8
STATEMENTS = st.sampled_from(
    [
        "INSERT INTO customers (name, city, joined) VALUES ('P{n}', 'X{n}', '2024-01-01')",
        "UPDATE orders SET total = coalesce(total, 0) + {n} WHERE id = 1 + {n} % 4",
        "DELETE FROM orders WHERE id = 1 + {n} % 4",
        "CREATE TABLE IF NOT EXISTS notes (n INTEGER)",
        "INSERT INTO notes VALUES ({n})",
        "CREATE TEMP TABLE IF NOT EXISTS scratch (n INTEGER)",
        "INSERT INTO scratch VALUES ({n})",
        "PRAGMA foreign_keys = ON",
        "DELETE FROM customers WHERE id = 1 + {n} % 3",
        "VACUUM",
    ]
)
CHECK = [
    "SELECT id, name, city FROM customers ORDER BY id",
    "SELECT id, customer_id, total FROM orders ORDER BY id",
    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
]


def _view(conn: sqlite3.Connection) -> list:
    out = []
    for sql in CHECK:
        try:
            out.append(conn.execute(sql).fetchall())
        except sqlite3.Error as exc:
            out.append(str(exc))
    return out


def _session_view(session: Session) -> list:
    results = [session.execute(sql) for sql in CHECK]
    return [r.rows if r.error is None else r.error for r in results]


def _apply(conn: sqlite3.Connection, sql: str) -> str | None:
    try:
        run_statement(conn, sql)
    except sqlite3.Error as exc:
        return str(exc)
    return None


class Interleavings(RuleBasedStateMachine):
    """Each rule runs one statement on one session and on that session's reference copy."""

    def __init__(self, root: Path, db_dir: Path) -> None:
        super().__init__()
        self.root, self.db_dir = root, db_dir

    @initialize()
    def open_sessions(self) -> None:
        self.pool = ReplicaPool(root=self.root / "replicas")
        task = parse_task({"instance_id": "t", "db_id": "shop"}, db_dir=self.db_dir)
        self.base = self.pool.store.base_for(task.db_path)
        self.sessions = [self.pool.session(task) for _ in range(SESSIONS)]
        self.refs = []
        for i in range(SESSIONS):
            copy = self.root / f"ref-{id(self)}-{i}.sqlite"
            shutil.copyfile(self.base.path, copy)
            copy.chmod(0o644)
            self.refs.append(sqlite3.connect(copy))

    @rule(which=st.integers(0, SESSIONS - 1), statement=STATEMENTS, n=st.integers(0, 50))
    def execute(self, which: int, statement: str, n: int) -> None:
        sql = statement.format(n=n)
        got = self.sessions[which].execute(sql).error
        expected = _apply(self.refs[which], sql)
        assert got == expected, (sql, got, expected)

    @invariant()
    def every_session_sees_only_its_own_state(self) -> None:
        if not hasattr(self, "sessions"):
            return
        for session, ref in zip(self.sessions, self.refs, strict=True):
            assert _session_view(session) == _view(ref)

    def teardown(self) -> None:
        if hasattr(self, "sessions"):
            for session, ref in zip(self.sessions, self.refs, strict=True):
                session.close()
                ref.close()
            assert file_sha256(self.base.path) == self.base.sha256
            self.pool.close()


def _run(root: str, db_dir: str, examples: int) -> int:
    """Run the state machine ``examples`` times on ``root``; return the number of steps taken."""
    steps = [0]

    class Bound(Interleavings):
        def __init__(self) -> None:
            super().__init__(Path(root), Path(db_dir))

        def execute(self, which: int, statement: str, n: int) -> None:
            steps[0] += 1
            super().execute(which, statement, n)

    Bound.execute = rule(
        which=st.integers(0, SESSIONS - 1), statement=STATEMENTS, n=st.integers(0, 50)
    )(Bound.execute)
    Bound.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    Bound.TestCase().runTest()
    return steps[0]


def _child(root: str, db_dir: str, examples: int) -> None:
    assert _run(root, db_dir, examples) > 0


def test_isolation_holds_under_random_interleavings_in_two_processes(tmp_path: Path) -> None:
    db_dir = tmp_path / "dbs"
    build_shop(db_dir)
    context = multiprocessing.get_context("spawn")
    other = context.Process(target=_child, args=(str(tmp_path), str(db_dir), 8))
    other.start()
    steps = _run(str(tmp_path), str(db_dir), 8)
    other.join(timeout=300)
    assert other.exitcode == 0
    assert steps >= 50, steps
