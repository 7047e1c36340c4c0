"""The copy-on-write page-overlay VFS against a private full copy, on real SQLite files.

Every scenario drives the overlay the way the official evaluator drives a database copy and
checks results, error messages, ``PRAGMA integrity_check`` and full dumps against the copy. The
scenarios that stay in one process also run with the session's pages in a shared,
content-addressed store (``pages``), which must change nothing but where the bytes live.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest

from birdenv.replicas import overlay
from tests.conftest import open_on

pytestmark = pytest.mark.skipif(
    not overlay.available(), reason=f"overlay VFS unavailable: {overlay.unavailable_reason()}"
)

REPO = Path(__file__).resolve().parents[1]
EVALUATOR_PRELUDE = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=OFF")
ROLLBACK_PRELUDE = ("PRAGMA synchronous=OFF",)


# ----------------------------------------------------------------------------- helpers


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_base(path: Path, customers: int = 2000, orders: int = 6000) -> Path:
    """A deterministic base: foreign keys with ON DELETE CASCADE, an index, a view, a trigger."""
    rng = random.Random(0)
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(
            """
            CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT);
            CREATE TABLE orders(
                id INTEGER PRIMARY KEY,
                customer_id INTEGER REFERENCES customers(id) ON DELETE CASCADE,
                amount REAL, note TEXT);
            CREATE INDEX orders_customer ON orders(customer_id);
            CREATE VIEW big_orders AS SELECT * FROM orders WHERE amount > 500;
            CREATE TABLE audit(id INTEGER PRIMARY KEY AUTOINCREMENT, what TEXT);
            CREATE TRIGGER orders_audit AFTER INSERT ON orders
            BEGIN INSERT INTO audit(what) VALUES ('order ' || new.id); END;
            """
        )
        cities = ["Lyon", "Porto", "Graz", "Turku", "Cork"]
        conn.executemany(
            "INSERT INTO customers VALUES (?, ?, ?)",
            [(i, f"customer {i}", rng.choice(cities)) for i in range(1, customers + 1)],
        )
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?, ?, ?)",
            [
                (
                    i,
                    rng.randint(1, customers),
                    round(rng.uniform(1, 1000), 2),
                    "n" * rng.randint(10, 90),
                )
                for i in range(1, orders + 1)
            ],
        )
        conn.commit()
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp("base") / "base.sqlite")


@pytest.fixture(params=["private", "shared"])
def pages(request, tmp_path) -> Iterator[Path | None]:
    """Where a test's sessions keep their changed pages: privately, or in a shared page store.

    A test that gets a store discards its sessions at the end; the store must then be gone.
    """
    if request.param == "private":
        yield None
        return
    store = tmp_path / "pages"
    yield store
    assert store_figures(store) is None, "the page store outlived its sessions"
    assert not list(tmp_path.glob("pages-*")), "the page store left files behind"


def store_figures(store: Path) -> dict | None:
    """The figures of a page store of this process, or None when it does not exist."""
    found = [s for s in overlay.page_stores() if s["pages"] == str(store)]
    return found[0] if found else None


def connect_overlay(
    session: Path, base_path: Path, *, in_place: bool = False, **kw
) -> sqlite3.Connection:
    """A connection to an overlay session; ``in_place``: unchanged base pages are read in place
    from the base's map (``PRAGMA mmap_size``, as the replica pool sets it)."""
    conn = sqlite3.connect(overlay.session_uri(session, base_path, **kw), uri=True)
    if in_place:
        conn.execute(f"PRAGMA mmap_size = {1 << 30}")
    return conn


@pytest.fixture(params=[False, True], ids=["read", "in-place"])
def in_place(request) -> bool:
    """Whether a test's connections read unchanged base pages in place (mmap) or through xRead."""
    return request.param


def run_like_evaluator(conn: sqlite3.Connection, statements, prelude=EVALUATOR_PRELUDE) -> list:
    """Drive a connection like the official evaluator; record rows, pragma outcomes and errors."""
    out = []
    for sql in statements:
        cur = conn.cursor()
        for pragma in prelude:
            try:
                out.append(("pragma", cur.execute(pragma).fetchall()))
            except sqlite3.Error as exc:
                out.append(("pragma-error", str(exc)))
        try:
            cur.execute(sql)
            if cur.description is not None:
                out.append(("rows", cur.fetchall()))
            if not sql.lstrip().lower().startswith(("select", "with")):
                conn.commit()
                out.append(("ok",))
        except sqlite3.Error as exc:
            out.append(("error", type(exc).__name__, str(exc)))
            conn.rollback()
    return out


def dump(conn: sqlite3.Connection) -> list[str]:
    return list(conn.iterdump())


def check_db(conn: sqlite3.Connection) -> list[str]:
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    return dump(conn)


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512 if path.exists() else 0


# ----------------------------------------------------------------------------- 1. parity

GROW = (
    "INSERT INTO g WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 20000) "
    "SELECT printf('%0200d', i) FROM c"
)
BLOB = "replace(hex(zeroblob({n})), '00', 'ab')"

