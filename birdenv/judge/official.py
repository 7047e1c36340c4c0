"""The official evaluator's helpers and constants, written from their documented behaviour.

Test code runs with these in scope, so they behave exactly as the official ones, quirks included:
the text transforms (``remove_comments``, ``remove_distinct``, ``remove_round``), the result
normaliser (``preprocess_results``), ``check_sql_function_usage``, the default test and the
per-instance limit.
"""

from __future__ import annotations

import datetime
import json
import re
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

__all__ = [
    "DEFAULT_TEST",
    "INSTANCE_TIMEOUT",
    "TEST_CALL",
    "TEST_PRELUDE",
    "check_sql_function_usage",
    "preprocess_results",
    "remove_comments",
    "remove_distinct",
    "remove_round",
]

INSTANCE_TIMEOUT = 180.0
#: The test used when a task has none, as the official evaluator defines it.
DEFAULT_TEST = """
def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):
    pred_sqls = remove_comments(pred_sqls)
    sol_sqls = remove_comments(sol_sqls)
    pred_sqls = remove_distinct(pred_sqls)
    pred_sqls = remove_round(pred_sqls)
    sol_sqls = remove_distinct(sol_sqls)
    sol_sqls = remove_round(sol_sqls)
    result = ex_base(pred_sqls, sol_sqls, db_path, conn, conditions)
    assert result == 1, f"ex_base returned {result} but expected 1."
    return result
"""
#: What the official evaluator prepends to every test's source.
TEST_PRELUDE = "import datetime\nfrom datetime import date\n"
#: How the official evaluator calls a test, after its source.
TEST_CALL = "\n__test_case_result__ = test_case(pred_sqls, sol_sqls, db_path, conn, **kwargs)"


def remove_comments(sql_list: list[str]) -> list[str]:
    """Drop ``/* */`` comments and ``--`` comments that end with a newline; squeeze blank lines.

    A ``--`` comment on the last line (no newline after it) stays, as in the official helper.

    >>> remove_comments(["SELECT 1 -- one\\nFROM t /* x */"])
    ['SELECT 1 \\nFROM t']
    """
    cleaned = []
    for sql in sql_list:
        sql = re.sub(r"/\*.*?\*/", "", sql, flags=re.DOTALL)
        sql = re.sub(r"--.*?(\r\n|\r|\n)", r"\1", sql)
        sql = re.sub(r"\n\s*\n+", "\n", sql)
        cleaned.append(sql.strip())
    return cleaned


def remove_distinct(sql_list: list[str]) -> list[str]:
    """Drop every space-separated token that is the word DISTINCT, in any case.

    >>> remove_distinct(["SELECT DISTINCT a FROM t", "SELECT COUNT(DISTINCT a) FROM t"])
    ['SELECT a FROM t', 'SELECT COUNT(DISTINCT a) FROM t']
    """
    return [" ".join(t for t in sql.split(" ") if t.lower() != "distinct") for sql in sql_list]


_ROUND = re.compile(r"ROUND\s*\(", re.IGNORECASE)


def _matching_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _first_argument_end(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        char = text[i]
        if char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                return i
            depth -= 1
        elif char == "," and depth == 0:
            return i
    return len(text)


def remove_round(sql_list: list[str]) -> list[str]:
    """Replace every ``ROUND(x, n)`` (nested too, any case) by its first argument ``x``.

    Matching is textual, like the official helper: no word boundary, parentheses in strings count.

    >>> remove_round(["SELECT ROUND(ROUND(price, 2), 1) FROM t"])
    ['SELECT price FROM t']
    """
    cleaned = []
    for sql in sql_list:
        while match := _ROUND.search(sql):
            open_at = match.end() - 1
            close_at = _matching_paren(sql, open_at)
            if close_at == -1:
                break
            argument = sql[open_at + 1 : _first_argument_end(sql, open_at + 1)].strip()
            sql = sql[: match.start()] + argument + sql[close_at + 1 :]
        cleaned.append(sql)
    return cleaned


def _round_value(item: Any, places: int) -> Any:
    if isinstance(item, Decimal):
        return item.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    if isinstance(item, float):
        return round(item, places)
    if isinstance(item, (list, tuple)):
        return type(item)(_round_value(x, places) for x in item)
    if isinstance(item, dict):
        return {k: _round_value(v, places) for k, v in item.items()}
    return item


# Values the official normalisation returns as they are: what SQLite gives, but for floats.
_UNCHANGED = frozenset({int, str, bytes, bool, type(None)})


def _normalise(item: Any, places: int) -> Any:
    if isinstance(item, (datetime.date, datetime.datetime)):
        return item.strftime("%Y-%m-%d")
    item = _round_value(item, places)
    return json.dumps(item, sort_keys=True) if isinstance(item, (dict, list)) else item


def preprocess_results(results: Any, decimal_places: int = 2) -> list[tuple[Any, ...]]:
    """Normalise result rows for comparison: dates as ``YYYY-MM-DD``, floats rounded, JSON for
    dicts and lists.

    >>> preprocess_results([(1.005, "a"), (2.0, None)])
    [(1.0, 'a'), (2.0, None)]
    """
    processed = []
    for row in results:
        items = []
        for item in row:
            # SQLite's own types by their exact type first: most cells of most results.
            cls = type(item)
            if cls in _UNCHANGED:
                items.append(item)
            elif cls is float:
                items.append(round(item, decimal_places))
            else:
                items.append(_normalise(item, decimal_places))
        processed.append(tuple(items))
    return processed


def check_sql_function_usage(sqls: list[str], required_keywords: list[str]) -> int:
    """1 if every keyword occurs (case-insensitively) somewhere in the SQL, else 0.

    >>> check_sql_function_usage(["SELECT strftime('%Y', d) FROM t"], ["STRFTIME"])
    1
    """
    if not sqls:
        return 0
    combined = " ".join(sql.lower() for sql in sqls)
    return int(all(kw.lower() in combined for kw in required_keywords))
