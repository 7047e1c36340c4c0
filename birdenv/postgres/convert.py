"""A SQLite database file as a PostgreSQL template: the same tables, rows, keys and views.

:func:`sqlite_template` gives the :class:`~birdenv.postgres.pool.Template` of a SQLite file, named
by the file's content hash (and this converter's version). Each table keeps its name and its
columns' names exactly (quoted where SQLite quoted them), with types by SQLite's affinity rules:
integers ``bigint``, reals ``double precision`` (SQLite's REAL has 8 bytes), text ``text`` (dates
and times too: SQLite keeps them as text), blobs ``bytea``, anything else ``numeric``. A
single-column ``INTEGER PRIMARY KEY`` becomes an identity column (SQLite numbers new rows by
itself), whose sequence starts after the largest key. ``NOT NULL``, literal defaults, ``CHECK``
constraints, unique constraints, foreign keys (with their ``ON DELETE``/``ON UPDATE`` actions) and
plain indexes follow; views are translated by sqlglot, and a view it cannot translate is left out
(:func:`convert` returns what was left out, with why). Triggers are left out: their SQLite bodies
do not run on PostgreSQL.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import sqlite3
from pathlib import Path
from typing import Any

from birdenv.files import file_sha256
from birdenv.postgres.templates import Template

__all__ = ["CONVERTER_VERSION", "convert", "pg_definition", "pg_type", "sqlite_template"]

#: Part of every converted template's content hash: a change to the rules below makes new ones.
CONVERTER_VERSION = "1"


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# PostgreSQL's reserved key words (and those it reserves for type and function names), which
# name nothing unquoted.
_RESERVED = frozenset(
    [
        "all",
        "analyse",
        "analyze",
        "and",
        "any",
        "array",
        "as",
        "asc",
        "asymmetric",
        "authorization",
        "binary",
        "both",
        "case",
        "cast",
        "check",
        "collate",
        "collation",
        "column",
        "concurrently",
        "constraint",
        "create",
        "cross",
        "current_catalog",
        "current_date",
        "current_role",
        "current_schema",
        "current_time",
        "current_timestamp",
        "current_user",
        "default",
        "deferrable",
        "desc",
        "distinct",
        "do",
        "else",
        "end",
        "except",
        "false",
        "fetch",
        "for",
        "foreign",
        "freeze",
        "from",
        "full",
        "grant",
        "group",
        "having",
        "ilike",
        "in",
        "initially",
        "inner",
        "intersect",
        "into",
        "is",
        "isnull",
        "join",
        "lateral",
        "leading",
        "left",
        "like",
        "limit",
        "localtime",
        "localtimestamp",
        "natural",
        "not",
        "notnull",
        "null",
        "offset",
        "on",
        "only",
        "or",
        "order",
        "outer",
        "overlaps",
        "placing",
        "primary",
        "references",
        "returning",
        "right",
        "select",
        "session_user",
        "similar",
        "some",
        "symmetric",
        "system_user",
        "table",
        "tablesample",
        "then",
        "to",
        "trailing",
        "true",
        "union",
        "unique",
        "user",
        "using",
        "variadic",
        "verbose",
        "when",
        "where",
        "window",
        "with",
    ]
)


def _ident(name: str) -> str:
    """A PostgreSQL identifier for ``name``: bare where it reads the same bare, else quoted."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", name) and name not in _RESERVED:
        return name
    return _quote(name)


def pg_type(declared: str) -> str:
    """The PostgreSQL type of a SQLite column declared ``declared``, by SQLite's affinity rules."""
    upper = declared.upper()
    if "INT" in upper:
        return "bigint"
    if any(word in upper for word in ("CHAR", "CLOB", "TEXT", "DATE", "TIME")) or not upper:
        return "text"
    if "BLOB" in upper:
        return "bytea"
    if any(word in upper for word in ("REAL", "FLOA", "DOUB")):
        return "double precision"
    if "BOOL" in upper:
        return "boolean"
    return "numeric"


def _checks(sql: str) -> list[str]:
    """The ``CHECK (...)`` clauses of a CREATE TABLE statement, parentheses balanced."""
    found = []
    for match in re.finditer(r"\bCHECK\s*\(", sql, re.IGNORECASE):
        depth, start = 0, match.end() - 1
        for i in range(start, len(sql)):
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            if depth == 0:
                found.append(sql[start + 1 : i].strip())
                break
    return found