SEQUENCES = {
    "ddl_dml": [
        "CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT UNIQUE)",
        "INSERT INTO t(b) VALUES ('x'), ('y')",
        "INSERT INTO t(b) VALUES ('x')",
        "UPDATE customers SET city = 'Oslo' WHERE id < 300",
        "DELETE FROM orders WHERE amount < 100",
        "ALTER TABLE customers ADD COLUMN vip INTEGER DEFAULT 0",
        "UPDATE customers SET vip = 1 WHERE id % 7 = 0",
        "CREATE INDEX customers_city ON customers(city, vip)",
        "SELECT city, count(*), sum(vip) FROM customers GROUP BY city ORDER BY city",
        "DROP TABLE t",
        "SELECT * FROM t",
        "SELEC 1",
        "WITH x AS (SELECT count(*) AS n FROM orders) SELECT n FROM x",
    ],
    "triggers_views": [
        "INSERT INTO orders(customer_id, amount, note) VALUES (1, 900, 'trig')",
        "SELECT what FROM audit ORDER BY id DESC LIMIT 2",
        "CREATE VIEW city_totals AS SELECT c.city, sum(o.amount) AS s FROM customers c "
        "JOIN orders o ON o.customer_id = c.id GROUP BY c.city",
        "SELECT city, round(s, 2) FROM city_totals ORDER BY city",
        "CREATE TRIGGER no_neg BEFORE UPDATE ON orders WHEN new.amount < 0 "
        "BEGIN SELECT RAISE(ABORT, 'negative amount'); END",
        "UPDATE orders SET amount = -1 WHERE id = 3",
        "SELECT count(*) FROM big_orders",
        "DROP VIEW big_orders",
        "SELECT count(*) FROM big_orders",
    ],
    "foreign_keys": [
        "PRAGMA foreign_keys = ON",
        "PRAGMA foreign_keys",
        "INSERT INTO orders(customer_id, amount) VALUES (999999, 1)",
        "SELECT count(*) FROM orders WHERE customer_id = 5",
        "DELETE FROM customers WHERE id = 5",
        "SELECT count(*) FROM orders WHERE customer_id = 5",
        "UPDATE customers SET id = 100000 WHERE id = 6",
        "PRAGMA foreign_key_check",
    ],
    "vacuum": [
        "DELETE FROM orders WHERE id % 2 = 0",
        "VACUUM",
        "SELECT count(*), round(sum(amount), 2) FROM orders",
        "PRAGMA page_count",
        "PRAGMA freelist_count",
    ],
    "journal_modes": [
        "PRAGMA journal_mode = delete",
        "INSERT INTO customers(name, city) VALUES ('jm1', 'x')",
        "PRAGMA journal_mode = truncate",
        "UPDATE customers SET city = 'y' WHERE name = 'jm1'",
        "PRAGMA journal_mode = memory",
        "DELETE FROM orders WHERE id < 50",
        "PRAGMA journal_mode = persist",
        "INSERT INTO customers(name, city) VALUES ('jm2', 'z')",
        "PRAGMA wal_checkpoint(TRUNCATE)",
        "SELECT name, city FROM customers WHERE name LIKE 'jm%' ORDER BY name",
        "PRAGMA journal_mode",
    ],
    "auto_vacuum": [
        "PRAGMA auto_vacuum = FULL",
        "VACUUM",
        "PRAGMA auto_vacuum",
        "DELETE FROM orders WHERE id > 2000",
        "PRAGMA page_count",
        "PRAGMA freelist_count",
        "PRAGMA auto_vacuum = INCREMENTAL",
        "VACUUM",
        "DELETE FROM customers WHERE id > 1000",
        "PRAGMA incremental_vacuum(5)",
        "PRAGMA freelist_count",
    ],
    "page_size": [
        "PRAGMA page_size = 8192",
        "VACUUM",
        "PRAGMA page_size",
        "SELECT count(*), round(sum(amount), 2) FROM orders",
        "PRAGMA page_size = 1024",
        "VACUUM",
        "PRAGMA page_size",
        "PRAGMA page_count",
    ],
    "autoincrement": [
        "INSERT INTO audit(what) VALUES ('a')",
        "DELETE FROM audit",
        "INSERT INTO audit(what) VALUES ('b')",
        "SELECT id, what FROM audit",
        "SELECT name, seq FROM sqlite_sequence",
        "CREATE TABLE ai(id INTEGER PRIMARY KEY AUTOINCREMENT, v)",
        "INSERT INTO ai(v) VALUES (1), (2)",
        "DELETE FROM ai WHERE id = 2",
        "INSERT INTO ai(v) VALUES (3)",
        "SELECT * FROM ai",
    ],
    "transactions": [
        "BEGIN",
        "INSERT INTO customers(name) VALUES ('t1')",
        "SAVEPOINT a",
        "UPDATE customers SET name = 't2' WHERE name = 't1'",
        "ROLLBACK TO a",
        "RELEASE a",
        "COMMIT",
        "SAVEPOINT s1",
        "DELETE FROM orders",
        "ROLLBACK TO s1",
        "RELEASE s1",
        "BEGIN IMMEDIATE",
        "DELETE FROM orders WHERE id < 10",
        "ROLLBACK",
        "SELECT count(*) FROM orders",
        "SELECT name FROM customers WHERE name LIKE 't%'",
        "COMMIT",
    ],
    "temp": [
        "CREATE TEMP TABLE tt AS SELECT * FROM customers WHERE id <= 10",
        "INSERT INTO tt(name) VALUES ('temp')",
        "SELECT count(*) FROM tt",
        "CREATE TEMP VIEW tv AS SELECT name FROM tt WHERE name = 'temp'",
        "SELECT * FROM tv",
        "CREATE TEMP TRIGGER ttr AFTER DELETE ON customers BEGIN "
        "INSERT INTO tt(name) VALUES ('deleted ' || old.id); END",
        "DELETE FROM customers WHERE id = 1",
        "SELECT name FROM tt WHERE name LIKE 'deleted%'",
        "SELECT count(*) FROM temp.sqlite_master",
    ],
    "big_blobs": [
        "CREATE TABLE blobs(id INTEGER PRIMARY KEY, b BLOB)",
        f"INSERT INTO blobs VALUES (1, {BLOB.format(n=150000)})",
        "INSERT INTO blobs VALUES (2, zeroblob(400000))",
        "UPDATE blobs SET b = b || b WHERE id = 1",
        "SELECT id, length(b), substr(b, 299990, 20) FROM blobs ORDER BY id",
        "DELETE FROM blobs WHERE id = 2",
        "PRAGMA freelist_count",
        "SELECT id, length(b) FROM blobs",
    ],
    "grow_and_shrink": [
        "CREATE TABLE g(x TEXT)",
        GROW,
        "SELECT count(*), max(x) FROM g",
        "PRAGMA page_count",
        "DELETE FROM g",
        "VACUUM",
        "PRAGMA page_count",
        "SELECT count(*) FROM orders",
    ],
}

