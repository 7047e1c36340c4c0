"""birdenv.sql: splitting agrees with SQLite itself; the tables a statement names agree with
SQLite's authorizer.

Splitting is checked against Python's sqlite3, which refuses a string holding two statements with
"You can only execute one statement at a time". The tables of a read or a write are checked
against the tables SQLite's authorizer is asked about when it prepares the statement.
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
CREATE TABLE "Ward Transfers"(id INTEGER, t_a INTEGER REFERENCES t(a));
CREATE TABLE [order items](id, qty);
CREATE VIEW vv AS SELECT * FROM t;
INSERT INTO t VALUES (1, 'x;y'), (2, '--');
"""

# (statement, the tables it names in order of first mention). Reads and writes are also prepared
# by SQLite and checked against its authorizer.
READS_AND_WRITES = [
    ("SELECT * FROM t", ["t"]),
    ("select a from T where b = 'u'", ["T"]),
    ('SELECT * FROM t JOIN u ON t.a = u.x LEFT JOIN "c;d" AS z ON 1', ["t", "u", "c;d"]),
    ("SELECT * FROM t, u AS uu, [order items] oi", ["t", "u", "order items"]),
    ("SELECT * FROM main.t", ["t"]),
    ('SELECT * FROM "Ward Transfers" WHERE t_a IN (SELECT a FROM t)', ["Ward Transfers", "t"]),
    ("SELECT (SELECT max(x) FROM u) FROM t", ["u", "t"]),
    ("SELECT * FROM (SELECT a FROM t) AS s", ["t"]),
    ("SELECT 1 WHERE EXISTS (SELECT 1 FROM `u`)", ["u"]),
    ("WITH c AS (SELECT a FROM t) SELECT * FROM c JOIN u ON 1", ["t", "u"]),
    ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 3) SELECT i FROM r", []),
    ("WITH t AS (SELECT 1 AS a) SELECT a FROM t", []),  # a CTE named like a table hides it
    ("SELECT * FROM vv", ["vv"]),
    ("VALUES (1), (2)", []),
    ("INSERT INTO u SELECT a FROM t", ["u", "t"]),
    ("INSERT INTO u(x) VALUES (1)", ["u"]),
    ("REPLACE INTO t VALUES (1, 'z')", ["t"]),
    ("INSERT OR REPLACE INTO t VALUES (1, 'z')", ["t"]),
    ("UPDATE t SET b = (SELECT x FROM u) WHERE a = 1", ["t", "u"]),
    ("UPDATE OR IGNORE u SET x = 1", ["u"]),
    ("DELETE FROM [order items] WHERE id IN (SELECT a FROM t)", ["order items", "t"]),
    ("WITH c AS (SELECT 1 AS v) DELETE FROM u WHERE x IN (SELECT v FROM c)", ["u"]),
]

# DDL and what SQLite's authorizer does not report (new tables, foreign-key targets).
OTHERS = [
    ("CREATE TABLE n(x REFERENCES t(a))", ["n", "t"]),
    ("CREATE TABLE IF NOT EXISTS n AS SELECT * FROM u", ["n", "u"]),
    ("CREATE INDEX i ON t(b)", ["t"]),
    ("CREATE UNIQUE INDEX IF NOT EXISTS i ON [order items](id)", ["order items"]),
    ("CREATE VIEW v2 AS SELECT * FROM t JOIN u", ["v2", "t", "u"]),
    ("CREATE TRIGGER tr AFTER INSERT ON u BEGIN DELETE FROM t; END", ["u", "t"]),
    (
        "CREATE TRIGGER tr AFTER UPDATE OF x ON u FOR EACH ROW WHEN new.x > 0 BEGIN "
        "INSERT INTO \"c;d\" VALUES (new.x); UPDATE t SET b = 'end;' WHERE a = new.x; END",
        ["u", "c;d", "t"],
    ),
    ("DROP TABLE IF EXISTS u", ["u"]),
    ("ALTER TABLE t ADD COLUMN c INTEGER", ["t"]),
    ("ALTER TABLE t RENAME TO t2", ["t", "t2"]),
    ("SELECT 1; SELECT * FROM u; DELETE FROM t", ["u", "t"]),
    ("BEGIN; SAVEPOINT a; RELEASE a; COMMIT", []),
    ("PRAGMA foreign_keys = ON", []),
    ("", []),
    ("-- only a comment", []),
    # Broken SQL: names are still found after FROM, JOIN, INTO, UPDATE.
    ("SELEC * FROM t JOIN u ON t.a = u.x WHERE", ["t", "u"]),
    ("SELECT a, FROM t,", ["t"]),
    ("INSERT INTO u VALUES (", ["u"]),
    ("garbage (( from", []),
]

