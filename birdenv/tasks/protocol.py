"""The protocol every kind of task implements: what environments, prompts, judging and reports ask.

A task is data. It says its kind and dialect, its category, the sections of its prompt, what it
mentions that names tables of its database, and where that database is; it never judges itself.
Scoring a submission belongs to the judge layer (:func:`birdenv.judge.score`), which picks the
judge by the task's :attr:`~BaseTask.kind` and :attr:`~BaseTask.dialect`.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

__all__ = ["BaseTask", "Judgement", "Mentions"]


class Judgement(Protocol):
    """What a verdict of any kind tells (:class:`birdenv.judge.Verdict`, :class:`birdenv.judge.ex.ExVerdict`)."""

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

    @property
    def tests_passed(self) -> int: ...

    @property
    def tests_total(self) -> int: ...

    def to_dict(self) -> dict[str, Any]: ...


class Mentions(NamedTuple):
    """What a task says that names tables of its database (what a linked schema prompt keeps).

    ``sql``: statements whose referenced tables the task names (a debugging task's issue SQL);
    ``text``: prose whose words may name tables or columns (a question and its evidence).
    """

    sql: tuple[str, ...] = ()
    text: str = ""


class BaseTask(abc.ABC):
    """What every kind of task provides.

    Per kind (class attributes): ``kind``, the kind's name (``"critic"``, ``"bird"``: the key of a
    kind in mixtures, TRL rows and summaries, and with :attr:`dialect` the key of its judge);
    ``env_id``, the Gymnasium environment that plays it; ``metric`` and ``metric_name``, what its
    verdicts add up to (``"SR"``/``"success_rate"``, ``"EX"``/``"execution_accuracy"``);
    ``category_name`` and ``categories``, what its :attr:`category` is called and its values in
    report order; ``skill``, what a model does (``"debugging"``, ``"generation"``); ``goal``, the
    task as the prompt states it; ``submission_rule``, what an environment's prompt adds about
    submitting (may be empty); ``suites``, the bundled suites of the kind, and ``eval_suite``, the
    one to evaluate on (and the default of the kind's environment).

    Per task: ``instance_id``, ``db_id``, ``db_dir``, :attr:`dialect`, :attr:`db_path`,
    :attr:`category`, ``preprocess_sql`` (what prepares an episode's starting state),
    :meth:`prompt_sections` (and :meth:`prompt_text`), :meth:`mentions`, :meth:`verdict_fields`
    and :meth:`to_dict`.
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

    #: The name of the SQL dialect of the task's database (:mod:`birdenv.dialects`: lower case,
    #: whatever the row's spelling).
    dialect: str = "sqlite"

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

    def verdict_fields(self) -> dict[str, Any]:
        """What a verdict row says of its task besides the verdict (:mod:`birdenv.predictions`)."""
        return {"category": self.category}

    @abc.abstractmethod
    def mentions(self) -> Mentions:
        """What the task says that names tables of its database (:func:`birdenv.schema.linked_tables`)."""

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
