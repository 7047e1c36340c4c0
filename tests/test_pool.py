"""Replica pool and sessions: isolation, persistence across turns, bounds, guard, orphans."""

from __future__ import annotations

import math
import os
import resource
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from birdenv.errors import PreprocessError
from birdenv.replicas import Limits, ReplicaPool
from birdenv.replicas import pool as pool_module
from birdenv.replicas.placement import (
    MEMORY_FILESYSTEM,
    default_sessions_dir,
    is_memory_filesystem,
)
from birdenv.replicas.session import run_statement
from birdenv.suites import file_sha256
from birdenv.tasks import parse_task
from tests.conftest import open_on

REPO = Path(__file__).resolve().parents[1]


def test_sessions_are_isolated_and_persistent(shop_tasks: list, pool: ReplicaPool) -> None:
    task = shop_tasks[0]
    with pool.session(task) as a, pool.session(task) as b:
        assert a.execute("PRAGMA foreign_keys = ON").ok
        assert a.execute("CREATE TEMP TABLE scratch AS SELECT 42 AS x").ok
        assert a.execute("DELETE FROM customers WHERE id = 1").ok  # cascades to orders
        assert a.execute("SELECT count(*) FROM orders").rows == [(2,)]
        assert a.execute("SELECT x FROM scratch").rows == [(42,)]
        assert a.execute("PRAGMA foreign_keys").rows == [(1,)]
        assert b.execute("SELECT count(*) FROM orders").rows == [(4,)]
        assert b.execute("SELECT x FROM scratch").error == "no such table: scratch"
    with pool.session(task) as fresh:
        assert fresh.execute("SELECT count(*) FROM customers").rows == [(3,)]
    stats = pool.stats()
    assert stats["open_sessions"] == 0 and stats["peak_sessions"] == 2 and stats["resets"] == 3
    base = pool.store.base_for(task.db_path)
    assert pool.store.verify(base)


def test_preprocess_is_applied_and_its_failure_is_an_error(
    shop_dir: Path, pool: ReplicaPool
) -> None:
    ok = parse_task(
        {"instance_id": "p", "db_id": "shop", "preprocess_sql": ["DELETE FROM orders"]},
        db_dir=shop_dir,
    )
    with pool.session(ok) as session:
        assert session.execute("SELECT count(*) FROM orders").rows == [(0,)]
    bad = parse_task(
        {"instance_id": "q", "db_id": "shop", "preprocess_sql": ["DELETE FROM nowhere"]},
        db_dir=shop_dir,
    )
    with pytest.raises(PreprocessError, match="no such table: nowhere"):
        pool.session(bad)
    assert pool.stats()["open_sessions"] == 0


@pytest.mark.parametrize(
    "sql",
    [
        "ATTACH DATABASE '/tmp/elsewhere.sqlite' AS x",
        "ATTACH 'file:/tmp/x.sqlite?mode=rwc' AS x",
        "VACUUM INTO '/tmp/stolen.sqlite'",
        "SELECT load_extension('/tmp/evil.so')",
        "PRAGMA temp_store_directory = '/tmp'",
    ],
)
def test_guard_denies_escapes_and_the_session_survives(
    shop_tasks: list, pool: ReplicaPool, sql: str
) -> None:
    with pool.session(shop_tasks[0]) as session:
        result = session.execute(sql)
        assert result.error is not None and "session guard forbids" in result.error
        assert session.execute("SELECT count(*) FROM customers").rows == [(3,)]
    assert not Path("/tmp/stolen.sqlite").exists()


