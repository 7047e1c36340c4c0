"""Reading rows out of task and prediction files, with errors that name the file, line and field.

A file is JSONL (one JSON value a line, blank lines skipped) or one JSON array (as BIRD's
``dev.json`` is), UTF-8 encoded. Both kinds of task and every prediction form are read here, so a
bad byte, a broken line or a missing field reads the same whichever file it is in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from birdenv.errors import InputFormatError, TaskFormatError

__all__ = ["open_row", "plain_db_id", "read_rows", "read_text"]


def read_text(path: Path, *, error: type[InputFormatError] = TaskFormatError) -> str:
    """The file's text; ``error`` naming the file and the line of the first byte that is not UTF-8.

    A UTF-8 byte-order mark is dropped (editors on Windows write one).

    >>> import tempfile
    >>> bad = Path(tempfile.mkdtemp()) / "rows.jsonl"
    >>> _ = bad.write_bytes(b'{"a": 1}\\n{"b": "caf\\xe9"}\\n')
    >>> read_text(bad)
    Traceback (most recent call last):
    ...
    birdenv.errors.TaskFormatError: .../rows.jsonl:2: not UTF-8 text (byte 0xe9 at column 11): save the file as UTF-8
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}): "
            "save the file as UTF-8",
            line=line,
        ) from None


def read_rows(
    path: Path, *, error: type[InputFormatError] = TaskFormatError
) -> Iterator[tuple[int, Any] | InputFormatError]:
    """``(line, row)`` of each line of a JSONL file, or ``(item, row)`` of a JSON array file.

    A line that is not valid JSON comes as the ``error`` naming it, so a caller can use the good
    rows and report the rest; a file that is not UTF-8 raises ``error`` (:func:`read_text`).
    """
    text = read_text(path, error=error)
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            yield error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})", line=exc.lineno)
            return
        yield from enumerate(items, start=1)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            yield error(f"{path}:{lineno}: not valid JSON ({exc.msg})", line=lineno)


def open_row(
    row: Any, *, source: str, line: int, error: type[InputFormatError] = TaskFormatError
) -> tuple[dict[str, Any], Callable[[str, str], InputFormatError]]:
    """A row's fields as a new dict, and the maker of errors naming ``source:line`` and a field.

    Raises ``error`` when the row is not a JSON object.
    """
    where = f"{source}:{line}" if line else source

    def fail(field: str, why: str) -> InputFormatError:
        return error(f"{where}: field {field!r}: {why}")

    if not isinstance(row, dict):
        raise error(f"{where}: expected a JSON object, got {type(row).__name__}")
    return dict(row), fail


def plain_db_id(value: Any, fail: Callable[[str, str], InputFormatError]) -> str:
    """``value`` as a database name that stays inside its folder, or the error ``fail`` makes."""
    if not isinstance(value, str) or not value:
        raise fail("db_id", "missing or not a non-empty string")
    if "/" in value or "\\" in value or value in (".", ".."):
        raise fail("db_id", f"not a plain database name: {value!r}")
    return value
