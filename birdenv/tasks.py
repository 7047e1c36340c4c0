"""The task protocol both kinds implement, the debugging kind, and loading tasks of either kind.

Two kinds of task share one protocol, :class:`BaseTask`: a BIRD-CRITIC debugging task
(:class:`Task`, here) and a BIRD text-to-SQL question (:class:`birdenv.bird.BirdTask`). Every task
says its kind, its category, the sections of its prompt, its database, and how a submission is
judged; environments, judging, rewards and reports ask the task instead of testing which kind it
is. :func:`load_tasks` loads either kind from a bundled suite's name or a file (the kind of a file
is read from its first row).

A debugging task row (one JSON object per line) carries the official fields: ``instance_id``,
``db_id``, ``dialect``, ``category``, ``query``, ``issue_sql``, ``preprocess_sql``,
``clean_up_sql``, ``sol_sql``, ``test_cases``, ``conditions``, ``efficiency``. SQL list fields may
also be strings joined with the literal separator ``[split]``; the older names
``selected_database`` and ``error_sql`` are accepted for ``db_id`` and ``issue_sql``. Databases
follow the official layout ``{db_dir}/{db_id}/{db_id}_template.sqlite``, so the official
``bird-critic-1.0-sqlite`` and ``six-gym-sqlite`` data work unchanged.

Judging sits a layer above this one (:mod:`birdenv.judge`, :mod:`birdenv.ex`, which import the
tasks); :meth:`BaseTask.judge` reaches it when it is called, never at import.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Protocol

from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.rows import open_row, plain_db_id, read_rows

__all__ = [
    "CATEGORIES",
    "BaseTask",
    "Judgement",
    "Task",
    "database_path",
    "iter_tasks",
    "load_tasks",
    "parse_task",
    "source_kind",
    "split_sql_field",
    "task_kinds",
]

#: The three categories of BIRD-CRITIC.
CATEGORIES = ("Query", "Management", "Personalization")

_SPLIT = re.compile(r"\[split\]\s*")
_ALIASES = {"selected_database": "db_id", "error_sql": "issue_sql"}
_SQL_LISTS = ("issue_sql", "preprocess_sql", "clean_up_sql", "sol_sql")


class Judgement(Protocol):
    """What a verdict of any kind tells (:class:`birdenv.judge.Verdict`, :class:`birdenv.ex.ExVerdict`)."""

    instance_id: str
    phase: str | None
    error: str | None
    timings: dict[str, float]

    @property
    def status(self) -> str: ...

    @property
    def passed(self) -> bool: ...

    @property
    def fraction(self) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


class BaseTask(abc.ABC):
    """What every kind of task provides.

    Per kind (class attributes): ``kind``, the kind's name (``"critic"``, ``"bird"``: the key of a
    kind in mixtures, TRL rows and summaries); ``env_id``, the Gymnasium environment that plays it;
    ``metric`` and ``metric_name``, what its verdicts add up to (``"SR"``/``"success_rate"``,
    ``"EX"``/``"execution_accuracy"``); ``category_name`` and ``categories``, what its
    :attr:`category` is called and its values in report order; ``skill``, what a model does
    (``"debugging"``, ``"generation"``); ``goal``, the task as the prompt states it;
    ``submission_rule``, what an environment's prompt adds about submitting (may be empty);
    ``suites``, the bundled suites of the kind, and ``eval_suite``, the one to evaluate on (and
    the default of the kind's environment).

    Per task: ``instance_id``, ``db_id``, ``db_dir``, :attr:`db_path`, :attr:`category`,
    ``preprocess_sql`` (what prepares an episode's starting state), :meth:`prompt_sections` (and
    :meth:`prompt_text`), :meth:`judge` and :meth:`to_dict`.
    """

    kind: ClassVar[str]
    env_id: ClassVar[str]
    metric: ClassVar[str]
    metric_name: ClassVar[str]
    category_name: ClassVar[str]
    categories: ClassVar[tuple[str, ...]]
    skill: ClassVar[str]
    goal: ClassVar[str]
    submission_rule: ClassVar[str]
    suites: ClassVar[tuple[str, ...]]
    eval_suite: ClassVar[str]

    instance_id: str
    db_id: str
    db_dir: Path | None
    preprocess_sql: list[str]

    @property
    @abc.abstractmethod
    def category(self) -> str:
        """What ``info["category"]`` says and reports group by."""

    @property
    @abc.abstractmethod
    def db_path(self) -> Path:
        """The task's database file; :class:`DatabaseNotFoundError` when it is missing."""

    @abc.abstractmethod
    def prompt_sections(self) -> list[tuple[str, str]]:
        """The task's own parts of a prompt, ``(heading, text)`` in order, after the schema."""

    def prompt_text(self) -> str:
        """:meth:`prompt_sections` as prompt text: a ``# heading:`` line above each part."""
        return "\n\n".join(f"# {heading}:\n{text}" for heading, text in self.prompt_sections())

    @abc.abstractmethod
    def judge(
        self,
        sql_list: list[str] | str,
        *,
        pool: Any = None,
        statement_timeout: float | None = None,
        official: bool = False,
    ) -> Judgement:
        """The verdict on a submission, judged on fresh states of the task's database.

        ``statement_timeout`` bounds each statement; each kind's default is its official
        evaluator's (none for BIRD-CRITIC, 30 s for BIRD). ``official=True`` scores exactly by the official rule, quirks included (evaluation);
        ``False`` (rewards, environments) closes a reward hack where the official rule of a kind
        has one. Problems with the submission are verdicts, never exceptions.
        """

    @classmethod
    @abc.abstractmethod
    def judge_many(
        cls,
        jobs: Iterable[tuple[Any, list[str] | str]],
        *,
        processes: int | None = None,
        official: bool = False,
        ray: bool = False,
    ) -> Iterator[Judgement]:
        """:meth:`judge` of many ``(task, sql_list)`` pairs of this kind, verdicts in order,
        over ``processes`` supervised worker processes (default one; ``ray=True``: Ray actors
        over the cluster, by default one per CPU of it)."""

    @classmethod
    @abc.abstractmethod
    def load(cls, source: str | Path, *, db_dir: str | Path | None = None) -> list[Any]:
        """The tasks of one of :attr:`suites`, or of a file of this kind (databases in ``db_dir``)."""

    @classmethod
    @abc.abstractmethod
    def matches(cls, row: Any) -> bool:
        """Whether a decoded row of a task file is of this kind."""

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The task as an official row of its kind."""


def database_path(db_dir: str | Path, db_id: str) -> Path:
    """The official location of a task database: ``{db_dir}/{db_id}/{db_id}_template.sqlite``."""
    return Path(db_dir) / db_id / f"{db_id}_template.sqlite"


@dataclasses.dataclass(frozen=True)
class Task(BaseTask):
    """One BIRD-CRITIC task: a database, a user's issue, their broken SQL, the fix and its tests.

    ``db_dir`` is not part of the official row: it says where the task's database lives and is set
    by :func:`load_tasks` (bundled suites know theirs; for a JSONL file pass ``db_dir=``).

    >>> task = load_tasks("critic-mini")[0]
    >>> task.kind, task.metric, task.category in task.categories
    ('critic', 'SR', True)
    >>> task.judge(task.sol_sql).status
    'success'
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
    suites = ("gym-mini", "critic-mini")
    eval_suite = "critic-mini"

    instance_id: str
    db_id: str
    query: str
    issue_sql: list[str]
    sol_sql: list[str] = dataclasses.field(default_factory=list)
    preprocess_sql: list[str] = dataclasses.field(default_factory=list)
    clean_up_sql: list[str] = dataclasses.field(default_factory=list)
    test_cases: list[str] = dataclasses.field(default_factory=list)
    conditions: dict[str, Any] = dataclasses.field(default_factory=dict)
    category: str = "Query"
    dialect: str = "SQLite"
    efficiency: bool = False
    external_data: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    db_dir: Path | None = dataclasses.field(default=None, compare=False)

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

    def judge(
        self,
        sql_list: list[str] | str,
        *,
        pool: Any = None,
        statement_timeout: float | None = None,
        official: bool = False,
    ) -> Judgement:
        """The official BIRD-CRITIC verdict (:func:`birdenv.judge.judge`); it has no reward hack
        to close, so ``official`` changes nothing."""
        from birdenv.judge import judge

        return judge(self, sql_list, pool=pool, statement_timeout=statement_timeout)

    @classmethod
    def judge_many(
        cls,
        jobs: Iterable[tuple[Any, list[str] | str]],
        *,
        processes: int | None = None,
        official: bool = False,
        ray: bool = False,
    ) -> Iterator[Judgement]:
        """:func:`birdenv.judge.judge_many` (every instance in a supervised worker)."""
        from birdenv.judge import judge_many

        return judge_many(jobs, processes=processes, ray=ray)

    @classmethod
    def load(cls, source: str | Path, *, db_dir: str | Path | None = None) -> list[Task]:
        """Debugging tasks of a bundled suite or an official JSONL file (see :func:`load_tasks`)."""
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
    kwargs["dialect"] = str(data.pop("dialect", "SQLite") or "SQLite")
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


def task_kinds() -> tuple[type[BaseTask], ...]:
    """Every kind of task, the most specific first: :class:`birdenv.bird.BirdTask`, :class:`Task`."""
    from birdenv.bird import BirdTask  # questions import this module

    return (BirdTask, Task)


def source_kind(source: str | Path) -> type[BaseTask]:
    """The kind of the tasks a bundled suite's name or a task file holds.

    A file's kind is its first row's: BIRD's rows carry ``question_id`` and ``SQL``, debugging
    tasks do not. Raises :class:`UnknownSuiteError` for a name that is neither a suite nor a file.

    >>> source_kind("bird-mini-eval").kind, source_kind("gym-mini").kind
    ('bird', 'critic')
    """
    kinds = task_kinds()
    for kind in kinds:
        if isinstance(source, str) and source in kind.suites:
            return kind
    path = Path(source)
    if not path.is_file():
        names = ", ".join(name for kind in reversed(kinds) for name in kind.suites)
        raise UnknownSuiteError(f"{str(source)!r} is neither a bundled suite ({names}) nor a file")
    first = next((item[1] for item in read_rows(path) if not isinstance(item, Exception)), None)
    return next((kind for kind in kinds if kind.matches(first)), Task)


def load_tasks(source: str | Path, *, db_dir: str | Path | None = None) -> list[Any]:
    """Tasks of either kind from a bundled suite's name or from an official file.

    ``critic-mini``/``gym-mini`` and debugging JSONL give :class:`Task`; ``bird-mini-train``/
    ``bird-mini-eval`` and BIRD's files (JSONL, or one JSON array as ``dev.json``) give
    :class:`birdenv.bird.BirdTask`. A bundled suite is built on first use and its tasks know their
    database directory; for a file, ``db_dir`` is the folder holding ``{db_id}/{db_id}_template.sqlite``
    (or BIRD's ``{db_id}/{db_id}.sqlite``). The first malformed row raises
    :class:`TaskFormatError` naming the file, line and field; so does a repeated id.

    >>> [type(t).__name__ for t in load_tasks("gym-mini")[:1] + load_tasks("bird-mini-train")[:1]]
    ['Task', 'BirdTask']
    """
    return source_kind(source).load(source, db_dir=db_dir)
