"""Evidence about a task, gathered for real: what its SQL does on a live session, and what a fix changes.

Both data builders explain a diagnosis from facts, never from templates about the answer:

- :func:`run_statements` runs statements on a fresh session of the task's database (its
  ``preprocess_sql`` applied, the pool the environment uses) and records each one's error, rows or
  number of changed rows;
- :func:`describe_changes` compares the syntax trees (sqlglot) of the problematic statements and
  the fixed ones and names the smallest differing parts, with the clause each one sits in;
- :func:`tables_touched` lists the real tables a statement reads or writes.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

import sqlglot
from sqlglot import exp

from birdenv.agents import SCHEMA_QUERY
from birdenv.dialects import SQLITE
from birdenv.replicas.pool import ReplicaPool
from birdenv.replicas.session import Session
from birdenv.sql import quiet_sqlglot, referenced_tables
from birdenv.tasks import Task

__all__ = [
    "SCHEMA_QUERIES",
    "Evidence",
    "StatementRun",
    "describe_changes",
    "gather_evidence",
    "run_statements",
    "summarize_run",
    "tables_touched",
]

#: What lists a database's tables and views, ``| type | name |``, in each dialect.
SCHEMA_QUERIES = {
    "sqlite": SCHEMA_QUERY,
    "postgresql": "SELECT CASE table_type WHEN 'VIEW' THEN 'view' ELSE 'table' END AS type, "
    "table_name AS name FROM information_schema.tables WHERE table_schema = current_schema() "
    "ORDER BY name",
}

_DML = re.compile(r"^\s*(insert|update|delete|replace)\b", re.IGNORECASE)
_READ = re.compile(r"^\s*(select|with)\b", re.IGNORECASE)
# The clause a differing part sits in, from the argument of its parent that holds it.
_CLAUSES = {
    "where": "WHERE clause",
    "group": "GROUP BY clause",
    "having": "HAVING clause",
    "order": "ORDER BY clause",
    "limit": "LIMIT",
    "joins": "join",
    "from_": "FROM clause",
    "from": "FROM clause",
    "with_": "WITH clause",
    "with": "WITH clause",
}


@dataclasses.dataclass
class StatementRun:
    """One statement run on a session: its error, or its columns, first rows and counts."""

    sql: str
    error: str | None = None
    columns: list[str] = dataclasses.field(default_factory=list)
    rows: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    row_count: int = 0
    truncated: bool = False
    changed: int | None = None  # rows changed by INSERT/UPDATE/DELETE (SQLite's changes())


@dataclasses.dataclass
class Evidence:
    """What the problematic SQL and the fix do on fresh sessions, and how they differ."""

    issue_runs: list[StatementRun]
    fix_runs: list[StatementRun]
    changes: list[str]
    functions_added: list[str]
    functions_removed: list[str]
    tables: list[str]


def _parse(sql: str) -> exp.Expression | None:
    """The syntax tree of one statement, or None when sqlglot cannot really parse it."""
    with quiet_sqlglot():
        try:
            tree = sqlglot.parse_one(sql, read="sqlite")
        except sqlglot.errors.SqlglotError:
            return None
    if tree is None or isinstance(tree, (exp.Command, exp.Block)):
        return None
    return tree


def _sql(node: Any) -> str:
    if isinstance(node, list):
        return ", ".join(_sql(n) for n in node)
    if isinstance(node, exp.Expression):
        return node.sql(dialect="sqlite")
    return "" if node is None else str(node)


def _clause(parent: exp.Expression, key: str, current: str) -> str:
    if key in _CLAUSES:
        return _CLAUSES[key]
    if key == "expressions" and isinstance(parent, exp.Select):
        return "SELECT list"
    if key == "expressions" and isinstance(parent, exp.Update):
        return "SET list"
    return current


def _tree_changes(a: Any, b: Any, clause: str, out: list[tuple[str, str, str]]) -> None:
    """Append the smallest differing parts of ``a`` and ``b`` as (clause, before, after)."""
    if a == b:
        return
    if not (isinstance(a, exp.Expression) and isinstance(b, exp.Expression)) or type(a) is not type(
        b
    ):
        out.append((clause, _sql(a), _sql(b)))
        return
    keys = list(dict.fromkeys([*a.args, *b.args]))
    # A changed flag (DESC, LEFT, DISTINCT, NOT) is only readable as a change of the whole node.
    for key in keys:
        va, vb = a.args.get(key), b.args.get(key)
        if (
            va != vb
            and not isinstance(va, (exp.Expression, list))
            and not isinstance(vb, (exp.Expression, list))
        ):
            out.append((clause, _sql(a), _sql(b)))
            return
    found: list[tuple[str, str, str]] = []
    for key in keys:
        va, vb = a.args.get(key), b.args.get(key)
        if va == vb:
            continue
        where = _clause(a, key, clause)
        if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for x, y in zip(va, vb, strict=True):
                _tree_changes(x, y, where, found)
        elif isinstance(va, list) or isinstance(vb, list):
            found.append((where, _sql(va), _sql(vb)))
        else:
            _tree_changes(va, vb, where, found)
    # Many small edits inside one short expression read better as one rewrite of it.
    if len(found) > 2 and a.parent is not None and len(_sql(a)) <= 240:
        out.append((clause, _sql(a), _sql(b)))
    else:
        out.extend(found)


def _token_changes(a: str, b: str) -> list[tuple[str, str, str]]:
    """Differences by words, quoted from the original text, for statements sqlglot cannot parse
    (triggers, for instance)."""
    token = re.compile(r"'(?:[^']|'')*'|\"[^\"]*\"|\w+|[^\w\s]")
    ma, mb = list(token.finditer(a)), list(token.finditer(b))

    def span(text: str, matches: list[re.Match[str]], i: int, j: int) -> str:
        return text[matches[i].start() : matches[j - 1].end()] if j > i else ""

    out = []
    matcher = difflib.SequenceMatcher(
        a=[m.group() for m in ma], b=[m.group() for m in mb], autojunk=False
    )
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            out.append(("statement", span(a, ma, i1, i2), span(b, mb, j1, j2)))
    return out


def _functions(trees: list[exp.Expression | None]) -> set[str]:
    names = set()
    for tree in trees:
        if tree is None:
            continue
        for node in tree.find_all(exp.Func):
            # AND/OR, arithmetic, CASE and IF are operators to a reader, not functions.
            if isinstance(node, (exp.Connector, exp.Binary, exp.Case, exp.If)):
                continue
            name = node.name if isinstance(node, exp.Anonymous) else node.sql_name()
            if name:
                names.add(name.upper())
    return names


def _phrase(clause: str, before: str, after: str) -> str:
    where = f"in the {clause}" if clause != "statement" else "in the statement"
    if before and after:
        return f"{where}, `{before}` should be `{after}`"
    if after:
        return f"{where}, `{after}` is missing"
    return f"{where}, `{before}` should go"


def describe_changes(issue_sqls: list[str], fixed_sqls: list[str]) -> list[str]:
    """Sentences naming what differs between the problematic statements and the fixed ones.

    >>> describe_changes(["SELECT name FROM t WHERE city = NULL"], ["SELECT name FROM t WHERE city IS NULL"])
    ['in the WHERE clause, `city = NULL` should be `city IS NULL`']
    >>> describe_changes(["SELECT a FROM t ORDER BY a"], ["SELECT a FROM t ORDER BY a DESC"])
    ['in the ORDER BY clause, `a` should be `a DESC`']
    """
    sentences: list[str] = []
    for i in range(max(len(issue_sqls), len(fixed_sqls))):
        if i >= len(issue_sqls):
            sentences.append(f"another statement is needed: `{fixed_sqls[i].strip()}`")
            continue
        if i >= len(fixed_sqls):
            sentences.append(f"the statement `{issue_sqls[i].strip()}` is not needed")
            continue
        a, b = _parse(issue_sqls[i]), _parse(fixed_sqls[i])
        found: list[tuple[str, str, str]] = []
        if a is not None and b is not None:
            _tree_changes(a, b, "statement", found)
        elif issue_sqls[i].strip() != fixed_sqls[i].strip():
            found = _token_changes(issue_sqls[i], fixed_sqls[i])
        prefix = f"statement {i + 1}: " if max(len(issue_sqls), len(fixed_sqls)) > 1 else ""
        for change in dict.fromkeys(found):  # the same edit repeated (e.g. in four CASEs) once
            sentences.append(prefix + _phrase(*change))
    return sentences


def tables_touched(sqls: list[str], existing: set[str] | None = None) -> list[str]:
    """The tables the statements name, in order of appearance (CTE names excluded), by
    :func:`birdenv.sql.referenced_tables`.

    ``existing`` (lower-case names) keeps only tables the database really has.

    >>> tables_touched(["WITH x AS (SELECT * FROM orders) SELECT * FROM x JOIN customers c ON 1"])
    ['orders', 'customers']
    """
    return [n for n in referenced_tables(sqls) if existing is None or n.lower() in existing]


def run_statements(
    session: Session, sqls: list[str], dialect: str = "sqlite"
) -> list[StatementRun]:
    """Run ``sqls`` in order on ``session`` until the first error (as the evaluator does); the
    rows a write changed are counted on SQLite (``changes()``), left unknown elsewhere."""
    runs = []
    for sql in sqls:
        result = session.execute(sql)
        run = StatementRun(sql=sql, error=result.error)
        if result.ok:
            run.columns, run.rows = list(result.columns), list(result.rows)
            run.row_count, run.truncated = len(result.rows), result.truncated
            if _DML.match(sql) and dialect == "sqlite":
                changed = session.execute("SELECT changes()")
                run.changed = int(changed.rows[0][0]) if changed.ok else None
        runs.append(run)
        if result.error is not None:
            break
    return runs


def _value(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, bytes):
        return f"<blob {len(value)} bytes>"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    return repr(text if len(text) <= 40 else text[:37] + "...")


def summarize_run(run: StatementRun, *, rows: int = 3) -> str:
    """One sentence on what a statement did: its error, its rows or the rows it changed.

    ``rows``: how many of its result rows to quote (0: only their count and columns).

    >>> summarize_run(StatementRun("SELECT 1", columns=["a"], rows=[(1,), (2,)], row_count=2))
    'it returns 2 rows (columns a); namely: (1), (2)'
    >>> summarize_run(StatementRun("SELECT 1", columns=["a"], rows=[(1,), (2,)], row_count=2), rows=0)
    'it returns 2 rows (columns a)'
    >>> summarize_run(StatementRun("UPDATE t SET a = 1", changed=0))
    'it runs but changes 0 rows'
    """
    if run.error is not None:
        return f"it fails with the error `{run.error}`"
    if run.changed is not None:
        return f"it runs but changes {run.changed} row{'s' * (run.changed != 1)}"
    if not run.columns:
        return "it runs without error and returns nothing"
    if not run.rows:
        return f"it returns no rows at all (columns {', '.join(run.columns)})"
    count = f"{run.row_count}{'+' if run.truncated else ''}"
    plural = "s" if run.row_count != 1 else ""
    said = f"it returns {count} row{plural} (columns {', '.join(run.columns)})"
    if rows <= 0:
        return said
    shown = ", ".join("(" + ", ".join(_value(v) for v in row) + ")" for row in run.rows[:rows])
    which = "the first" if run.row_count > rows else "namely"
    return f"{said}; {which}: {shown}"


def gather_evidence(task: Task, pool: ReplicaPool) -> Evidence:
    """Run the issue SQL and the fix on two fresh sessions of ``task`` and compare them.

    ``pool`` leases SQLite sessions; a PostgreSQL task's sessions are clones on the process's
    PostgreSQL server (:func:`birdenv.judge.postgres.default_task_databases`), unless ``pool`` is
    a :class:`~birdenv.judge.postgres.TaskDatabases`. Raises
    :class:`birdenv.errors.PreprocessError` when the task's ``preprocess_sql`` fails.
    """
    dialect = task.dialect
    if dialect != SQLITE.name and isinstance(pool, ReplicaPool):
        from birdenv.judge.postgres import default_task_databases  # psycopg: PostgreSQL only

        pool = default_task_databases()
    with pool.session(task) as session:
        issue_runs = run_statements(session, list(task.issue_sql), dialect)
        existing = {row[1].lower() for row in session.execute(SCHEMA_QUERIES[dialect]).rows}
    with pool.session(task) as session:
        fix_runs = run_statements(session, list(task.sol_sql), dialect)
    issue_trees = [_parse(s) for s in task.issue_sql]
    fix_trees = [_parse(s) for s in task.sol_sql]
    before, after = _functions(issue_trees), _functions(fix_trees)
    return Evidence(
        issue_runs=issue_runs,
        fix_runs=fix_runs,
        changes=describe_changes(list(task.issue_sql), list(task.sol_sql)),
        functions_added=sorted(after - before),
        functions_removed=sorted(before - after),
        tables=tables_touched(list(task.issue_sql), existing),
    )
