"""birdenv.sql: splitting and classification agree with SQLite itself.

Classification is checked against SQLite's authorizer (what the statement really asks SQLite to
do, at prepare time); splitting against Python's sqlite3, which refuses a string holding two
statements with "You can only execute one statement at a time".
"""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from birdenv import sql as sqlkit

SCHEMA = """
CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT);
CREATE TABLE u(x);
CREATE TABLE "c;d"("a;b");
INSERT INTO t VALUES (1, 'x;y'), (2, '--');
"""

# (statement, kind). Each is also prepared by SQLite and checked against its authorizer.
CASES = [
    ("SELECT * FROM t", "read"),
    ("  -- c\n/* d */ select 1", "read"),
    ("VALUES (1), (2)", "read"),
    ("WITH c AS (SELECT 1) SELECT * FROM c", "read"),
    (
        "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM c LIMIT 3) SELECT i FROM c",
        "read",
    ),
    ("WITH c(x) AS (SELECT ';delete') SELECT x AS \"update\" FROM c", "read"),
    ("EXPLAIN QUERY PLAN DELETE FROM t", "read"),
    ("INSERT INTO u VALUES (1)", "write"),
    ("REPLACE INTO t VALUES (1, 'z')", "write"),
    ("INSERT OR IGNORE INTO u SELECT a FROM t", "write"),
    ("UPDATE t SET b = 'q' WHERE a = 1", "write"),
    ("DELETE FROM u", "write"),
    ("WITH c AS (SELECT 1 AS v) INSERT INTO u SELECT v FROM c", "write"),
    ("WITH c AS (SELECT 1 AS v) DELETE FROM u WHERE x IN (SELECT v FROM c)", "write"),
    ("WITH c AS MATERIALIZED (SELECT 1 AS v) UPDATE u SET x = (SELECT v FROM c)", "write"),
    ("CREATE TABLE n(x)", "ddl"),
    ("CREATE TEMP VIEW v AS SELECT 1", "ddl"),
    ("CREATE INDEX i ON t(b)", "ddl"),
    ("CREATE TRIGGER tr AFTER INSERT ON u BEGIN DELETE FROM t; END", "ddl"),
    ("DROP TABLE u", "ddl"),
    ("ALTER TABLE t ADD COLUMN c", "ddl"),
    ("BEGIN", "transaction"),
    ("BEGIN IMMEDIATE TRANSACTION", "transaction"),
    ("SAVEPOINT a", "transaction"),
    ("RELEASE a", "transaction"),
    ("RELEASE SAVEPOINT a", "transaction"),
    ("ROLLBACK", "transaction"),
    ("COMMIT", "transaction"),
    ("END TRANSACTION", "transaction"),
    ("PRAGMA foreign_keys = ON", "pragma"),
    ("pragma table_info(t)", "pragma"),
    ("VACUUM", "other"),
    ("ANALYZE", "other"),
    ("REINDEX", "other"),
    ("ATTACH ':memory:' AS m", "other"),
]

_AUTH_KIND = {
    sqlite3.SQLITE_INSERT: "write",
    sqlite3.SQLITE_UPDATE: "write",
    sqlite3.SQLITE_DELETE: "write",
    sqlite3.SQLITE_TRANSACTION: "transaction",
    sqlite3.SQLITE_SAVEPOINT: "transaction",
    sqlite3.SQLITE_PRAGMA: "pragma",
    sqlite3.SQLITE_ATTACH: "other",
    sqlite3.SQLITE_ANALYZE: "other",
    sqlite3.SQLITE_REINDEX: "other",
}
_DDL = {
    code
    for name, code in vars(sqlite3).items()
    if name.startswith(("SQLITE_CREATE_", "SQLITE_DROP_", "SQLITE_ALTER_TABLE"))
}


