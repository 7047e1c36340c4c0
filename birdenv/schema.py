"""The schema prompt of a database: the full form BIRD-CRITIC renders, or a linked one.

For every table: its ``CREATE`` statement, then ``First 3 rows:`` and a right-aligned text table of
its first rows (the benchmark's prompts print a pandas frame without index; this is the same layout
without pandas). Views and triggers follow as their ``CREATE`` statements.

A prompt is set by one :class:`PromptOptions`, shared by the environments, synthesis, training
and evaluation so that a model is tested on the prompts it learned from:

- ``schema="full"`` (default, the benchmark's form): every table, view and trigger;
- ``schema="linked"``: only the tables a task names (:func:`linked_tables`) and their
  foreign-key neighbours, with the views and triggers that touch them;
- ``schema="named"``: only the tables a task names, without neighbours (the smallest; the table a
  fix needs may be missing);
- ``sample_rows=False``: no ``First 3 rows`` blocks.

Token counts per setting on critic-mini are in benchmarks/README.md ("Prompt sizes").

:func:`task_schema` renders the schema part of a task's prompt under those options.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from birdenv.dialects import dialect_name, dialect_of
from birdenv.errors import DatabaseNotFoundError, SchemaError
from birdenv.files import identify
from birdenv.sql import fold, referenced_tables
from birdenv.tasks.protocol import BaseTask

__all__ = [
    "SAMPLE_ROWS",
    "SCHEMA_MODES",
    "PromptOptions",
    "ServerCatalog",
    "linked_tables",
    "read_server_catalog",
    "render_schema",
    "task_schema",
    "text_table",
]

#: Schema modes of :class:`PromptOptions`: every table; those a task names plus their foreign-key
#: neighbours; those a task names.
SCHEMA_MODES: Final = ("full", "linked", "named")
#: Rows shown per table when sample rows are on (the benchmark's three).
SAMPLE_ROWS: Final = 3
# Names shorter than this are not matched in a question's words ("id" is in every table).
_MIN_NAME: Final = 3
_WORDS = re.compile(r"[A-Za-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


@dataclasses.dataclass(frozen=True)
class PromptOptions:
    """How a task's prompt shows its database; one setting for every stage that builds prompts.

    >>> PromptOptions(schema="linked", sample_rows=False)
    PromptOptions(schema='linked', sample_rows=False)
    >>> PromptOptions(schema="short")
    Traceback (most recent call last):
    ...
    birdenv.errors.SchemaError: schema must be one of 'full', 'linked', 'named'; got 'short'
    """

    #: ``"full"`` (every table, the benchmark's form), ``"linked"`` or ``"named"`` (see
    #: :func:`linked_tables`).
    schema: str = "full"
    #: Whether each table is followed by its first three rows.
    sample_rows: bool = True

    def __post_init__(self) -> None:
        if self.schema not in SCHEMA_MODES:
            raise SchemaError(
                f"schema must be one of {', '.join(map(repr, SCHEMA_MODES))}; got {self.schema!r}"
            )
        if not isinstance(self.sample_rows, bool):
            raise SchemaError(f"sample_rows must be True or False; got {self.sample_rows!r}")

    @classmethod
    def of(cls, value: PromptOptions | Mapping[str, Any] | None) -> PromptOptions:
        """Options from what a caller or a config file gives: options, a mapping, or None
        (the defaults).

        >>> PromptOptions.of({"schema": "linked"})
        PromptOptions(schema='linked', sample_rows=True)
        >>> PromptOptions.of({"rows": 0})
        Traceback (most recent call last):
        ...
        birdenv.errors.SchemaError: unknown prompt option 'rows'; the options are schema, sample_rows
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise SchemaError(
                f"prompt options must be PromptOptions or a mapping; got {type(value).__name__}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise SchemaError(
                f"unknown prompt option {', '.join(map(repr, unknown))}; "
                f"the options are {', '.join(names)}"
            )
        return cls(**value)


