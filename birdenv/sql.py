"""Statement splitting and classification, the way SQLite itself reads SQL.

Two questions every layer asks about a piece of SQL: *how many statements is it* (the official
evaluator fails a string holding two) and *what kind is each* (a read, a write, DDL, transaction
control, a pragma, something else). Both are answered by SQLite's own grammar rather than by a
general-purpose parser:

- :func:`split_statements` cuts only at a ``;`` after which :func:`sqlite3.complete_statement`
  (SQLite's own tokenizer) says the text so far is complete, so semicolons inside strings, quoted
  identifiers, comments and ``CREATE TRIGGER ... BEGIN ...; END`` bodies never split a statement.
- :func:`classify` reads the leading keyword, skipping comments, exactly as SQLite's parser
  dispatches on it; for ``WITH`` it skips the common table expressions (string-, comment- and
  parenthesis-aware) to the statement they prefix, since SQLite allows ``WITH ... INSERT``,
  ``UPDATE`` and ``DELETE`` too.

sqlglot is used only where it is right and useful, to list the tables a read or write names
(:func:`tables`); it is not trusted to classify. sqlglot 30.30 parses ``SAVEPOINT a`` and
``RELEASE a`` as a column with an alias:

>>> import sqlglot
>>> type(sqlglot.parse_one("SAVEPOINT a", read="sqlite")).__name__
'Alias'
>>> classify("SAVEPOINT a"), classify("RELEASE a")
('transaction', 'transaction')

Nothing here raises on odd input (NUL bytes, lone surrogates, megabytes of text): these functions
sit in front of an RL policy's output.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Final

__all__ = [
    "DDL",
    "EMPTY",
    "KINDS",
    "OTHER",
    "PRAGMA",
    "READ",
    "TRANSACTION",
    "WRITE",
    "classify",
    "is_single_statement",
    "leading_keyword",
    "split_statements",
    "tables",
]

READ: Final = "read"
WRITE: Final = "write"
DDL: Final = "ddl"
TRANSACTION: Final = "transaction"
PRAGMA: Final = "pragma"
OTHER: Final = "other"
EMPTY: Final = "empty"
#: Every kind :func:`classify` returns.
KINDS: Final = (READ, WRITE, DDL, TRANSACTION, PRAGMA, OTHER, EMPTY)

_BY_KEYWORD: Final = {
    "select": READ,
    "values": READ,
    # EXPLAIN [QUERY PLAN] never runs the statement it describes.
    "explain": READ,
    "insert": WRITE,
    "replace": WRITE,
    "update": WRITE,
    "delete": WRITE,
    "create": DDL,
    "drop": DDL,
    "alter": DDL,
    "begin": TRANSACTION,
    "commit": TRANSACTION,
    "end": TRANSACTION,
    "rollback": TRANSACTION,
    "savepoint": TRANSACTION,
    "release": TRANSACTION,
    "pragma": PRAGMA,
    # attach, detach, vacuum, analyze, reindex and anything unknown are OTHER.
}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _words(sql: str, start: int = 0, *, depth_zero: bool = True):
    """Yield ``(word_lower, index)`` of the bare words of ``sql``, at parenthesis depth 0 only."""
    depth = 0
    i = _skip_space_and_comments(sql, start)
    while i < len(sql):
        c = sql[i]
        end = _skip_token(sql, i)
        if c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif (depth == 0 or not depth_zero) and (c.isalpha() or c == "_"):
            yield sql[i:end].lower(), i
        i = _skip_space_and_comments(sql, end)


def leading_keyword(sql: str) -> str:
    """The first word of a statement in lower case, after comments; ``""`` when there is none.

    >>> leading_keyword("  -- note\\n/* x */ Select 1")
    'select'
    >>> leading_keyword("-- only a comment")
    ''
    """
    i = _skip_space_and_comments(sql, 0)
    m = _WORD.match(sql, i)
    return m.group(0).lower() if m else ""


def _with_target(sql: str) -> str:
    """The keyword of the statement a ``WITH`` clause prefixes (``""`` when it cannot be found)."""
    for word, _ in _words(sql):
        if word in ("select", "values", "insert", "replace", "update", "delete"):
            return word
    return ""


def classify(sql: str) -> str:
    """The kind of one statement: one of :data:`KINDS`.

    >>> [classify(s) for s in ("select 1", "WITH t AS (SELECT 1) DELETE FROM x", "PRAGMA foreign_keys")]
    ['read', 'write', 'pragma']
    >>> [classify(s) for s in ("create temp table t(x)", "END", "VACUUM", "  ;", "-- hi")]
    ['ddl', 'transaction', 'other', 'empty', 'empty']
    >>> classify("WITH x(a) AS (SELECT ';' AS \\"delete\\") SELECT * FROM x")
    'read'
    """
    text = sql.strip().strip(";") if sql else ""
    word = leading_keyword(text)
    if not word:
        return EMPTY if _skip_space_and_comments(text.replace(";", " "), 0) >= len(text) else OTHER
    if word == "with":
        target = _with_target(text)
        return _BY_KEYWORD.get(target, OTHER) if target else OTHER
    return _BY_KEYWORD.get(word, OTHER)


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
    return [p for p in pieces if classify(p) != EMPTY]


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


def is_single_statement(sql: str) -> bool:
    """True when ``sql`` holds exactly one statement (what one official ``execute`` accepts).

    >>> is_single_statement("SELECT 1; -- trailing comment")
    True
    >>> is_single_statement("SELECT 1; SELECT 2")
    False
    """
    return len(split_statements(sql)) == 1


def tables(sql: str) -> set[str]:
    """Lower-cased names of the tables a statement names, by sqlglot; empty when it cannot parse.

    >>> sorted(tables("SELECT * FROM a JOIN b ON a.id = b.id"))
    ['a', 'b']
    >>> tables("SAVEPOINT a")
    set()
    """
    if classify(sql) not in (READ, WRITE, DDL):
        return set()
    import sqlglot
    from sqlglot import exp

    try:
        tree = sqlglot.parse_one(sql, read="sqlite")
    except Exception:  # sqlglot raises several unrelated types on SQL it does not know
        return set()
    if tree is None:
        return set()
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    return {t.name.lower() for t in tree.find_all(exp.Table) if t.name} - ctes
