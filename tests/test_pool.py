"""Replica pool and sessions: isolation, persistence across turns, bounds, guard, orphans."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from birdenv.errors import PreprocessError
from birdenv.replicas import Limits, ReplicaPool
from birdenv.suites import file_sha256
from birdenv.tasks import parse_task


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
        assert slow.timed_out and "timed out" in slow.error and slow.elapsed < 2
        many = s.execute(
            "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 500) SELECT i FROM r"
        )
        assert many.truncated and len(many.rows) == 50
        wide = s.execute("SELECT randomblob(4000) FROM customers")
        assert wide.truncated and len(wide.rows) == 2
        assert s.execute("SELECT 1").rows == [(1,)]


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
    leftovers = [p for p in (root / "sessions").iterdir() if not p.name.endswith(".lock")]
    assert leftovers
    with ReplicaPool(root=root) as pool:
        assert pool.swept >= len(leftovers)
        assert [p.name for p in (root / "sessions").iterdir() if not p.name.endswith(".lock")] == []
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
    assert stats["mean_reset_ms"] >= 0