_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}


def _authorized_tables(sql: str) -> set[str]:
    """The tables SQLite's authorizer is asked about, reading or writing, for ``sql`` itself
    (not for the views it reads, whose own tables come with the view's name as the source)."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA)
    views = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'")}
    tables: set[str] = set()

    def record(action, arg1, arg2, db, source):
        if (action == sqlite3.SQLITE_READ or action in _WRITES) and source not in views:
            tables.add(arg1)
        return sqlite3.SQLITE_OK

    conn.set_authorizer(record)
    conn.execute(f"EXPLAIN {sql}")
    return {t.lower() for t in tables if not t.startswith("sqlite_")}


@pytest.mark.parametrize(
    ("sql", "names"), READS_AND_WRITES, ids=[c[0][:40] for c in READS_AND_WRITES]
)
def test_tables_of_reads_and_writes_agree_with_sqlite(sql: str, names: list[str]) -> None:
    assert sqlkit.referenced_tables(sql) == names
    assert {n.lower() for n in names} == _authorized_tables(sql)


@pytest.mark.parametrize(("sql", "names"), OTHERS, ids=[c[0][:40] for c in OTHERS])
def test_tables_of_ddl_scripts_and_broken_sql(sql: str, names: list[str]) -> None:
    assert sqlkit.referenced_tables(sql) == names


def test_tables_of_a_list_of_statements_are_named_once_in_order() -> None:
    statements = [
        "SELECT * FROM U",
        "CREATE TRIGGER x AFTER INSERT ON t BEGIN SELECT 1; END",
        "SELECT * FROM u, t",
    ]
    assert sqlkit.referenced_tables(statements) == ["U", "t"]
    assert sqlkit.referenced_tables([]) == []


@pytest.mark.parametrize(
    "text",
    ["", " ", ";", ";;", "-- x", "/* x */", "/* x */ ; -- y\n;", "\n\t;\n"],
)
def test_empty_statements(text: str) -> None:
    assert sqlkit.split_statements(text) == []
    assert sqlkit.referenced_tables(text) == []


def test_hostile_text_never_raises() -> None:
    for text in ["\x00", "SELECT '\ud800'", "\udfff;\ud800;", "'" * 1001, "[", "/*", "--", "`a"]:
        assert all(isinstance(p, str) for p in sqlkit.split_statements(text))
        assert all(isinstance(n, str) for n in sqlkit.referenced_tables(text))


def test_split_is_linear_on_semicolons() -> None:
    import time

    start = time.process_time()  # CPU time: other processes on the machine do not count
    assert sqlkit.split_statements("SELECT 1" + ";" * 200_000) == ["SELECT 1;"]
    assert len(sqlkit.split_statements("SELECT 1;" * 20_000)) == 20_000
    assert len(sqlkit.split_statements("CREATE TRIGGER x BEGIN " + "; " * 20_000)) == 1
    assert time.process_time() - start < 5


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
        assert sqlkit.split_statements(piece) == [piece]
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


def test_fallback_parsing_logs_nothing_and_leaves_sqlglot_logging_alone(caplog) -> None:
    import sqlglot

    with caplog.at_level("WARNING", logger="sqlglot"):
        assert sqlkit.referenced_tables("REPLACE INTO t VALUES (1); SAVEPOINT a") == ["t"]
        assert caplog.records == []
        sqlglot.parse_one("SAVEPOINT a", read="sqlite")  # outside: sqlglot's own warning stays
        assert [r.name for r in caplog.records] == ["sqlglot"]