CASES = [(name, EVALUATOR_PRELUDE) for name in SEQUENCES] + [
    (name, ROLLBACK_PRELUDE)
    for name in ("journal_modes", "page_size", "auto_vacuum", "grow_and_shrink", "transactions")
]


@pytest.mark.parametrize(
    ("name", "prelude"),
    CASES,
    ids=[f"{n}-{'wal' if len(p) == 2 else 'rollback'}" for n, p in CASES],
)
def test_parity_with_private_copy(base, tmp_path, name, prelude, pages, in_place):
    before = sha256(base)
    copy = tmp_path / "copy.sqlite"
    shutil.copyfile(base, copy)
    session = tmp_path / "session.sqlite"
    with closing(sqlite3.connect(copy)) as ref_conn:
        expected = run_like_evaluator(ref_conn, SEQUENCES[name], prelude)
    with closing(connect_overlay(session, base, pages=pages, in_place=in_place)) as ovl_conn:
        got = run_like_evaluator(ovl_conn, SEQUENCES[name], prelude)
    assert got == expected
    with closing(sqlite3.connect(copy)) as ref_conn:
        ref_dump = check_db(ref_conn)
        ref_pages = ref_conn.execute("PRAGMA page_size").fetchall()
    with closing(connect_overlay(session, base, pages=pages)) as ovl_conn:
        assert check_db(ovl_conn) == ref_dump
        assert ovl_conn.execute("PRAGMA page_size").fetchall() == ref_pages
    overlay.discard(session)
    assert sha256(base) == before


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
def test_pages_read_in_place_while_the_session_changes_them(base, tmp_path, journal_mode, pages):
    """A cursor reading base pages in place while its own connection rewrites those pages, and a
    second session on the same base that must never see them: the same rows as on a private copy
    mapped by SQLite's own VFS."""
    copy = tmp_path / "copy.sqlite"
    shutil.copyfile(base, copy)
    ref = sqlite3.connect(copy)
    ref.execute(f"PRAGMA mmap_size = {1 << 30}")
    a = connect_overlay(tmp_path / "a.sqlite", base, pages=pages, in_place=True)
    b = connect_overlay(tmp_path / "b.sqlite", base, pages=pages, in_place=True)
    try:

        def script(conn: sqlite3.Connection) -> list:
            conn.execute(f"PRAGMA journal_mode = {journal_mode}")
            conn.execute("PRAGMA cache_size = 20")  # spill changed pages into the file early
            out = []
            for rnd in range(6):
                reader = conn.execute(
                    "SELECT id, customer_id, amount, note FROM orders ORDER BY id"
                )
                out.append(reader.fetchmany(700 * (rnd + 1)))
                conn.execute(
                    f"UPDATE orders SET note = printf('%0150d', id), amount = amount + {rnd} "
                    f"WHERE id % 6 = {rnd}"
                )
                conn.execute(f"DELETE FROM customers WHERE id % 11 = {rnd}")
                conn.commit()
                out.append(reader.fetchall())  # pages fetched before the writes, and after
                if rnd % 2:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                out.append(conn.execute("SELECT sum(amount), count(*) FROM orders").fetchall())
                out.append(
                    conn.execute(
                        "SELECT count(*), sum(length(note)) FROM orders WHERE id % 6 = ?", (rnd,)
                    ).fetchall()
                )
            out.append(conn.execute("PRAGMA integrity_check").fetchall())
            return out

        assert script(a) == script(ref)
        # the other session still sees the base, page for page
        pristine = sqlite3.connect(base)
        try:
            assert dump(b) == dump(pristine)
        finally:
            pristine.close()
        assert dump(a) == dump(ref)
    finally:
        for conn in (ref, a, b):
            conn.close()
    overlay.discard(tmp_path / "a.sqlite")
    overlay.discard(tmp_path / "b.sqlite")


def test_rewriting_identical_pages_is_free(base, tmp_path, pages):
    """A VACUUM that reproduces the base page for page costs (almost) no private bytes."""
    packed = tmp_path / "packed.sqlite"
    shutil.copyfile(base, packed)
    with closing(sqlite3.connect(packed)) as conn:
        conn.execute("VACUUM")
    session = tmp_path / "s.sqlite"
    with closing(connect_overlay(session, packed, pages=pages)) as conn:
        conn.execute("VACUUM")
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert packed.stat().st_size > 300_000
    assert allocated(session) <= 16 * 1024
    if pages is not None:
        assert store_figures(pages)["stored_bytes"] <= 16 * 1024
    overlay.discard(session)


# ----------------------------------------------------------------------------- 2. isolation