def _cell(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e15 else repr(value)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    text = str(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def text_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """Rows as a right-aligned text table with a header line (pandas ``to_string(index=False)`` style).

    >>> print(text_table(["id", "name"], [(1, "Ann"), (20, None)]))
     id name
      1  Ann
     20 None
    """
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [" ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += [" ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(" " + line for line in lines)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclasses.dataclass(frozen=True)
class _Object:
    """A table, view or trigger of a database, with what the linked form needs to know of it."""

    kind: str
    name: str
    sql: str
    columns: tuple[str, ...] = ()
    #: Folded names of the tables it is linked to: FK targets (a table), or what it reads and
    #: writes (a view or trigger).
    refs: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=64)
def _catalog(path: str, mtime_ns: int, dialect: str = "sqlite") -> tuple[_Object, ...]:
    """Tables, views and triggers of a database, in the order the prompt shows them; for
    ``dialect="postgresql"``, as its PostgreSQL template defines them (no triggers)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' AND type IN ('table', 'view', 'trigger') "
            "ORDER BY CASE type WHEN 'table' THEN 0 WHEN 'view' THEN 1 ELSE 2 END, rowid"
        ).fetchall()
        objects = []
        for kind, name, sql in rows:
            if dialect == "postgresql":
                from birdenv.postgres.convert import pg_definition  # the postgres extra

                sql = pg_definition(conn, kind, name, sql)
                if sql is None:
                    continue  # not in the template
            if kind == "table":
                columns = tuple(r[1] for r in conn.execute(f"PRAGMA table_info({_quote(name)})"))
                targets = {r[2] for r in conn.execute(f"PRAGMA foreign_key_list({_quote(name)})")}
                refs = frozenset(fold(t) for t in targets)
                objects.append(_Object(kind, name, sql, columns, refs))
            else:
                refs = frozenset(fold(t) for t in referenced_tables(sql))
                objects.append(_Object(kind, name, sql, refs=refs))
        return tuple(objects)
    finally:
        conn.close()


def _database(db_path: str | Path) -> tuple[str, int]:
    real, st = identify(db_path)
    return real, st.st_mtime_ns


@functools.lru_cache(maxsize=256)
def _render(
    path: str, mtime_ns: int, rows: int, tables: frozenset[str] | None, dialect: str = "sqlite"
) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)

    def sample(name: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        cursor = conn.execute(f"SELECT * FROM {_quote(name)} LIMIT {rows}")
        return [d[0] for d in cursor.description], cursor.fetchall()

    try:
        return _render_objects(_catalog(path, mtime_ns, dialect), rows, tables, sample)
    finally:
        conn.close()


def _render_objects(
    objects: Iterable[_Object],
    rows: int,
    tables: frozenset[str] | None,
    sample: Callable[[str], tuple[list[str], list[tuple[Any, ...]]]],
) -> str:
    """The schema text of ``objects``: each one's statement, a table's followed by its first
    ``rows`` rows (``sample(name)``: its columns and rows), keeping what touches ``tables``."""
    parts = []
    for obj in objects:
        if tables is not None:
            mine = {fold(obj.name)} if obj.kind == "table" else obj.refs
            if not mine & tables:
                continue
        if obj.kind != "table" or rows <= 0:
            parts.append(f"{obj.sql};")
            continue
        columns, first = sample(obj.name)
        parts.append(f"{obj.sql};\n\nFirst {rows} rows:\n{text_table(columns, first[:rows])}\n")
    return "\n\n".join(parts)


def render_schema(
    db_path: str | Path,
    *,
    rows: int = SAMPLE_ROWS,
    tables: Iterable[str] | None = None,
    dialect: str = "sqlite",
) -> str:
    """The schema text of a database: CREATE statements plus the first ``rows`` rows of each table.

    ``rows=0`` shows no rows and no ``First N rows`` heading. ``tables`` (names, compared as
    SQLite compares them) keeps only those tables and the views and triggers that touch one of
    them; ``None`` keeps everything. ``dialect="postgresql"`` shows the definitions of the
    database's PostgreSQL template (:func:`birdenv.postgres.convert.pg_definition`).

    Raises:
        SchemaError: ``tables`` names a table the database does not have, or ``rows`` < 0.
    """
    if rows < 0:
        raise SchemaError(f"rows must be 0 or more; got {rows}")
    path, mtime_ns = _database(db_path)
    keep = None
    if tables is not None:
        keep = frozenset(fold(t) for t in tables)
        known = {fold(o.name) for o in _catalog(path, mtime_ns) if o.kind == "table"}
        if keep - known:
            raise SchemaError(
                f"{db_path} has no table {', '.join(sorted(map(repr, keep - known)))}; "
                f"its tables are {', '.join(sorted(known))}"
            )
    return _render(path, mtime_ns, rows, keep, dialect_name(dialect))


def _keys(text: str) -> set[str]:
    """The lookup keys of a name or of a text: its words, lower-cased and singular, and runs of
    two or three adjacent words joined (``district name`` also gives ``districtname``)."""
    words = [_singular(w.lower()) for w in _WORDS.findall(_CAMEL.sub(" ", text))]
    keys = set(words)
    for n in (2, 3):
        keys.update("".join(words[i : i + n]) for i in range(len(words) - n + 1))
    return keys


def _singular(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _name_key(name: str) -> str:
    """One key for a table or column name: its words (camelCase and ``_`` split) run together."""
    words = [_singular(w.lower()) for w in _WORDS.findall(_CAMEL.sub(" ", name))]
    return "".join(words)


@functools.lru_cache(maxsize=1024)
def _linked(
    path: str, mtime_ns: int, sql: tuple[str, ...], text: str, neighbours: bool
) -> tuple[str, ...]:
    return _linked_in(_catalog(path, mtime_ns), sql, text, neighbours)


def _linked_in(
    catalog: tuple[_Object, ...], sql: tuple[str, ...], text: str, neighbours: bool
) -> tuple[str, ...]:
    tables = [o for o in catalog if o.kind == "table"]
    named = {fold(t) for t in referenced_tables(sql)}
    for view in catalog:
        if view.kind == "view" and fold(view.name) in named:
            named |= view.refs  # a view stands for the tables it reads
    if text:
        words = _keys(text)
        for table in tables:
            keys = [_name_key(table.name)]
            keys += [_name_key(c) for c in table.columns]
            if any(len(k) >= _MIN_NAME and k in words for k in keys):
                named.add(fold(table.name))
    named &= {fold(t.name) for t in tables}
    if not named:
        return tuple(t.name for t in tables)
    if not neighbours:
        return tuple(t.name for t in tables if fold(t.name) in named)
    # One hop along foreign keys, both ways: tables this one points at, and those pointing at it.
    linked = set(named)
    for table in tables:
        me = fold(table.name)
        if me in named:
            linked |= table.refs
        elif table.refs & named:
            linked.add(me)
    return tuple(t.name for t in tables if fold(t.name) in linked)


def linked_tables(
    db_path: str | Path,
    *,
    sql: str | Iterable[str] = (),
    text: str = "",
    neighbours: bool = True,
) -> list[str]:
    """The tables of a database a task links to, in schema order.

    A table is named when ``sql`` (a statement or a list, e.g. a debugging task's issue SQL)
    references it (:func:`birdenv.sql.referenced_tables`; a view it references names the view's
    tables), or when a word or run of words of
    ``text`` (a question and its evidence) matches its name or one of its columns' names
    (case-insensitive, ``snake_case`` and ``camelCase`` split into words, plurals as singulars,
    names shorter than three letters never matched). The linked tables are the named ones plus
    (with ``neighbours``) their foreign-key neighbours, one hop in both directions. When nothing
    is named, every table is linked.
    """
    path, mtime_ns = _database(db_path)
    statements = (sql,) if isinstance(sql, str) else tuple(sql)
    return list(_linked(path, mtime_ns, statements, text, neighbours))


# -- a database on a PostgreSQL server, read through a session ----------------------------------
_PG_RELATIONS = (
    "SELECT c.oid::bigint, c.relname, CASE WHEN c.relkind = 'v' THEN 'view' ELSE 'table' END, "
    "pg_get_viewdef(c.oid, true) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v') "
    "ORDER BY c.relkind = 'v', c.oid"
)
_PG_COLUMNS = (
    "SELECT a.attrelid::bigint, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, "
    "pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated "
    "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND a.attnum > 0 "
    "AND NOT a.attisdropped ORDER BY a.attrelid, a.attnum"
)
_PG_CONSTRAINTS = (
    "SELECT k.conrelid::bigint, k.contype, pg_get_constraintdef(k.oid), "
    "coalesce(f.relname, '') FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid "
    "JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_class f ON f.oid = k.confrelid "
    "WHERE n.nspname = current_schema() AND k.contype IN ('p', 'u', 'c', 'f') "
    "ORDER BY k.conrelid, k.contype = 'f', k.contype <> 'p', k.conname"
)
_PG_NAME = re.compile(r"[a-z_][a-z0-9_$]*")


def _pg_ident(name: str) -> str:
    return name if _PG_NAME.fullmatch(name) else '"' + name.replace('"', '""') + '"'


@dataclasses.dataclass(frozen=True)
class ServerCatalog:
    """A PostgreSQL database as its prompt shows it, read once from a server
    (:func:`read_server_catalog`): its tables' and views' definitions, in creation order, and each
    table's first :data:`SAMPLE_ROWS` rows."""

    objects: tuple[_Object, ...]
    samples: Mapping[str, tuple[list[str], list[tuple[Any, ...]]]]


def _checked(result: Any, what: str) -> list[tuple[Any, ...]]:
    if not result.ok:
        raise SchemaError(f"cannot read the {what} of the PostgreSQL database: {result.error}")
    return list(result.rows)


def read_server_catalog(session: Any) -> ServerCatalog:
    """The :class:`ServerCatalog` of the database ``session`` is connected to (a
    :class:`birdenv.postgres.PgSession`, or anything whose ``execute(sql)`` gives a
    :class:`~birdenv.replicas.session.Result`): for tasks whose database is on the server only (the
    official PostgreSQL layout, no SQLite file). Tables are shown as ``CREATE TABLE`` with their
    columns, identity, defaults and keys, foreign keys as ``ALTER TABLE ... ADD``, views as
    ``CREATE VIEW``, all as PostgreSQL itself prints them (``format_type``,
    ``pg_get_constraintdef``, ``pg_get_viewdef``)."""
    relations = _checked(session.execute(_PG_RELATIONS), "tables")
    columns: dict[int, list[tuple[Any, ...]]] = {}
    for row in _checked(session.execute(_PG_COLUMNS), "columns"):
        columns.setdefault(row[0], []).append(row)
    constraints: dict[int, list[tuple[Any, ...]]] = {}
    for row in _checked(session.execute(_PG_CONSTRAINTS), "constraints"):
        constraints.setdefault(row[0], []).append(row)
    objects, samples = [], {}
    for oid, name, kind, viewdef in relations:
        if kind == "view":
            sql = f"CREATE VIEW {_pg_ident(name)} AS\n{viewdef.rstrip().rstrip(';')}"
            objects.append(_Object("view", name, sql, refs=_refs(sql)))
            continue
        lines = []
        for _, column, type_, notnull, default, identity, generated in columns.get(oid, []):
            line = f"{_pg_ident(column)} {type_}"
            if identity:
                line += f" GENERATED {'ALWAYS' if identity == 'a' else 'BY DEFAULT'} AS IDENTITY"
            if notnull:
                line += " NOT NULL"
            if default is not None:
                line += (
                    f" GENERATED ALWAYS AS ({default}) STORED"
                    if generated
                    else f" DEFAULT {default}"
                )
            lines.append(line)
        mine = constraints.get(oid, [])
        lines += [definition for _, kind_, definition, _ in mine if kind_ != "f"]
        body = ",\n    ".join(lines)
        statements = [f"CREATE TABLE {_pg_ident(name)} (\n    {body}\n)"]
        statements += [
            f"ALTER TABLE {_pg_ident(name)} ADD {definition}"
            for _, kind_, definition, _ in mine
            if kind_ == "f"
        ]
        refs = frozenset(fold(target) for _, kind_, _, target in mine if kind_ == "f")
        names = tuple(c[1] for c in columns.get(oid, []))
        objects.append(_Object("table", name, ";\n".join(statements), names, refs))
        first = session.execute(f"SELECT * FROM {_pg_ident(name)} LIMIT {SAMPLE_ROWS}")
        samples[name] = (list(first.columns), _checked(first, f"first rows of {name}"))
    return ServerCatalog(tuple(objects), samples)


def _refs(sql: str) -> frozenset[str]:
    try:
        return frozenset(fold(t) for t in referenced_tables(sql))
    except Exception:  # a definition sqlglot cannot read links to nothing
        return frozenset()


def task_schema(
    task: BaseTask, options: PromptOptions | None = None, *, catalog: ServerCatalog | None = None
) -> str:
    """The schema part of ``task``'s prompt under ``options`` (default: full, with sample rows).

    The linked and named modes keep the tables the task mentions (:meth:`BaseTask.mentions`: a
    debugging task's issue SQL, a BIRD question's words and evidence). ``catalog``: the task's
    database as read from a PostgreSQL server (:func:`read_server_catalog`), for a task without a
    database file; ``BirdCritic-PostgreSQL-v0`` reads it for such tasks.
    """
    if not isinstance(task, BaseTask):
        raise TypeError(f"not a task: {type(task).__name__} (expected a birdenv.tasks.BaseTask)")
    options = options or PromptOptions()
    rows = SAMPLE_ROWS if options.sample_rows else 0
    dialect = task.dialect
    if catalog is not None:
        keep = None
        if options.schema != "full":
            mentions = task.mentions()
            keep = frozenset(
                fold(t)
                for t in _linked_in(
                    catalog.objects,
                    tuple(mentions.sql),
                    mentions.text,
                    options.schema == "linked",
                )
            )
        return _render_objects(catalog.objects, rows, keep, catalog.samples.__getitem__)
    if task.db_dir is None and not dialect_of(dialect).files:
        raise DatabaseNotFoundError(
            f"task {task.instance_id!r} has no database file (the official PostgreSQL layout): "
            "its schema is on the server, which BirdCritic-PostgreSQL-v0 reads it from; a prompt "
            "made without that environment needs the task's SQLite file (load it with db_dir=)"
        )
    if options.schema == "full":
        return render_schema(task.db_path, rows=rows, dialect=dialect)
    mentions = task.mentions()
    tables = linked_tables(
        task.db_path,
        sql=mentions.sql,
        text=mentions.text,
        neighbours=options.schema == "linked",
    )
    return render_schema(task.db_path, rows=rows, tables=tables, dialect=dialect)