def test_bounds_deadline_rows_bytes(shop_tasks: list, tmp_path: Path) -> None:
    limits = Limits(statement_timeout=0.2, max_rows=50, max_result_bytes=10_000)
    with ReplicaPool(root=tmp_path / "r", limits=limits) as pool, pool.session(shop_tasks[0]) as s:
        slow = s.execute(
            "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
        )
        # It never ends by itself: timed out is the deadline's doing (a broken one would hang).
        assert slow.timed_out and "timed out" in slow.error, slow
        many = s.execute(
            "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 500) SELECT i FROM r"
        )
        assert many.truncated and len(many.rows) == 50
        wide = s.execute("SELECT randomblob(4000) FROM customers")
        assert wide.truncated and len(wide.rows) == 2
        assert s.execute("SELECT 1").rows == [(1,)]


# ~4 s of work unbounded (a broken deadline fails the test instead of hanging it)
_SLOW = (
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 30000000) "
    "SELECT count(*) FROM r"
)


def test_deadlines_bind_each_statement_alone(shop_tasks: list, tmp_path: Path) -> None:
    # The session's connection keeps one progress handler; each statement sets its deadline.
    with ReplicaPool(root=tmp_path / "r") as pool, pool.session(shop_tasks[0]) as s:
        assert s.execute("SELECT 1", timeout=0.05).rows == [(1,)]
        time.sleep(0.1)  # past that statement's deadline: nothing after it may inherit it
        s.prepare(
            "CREATE TABLE n AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r "
            "LIMIT 200000) SELECT count(*) AS c FROM r"
        )
        assert s.execute("SELECT c FROM n", timeout=5).rows == [(200000,)]
        assert s.execute(_SLOW, timeout=0.2).timed_out
        # Whoever holds the connection may replace its progress handler: deadlines still hold.
        s.conn.set_progress_handler(None, 0)
        slow = s.execute(_SLOW, timeout=0.2)
        assert slow.timed_out, slow  # not run to its end
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]


def test_private_disk_cap(shop_tasks: list, tmp_path: Path) -> None:
    limits = Limits(max_session_bytes=2 << 20)
    with ReplicaPool(root=tmp_path / "r", limits=limits) as pool, pool.session(shop_tasks[0]) as s:
        assert s.execute("CREATE TABLE junk (b BLOB)").ok
        runaway = s.execute(
            "INSERT INTO junk WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 5000) "
            "SELECT randomblob(4096) FROM r"
        )
        assert runaway.error is not None and "full" in runaway.error
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]


def test_orphans_of_a_killed_process_are_swept(shop_tasks: list, tmp_path: Path) -> None:
    root = tmp_path / "r"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path.cwd())!r})
        from birdenv.replicas import ReplicaPool
        from birdenv.tasks import parse_task
        task = parse_task({{"instance_id": "t", "db_id": "shop"}}, db_dir={str(shop_tasks[0].db_dir)!r})
        pool = ReplicaPool(root={str(root)!r})
        s = pool.session(task)
        s.execute("BEGIN")
        s.execute("INSERT INTO customers VALUES (99, 'Zed', 'Oslo', '2024-01-01')")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    sessions = default_sessions_dir(root)
    leftovers = [p for p in sessions.iterdir() if not p.name.endswith(".lock")]
    assert leftovers
    with ReplicaPool(root=root) as pool:
        assert pool.swept >= len(leftovers)
        assert [p.name for p in sessions.iterdir() if not p.name.endswith(".lock")] == []
        with pool.session(shop_tasks[0]) as s:
            assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
            assert s.execute("PRAGMA integrity_check").rows == [("ok",)]


def test_a_modified_base_is_never_served(shop_tasks: list, tmp_path: Path) -> None:
    task = shop_tasks[0]
    with ReplicaPool(root=tmp_path / "r") as pool:
        base = pool.store.base_for(task.db_path)
        os.chmod(base.path, 0o644)
        conn = sqlite3.connect(base.path)
        conn.execute("DELETE FROM customers")
        conn.commit()
        conn.close()
        assert file_sha256(base.path) != base.sha256
        with pool.session(task) as s:
            assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert list((tmp_path / "r" / "bases").glob("*.corrupt-*"))


