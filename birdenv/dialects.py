"""The SQL dialects tasks are written in: one object each, and the one place a spelling is read.

A task row spells its dialect as it likes (BIRD-CRITIC's rows say ``"SQLite"`` and
``"PostgreSQL"``); a task holds the dialect's :attr:`Dialect.name` (``"sqlite"``,
``"postgresql"``), read once by :func:`dialect_name` when the task is made, so everything after
compares names. What else varies by dialect is registered under that name where it lives: its
judge (:func:`birdenv.judge.register_scorer`) and its environment (a
:class:`~birdenv.envs.ToolEnv` subclass naming its ``dialect``).

>>> dialect_name("SQLite"), dialect_of("PostgreSQL").title
('sqlite', 'PostgreSQL')
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "POSTGRESQL",
    "SQLITE",
    "Dialect",
    "dialect_name",
    "dialect_of",
    "dialects",
    "register_dialect",
]


@dataclasses.dataclass(frozen=True)
class Dialect:
    """One SQL dialect.

    ``name``: what tasks hold and registries are keyed by (lower case); ``title``: how official
    rows and prompts spell it; ``files``: its databases are files a task can name (SQLite), not
    databases on a server (PostgreSQL, whose tasks may come without a file).
    """

    name: str
    title: str
    files: bool


_DIALECTS: dict[str, Dialect] = {}


def register_dialect(dialect: Dialect) -> Dialect:
    """Make ``dialect`` known under its name (and any spelling of it); return it."""
    if dialect.name != dialect.name.casefold():
        raise ValueError(f"a dialect's name is lower case: {dialect.name!r}")
    _DIALECTS[dialect.name] = dialect
    return dialect


SQLITE = register_dialect(Dialect("sqlite", "SQLite", files=True))
POSTGRESQL = register_dialect(Dialect("postgresql", "PostgreSQL", files=False))


def dialect_name(spelling: str) -> str:
    """The name of the dialect ``spelling`` spells, whatever its case; a dialect nobody registered
    keeps its spelling, lower case, so its tasks load and a judge or environment can name it."""
    return str(spelling).casefold()


def dialect_of(spelling: str) -> Dialect:
    """The :class:`Dialect` ``spelling`` names; for one nobody registered, a dialect of files
    titled as spelled (its tasks load; no judge or environment plays them until registered)."""
    name = dialect_name(spelling)
    return _DIALECTS.get(name) or Dialect(name, str(spelling), files=True)


def dialects() -> tuple[Dialect, ...]:
    """Every registered dialect, in registration order."""
    return tuple(_DIALECTS.values())
