"""The tables a piece of SQL names, and cutting text into statements the way SQLite reads it.

:func:`referenced_tables` is what the linked schema prompt (:mod:`birdenv.schema`) asks of a
task's SQL: which tables does it read, write, create or point a foreign key at. sqlglot answers
for what it parses; what it cannot parse (``CREATE TRIGGER``, ``REPLACE INTO``, ``ALTER TABLE ...
ADD COLUMN``, broken SQL) falls back to a scan of the tokens after ``FROM``, ``JOIN``, ``INTO``,
``UPDATE``, ``TABLE``, ``ON`` and ``REFERENCES``:

>>> referenced_tables("CREATE TRIGGER tr AFTER INSERT ON u BEGIN DELETE FROM t; END")
['u', 't']

:func:`split_statements` cuts only where SQLite would, so that one statement sqlglot cannot parse
does not hide the tables of its neighbours: semicolons inside strings, quoted identifiers,
comments and ``CREATE TRIGGER ... BEGIN ...; END`` bodies never split a statement.

Nothing here raises on odd input (NUL bytes, lone surrogates, megabytes of text): these functions
read model output as well as task files.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from typing import Final

__all__ = ["fold", "quiet_sqlglot", "referenced_tables", "split_statements"]

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
# A statement longer than this is scanned, not parsed: sqlglot's parse time grows with the text,
# and a prompt never needs more than the names.
_PARSE_LIMIT: Final = 100_000
# Keywords after which a table name follows (ON: of an index or a trigger; a join's ON is
# followed by a condition, told apart by the '.' of a qualified column).
_NAME_AFTER: Final = frozenset({"from", "join", "into", "update", "table", "on", "references"})
# Words that may sit between such a keyword and the name.
_SKIP_BEFORE_NAME: Final = frozenset(
    {"if", "not", "exists", "or", "rollback", "abort", "replace", "fail", "ignore", "only"}
)
# Words that end a FROM item instead of aliasing it.
_NOT_ALIAS: Final = frozenset(
    {
        "where", "join", "left", "right", "full", "inner", "outer", "cross", "natural", "on",
        "using", "group", "order", "limit", "having", "union", "except", "intersect", "window",
        "set", "values", "select", "default", "returning", "indexed", "not", "as", "begin",
        "for", "when", "after", "before", "instead", "do", "of",
    }
)  # fmt: skip


def fold(name: str) -> str:
    """An identifier as SQLite compares it: ASCII letters lower-cased, everything else kept.

    >>> fold("Ward Transfers"), fold("ÄB")
    ('ward transfers', 'Äb')
    """
    return name.translate(_ASCII_LOWER)


def _skip_space_and_comments(sql: str, i: int) -> int:
    """Index of the first character at or after ``i`` that is not whitespace or a comment."""
    n = len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            return i
    return n


def _skip_token(sql: str, i: int) -> int:
    """Index just past the token at ``i``: a quoted string/identifier, a word, or one character."""
    c = sql[i]
    if c in "'\"`":
        # A doubled quote is an escaped quote; an unterminated one runs to the end.
        j = i + 1
        while True:
            j = sql.find(c, j)
            if j < 0:
                return len(sql)
            if j + 1 < len(sql) and sql[j + 1] == c:
                j += 2
                continue
            return j + 1
    if c == "[":
        j = sql.find("]", i + 1)
        return len(sql) if j < 0 else j + 1
    m = _WORD.match(sql, i)
    return m.end() if m else i + 1


def _tokens(sql: str) -> Iterator[str]:
    """The tokens of ``sql``, comments and whitespace left out."""
    i = _skip_space_and_comments(sql, 0)
    while i < len(sql):
        end = _skip_token(sql, i)
        yield sql[i:end]
        i = _skip_space_and_comments(sql, end)


def split_statements(text: str) -> list[str]:
    """Cut ``text`` into statements where SQLite would; each keeps its own ``;``.

    Pieces holding nothing but whitespace, comments or ``;`` are dropped; an unterminated last
    statement is kept as it is.

    >>> split_statements("SELECT 'a;b'; -- c;\\nSELECT 2;;")
    ["SELECT 'a;b';", '-- c;\\nSELECT 2;']
    >>> split_statements("CREATE TRIGGER t AFTER INSERT ON x BEGIN DELETE FROM y; END; SELECT 1")
    ['CREATE TRIGGER t AFTER INSERT ON x BEGIN DELETE FROM y; END;', 'SELECT 1']
    >>> split_statements("  ;; -- nothing")
    []
    """
    if not text:
        return []
    pieces: list[str] = []
    start = 0
    last_word = ""
    trigger: bool | None = None  # whether the statement from `start` is a CREATE TRIGGER
    i = _skip_space_and_comments(text, 0)
    # One pass over the tokens (strings, quoted names and comments are single tokens, so their
    # ';' never count). A ';' ends the statement unless SQLite says otherwise, which it only does
    # inside a CREATE TRIGGER body; there the end is a ';' after END, confirmed by SQLite itself.
    # Asking complete_statement at every ';' instead would be quadratic on hostile input.
    while i < len(text):
        end = _skip_token(text, i)
        if text[i] == ";":
            if i == start or text[start:i].isspace():  # an empty statement: just skip it
                start, trigger = end, None
                i = _skip_space_and_comments(text, end)
                continue
            if trigger is None:
                trigger = _is_trigger(text, start)
            if not trigger or (last_word == "end" and _complete(text[start:end])):
                pieces.append(text[start:end].strip())
                start, trigger = end, None
        elif text[i].isalpha() or text[i] == "_":
            last_word = text[i:end].lower()
        else:
            last_word = ""
        i = _skip_space_and_comments(text, end)
    pieces.append(text[start:].strip())
    return [p for p in pieces if _skip_space_and_comments(p.replace(";", " "), 0) < len(p)]


def _is_trigger(text: str, start: int) -> bool:
    """Whether the statement starting at ``start`` is ``CREATE [TEMP|TEMPORARY] TRIGGER``.

    Looks at three tokens at most, so a run of empty statements stays linear.
    """
    words = []
    i = _skip_space_and_comments(text, start)
    while i < len(text) and len(words) < 3:
        end = _skip_token(text, i)
        words.append(text[i:end].lower())
        i = _skip_space_and_comments(text, end)
    if not words or words[0] != "create":
        return False
    return words[1:2] == ["trigger"] or (
        words[1:2] in (["temp"], ["temporary"]) and words[2:3] == ["trigger"]
    )


def _complete(piece: str) -> bool:
    """SQLite's own verdict that ``piece`` ends a statement (``CREATE TRIGGER`` bodies included).

    ``complete_statement`` rejects NUL (ValueError) and lone surrogates (UnicodeEncodeError);
    neither is ever a ';' or part of a keyword, so a same-length stand-in gives the same answer.
    """
    return sqlite3.complete_statement(_SURROGATE.sub("x", piece.replace("\x00", " ")))


class _QuietFilter(logging.Filter):
    """Drops sqlglot's records logged by a thread while it is inside :func:`quiet_sqlglot`."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.inside, "depth", 0)