# A literal SQLite and PostgreSQL read alike.
_LITERAL = re.compile(r"(?is)\s*(null|true|false|[+-]?\d+(\.\d*)?(e[+-]?\d+)?|'([^']|'')*')\s*")
# SQLite's clock functions as column defaults, and the same text on PostgreSQL.
_CLOCK = {
    "current_timestamp": "to_char(now(), 'YYYY-MM-DD HH24:MI:SS')",
    "datetime('now')": "to_char(now(), 'YYYY-MM-DD HH24:MI:SS')",
    "current_date": "to_char(now(), 'YYYY-MM-DD')",
    "date('now')": "to_char(now(), 'YYYY-MM-DD')",
    "current_time": "to_char(now(), 'HH24:MI:SS')",
}


def _default(value: str | None) -> str | None:
    """The PostgreSQL default for a SQLite one: literals and the clock; None for anything else."""
    if value is None:
        return None
    if _LITERAL.fullmatch(value):
        return value
    inner = value.strip().lower()
    if inner.startswith("(") and inner.endswith(")"):
        inner = inner[1:-1]
    return _CLOCK.get(re.sub(r"\s+", "", inner).replace('"', "'"))


def _table_sql(
    conn: sqlite3.Connection, table: str, sql: str, left_out: list[str]
) -> tuple[str, str | None]:
    """The CREATE TABLE statement for ``table``, and its identity column if it has one; what it
    cannot translate is added to ``left_out``."""
    columns = conn.execute(f"PRAGMA table_xinfo({_quote(table)})").fetchall()
    keys = sorted((c for c in columns if c[5]), key=lambda c: c[5])
    identity = keys[0][1] if len(keys) == 1 and keys[0][2].upper() == "INTEGER" else None
    parts = []
    for _, name, declared, notnull, default, _pk, hidden in columns:
        if hidden:
            continue  # generated columns are left out (their expressions are SQLite's)
        line = f"{_ident(name)} {pg_type(declared)}"
        if name == identity:
            line += " GENERATED BY DEFAULT AS IDENTITY"
        if notnull:
            line += " NOT NULL"
        if default is not None and name != identity:
            translated = _default(default)
            if translated is None:
                left_out.append(f"default of {table}.{name}: {default}")
            else:
                line += f" DEFAULT {translated}"
        parts.append(line)
    if keys:
        parts.append(f"PRIMARY KEY ({', '.join(_ident(c[1]) for c in keys)})")
    for index in conn.execute(f"PRAGMA index_list({_quote(table)})").fetchall():
        if index[3] == "u":
            cols = conn.execute(f"PRAGMA index_info({_quote(index[1])})").fetchall()
            parts.append(f"UNIQUE ({', '.join(_ident(c[2]) for c in cols)})")
    parts += [f"CHECK ({check})" for check in _checks(sql)]
    body = ",\n    ".join(parts)
    return f"CREATE TABLE {_ident(table)} (\n    {body}\n)", identity


def _foreign_keys(conn: sqlite3.Connection, table: str) -> list[str]:
    groups: dict[int, list[Any]] = {}
    for row in conn.execute(f"PRAGMA foreign_key_list({_quote(table)})").fetchall():
        groups.setdefault(row[0], []).append(row)
    statements = []
    for rows in groups.values():
        target, on_update, on_delete = rows[0][2], rows[0][5], rows[0][6]
        here = ", ".join(_ident(r[3]) for r in rows)
        there = ", ".join(_ident(r[4]) for r in rows if r[4] is not None)
        clause = f"ALTER TABLE {_ident(table)} ADD FOREIGN KEY ({here}) REFERENCES {_ident(target)}"
        if there:
            clause += f" ({there})"
        for event, action in (("UPDATE", on_update), ("DELETE", on_delete)):
            if action and action.upper() != "NO ACTION":
                clause += f" ON {event} {action.upper()}"
        statements.append(clause)
    return statements


def _indexes(conn: sqlite3.Connection, table: str) -> list[str]:
    statements = []
    for _, name, unique, origin, _partial in conn.execute(
        f"PRAGMA index_list({_quote(table)})"
    ).fetchall():
        if origin != "c":
            continue
        cols = conn.execute(f"PRAGMA index_xinfo({_quote(name)})").fetchall()
        keyed = [c for c in cols if c[5]]
        if any(c[2] is None for c in keyed):
            continue  # an index on expressions: SQLite's expressions
        kind = "UNIQUE INDEX" if unique else "INDEX"
        columns = ", ".join(_ident(c[2]) + (" DESC" if c[3] else "") for c in keyed)
        statements.append(f"CREATE {kind} {_ident(name)} ON {_ident(table)} ({columns})")
    return statements