def test_stats_report_strategy_and_bytes(shop_tasks: list, pool: ReplicaPool) -> None:
    with pool.session(shop_tasks[0]) as s:
        s.execute("INSERT INTO customers VALUES (9, 'Ivy', 'Oslo', '2024-01-01')")
        stats = pool.stats()
    assert stats["strategy"] in ("overlay", "copy")
    assert stats["bytes_on_disk"] >= stats["bases_bytes"] > 0
    assert (stats["resets"], stats["mean_reset_ms"]) == (0, 0.0)  # its session is still open
    first_ms = pool.stats()["mean_reset_ms"]  # one reset: the session above
    assert pool.stats()["resets"] == 1 and 0 < first_ms < math.inf
    # A reset happens inside a session's close, so three more resets take no longer, together,
    # than their three closes measured from outside.
    closing = 0.0
    for _ in range(3):
        session = pool.session(shop_tasks[0])
        session.execute("UPDATE customers SET city = 'Bergen'")
        start = time.perf_counter()
        session.close()
        closing += time.perf_counter() - start
    stats = pool.stats()
    assert stats["resets"] == 4
    assert 0 < 4 * stats["mean_reset_ms"] - first_ms <= 1000 * closing


# -- where sessions live ------------------------------------------------------------------------
memory_only = pytest.mark.skipif(
    not is_memory_filesystem(MEMORY_FILESYSTEM),
    reason=f"{MEMORY_FILESYSTEM} is no memory filesystem",
)


@memory_only
def test_sessions_live_in_memory_by_default(shop_tasks: list, tmp_path: Path) -> None:
    with ReplicaPool(root=tmp_path / "r") as pool:
        assert pool.sessions_dir.is_relative_to(MEMORY_FILESYSTEM) and pool.in_memory
        with pool.session(shop_tasks[0]) as s:
            assert s.path.parent == pool.sessions_dir
            assert s.execute("INSERT INTO customers(name) VALUES ('Dee')").ok
            stats = pool.stats()
            assert stats["sessions_in_memory"] is True
            assert stats["sessions_dir"] == str(pool.sessions_dir)
            assert (stats["open_in_memory"], stats["open_on_disk"], stats["fallbacks"]) == (1, 0, 0)
            assert stats["sessions_bytes"] > 0
        folder = pool.sessions_dir
    assert not folder.exists()  # an empty folder in memory goes with its last pool