_QUIET = _QuietFilter()


@contextlib.contextmanager
def quiet_sqlglot() -> Iterator[None]:
    """Silence sqlglot's warning for each statement it falls back to parsing as a ``Command``
    (triggers, ``REPLACE INTO``, some ``ALTER TABLE``) in this thread: callers detect that case
    themselves. Other threads' sqlglot logging is untouched."""
    logger = logging.getLogger("sqlglot")
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)
    _QUIET.inside.depth = getattr(_QUIET.inside, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.inside.depth -= 1


def _unquote(token: str) -> str | None:
    """The identifier a token spells, or None when it is no identifier (a string, a symbol)."""
    if len(token) >= 2 and token[0] == token[-1] and token[0] in '"`':
        return token[1:-1].replace(token[0] * 2, token[0])
    if len(token) >= 2 and token[0] == "[" and token[-1] == "]":
        return token[1:-1]
    if _WORD.fullmatch(token):
        return token
    return None


def _scan_tables(sql: str) -> list[str]:
    """Table names found by keywords alone: the fallback for SQL sqlglot cannot parse."""
    toks = list(_tokens(sql))
    lower = [t.lower() for t in toks]
    ctes = set()
    for k in range(2, len(toks)):
        # `name AS (`, `name(cols) AS (`, `name AS [NOT] MATERIALIZED (`: a common table expression.
        if toks[k] != "(" or lower[k - 1] not in ("as", "materialized"):
            continue
        j = k - 1
        while j > 0 and lower[j] in ("as", "materialized", "not"):
            j -= 1
        if toks[j] == ")":
            while j > 0 and toks[j] != "(":
                j -= 1
            j -= 1
        name = _unquote(toks[j]) if j >= 0 else None
        if name:
            ctes.add(fold(name))
    found: list[str] = []

    def name_at(j: int) -> tuple[str | None, int]:
        """The (schema-qualified) name starting at token ``j``, and the index after it."""
        name = _unquote(toks[j]) if j < len(toks) else None
        if name is None or lower[j] in _NOT_ALIAS:
            return None, j
        if j + 2 < len(toks) and toks[j + 1] == "." and _unquote(toks[j + 2]):
            return _unquote(toks[j + 2]), j + 3
        return name, j + 1

    for i, word in enumerate(lower):
        if word not in _NAME_AFTER:
            continue
        j = i + 1
        while j < len(toks) and lower[j] in _SKIP_BEFORE_NAME:
            j += 1
        while True:
            start = j
            name, j = name_at(j)
            if name is None or (word == "on" and j - start > 1):  # ON a.b: a join condition
                break
            found.append(name)
            if word != "from":
                break
            # FROM a [AS] x, b y: the comma-separated items of one FROM list.
            if j < len(toks) and lower[j] == "as":
                j += 2
            elif j < len(toks) and _unquote(toks[j]) and lower[j] not in _NOT_ALIAS:
                j += 1
            if j >= len(toks) or toks[j] != ",":
                break
            j += 1
    return [n for n in found if fold(n) not in ctes]


def _parse_tables(sql: str) -> list[str] | None:
    """The tables of a statement by sqlglot, or None when sqlglot cannot really parse it."""
    # sqlglot takes ~0.8 s of CPU to import: imported only where used
    import sqlglot
    from sqlglot import exp

    if len(sql) > _PARSE_LIMIT:
        return None
    with quiet_sqlglot():
        try:
            trees = sqlglot.parse(sql, read="sqlite")
        except Exception:  # sqlglot raises several unrelated types on SQL it does not know
            return None
    found: list[tuple[int, str]] = []
    for tree in trees:
        if tree is None:
            continue
        if isinstance(tree, exp.Command) or tree.find(exp.Command) is not None:
            return None
        ctes = {fold(cte.alias_or_name) for cte in tree.find_all(exp.CTE)}
        for table in tree.find_all(exp.Table):
            if table.name and fold(table.name) not in ctes:
                found.append((table.this.meta.get("start", len(sql)), table.name))
    # find_all walks breadth first; order by position in the text, as a reader would.
    return [name for _, name in sorted(found, key=lambda f: f[0])]


def referenced_tables(sql: str | Iterable[str]) -> list[str]:
    """The tables that a statement, or a list of statements, names: read, written, created,
    altered or referenced by a foreign key. Common table expressions are not tables; a
    schema-qualified name (``main.t``) gives ``t``.

    Names come as written, each once (compared as SQLite does, ASCII case-insensitively), in
    order of first mention. Text that holds several statements is split first, so a statement
    sqlglot cannot parse is scanned for names by itself (see the module doc) without spoiling the
    others. Never raises on text; the result may name tables a database does not have.

    >>> referenced_tables("WITH x AS (SELECT * FROM orders) SELECT * FROM x JOIN Customers c ON 1")
    ['orders', 'Customers']
    >>> referenced_tables(['SELECT * FROM "Ward Transfers" w, main.t', "UPDATE t SET a = 1"])
    ['Ward Transfers', 't']
    >>> referenced_tables("REPLACE INTO stock VALUES (1); DELETE FROM [order items]")
    ['stock', 'order items']
    >>> referenced_tables("SAVEPOINT a; this is not SQL")
    []
    """
    statements = [sql] if isinstance(sql, str) else list(sql)
    seen: dict[str, str] = {}
    for text in statements:
        for statement in split_statements(text):
            names = _parse_tables(statement)
            for name in _scan_tables(statement) if names is None else names:
                seen.setdefault(fold(name), name)
    return list(seen.values())