def _copy_rows(conn: sqlite3.Connection, db: Any, table: str, columns: list[str]) -> None:
    """Copy a table's rows as CSV, written by the csv module's C loop: a million rows in
    seconds. SQLite writes NULL as the string ``\\x01N``, the copy's NULL, so that NULL and the
    empty string stay apart; a table holding blobs goes row by row (CSV has no bytes)."""
    names = ", ".join(map(_quote, columns))
    target = f"COPY {_quote(table)} ({names}) FROM STDIN"
    blobs = " OR ".join(f"typeof({_quote(c)}) = 'blob'" for c in columns)
    if conn.execute(f"SELECT 1 FROM {_quote(table)} WHERE {blobs} LIMIT 1").fetchone():
        with db.cursor().copy(target) as copy:
            for row in conn.execute(f"SELECT {names} FROM {_quote(table)}"):
                copy.write_row(row)
        return
    marked = ", ".join(f"ifnull({_quote(c)}, char(1) || 'N')" for c in columns)
    cursor = conn.execute(f"SELECT {marked} FROM {_quote(table)}")
    options = f"(FORMAT csv, NULL E'\\x01N', FORCE_NULL ({names}))"
    with db.cursor().copy(f"{target} {options}") as copy:
        while rows := cursor.fetchmany(20_000):
            text = io.StringIO()
            csv.writer(text, quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n").writerows(rows)
            copy.write(text.getvalue())


def convert(source: str | Path, db: Any) -> list[str]:
    """Create the SQLite file ``source``'s tables, rows, keys, indexes and views through the
    PostgreSQL connection ``db`` (autocommit); return what was left out, one line each."""
    # sqlglot takes ~0.8 s of CPU to import: imported only where used
    import sqlglot

    left_out = []
    conn = sqlite3.connect(f"file:{Path(source).absolute()}?mode=ro", uri=True)
    try:
        objects = conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master "
            "WHERE name NOT LIKE 'sqlite_%' AND sql IS NOT NULL ORDER BY rowid"
        ).fetchall()
        tables = [(name, sql) for kind, name, _, sql in objects if kind == "table"]
        for table, sql in tables:
            create, identity = _table_sql(conn, table, sql, left_out)
            db.execute(create)
            columns = [
                c[1] for c in conn.execute(f"PRAGMA table_xinfo({_quote(table)})") if not c[6]
            ]
            _copy_rows(conn, db, table, columns)
            if identity is not None:
                db.execute(
                    f"SELECT setval(pg_get_serial_sequence(%s, %s), "
                    f"coalesce(max({_quote(identity)}), 0) + 1, false) FROM {_quote(table)}",
                    (_quote(table), identity),
                )
        for table, _ in tables:
            for statement in _foreign_keys(conn, table) + _indexes(conn, table):
                db.execute(statement)
        for kind, name, _, sql in objects:
            if kind == "view":
                try:
                    translated = sqlglot.transpile(sql, read="sqlite", write="postgres")[0]
                    db.execute(translated)
                except Exception as exc:  # any failure leaves the view out, and says so
                    left_out.append(f"view {name}: {str(exc).splitlines()[0]}")
            elif kind == "trigger":
                left_out.append(f"trigger {name}: SQLite trigger bodies do not run on PostgreSQL")
        db.execute("ANALYZE")
    finally:
        conn.close()
    return left_out


def pg_definition(conn: sqlite3.Connection, kind: str, name: str, sql: str) -> str | None:
    """What a template holds for one object of the SQLite database ``conn`` (``kind`` and ``sql``
    as ``sqlite_master`` has them): a table's CREATE TABLE with its foreign keys, a view as
    sqlglot translates it; None for what :func:`convert` leaves out (triggers, views it cannot
    translate). For prompts that show the PostgreSQL schema."""
    # sqlglot takes ~0.8 s of CPU to import: imported only where used
    import sqlglot

    if kind == "table":
        create, _ = _table_sql(conn, name, sql, [])
        return ";\n".join([create, *_foreign_keys(conn, name)])
    if kind == "view":
        try:
            return sqlglot.transpile(sql, read="sqlite", write="postgres", pretty=True)[0]
        except Exception:  # left out of the template too
            return None
    return None


def sqlite_template(path: str | Path, key: str | None = None) -> Template:
    """The template of the SQLite file at ``path`` (``key``: its short name, default the file's
    stem without ``_template``), named by the file's content hash and :data:`CONVERTER_VERSION`."""
    path = Path(path)
    digest = hashlib.sha256(f"{file_sha256(path)}:{CONVERTER_VERSION}".encode()).hexdigest()
    name = key or path.stem.removesuffix("_template")
    return Template(name, digest, lambda db: convert(path, db))