@memory_only
def test_sessions_fall_back_to_disk_when_memory_is_short(
    shop_tasks: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Demand more free memory than any machine has: every new session goes to disk.
    monkeypatch.setattr(pool_module, "MEMORY_HEADROOM", 1 << 62)
    limits = Limits(max_session_bytes=2 << 20)
    with ReplicaPool(root=tmp_path / "r", limits=limits) as pool:
        with pool.session(shop_tasks[0]) as s:
            assert s.path.parent == tmp_path / "r" / "sessions"
            stats = pool.stats()
            assert (stats["open_in_memory"], stats["open_on_disk"], stats["fallbacks"]) == (0, 1, 1)
            assert s.execute("CREATE TABLE junk (b BLOB)").ok
            # the per-session cap holds on disk as well
            full = s.execute(
                "INSERT INTO junk WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r "
                "LIMIT 5000) SELECT randomblob(4096) FROM r"
            )
            assert full.error is not None and "full" in full.error
            assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
        monkeypatch.setattr(pool_module, "MEMORY_HEADROOM", 0)
        monkeypatch.setattr(pool_module, "_ROOM_TTL", 0.0)
        with pool.session(shop_tasks[0]) as s:
            assert s.path.parent == pool.sessions_dir
    assert not list((tmp_path / "r" / "sessions").glob("*.db*"))


def test_sessions_dir_from_the_argument_or_the_environment(
    shop_tasks: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BIRDENV_SESSIONS_DIR", str(tmp_path / "from-env"))
    assert default_sessions_dir(tmp_path / "r") == tmp_path / "from-env"
    with ReplicaPool(root=tmp_path / "r") as pool, pool.session(shop_tasks[0]) as s:
        assert s.path.parent == tmp_path / "from-env"
        assert pool.stats()["sessions_dir"] == str(tmp_path / "from-env")
    given = tmp_path / "given"
    with (
        ReplicaPool(root=tmp_path / "r", sessions_dir=given) as pool,
        pool.session(shop_tasks[0]) as s,
    ):
        assert s.path.parent == given
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]


def test_a_linked_sessions_dir_is_used_by_its_real_path(shop_tasks: list, tmp_path: Path) -> None:
    # SQLite names a session's files by their real path: so does the pool, once, and a reset
    # removes every file a session made without resolving the path again.
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with ReplicaPool(root=tmp_path / "r", sessions_dir=link) as pool:
        assert pool.sessions_dir == real
        for exclusive in (True, False):
            with pool.session(shop_tasks[0], exclusive=exclusive) as s:
                assert s.path.parent == real
                assert s.execute("CREATE TABLE t AS SELECT 1 AS x").ok
                assert s.execute("SELECT x FROM t").rows == [(1,)]
                assert len(list(real.glob(f"{s.path.name}*"))) > 1  # the state and its side files
            assert [p.name for p in real.iterdir() if not p.name.endswith(".lock")] == []


def test_a_template_path_that_comes_to_name_another_file_gets_its_base(
    shop_tasks: list, tmp_path: Path
) -> None:
    task = shop_tasks[0]
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    task_db = sqlite3.connect(task.db_path)
    task_db.backup(conn)
    task_db.close()
    conn.execute("DELETE FROM customers WHERE id = 1")
    conn.commit()
    conn.close()
    link = tmp_path / "template.sqlite"
    link.symlink_to(task.db_path)
    with ReplicaPool(root=tmp_path / "r") as pool:
        first = pool.store.base_for(link)
        assert first == pool.store.base_for(task.db_path)
        link.unlink()
        link.symlink_to(other)
        second = pool.store.base_for(link)
        assert second.sha256 != first.sha256
        with pool.open_base(second) as s:
            assert s.execute("SELECT count(*) FROM customers").rows == [(2,)]


# -- file descriptors ---------------------------------------------------------------------------
def _run_limited(script: str, shop_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (its descriptor limit never touches this process)."""
    prelude = textwrap.dedent(f"""
        import logging, os, resource, sys
        from birdenv.errors import BirdEnvError, DescriptorLimitError
        from birdenv.replicas import ReplicaPool
        from birdenv.tasks import parse_task
        task = parse_task({{"instance_id": "t", "db_id": "shop"}}, db_dir={str(shop_dir)!r})
        root = {str(tmp_path / "limited")!r}
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
    reason="the hard limit on open files is below 4096 here",
)
def test_512_writers_under_a_soft_limit_of_1024(shop_dir: Path, tmp_path: Path) -> None:
    proc = _run_limited(
        """
        logging.basicConfig(level=logging.INFO)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        with ReplicaPool(root=root) as pool:
            stats = pool.stats()
            assert stats["descriptor_limit_raised_from"] == 1024, stats
            assert stats["descriptor_limit"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1024
            sessions = [pool.session(task) for _ in range(512)]
            for i, s in enumerate(sessions):
                r = s.execute(f"UPDATE customers SET name = 'w{i}' WHERE id = 1")
                assert r.ok, r
            for i, s in enumerate(sessions):
                assert s.execute("SELECT name FROM customers WHERE id = 1").rows == [(f"w{i}",)]
            print("open", pool.stats()["open_sessions"], "fds", pool.stats()["descriptors_in_use"])
            for s in sessions:
                s.close()
            assert pool.stats()["open_sessions"] == 0
        print("ok")
        """,
        shop_dir,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "ok"
    assert "open 512 " in proc.stdout
    assert "raised this process's soft limit on open files from 1024" in proc.stderr


def test_a_pool_keeps_each_base_open_between_its_sessions(shop_tasks: list, tmp_path: Path) -> None:
    """An env closes its session before it leases the next: the pool keeps the base's descriptor
    (and its in-place map) for the next one, and lets go when it closes."""

    with ReplicaPool(root=tmp_path / "r") as pool:
        if pool.strategy != "overlay":
            pytest.skip("the copy strategy opens no base")
        base = pool.store.base_for(shop_tasks[0].db_path).path.resolve()
        for i in range(3):
            with pool.session(shop_tasks[0]) as s:
                assert s.execute(f"UPDATE customers SET name = 'n{i}' WHERE id = 1").ok
                assert s.execute("SELECT count(*) FROM customers WHERE name LIKE 'n%'").rows == [
                    (1,)
                ]
            assert open_on(base) == 1
    assert open_on(base) == 0


def test_a_pool_holds_its_most_recent_bases_only(
    shop_tasks: list, shop_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "HELD_BASES", 1)
    other_db = shop_dir / "shop2" / "shop2_template.sqlite"
    other_db.parent.mkdir()
    with sqlite3.connect(other_db) as conn:  # a base with other bytes
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    other = parse_task({"instance_id": "o", "db_id": "shop2"}, db_dir=shop_dir)
    with ReplicaPool(root=tmp_path / "r") as pool:
        if pool.strategy != "overlay":
            pytest.skip("the copy strategy opens no base")
        first = pool.store.base_for(shop_tasks[0].db_path).path.resolve()
        second = pool.store.base_for(other.db_path).path.resolve()
        for task in (shop_tasks[0], other):
            with pool.session(task) as s:
                assert s.execute("SELECT 1").ok
        assert (open_on(first), open_on(second)) == (0, 1)


def test_running_out_of_descriptors_is_a_clear_error(shop_dir: Path, tmp_path: Path) -> None:
    proc = _run_limited(
        """
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        with ReplicaPool(root=root) as pool:
            opened = []
            try:
                while len(opened) < 100:
                    opened.append(pool.session(task, preprocess=False))
            except DescriptorLimitError as exc:
                assert isinstance(exc, BirdEnvError) and isinstance(exc, OSError)
                print("open:", exc)
            assert 3 < len(opened) < 100
            # A few descriptors back: for stats() to list folders, and for the first statement's
            # WAL, its -shm and the page store (a session on shared pages holds only one).
            for _ in range(3):
                opened.pop().close()
            assert pool.stats()["open_sessions"] == len(opened)
            # A session that opened but has no descriptor left for its first statement's WAL.
            spare = []
            try:
                while True:
                    spare.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            try:
                opened[-1].execute("SELECT count(*) FROM customers")
            except DescriptorLimitError as exc:
                print("statement:", exc)
            for fd in spare:
                os.close(fd)
            # Nothing is lost: with descriptors back, the same session works.
            assert opened[-1].execute("SELECT count(*) FROM customers").rows == [(3,)]
        print("ok")
        """,
        shop_dir,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "ok" and len(lines) == 3, proc.stdout
    for line, action in zip(
        lines[:2], ("cannot open a session", "cannot run a statement"), strict=True
    ):
        assert line.split(": ", 1)[1].startswith(action), line
        assert "of its 64 file descriptors open" in line and "hard 64" in line, line
        assert "ulimit -Hn" in line and "max_sessions" in line, line
        assert "unable to open database file" not in line


# -- the official settings before every statement -----------------------------------------------
SETTINGS_SCRIPT = [
    "PRAGMA journal_mode",
    "PRAGMA journal_mode = DELETE",
    "SELECT count(*) FROM customers",
    "PRAGMA journal_mode",
    "/* a comment */ pRaGmA synchronous = FULL",
    "PRAGMA synchronous",
    "INSERT INTO customers(name) VALUES ('Eve')",
    "BEGIN",
    "PRAGMA journal_mode = MEMORY",
    "UPDATE customers SET city = 'Oslo'",
    "COMMIT",
    "PRAGMA main.journal_mode",
    "SELECT * FROM pragma_journal_mode",
    "CREATE TEMP TABLE t AS SELECT 1 AS x",
    "ATTACH ':memory:' AS m",
    "PRAGMA m.journal_mode",
    "PRAGMA temp.synchronous",
    "SELECT count(*), group_concat(city) FROM customers",
]


def test_session_statements_see_the_official_settings(shop_tasks: list, pool: ReplicaPool) -> None:
    """Session.execute skips re-issuing settings already in force; what every statement sees is
    what it sees when they are issued before each one (run_statement, the official way)."""
    with pool.session(shop_tasks[0]) as ours, pool.session(shop_tasks[0]) as official:
        for sql in SETTINGS_SCRIPT:
            got = ours.execute(sql)
            try:
                rows, columns, _ = run_statement(official.conn, sql)
                want = (columns, rows or [], None)
            except sqlite3.Error as exc:
                want = ([], [], str(exc))
            assert (got.columns, got.rows, got.error) == want, sql


def test_settings_are_issued_again_after_others_touch_the_connection(
    shop_tasks: list, pool: ReplicaPool
) -> None:
    with pool.session(shop_tasks[0]) as s:
        assert s.execute("SELECT 1").ok
        s.conn.execute("PRAGMA synchronous = FULL")
        assert s.execute("PRAGMA synchronous").rows == [(0,)]
        other = s.connect()
        assert s.execute("SELECT 1").ok
        other.execute("PRAGMA synchronous = FULL")  # its own connection's setting, not ours
        assert other.execute("PRAGMA journal_mode = DELETE").fetchone() == ("delete",)
        other.close()
        assert s.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert s.execute("PRAGMA main.journal_mode").rows == [("wal",)]


def test_rollouts_of_a_task_share_their_changed_pages(shop_tasks: list, tmp_path: Path) -> None:
    """G sessions of one task that make the same changes keep one copy of each changed page; the
    pages go when the last of them resets, and each session still sees only its own state."""
    task = shop_tasks[0]
    write = "INSERT INTO customers (name, city) SELECT name || '+', city FROM customers"
    with ReplicaPool(root=tmp_path / "r") as pool:
        if pool.strategy != "overlay":
            pytest.skip("page sharing needs the overlay strategy")
        sessions = [pool.session(task) for _ in range(4)]
        for s in sessions:
            for _ in range(9):  # 3 -> 1536 rows: several pages
                assert s.execute(write).ok
        stats = pool.stats()
        assert stats["pages_stored_bytes"] > 0 and stats["pages_shared"] > 0
        assert stats["pages_mapped_bytes"] == 4 * stats["pages_stored_bytes"]
        assert sessions[0].execute("DELETE FROM customers WHERE id > 3").ok  # its own change
        assert [s.execute("SELECT count(*) FROM customers").rows for s in sessions] == [
            [(3,)],
            [(1536,)],
            [(1536,)],
            [(1536,)],
        ]
        for s in sessions:
            s.close()
        stats = pool.stats()
        assert stats["pages_stored_bytes"] == stats["pages_mapped_bytes"] == 0
        files = [p.name for p in pool.sessions_dir.glob(f"{pool._prefix}-*") if p.suffix != ".lock"]
        assert files == []


def test_pages_stay_private_when_sharing_is_off(shop_tasks: list, tmp_path: Path) -> None:
    with (
        ReplicaPool(root=tmp_path / "r", share_pages=False) as pool,
        pool.session(shop_tasks[0]) as s,
    ):
        assert s.execute("UPDATE customers SET city = 'Oslo'").ok
        assert "pages_stored_bytes" not in pool.stats()
        assert s.execute("SELECT DISTINCT city FROM customers").rows == [("Oslo",)]
