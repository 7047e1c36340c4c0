"""Values read from PostgreSQL as the official evaluator's driver, psycopg2, reads them.

The official BIRD-CRITIC PostgreSQL evaluator compares what psycopg2 returns; this project talks
to the server through psycopg 3, whose readings differ where it matters for a verdict:

- dates and times: psycopg2 parses the text of the ISO ``DateStyle`` only (after ``SET datestyle
  'SQL, DMY'`` it cannot read a date, where psycopg 3 reads every style); ``'infinity'`` dates
  and timestamps are ``date.max``/``datetime.max`` (psycopg 3 raises); a ``timestamptz`` keeps
  the offset the server printed, as a fixed offset (psycopg 3 converts it to the session's time
  zone, and to UTC where Python does not know that zone, as after ``SET TIME ZONE INTERVAL
  '+09:00'``: the day can change); intervals are read in the ``postgres`` style alone, months as
  30 days and years as 365;
- ``uuid``, ``inet``, ``cidr`` and records are strings (psycopg 3 makes ``UUID``, ``ipaddress``
  objects and tuples, which then no longer equal the same value read as text).

:func:`psycopg2_values` is the adapters map with these loaders; every connection to a clone is
made with it (:meth:`birdenv.postgres.DatabasePool.connect`). A value psycopg2 cannot read is
not an error while the rows stream: it is read as :class:`Unreadable`, and
:func:`raise_unreadable` raises it once the statement is committed, as psycopg2 raises when
the rows are fetched after the official evaluator's ``commit``.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

from birdenv.postgres.server import psycopg

__all__ = ["Unreadable", "psycopg2_values", "raise_unreadable"]


class _Psycopg2Error(Exception):
    """An error psycopg2 raises by a name of its own (``DataError``, ``NotSupportedError``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class Unreadable:
    """A value psycopg2 fails to read: the name of the error it raises (``DataError``,
    ``ValueError``, ``OverflowError`` or ``NotSupportedError``) and its message."""

    __slots__ = ("error", "message")

    def __init__(self, error: str, message: str) -> None:
        self.error, self.message = error, message

    def __repr__(self) -> str:
        return f"<unreadable: {self.message}>"


def raise_unreadable(rows: list[tuple[Any, ...]] | None) -> None:
    """Raise, as a ``psycopg`` ``DataError`` naming psycopg2's error, the first value of
    ``rows`` that psycopg2 could not read (a ``psycopg`` error, so every caller that handles the
    server's errors handles it; psycopg2's own type is in the message)."""
    for row in rows or ():
        for value in row:
            if isinstance(value, Unreadable):
                raise psycopg().DataError(f"{value.error}: {value.message}")


def _text(data: Any) -> str:
    return bytes(data).decode("ascii", "replace")


def _digit(acc: int, char: str) -> int:
    # psycopg2 reads every character it does not expect as a digit: '/' or a letter give
    # nonsense numbers (and then an error), never a silent success on another style.
    return (0 if acc == -1 else acc * 10) + ord(char) - ord("0")


def _parse_date(text: str) -> tuple[int, list[int], str]:
    """psycopg2's date scan: fields split at ``-``, space or ``T``; (fields read, [y, m, d],
    the rest of the text). A trailing ``BC`` negates the year."""
    fields, acc, i = [0, 0, 0], -1, 0
    count = 0
    while count < 3 and i < len(text):
        char = text[i]
        if char in "- T":
            fields[count], acc, count = acc, -1, count + 1
        else:
            acc = _digit(acc, char)
        i += 1
    if acc != -1:
        fields[2], count = acc, count + 1
    rest = text[i:]
    if len(rest) >= 2 and rest.endswith("BC"):
        fields[0] = -fields[0]
    return count, fields, rest


def _parse_time(text: str) -> tuple[int, list[int], int]:
    """psycopg2's time scan: (fields read, [h, m, s, us], UTC offset in seconds), -1 fields
    read when a sign or a dot comes where it cannot."""
    parts, tz = [0, 0, 0, 0], [0, 0, 0]
    acc, count, sign, decimals = -1, 0, 1, 0

    def put(index: int, value: int) -> None:
        if index < 4:
            parts[index] = value
        elif index < 7:
            tz[index - 4] = value

    for char in text:
        if count >= 7:
            break
        if char == ":":
            if count < 6:
                put(count, acc)
            acc, count = -1, count + 1
        elif char == ".":
            if count != 2:
                return -1, parts, 0
            parts[2], acc, count = acc, -1, 3
        elif char in "+-":
            if count not in (2, 3):
                return -1, parts, 0
            sign = -1 if char == "-" else 1
            put(count, acc)
            acc, count = -1, 4
        elif char in " BC":
            continue
        else:
            acc = _digit(acc, char)
            decimals += count == 3
    if acc != -1:
        put(count, acc)
        count += count < 6
    if parts[3]:
        parts[3] *= 10 ** max(0, 6 - decimals)
    if parts[0] == 24:
        parts[0] = 0
    return count, parts, sign * (3600 * tz[0] + 60 * tz[1] + tz[2])


def _zone(count: int, offset: int) -> datetime.timezone | None:
    return datetime.timezone(datetime.timedelta(seconds=offset)) if count >= 5 else None


def _read(build: Any, data: Any) -> Any:
    """``build(text)``, or the :class:`Unreadable` psycopg2's error would be."""
    try:
        return build(_text(data))
    except _Psycopg2Error as exc:
        return Unreadable(exc.name, str(exc))
    except (ValueError, OverflowError) as exc:
        return Unreadable(type(exc).__name__, str(exc))


def _date(text: str) -> datetime.date:
    if text in ("infinity", "-infinity"):
        return datetime.date.min if text[0] == "-" else datetime.date.max
    count, (year, month, day), _ = _parse_date(text)
    if count != 3:
        raise _Psycopg2Error("DataError", "unable to parse date")
    return datetime.date(year, month, day)


def _timestamp(text: str, *, aware: bool) -> datetime.datetime:
    if text in ("infinity", "-infinity"):
        value = datetime.datetime.min if text[0] == "-" else datetime.datetime.max
        return value.replace(tzinfo=datetime.timezone.utc) if aware else value
    count, (year, month, day), rest = _parse_date(text)
    if count != 3:
        raise _Psycopg2Error("DataError", "unable to parse date")
    parts, offset, count = [0, 0, 0, 0], 0, 0
    if rest:
        count, parts, offset = _parse_time(rest)
        if not 3 <= count <= 6:
            raise _Psycopg2Error("DataError", "unable to parse time")
    hour, minute, second, micro = parts
    if second > 59:  # a leap second
        minute, second = minute + 1, second - 60
    return datetime.datetime(year, month, day, hour, minute, second, micro, _zone(count, offset))


def _time(text: str) -> datetime.time:
    count, (hour, minute, second, micro), offset = _parse_time(text)
    if not 3 <= count <= 6:
        raise _Psycopg2Error("DataError", "unable to parse time")
    if second > 59:
        minute, second = minute + 1, second - 60
    return datetime.time(hour, minute, second, micro, _zone(count, offset))


_INT_MAX = 2**31 - 1


def _micros(text: str) -> datetime.timedelta:
    """A bare integer read as microseconds (psycopg2's fallback)."""
    return datetime.timedelta(microseconds=int(text.strip(), 0))


def _interval(text: str) -> datetime.timedelta:
    """psycopg2's interval scan: the ``postgres`` IntervalStyle; months are 30 days, years 365."""
    value, sign, part, denom = 0, 1, 0, 1
    years = months = days = hours = minutes = seconds = micros = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "-":
            sign = -1
        elif char.isdigit() and char.isascii():
            value = value * 10 + int(char)
            if value > _INT_MAX:
                try:
                    return _micros(text)
                except ValueError:
                    raise OverflowError("interval component too big") from None
            if part == 6 and denom <= _INT_MAX // 10:
                denom *= 10
        elif char in "ymd" and part <= {"y": 0, "m": 1, "d": 2}[char]:
            if char == "y":
                years, part = value * sign, 1
            elif char == "m":
                months, part = value * sign, 2
            else:
                days, part = value * sign, 3
            value, sign = 0, 1
            while i < len(text) and text[i] != " ":  # the rest of the unit's word
                i += 1
            continue
        elif char == ":":
            if part <= 3:
                hours, value, part = value, 0, 4
            elif part == 4:
                minutes, value, part = value, 0, 5
        elif char == "." and part == 5:
            seconds, value, part = value, 0, 6
        elif char == "P":
            raise _Psycopg2Error(
                "NotSupportedError", "iso_8601 intervalstyle currently not supported"
            )
        i += 1
    if part == 4:
        minutes = value
    elif part == 5:
        seconds = value
    elif part == 6:
        micros = value
        if denom < 1_000_000:
            micros *= 1_000_000 // denom
        elif denom > 1_000_000:
            micros = round(micros / denom * 1_000_000)
    elif part == 0:
        return _micros(text)
    seconds += 60 * minutes + 3600 * hours
    if sign < 0:
        seconds, micros = -seconds, -micros
    return datetime.timedelta(days + 30 * months + 365 * years, seconds, micros)


_READERS: dict[str, Any] = {
    "date": _date,
    "timestamp": functools.partial(_timestamp, aware=False),
    "timestamptz": functools.partial(_timestamp, aware=True),
    "time": _time,
    "timetz": _time,
    "interval": _interval,
}
# Read as their text, as psycopg2 reads a type it has no reader for.
_AS_TEXT = ("uuid", "inet", "cidr", "record")


@functools.cache
def psycopg2_values() -> Any:
    """psycopg's adapters with psycopg2's readings of the values above (text format): pass it
    as ``context=`` to ``psycopg.connect``."""
    adapt = psycopg().adapt

    class Reader(adapt.Loader):
        read: Any = None

        def load(self, data: Any) -> Any:
            return _read(self.read, data)

    class Text(adapt.Loader):
        def load(self, data: Any) -> str:
            return bytes(data).decode()

    values = adapt.AdaptersMap(psycopg().adapters)
    for name, read in _READERS.items():
        values.register_loader(
            name, type(f"{name}_reader", (Reader,), {"read": staticmethod(read)})
        )
    for name in _AS_TEXT:
        values.register_loader(name, Text)
    return values