def _other_process_sessions(base_path: str, workdir: str, n: int) -> list[list[str]]:
    """Run in a spawned process: n sessions of its own on the shared base, interleaved writes."""
    from birdenv.replicas import overlay as ovl

    assert ovl.available(), ovl.unavailable_reason()
    conns = [
        sqlite3.connect(ovl.session_uri(Path(workdir) / f"p{i}.sqlite", base_path), uri=True)
        for i in range(n)
    ]
    for rnd in range(5):
        for i, conn in enumerate(conns):
            run_like_evaluator(
                conn, [f"INSERT INTO customers(name, city) VALUES ('p{i}r{rnd}', 'iso')"]
            )
    seen = [
        [r[0] for r in conn.execute("SELECT name FROM customers WHERE city = 'iso' ORDER BY id")]
        for conn in conns
    ]
    for conn in conns:
        conn.close()
    return seen


def test_isolation_many_sessions_and_a_second_process(base, tmp_path):
    before = sha256(base)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        pending = pool.apply_async(_other_process_sessions, (str(base), str(other_dir), 5))
        conns = [connect_overlay(tmp_path / f"s{i}.sqlite", base) for i in range(20)]
        try:
            for rnd in range(5):
                for i, conn in enumerate(conns):
                    run_like_evaluator(
                        conn,
                        [
                            f"INSERT INTO customers(name, city) VALUES ('s{i}r{rnd}', 'iso')",
                            f"UPDATE orders SET amount = {i} WHERE id = {rnd + 1}",
                        ],
                    )
            for i, conn in enumerate(conns):
                names = [
                    r[0] for r in conn.execute("SELECT name FROM customers WHERE city = 'iso'")
                ]
                assert names == [f"s{i}r{rnd}" for rnd in range(5)]
                amounts = conn.execute(
                    "SELECT DISTINCT amount FROM orders WHERE id <= 5"
                ).fetchall()
                assert amounts == [(float(i),)]
        finally:
            for conn in conns:
                conn.close()
        seen = pending.get(timeout=120)
    assert seen == [[f"p{i}r{rnd}" for rnd in range(5)] for i in range(5)]
    assert sha256(base) == before
    with closing(sqlite3.connect(base)) as conn:
        assert conn.execute("SELECT count(*) FROM customers WHERE city = 'iso'").fetchone() == (0,)


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
def test_two_connections_share_one_session(base, tmp_path, journal_mode, pages, in_place):
    """Writes and checkpoints by one connection are seen by the other (side-file reloads, or the
    one in-memory state of a session on shared pages), whether they read base pages in place."""
    session = tmp_path / "s.sqlite"
    a = connect_overlay(session, base, pages=pages, in_place=in_place)
    b = connect_overlay(session, base, pages=pages, in_place=in_place)
    try:
        for conn in (a, b):
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute(f"PRAGMA journal_mode = {journal_mode}")
            conn.execute("PRAGMA cache_size = 20")  # force cache spills into the file
        for i in range(30):
            writer, reader = (a, b) if i % 2 else (b, a)
            writer.execute(f"UPDATE orders SET note = printf('%0300d', {i}) WHERE id % 30 = {i}")
            writer.execute(f"INSERT INTO customers(name, city) VALUES ('shared {i}', 'sh')")
            writer.commit()
            if i % 5 == 4:
                writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            got = reader.execute("SELECT count(*) FROM customers WHERE city = 'sh'").fetchone()
            assert got == (i + 1,)
            assert (
                reader.execute(
                    f"SELECT count(*) FROM orders WHERE id % 30 = {i} AND note = printf('%0300d', {i})"
                ).fetchone()
                == writer.execute(f"SELECT count(*) FROM orders WHERE id % 30 = {i}").fetchone()
            )
        a.execute("VACUUM")
        assert b.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert dump(a) == dump(b)
    finally:
        a.close()
        b.close()
    with closing(connect_overlay(session, base, pages=pages)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT count(*) FROM customers WHERE city = 'sh'").fetchone() == (30,)
    overlay.discard(session)


def _hammer_shared_session(session: str, base_path: str, worker: int, mode: str) -> bool:
    """Run in a spawned process: write one shared session with tiny caches (forced spills)."""
    from birdenv.replicas import overlay as ovl

    with closing(sqlite3.connect(ovl.session_uri(session, base_path), uri=True, timeout=60)) as c:
        c.execute(f"PRAGMA journal_mode = {mode}")
        c.execute("PRAGMA cache_size = 10")
        c.execute("PRAGMA synchronous = OFF")
        for k in range(80):
            c.execute("INSERT INTO customers(name, city) VALUES (?, 'mp')", (f"w{worker}k{k}",))
            c.execute("UPDATE orders SET note = printf('%0150d', ?) WHERE id % 23 = ?", (k, k % 23))
            c.commit()
            if k % 20 == 0:
                assert c.execute("PRAGMA quick_check").fetchone() == ("ok",)
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return True


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
def test_processes_share_one_session(base, tmp_path, journal_mode):
    """Three processes write the same session at once: side-file reloads across processes."""
    session = tmp_path / "shared.sqlite"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        args = [(str(session), str(base), w, journal_mode) for w in range(3)]
        assert pool.starmap(_hammer_shared_session, args) == [True] * 3
    with closing(connect_overlay(session, base)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        names = {r[0] for r in conn.execute("SELECT name FROM customers WHERE city = 'mp'")}
        assert names == {f"w{w}k{k}" for w in range(3) for k in range(80)}


# ----------------------------------------------------------------------------- 3. crash

# The child loads only the extension (not the birdenv package, whose imports would dominate the
# test's run time) and opens the URI the parent built with overlay.session_uri.
CRASH_CHILD = textwrap.dedent(
    """
    import importlib.machinery, importlib.util, sqlite3, sys
    uri, so_path, vfs, mode, committed, cache = sys.argv[1:7]
    loader = importlib.machinery.ExtensionFileLoader("_overlay", so_path)
    spec = importlib.util.spec_from_file_location("_overlay", so_path, loader=loader)
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    ext.register(vfs)
    conn = sqlite3.connect(uri, uri=True)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute(f"PRAGMA journal_mode={mode}")
    conn.execute(f"PRAGMA cache_size={cache}")
    for i in range(int(committed)):
        conn.execute("INSERT INTO customers(name, city) VALUES (?, 'crash')", (f"c{i}",))
        conn.execute("UPDATE orders SET note = printf('%0200d', ?) WHERE id % 97 = ?", (i, i % 97))
        conn.commit()
    print("committed", flush=True)
    conn.execute("BEGIN")
    conn.execute("UPDATE customers SET name = 'doomed' WHERE id % 3 = 0")
    n = 0
    while True:
        conn.execute("INSERT INTO orders(customer_id, amount, note) VALUES (1, 1, randomblob(3000))")
        n += 1
        if n % 200 == 0:
            conn.execute("UPDATE orders SET amount = amount + 1 WHERE id % 11 = 0")
    """
)


def test_sigkill_mid_transaction_recovers_last_commit(base, tmp_path):
    with closing(sqlite3.connect(base)) as conn:
        base_dump = dump(conn)
    before = sha256(base)
    from birdenv.replicas.native import _overlay

    runs = []  # ten children at once, killed at staggered moments
    for attempt in range(10):
        session = tmp_path / f"crash{attempt}.sqlite"
        mode = "wal" if attempt % 2 else "delete"
        committed = 20 + 7 * attempt
        cache = 30 if attempt % 3 == 0 else 2000
        uri = overlay.session_uri(session, base)
        args = [uri, _overlay.__file__, overlay.VFS_NAME, mode, str(committed), str(cache)]
        child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, *args], stdout=subprocess.PIPE)
        runs.append((child, session, committed))
    try:
        for attempt, (child, _, _) in enumerate(runs):
            assert child.stdout.readline() == b"committed\n"
            time.sleep(0.01 + 0.03 * attempt)
            child.send_signal(signal.SIGKILL)
    finally:
        for child, _, _ in runs:
            child.kill()
            child.wait()
            child.stdout.close()
    for _, session, committed in runs:
        with closing(connect_overlay(session, base)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            names = [r[0] for r in conn.execute("SELECT name FROM customers WHERE city = 'crash'")]
            assert names == [f"c{i}" for i in range(committed)]
            doomed = conn.execute("SELECT count(*) FROM customers WHERE name = 'doomed'")
            assert doomed.fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM orders").fetchone() == (6000,)
        overlay.discard(session)
        assert not any(p.exists() for p in overlay.session_files(session))
        with closing(connect_overlay(session, base)) as conn:
            assert dump(conn) == base_dump
        overlay.discard(session)
    assert sha256(base) == before


# ----------------------------------------------------------------------------- 4. maxbytes

RUNAWAY = (
    "INSERT INTO blobs(b) WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c "
    "WHERE i < 2000) SELECT randomblob(10000) FROM c"
)


@pytest.mark.parametrize(
    ("name", "prelude"), [("wal", EVALUATOR_PRELUDE), ("rollback", ROLLBACK_PRELUDE)]
)
def test_max_bytes_fails_cleanly_and_session_stays_usable(base, tmp_path, name, prelude, pages):
    before = sha256(base)
    session = tmp_path / "s.sqlite"
    cap = 2_000_000
    with closing(connect_overlay(session, base, max_bytes=cap, pages=pages)) as conn:
        out = run_like_evaluator(
            conn,
            [
                "CREATE TABLE blobs(id INTEGER PRIMARY KEY, b BLOB)",
                RUNAWAY,
                "SELECT count(*) FROM customers",
                "INSERT INTO blobs(b) VALUES (x'00ff')",
                "SELECT count(*), sum(length(b)) FROM blobs",
            ],
            prelude,
        )
        results = [r for r in out if r[0] != "pragma"]
        assert results[1] == ("error", "OperationalError", "database or disk is full")
        assert results[2:] == [("rows", [(2000,)]), ("ok",), ("rows", [(1, 2)])]
    for path in overlay.session_files(session):
        assert allocated(path) <= cap + 64 * 1024, path
    if pages is not None:
        assert store_figures(pages)["mapped_bytes"] <= cap
    with closing(connect_overlay(session, base, max_bytes=cap, pages=pages)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT count(*) FROM blobs").fetchone() == (1,)
    overlay.discard(session)
    assert sha256(base) == before


# ----------------------------------------------------------------------------- 5. O(changes)


def test_private_disk_is_proportional_to_changes(tmp_path, pages):
    big = build_base(tmp_path / "big.sqlite", customers=20000, orders=60000)
    assert big.stat().st_size > 3_000_000
    session = tmp_path / "s.sqlite"
    with closing(connect_overlay(session, big, pages=pages)) as conn:
        run_like_evaluator(conn, ["UPDATE customers SET city = 'Nice' WHERE id = 12345"])
    with closing(connect_overlay(session, big, pages=pages)) as conn:
        assert conn.execute("SELECT city FROM customers WHERE id = 12345").fetchone() == ("Nice",)
    private = sum(allocated(p) for p in overlay.session_files(session))
    private += sum(allocated(p) for p in tmp_path.glob("pages-*"))
    assert private <= 64 * 1024, private
    assert session.stat().st_size <= big.stat().st_size
    overlay.discard(session)


# ----------------------------------------------------------------------------- 6. URI quoting


def test_uri_quoting_of_awkward_paths(tmp_path, pages):
    weird = tmp_path / "a dir %41 #x ?y &z=1"
    weird.mkdir()
    base_path = build_base(weird / "base 100% #1 ?&.sqlite", customers=20, orders=20)
    before = sha256(base_path)
    session = weird / "sess ion %20 #2 ?q=1&r.sqlite"
    store = None if pages is None else weird / "pages %2F #3 ?p=1&"
    with closing(connect_overlay(session, base_path, pages=store)) as conn:
        run_like_evaluator(conn, ["INSERT INTO customers(name) VALUES ('weird')"])
    assert session.exists()
    assert Path(f"{session}-ovl" if store is None else f"{session}-shared").exists()
    if store is not None:
        assert store_figures(store)["stored_bytes"] > 0
    with closing(connect_overlay(session, base_path, pages=store)) as conn:
        assert conn.execute("SELECT count(*) FROM customers").fetchone() == (21,)
    assert sha256(base_path) == before
    overlay.discard(session)
    assert not any(p.exists() for p in overlay.session_files(session))
    if store is not None:
        assert store_figures(store) is None
        assert not list(weird.glob("pages *"))


# ----------------------------------------------------------------------------- 7. shared pages

SIBLING_WRITES = [
    "UPDATE orders SET note = printf('%0300d', id) WHERE id % 3 = 0",
    "INSERT INTO customers(name, city) VALUES ('sibling', 'Rome')",
    "DELETE FROM orders WHERE amount < 50",
]


def test_identical_pages_of_sibling_sessions_are_stored_once(base, tmp_path):
    """Four sessions run the same writes: the store keeps one copy of each changed page, every
    session reads exactly what a private copy holds, and the base never changes."""
    before = sha256(base)
    store = tmp_path / "pages"
    copy = tmp_path / "copy.sqlite"
    shutil.copyfile(base, copy)
    with closing(sqlite3.connect(copy)) as conn:
        run_like_evaluator(conn, SIBLING_WRITES)
        expected = check_db(conn)
    sessions = [tmp_path / f"s{i}.sqlite" for i in range(4)]
    for session in sessions:
        with closing(connect_overlay(session, base, pages=store)) as conn:
            run_like_evaluator(conn, SIBLING_WRITES)
    figures = store_figures(store)
    assert figures["sessions"] == 4
    assert figures["stored_bytes"] > 100_000  # the writes really changed pages
    assert figures["mapped_bytes"] == 4 * figures["stored_bytes"]
    assert figures["shared_writes"] > 0
    assert not any(allocated(p) for s in sessions for p in overlay.session_files(s))
    for session in sessions:
        with closing(connect_overlay(session, base, pages=store)) as conn:
            assert check_db(conn) == expected
    for session in sessions:
        overlay.discard(session)
    assert store_figures(store) is None
    assert not list(tmp_path.glob("pages-*"))
    assert sha256(base) == before


def test_a_shared_page_never_changes(base, tmp_path):
    """Two sessions share their changed pages; when one of them writes those pages again, the
    other's view (and the stored page it maps) is untouched."""
    store = tmp_path / "pages"
    a_path, b_path = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    a = connect_overlay(a_path, base, pages=store)
    b = connect_overlay(b_path, base, pages=store)
    try:
        for conn in (a, b):  # checkpointed, as sessions do, so the pages reach the store
            run_like_evaluator(conn, [*SIBLING_WRITES, "PRAGMA wal_checkpoint(TRUNCATE)"])
        shared = store_figures(store)
        assert shared["stored_bytes"] > 100_000
        assert shared["mapped_bytes"] == 2 * shared["stored_bytes"]
        b_dump = dump(b)
        run_like_evaluator(
            a,
            [
                "UPDATE orders SET note = 'a only' WHERE id % 3 = 0",
                "PRAGMA wal_checkpoint(TRUNCATE)",
                "VACUUM",
            ],
        )
        assert dump(b) == b_dump
        assert b.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert a.execute("SELECT count(*) FROM orders WHERE note = 'a only'").fetchone()[0] > 1000
        assert b.execute("SELECT count(*) FROM orders WHERE note = 'a only'").fetchone() == (0,)
        assert store_figures(store)["stored_bytes"] > shared["stored_bytes"]
    finally:
        a.close()
        b.close()
    overlay.discard(a_path)
    with closing(connect_overlay(b_path, base, pages=store)) as conn:
        assert dump(conn) == b_dump
    overlay.discard(b_path)
    assert store_figures(store) is None


def test_pages_are_freed_when_the_last_session_that_maps_them_resets(base, tmp_path):
    store = tmp_path / "pages"
    sessions = [tmp_path / f"s{i}.sqlite" for i in range(3)]
    for session in sessions:
        with closing(connect_overlay(session, base, pages=store)) as conn:
            run_like_evaluator(conn, SIBLING_WRITES[:1])
    one = store_figures(store)["stored_bytes"]
    with closing(connect_overlay(sessions[2], base, pages=store)) as conn:
        run_like_evaluator(conn, ["UPDATE customers SET city = printf('%0200d', id)"])
    both = store_figures(store)["stored_bytes"]
    assert both > one
    overlay.discard(sessions[2])  # its own pages go, the shared ones stay
    assert store_figures(store)["stored_bytes"] == one
    assert store_figures(store)["mapped_bytes"] == 2 * one
    overlay.discard(sessions[0])
    assert store_figures(store)["stored_bytes"] == one
    with closing(connect_overlay(sessions[1], base, pages=store)) as conn:
        assert conn.execute("SELECT count(*) FROM orders WHERE note LIKE '000%'").fetchone()[0] > 0
    overlay.discard(sessions[1])
    assert store_figures(store) is None
    assert not list(tmp_path.glob("pages-*"))


def test_a_discarded_session_keeps_working_until_its_connection_closes(base, tmp_path):
    store = tmp_path / "pages"
    session = tmp_path / "s.sqlite"
    conn = connect_overlay(session, base, pages=store)
    run_like_evaluator(conn, SIBLING_WRITES)
    overlay.discard(session)  # like unlinking an open file
    assert conn.execute("SELECT count(*) FROM customers WHERE name = 'sibling'").fetchone() == (1,)
    assert store_figures(store)["sessions"] == 1
    with closing(connect_overlay(session, base, pages=store)) as fresh:  # the path is free again
        assert fresh.execute(
            "SELECT count(*) FROM customers WHERE name = 'sibling'"
        ).fetchone() == (0,)
    overlay.discard(session)
    conn.close()
    assert store_figures(store) is None


def _open_shared_session(uri: str) -> str:
    """Run in a spawned process: try to read a session whose state lives in its parent."""
    from birdenv.replicas import overlay as ovl

    assert ovl.available()
    try:
        with closing(sqlite3.connect(uri, uri=True)) as conn:
            return repr(conn.execute("SELECT count(*) FROM customers").fetchall())
    except sqlite3.OperationalError as exc:
        return str(exc)


def test_a_session_on_shared_pages_opens_only_where_it_lives(base, tmp_path):
    """Its pages live in this process: another process, and a connection without the store, are
    refused instead of shown a wrong view; so is a store of another base."""
    store = tmp_path / "pages"
    session = tmp_path / "s.sqlite"
    with closing(connect_overlay(session, base, pages=store)) as conn:
        run_like_evaluator(conn, SIBLING_WRITES)
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(session, base).execute("SELECT 1")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as other:
        answer = other.apply(
            _open_shared_session, (overlay.session_uri(session, base, pages=store),)
        )
    assert answer == "unable to open database file"
    other_base = build_base(tmp_path / "other.sqlite", customers=5, orders=5)
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(tmp_path / "t.sqlite", other_base, pages=store).execute("SELECT 1")
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(session, other_base, pages=store).execute("SELECT 1")
    # a session with private pages cannot move onto a store either
    private = tmp_path / "p.sqlite"
    with closing(connect_overlay(private, base)) as conn:
        run_like_evaluator(conn, SIBLING_WRITES[:1])
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(private, base, pages=store).execute("SELECT 1")
    overlay.discard(private)
    overlay.discard(session)
    assert store_figures(store) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_its_parents_pages_alone(base, tmp_path):
    """A child inherits the parent's connections and page stores; closing and discarding the
    session there (as a forked copy of a pool or an environment would) must not free, punch out
    or unlink anything of the parent's."""
    store = tmp_path / "pages"
    session = tmp_path / "s.sqlite"
    conn = connect_overlay(session, base, pages=store)
    run_like_evaluator(conn, [*SIBLING_WRITES, "PRAGMA wal_checkpoint(TRUNCATE)"])
    expected, figures = dump(conn), store_figures(store)
    assert figures["stored_bytes"] > 1 << 20  # enough freed in the child to give disk back
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit status
        try:
            conn.close()
            overlay.discard(session)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert dump(conn) == expected
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert store_figures(store) == figures
    assert list(tmp_path.glob("pages-*"))
    conn.close()
    overlay.discard(session)
    assert store_figures(store) is None


def test_sessions_on_one_store_in_many_threads(base, tmp_path):
    """Threads write and read their own sessions on one store at once (SQLite releases the GIL):
    each ends exactly where a private copy fed the same statements ends."""
    store = tmp_path / "pages"
    copy = tmp_path / "copy.sqlite"
    scripts = [
        [*SIBLING_WRITES, f"UPDATE customers SET city = 'T{i % 2}' WHERE id % 5 = {i % 2}"]
        for i in range(6)
    ]
    sessions = [tmp_path / f"s{i}.sqlite" for i in range(len(scripts))]

    def work(i: int) -> list[str]:
        with closing(connect_overlay(sessions[i], base, pages=store)) as conn:
            for _ in range(3):  # the same statements again: rewrites of identical pages
                run_like_evaluator(conn, scripts[i])
                conn.execute("SELECT sum(length(note)) FROM orders").fetchall()
            return check_db(conn)

    with ThreadPoolExecutor(max_workers=6) as executor:
        dumps = list(executor.map(work, range(len(scripts))))
    for i, got in enumerate(dumps):
        shutil.copyfile(base, copy)
        with closing(sqlite3.connect(copy)) as conn:
            for _ in range(3):
                run_like_evaluator(conn, scripts[i])
            assert got == check_db(conn), i
    for session in sessions:
        overlay.discard(session)
    assert store_figures(store) is None


# ----------------------------------------------------------------------------- misc contract


def test_main_db_without_base_is_refused(tmp_path):
    plain = tmp_path / "plain.sqlite"
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        sqlite3.connect(f"file:{plain}?vfs={overlay.VFS_NAME}", uri=True).execute("SELECT 1")
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(plain, tmp_path / "missing-base.sqlite")
    assert not plain.exists()


def test_session_uri_validation_and_files(tmp_path):
    with pytest.raises(ValueError):
        overlay.session_uri(tmp_path / "s", tmp_path / "b", mode="memory")
    with pytest.raises(ValueError):
        overlay.session_uri(tmp_path / "s", tmp_path / "b", max_bytes=0)
    uri = overlay.session_uri(tmp_path / "s", tmp_path / "b", max_bytes=10, mode="ro")
    assert uri.endswith("&maxbytes=10&mode=ro") and f"vfs={overlay.VFS_NAME}" in uri
    names = [p.name for p in overlay.session_files(tmp_path / "s")]
    assert sorted(names) == sorted(["s", "s-ovl", "s-shared", "s-journal", "s-wal", "s-shm"])
    overlay.discard(tmp_path / "never-existed")


def test_read_only_session_and_no_fd_leaks(base, tmp_path, pages):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    session = tmp_path / "s.sqlite"
    start = fds()
    for i in range(30):
        with closing(connect_overlay(session, base, pages=pages)) as conn:
            run_like_evaluator(conn, [f"INSERT INTO customers(name) VALUES ('fd{i}')", "SELEC"])
            conn.execute("CREATE TEMP TABLE t AS SELECT 1")
        with closing(connect_overlay(session, base, mode="ro", pages=pages)) as conn:
            assert conn.execute(
                "SELECT count(*) FROM customers WHERE name LIKE 'fd%'"
            ).fetchone() == (i + 1,)
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                conn.execute("DELETE FROM customers")
        with pytest.raises(sqlite3.OperationalError):
            connect_overlay(tmp_path / "x.sqlite", tmp_path / "nope.sqlite", pages=pages)
    overlay.discard(session)  # a page store's files stay open until its last session goes
    assert fds() == start


def mapped(path: Path) -> bool:
    """Whether this process maps ``path``."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path.resolve())) for line in maps)


def test_sessions_on_one_base_share_its_descriptor(base, tmp_path, pages):
    sessions = [tmp_path / f"s{i}.sqlite" for i in range(8)]
    conns = [connect_overlay(s, base, pages=pages) for s in sessions]
    for conn in conns:
        run_like_evaluator(conn, ["INSERT INTO customers(name) VALUES ('shared')"])
    assert open_on(base) == 1
    for conn, session in zip(conns[:-1], sessions, strict=False):
        conn.close()
        overlay.discard(session)  # with shared pages, what releases the session's pages
    assert open_on(base) == 1
    conns[-1].close()
    overlay.discard(sessions[-1])
    assert open_on(base) == 0


def test_a_held_base_keeps_its_descriptor_and_map_between_sessions(base, tmp_path):
    """Sessions that come and go one at a time reuse a held base's descriptor and in-place map;
    both go with the last hold."""
    handle = overlay.hold_base(base)
    assert open_on(base) == 1 and not mapped(base)  # mapped on the first read in place
    for i in range(3):
        session = tmp_path / f"s{i}.sqlite"
        with closing(connect_overlay(session, base)) as conn:
            conn.execute(f"PRAGMA mmap_size = {base.stat().st_size}")
            run_like_evaluator(conn, [f"INSERT INTO customers(name) VALUES ('h{i}')"])
            rows = conn.execute("SELECT count(*) FROM customers WHERE name LIKE 'h%'").fetchall()
            assert rows == [(1,)]  # its own change only
        overlay.discard(session)
        assert open_on(base) == 1 and mapped(base)
    second = overlay.hold_base(base)
    overlay.release_base(handle)
    assert open_on(base) == 1 and mapped(base)
    overlay.release_base(second)
    assert open_on(base) == 0 and not mapped(base)
    with pytest.raises(FileNotFoundError):
        overlay.hold_base(tmp_path / "missing.sqlite")
    with pytest.raises(OSError):
        overlay.hold_base(tmp_path)  # not a regular file


def test_a_base_replaced_at_its_path_is_read_afresh(tmp_path):
    """Descriptors are shared by file identity, not by path: a new file at the same path is
    another base, even while a session still reads the old one."""
    path = build_base(tmp_path / "base.sqlite", customers=10, orders=10)
    with closing(connect_overlay(tmp_path / "old.sqlite", path)) as old:
        assert old.execute("SELECT count(*) FROM customers").fetchone() == (10,)
        build_base(tmp_path / "next.sqlite", customers=20, orders=10).replace(path)
        with closing(connect_overlay(tmp_path / "new.sqlite", path)) as new:
            assert new.execute("SELECT count(*) FROM customers").fetchone() == (20,)
        assert old.execute("SELECT count(*) FROM customers").fetchone() == (10,)


def test_base_of_another_size_is_refused(base, tmp_path):
    session = tmp_path / "s.sqlite"
    with closing(connect_overlay(session, base)) as conn:
        run_like_evaluator(conn, ["INSERT INTO customers(name) VALUES ('x')"])
    other = build_base(tmp_path / "other.sqlite", customers=5, orders=5)
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_overlay(session, other).execute("SELECT 1")


@pytest.mark.parametrize("base_size", [0, 700, 4096, 50_000])
def test_file_level_fuzz(tmp_path, base_size, pages):
    """Random unaligned and page-sized writes (often of the twin session's or the base's bytes),
    reads, truncations, reopens, discards and a second handle, on two sessions vs mirrors; with
    shared pages also the store's books, and no store left after both are discarded."""
    from birdenv.replicas.native import _overlay

    rng = random.Random(base_size)
    base_path = tmp_path / "base.bin"
    base_path.write_bytes(rng.randbytes(base_size))
    for seed in range(1, 6):
        session = tmp_path / f"s{seed}"
        _overlay._selftest(
            overlay.VFS_NAME,
            str(session),
            str(base_path),
            seed * 7919 + base_size,
            1500,
            "" if pages is None else str(pages),
        )
        overlay.discard(session)
