"""The schema prompt of a database, rendered the way BIRD-CRITIC renders it.

For every table: its ``CREATE`` statement, then ``First 3 rows:`` and a right-aligned text table of
its first rows (the benchmark's prompts print a pandas frame without index; this is the same layout
without pandas). Views and triggers follow as their ``CREATE`` statements.
"""

from __future__ import annotations

import functools
import sqlite3
from pathlib import Path
from typing import Any

__all__ = ["render_schema", "text_table"]


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


@functools.lru_cache(maxsize=64)
def _render(path: str, mtime_ns: int, rows: int) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        objects = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' AND type IN ('table', 'view', 'trigger') "
            "ORDER BY CASE type WHEN 'table' THEN 0 WHEN 'view' THEN 1 ELSE 2 END, rowid"
        ).fetchall()
        parts = []
        for kind, name, sql in objects:
            if kind != "table":
                parts.append(f"{sql};")
                continue
            cursor = conn.execute(f"SELECT * FROM {_quote(name)} LIMIT {rows}")
            columns = [d[0] for d in cursor.description]
            sample = cursor.fetchall()
            parts.append(f"{sql};\n\nFirst {rows} rows:\n{text_table(columns, sample)}\n")
        return "\n\n".join(parts)
    finally:
        conn.close()


def render_schema(db_path: str | Path, *, rows: int = 3) -> str:
    """The schema text of a database: CREATE statements plus the first ``rows`` rows of each table."""
    path = Path(db_path)
    return _render(str(path.resolve()), path.stat().st_mtime_ns, rows)