def _sqlite_kind(conn: sqlite3.Connection, sql: str) -> str:
    """What SQLite's authorizer says a statement does, reduced to :data:`birdenv.sql.KINDS`."""
    actions: list[tuple[int, str | None]] = []

    def record(action, arg1, arg2, db, source):
        if source is None:  # not from inside a trigger or view
            actions.append((action, arg1))
        return sqlite3.SQLITE_OK

    conn.set_authorizer(record)
    try:
        conn.execute(f"EXPLAIN {sql}")
    finally:
        conn.set_authorizer(None)
    codes = {a for a, _ in actions}
    if codes & _DDL:
        return "ddl"
    # The temporary tables of a CTE or sqlite_master reads are not the statement's own writes.
    for code, arg1 in actions:
        if code in _AUTH_KIND and not (code != sqlite3.SQLITE_PRAGMA and arg1 == "sqlite_master"):
            return _AUTH_KIND[code]
    if sqlite3.SQLITE_SELECT in codes:
        return "read"
    return "other"  # VACUUM asks no authorization beyond ATTACH of its temporary database


@pytest.mark.parametrize(("sql", "kind"), CASES, ids=[c[0][:40] for c in CASES])
def test_classify_agrees_with_sqlite(sql: str, kind: str) -> None:
    assert sqlkit.classify(sql) == kind
    assert sqlkit.classify(sql + " ;  -- trailing") == kind
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA)
    if sql.startswith(("RELEASE", "EXPLAIN", "ANALYZE")):
        # RELEASE needs a savepoint; EXPLAIN is authorized as what it explains; ANALYZE creates
        # sqlite_stat1, which is maintenance ("other") rather than the agent's own DDL.
        return
    assert _sqlite_kind(conn, sql) == kind


@pytest.mark.parametrize(
    "text",
    ["", " ", ";", ";;", "-- x", "/* x */", "/* x */ ; -- y\n;", "\n\t;\n"],
)
def test_empty_statements(text: str) -> None:
    assert sqlkit.classify(text) == "empty"
    assert sqlkit.split_statements(text) == []


def test_hostile_text_never_raises() -> None:
    for text in ["\x00", "SELECT '\ud800'", "\udfff;\ud800;", "'" * 1001, "[", "/*", "--", "`a"]:
        sqlkit.split_statements(text)
        assert sqlkit.classify(text) in sqlkit.KINDS
        sqlkit.tables(text)


def test_split_is_linear_on_semicolons() -> None:
    import time

    start = time.perf_counter()
    assert sqlkit.split_statements("SELECT 1" + ";" * 200_000) == ["SELECT 1;"]
    assert len(sqlkit.split_statements("SELECT 1;" * 20_000)) == 20_000
    assert len(sqlkit.split_statements("CREATE TRIGGER x BEGIN " + "; " * 20_000)) == 1
    assert time.perf_counter() - start < 5


_pieces = st.sampled_from(
    [
        "SELECT 'a;b'",
        'SELECT "x;y" FROM t',
        "SELECT 1 -- c;\n",
        "SELECT /* ; */ 2",
        "SELECT [a;b] FROM `c;d`",
        "CREATE TRIGGER IF NOT EXISTS tr AFTER INSERT ON u BEGIN DELETE FROM t; "
        "UPDATE t SET b = 'end;'; END",
        "INSERT INTO u VALUES (';')",
        "SELECT 'it''s;'",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_pieces, min_size=1, max_size=6))
def test_split_recovers_statements(pieces: list[str]) -> None:
    text = ";\n".join(pieces)
    split = sqlkit.split_statements(text)
    expected = [(p + ";").strip() for p in pieces[:-1]] + [pieces[-1].strip()]
    assert split == expected
    for piece in split:
        assert sqlkit.is_single_statement(piece)
        # Python's sqlite3 agrees that each piece is exactly one statement.
        conn = sqlite3.connect(":memory:")
        conn.executescript(SCHEMA)
        try:
            conn.execute(piece)
        except sqlite3.ProgrammingError as exc:  # pragma: no cover - the failure we look for
            pytest.fail(f"{piece!r}: {exc}")
        except sqlite3.Error:
            pass
    if len(pieces) > 1:
        conn = sqlite3.connect(":memory:")
        conn.executescript(SCHEMA)
        with pytest.raises(sqlite3.ProgrammingError, match="one statement"):
            conn.execute(text)
