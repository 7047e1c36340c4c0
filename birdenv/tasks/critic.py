"""The debugging kind: a BIRD-CRITIC task (:class:`Task`), reading its rows, and its database.

A debugging task row (one JSON object per line) carries the official fields: ``instance_id``,
``db_id``, ``dialect``, ``category``, ``query``, ``issue_sql``, ``preprocess_sql``,
``clean_up_sql``, ``sol_sql``, ``test_cases``, ``conditions``, ``efficiency``. SQL list fields may
also be strings joined with the literal separator ``[split]``; the older names
``selected_database`` and ``error_sql`` are accepted for ``db_id`` and ``issue_sql``. Databases
follow the official layout ``{db_dir}/{db_id}/{db_id}_template.sqlite``, so the official
``bird-critic-1.0-sqlite`` and ``six-gym-sqlite`` data work unchanged.

A task is judged by the BIRD-CRITIC judge (:func:`birdenv.judge.score` picks it by kind and
dialect), a layer above this one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdenv.dialects import dialect_name, dialect_of
from birdenv.errors import DatabaseNotFoundError, TaskFormatError
from birdenv.rows import open_row, plain_db_id, read_rows
from birdenv.tasks.protocol import BaseTask, Mentions

__all__ = ["CATEGORIES", "Task", "database_path", "iter_tasks", "parse_task", "split_sql_field"]

#: The three categories of BIRD-CRITIC.
CATEGORIES = ("Query", "Management", "Personalization")

_SPLIT = re.compile(r"\[split\]\s*")
_ALIASES = {"selected_database": "db_id", "error_sql": "issue_sql"}
_SQL_LISTS = ("issue_sql", "preprocess_sql", "clean_up_sql", "sol_sql")


def database_path(db_dir: str | Path, db_id: str) -> Path:
    """The official location of a task database: ``{db_dir}/{db_id}/{db_id}_template.sqlite``."""
    return Path(db_dir) / db_id / f"{db_id}_template.sqlite"


@dataclasses.dataclass(frozen=True)
class Task(BaseTask):
    """One BIRD-CRITIC task: a database, a user's issue, their broken SQL, the fix and its tests.

    ``db_dir`` is not part of the official row: it says where the task's database lives and is set
    by :func:`birdenv.tasks.load_tasks` (bundled suites know theirs; for a JSONL file pass ``db_dir=``).

    >>> task = Task.load("critic-mini")[0]
    >>> task.kind, task.metric, task.category in task.categories, task.dialect
    ('critic', 'SR', True, 'sqlite')
    """

    kind = "critic"
    env_id = "BirdCritic-SQLite-v0"
    metric = "SR"
    metric_name = "success_rate"
    category_name = "category"
    categories = CATEGORIES
    skill = "debugging"
    goal = "understand the user's issue and fix their problematic SQL, given the database schema"
    submission_rule = ""
    suites = ("gym-mini", "critic-mini", "gym-mini-pg", "critic-mini-pg")
    eval_suite = "critic-mini"

    instance_id: str
    db_id: str
    query: str
    issue_sql: list[str]
    # Never in a repr: a repr can end up in a message an agent or a client sees.
    sol_sql: list[str] = dataclasses.field(default_factory=list, repr=False)
    preprocess_sql: list[str] = dataclasses.field(default_factory=list)
    clean_up_sql: list[str] = dataclasses.field(default_factory=list)
    test_cases: list[str] = dataclasses.field(default_factory=list, repr=False)
    conditions: dict[str, Any] = dataclasses.field(default_factory=dict)
    category: str = "Query"
    #: The dialect's name (:func:`birdenv.dialects.dialect_name`: a row's ``"SQLite"`` is
    #: ``"sqlite"``); :meth:`to_dict` writes it as official rows spell it.
    dialect: str = "sqlite"
    efficiency: bool = False
    external_data: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    db_dir: Path | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dialect", dialect_name(self.dialect))

    @property
    def db_path(self) -> Path:
        """The task's template database; raises :class:`DatabaseNotFoundError` if it is missing."""
        if self.db_dir is None:
            raise DatabaseNotFoundError(
                f"task {self.instance_id!r} has no database directory: "
                "load it with load_tasks(path, db_dir=...) or use a bundled suite"
            )
        path = database_path(self.db_dir, self.db_id)
        if not path.is_file():
            raise DatabaseNotFoundError(
                f"database {self.db_id!r} of task {self.instance_id!r} not found at {path} "
                "(expected layout: {db_dir}/{db_id}/{db_id}_template.sqlite)"
            )
        return path

    def prompt_sections(self) -> list[tuple[str, str]]:
        """The user's issue and the problematic SQL, one fenced block per statement."""
        return [
            ("User issue", self.query),
            ("Problematic SQL", "\n".join(f"```sql\n{sql}\n```" for sql in self.issue_sql)),
        ]

    def mentions(self) -> Mentions:
        """The issue SQL: the tables it references are the ones the task names."""
        return Mentions(sql=tuple(self.issue_sql))

    @classmethod
    def load(cls, source: str | Path, *, db_dir: str | Path | None = None) -> list[Task]:
        """Debugging tasks of a bundled suite or an official JSONL file (see :func:`birdenv.tasks.load_tasks`)."""
        from birdenv import suites  # a suite builds databases: import it only when a name is used

        if isinstance(source, str) and suites.is_suite(source):
            suite = suites.ensure(source)
            source, db_dir = suite.tasks_path, (db_dir or suite.db_dir)
        path = Path(source)
        tasks: list[Task] = []
        seen: set[str] = set()
        for item in iter_tasks(path, db_dir=db_dir):
            if isinstance(item, TaskFormatError):
                raise item
            if item.instance_id in seen:
                raise TaskFormatError(
                    f"{path}: field 'instance_id': {item.instance_id!r} appears twice"
                )
            seen.add(item.instance_id)
            tasks.append(item)
        return tasks

    @classmethod
    def matches(cls, row: Any) -> bool:
        """Every object row that is not another kind's: the official form names few fields."""
        return isinstance(row, dict)

    def to_dict(self) -> dict[str, Any]:
        """The task as an official JSONL row (lists, not ``[split]`` strings)."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        row.pop("db_dir")
        row["dialect"] = dialect_of(self.dialect).title
        extra = row.pop("extra")
        return {**extra, **row}


def split_sql_field(value: Any) -> list[str]:
    """An SQL list field as the official evaluator reads it.

    Strings are split on ``[split]`` with surrounding whitespace stripped and empty pieces dropped;
    lists are kept as they are; anything falsy is an empty list.

    >>> split_sql_field("SELECT 1;[split] SELECT 2")
    ['SELECT 1;', 'SELECT 2']
    >>> split_sql_field(["SELECT 1"])
    ['SELECT 1']
    """
    if not value:
        return []
    if isinstance(value, str):
        return [s.strip() for s in _SPLIT.split(value) if s.strip()]
    if isinstance(value, list):
        return list(value)
    raise TypeError(
        f"expected a list of strings or a [split]-joined string, got {type(value).__name__}"
    )


def parse_task(
    row: Any, *, source: str = "<row>", line: int = 0, db_dir: str | Path | None = None
) -> Task:
    """Build a :class:`Task` from one decoded JSONL row, naming ``source:line`` and the field on error."""
    data, fail = open_row(row, source=source, line=line)
    for old, new in _ALIASES.items():
        if old in data and new not in data:
            data[new] = data.pop(old)
        else:
            data.pop(old, None)

    kwargs: dict[str, Any] = {}
    instance_id = data.pop("instance_id", None)
    if isinstance(instance_id, int):
        instance_id = str(instance_id)
    if not isinstance(instance_id, str) or not instance_id:
        raise fail("instance_id", "missing or not a non-empty string")
    kwargs["instance_id"] = instance_id
    kwargs["db_id"] = plain_db_id(data.pop("db_id", None), fail)

    query = data.pop("query", "")
    if not isinstance(query, str):
        raise fail("query", "not a string")
    kwargs["query"] = query

    for field in _SQL_LISTS:
        try:
            statements = split_sql_field(data.pop(field, None))
        except TypeError as exc:
            raise fail(field, str(exc)) from None
        if not all(isinstance(s, str) for s in statements):
            raise fail(field, "every element must be a string")
        kwargs[field] = statements

    tests = data.pop("test_cases", None) or []
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise fail("test_cases", "expected a list of Python source strings")
    kwargs["test_cases"] = tests

    conditions = data.pop("conditions", None) or {}
    if not isinstance(conditions, dict):
        raise fail("conditions", 'expected a JSON object such as {"order": true}')
    kwargs["conditions"] = conditions

    category = data.pop("category", "Query") or "Query"
    if not isinstance(category, str):
        raise fail("category", "not a string")
    kwargs["category"] = category
    kwargs["dialect"] = str(data.pop("dialect", "sqlite") or "sqlite")
    kwargs["efficiency"] = bool(data.pop("efficiency", False))
    kwargs["external_data"] = data.pop("external_data", None)
    return Task(**kwargs, extra=data, db_dir=Path(db_dir) if db_dir is not None else None)


def iter_tasks(
    path: str | Path, *, db_dir: str | Path | None = None
) -> Iterator[Task | TaskFormatError]:
    """Yield each row of a JSONL file as a :class:`Task`, or as the :class:`TaskFormatError` it raised.

    Lets a caller judge the good rows of a file and report the broken ones. A file holding one
    JSON array of rows is read too.
    """
    path = Path(path)
    for item in read_rows(path):
        if isinstance(item, TaskFormatError):
            yield item
            continue
        lineno, row = item
        try:
            yield parse_task(row, source=str(path), line=lineno, db_dir=db_dir)
        except TaskFormatError as exc:
            yield exc
