"""BIRD text-to-SQL questions: the task kind :class:`BirdTask`, and loading them.

A task row carries the official BIRD fields: ``question_id`` (int), ``db_id``, ``question``,
``evidence`` (may be ``""``), ``SQL`` (the gold query) and ``difficulty`` (``simple``,
``moderate`` or ``challenging``; optional, since the official train set has none). Files are JSONL
(one object a line) or, as the official ``dev.json`` and ``mini_dev_sqlite.json`` are, one JSON
array. Databases follow the official layout ``{db_root}/{db_id}/{db_id}.sqlite``; the bundled
suites ``bird-mini-train`` and ``bird-mini-eval`` (questions in ``suites/bird/{db_id}.jsonl`` with
a ``split`` field) run on the bundled databases, named ``{db_id}_template.sqlite``.

A question is judged by BIRD's execution accuracy (:mod:`birdenv.judge.ex`), which
:func:`birdenv.judge.score` picks by the task's kind and dialect, a layer above this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdenv.compat import db_dir_argument
from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.rows import open_row, plain_db_id, read_rows
from birdenv.tasks.protocol import BaseTask, Mentions
from birdenv.tasks.registry import register_kind

__all__ = [
    "BIRD_SEPARATOR",
    "BIRD_SUITES",
    "DIFFICULTIES",
    "BirdTask",
    "iter_bird",
    "load_bird",
    "parse_bird_task",
]

#: BIRD's three difficulty levels.
DIFFICULTIES = ("simple", "moderate", "challenging")
#: The bundled BIRD suites and the ``split`` value each one keeps.
BIRD_SUITES = {"bird-mini-train": "train", "bird-mini-eval": "eval"}
#: What BIRD's own scripts put between a predicted query and its database name.
BIRD_SEPARATOR = "\t----- bird -----\t"

_BUNDLED_DIR = Path(__file__).parents[1] / "suites" / "bird"
_SPLITS = ("train", "eval")


def _database_file(db_root: Path, db_id: str) -> Path | None:
    for name in (f"{db_id}.sqlite", f"{db_id}_template.sqlite"):
        path = db_root / db_id / name
        if path.is_file():
            return path
    return None


@dataclasses.dataclass(frozen=True)
class BirdTask(BaseTask):
    """One BIRD question: a database, a natural-language question, its evidence and the gold SQL.

    ``db_dir`` is not part of the official row: it is the database folder set by :func:`load_bird`.
    Its category is its difficulty; its submission is judged by execution accuracy.

    >>> question = load_bird("bird-mini-eval")[0]
    >>> question.kind, question.metric, question.category in question.categories, question.dialect
    ('bird', 'EX', True, 'sqlite')
    """

    kind = "bird"
    env_id = "BirdSQL-SQLite-v0"
    metric = "EX"
    metric_name = "execution_accuracy"
    category_name = "difficulty"
    categories = DIFFICULTIES
    skill = "generation"
    goal = (
        "answer the user's question with one SQLite query, given the database schema and the "
        "external knowledge"
    )
    submission_rule = (
        "Submit exactly one SELECT statement as the only element of sql_list; it is judged by "
        "running it on a fresh copy of the database and comparing its rows with the correct "
        "answer's (order and duplicates ignored)."
    )
    suites = tuple(BIRD_SUITES)
    eval_suite = "bird-mini-eval"

    question_id: int
    db_id: str
    question: str
    SQL: str = dataclasses.field(repr=False)  # never in a repr (one can reach an agent)
    evidence: str = ""
    difficulty: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    db_dir: Path | None = dataclasses.field(default=None, compare=False)

    @property
    def instance_id(self) -> str:
        """The question id as a string (what environments report as ``task_id``)."""
        return str(self.question_id)

    @property
    def category(self) -> str:
        """The difficulty: simple, moderate or challenging (empty when the row has none)."""
        return self.difficulty

    def verdict_fields(self) -> dict[str, Any]:
        """The question's id, database and difficulty, as BIRD's reports name them."""
        return {"question_id": self.question_id, "db_id": self.db_id, "difficulty": self.category}

    @property
    def preprocess_sql(self) -> list[str]:
        """Nothing: a question starts from its database as it is."""
        return []

    @property
    def db_path(self) -> Path:
        """The database: ``{db_dir}/{db_id}/{db_id}.sqlite``, else ``{db_id}_template.sqlite``.

        Raises :class:`DatabaseNotFoundError` when neither exists.
        """
        if self.db_dir is None:
            raise DatabaseNotFoundError(
                f"question {self.question_id} has no database folder: "
                "load it with load_tasks(path, db_dir=...) or use a bundled suite"
            )
        path = _database_file(Path(self.db_dir), self.db_id)
        if path is None:
            raise DatabaseNotFoundError(
                f"database {self.db_id!r} of question {self.question_id} not found under "
                f"{Path(self.db_dir) / self.db_id} (expected {self.db_id}.sqlite, the official "
                f"BIRD layout {{db_dir}}/{{db_id}}/{{db_id}}.sqlite, or {self.db_id}_template.sqlite)"
            )
        return path

    def prompt_sections(self) -> list[tuple[str, str]]:
        """The question and its external knowledge ("(none)" when the row has none)."""
        return [("Question", self.question), ("External knowledge", self.evidence or "(none)")]

    def mentions(self) -> Mentions:
        """The question and its evidence: their words may name tables and columns."""
        return Mentions(text=f"{self.question}\n{self.evidence or ''}")

    @classmethod
    def load(cls, source: str | Path, *, db_dir: str | Path | None = None) -> list[BirdTask]:
        """:func:`load_bird`."""
        return load_bird(source, db_dir=db_dir)

    @classmethod
    def matches(cls, row: Any) -> bool:
        """BIRD's rows carry ``question_id`` and ``SQL``."""
        return isinstance(row, dict) and "question_id" in row and "SQL" in row

    def to_dict(self) -> dict[str, Any]:
        """The task as an official BIRD row."""
        row = {
            "question_id": self.question_id,
            "db_id": self.db_id,
            "question": self.question,
            "evidence": self.evidence,
            "SQL": self.SQL,
        }
        if self.difficulty:
            row["difficulty"] = self.difficulty
        return {**self.extra, **row}


def parse_bird_task(
    row: Any, *, source: str = "<row>", line: int = 0, db_dir: str | Path | None = None
) -> BirdTask:
    """Build a :class:`BirdTask` from one decoded row, naming ``source:line`` and the field on error."""
    data, fail = open_row(row, source=source, line=line)
    question_id = data.pop("question_id", None)
    if isinstance(question_id, bool) or not isinstance(question_id, int):
        raise fail("question_id", "missing or not an integer")
    db_id = plain_db_id(data.pop("db_id", None), fail)
    texts: dict[str, str] = {}
    for field, required in (("question", True), ("SQL", True), ("evidence", False)):
        value = data.pop(field, None)
        if value is None and not required:
            value = ""
        if not isinstance(value, str) or (required and not value.strip()):
            raise fail(field, "missing or not a non-empty string" if required else "not a string")
        texts[field] = value
    difficulty = data.pop("difficulty", None) or ""
    if difficulty and difficulty not in DIFFICULTIES:
        raise fail("difficulty", f"must be one of {list(DIFFICULTIES)}, got {difficulty!r}")
    return BirdTask(
        question_id=question_id,
        db_id=db_id,
        question=texts["question"],
        SQL=texts["SQL"],
        evidence=texts["evidence"],
        difficulty=difficulty,
        extra=data,
        db_dir=Path(db_dir) if db_dir is not None else None,
    )


def iter_bird(
    path: str | Path, *, db_dir: str | Path | None = None, split: str | None = None
) -> Iterator[BirdTask | TaskFormatError]:
    """Each row of a BIRD file as a :class:`BirdTask`, or the :class:`TaskFormatError` it raised.

    With ``split``, rows must carry ``"split": "train" | "eval"`` (the bundled files do) and only
    those of that split are yielded; the ``split`` field is not kept.
    """
    path = Path(path)
    for item in read_rows(path):
        if isinstance(item, TaskFormatError):
            yield item
            continue
        lineno, row = item
        if split is not None and isinstance(row, dict):
            row = dict(row)
            value = row.pop("split", None)
            if value not in _SPLITS:
                yield TaskFormatError(
                    f"{path}:{lineno}: field 'split': must be one of {list(_SPLITS)}, got {value!r}"
                )
                continue
            if value != split:
                continue
        try:
            yield parse_bird_task(row, source=str(path), line=lineno, db_dir=db_dir)
        except TaskFormatError as exc:
            yield exc


def load_bird(
    source: str | Path, *, db_dir: str | Path | None = None, db_root: str | Path | None = None
) -> list[BirdTask]:
    """Load BIRD questions from a bundled suite's name or from an official JSONL / JSON file.

    ``"bird-mini-train"`` and ``"bird-mini-eval"`` read the bundled question files and use the
    bundled databases (built on first use) unless ``db_dir`` is given. For a file, ``db_dir`` is
    the folder holding ``{db_id}/{db_id}.sqlite``. The first malformed row raises
    :class:`TaskFormatError` naming the file, the line and the field; so does a repeated
    ``question_id``. ``db_root`` is the old name of ``db_dir`` (deprecated).
    :func:`birdenv.tasks.load_tasks` loads either kind.
    """
    db_dir = db_dir_argument(db_dir, db_root, "load_bird")
    if isinstance(source, str) and source in BIRD_SUITES:
        if db_dir is None:
            from birdenv import suites  # builds the bundled databases on first use

            db_dir = suites.ensure().db_dir
        paths = sorted(_BUNDLED_DIR.glob("*.jsonl"))
        split: str | None = BIRD_SUITES[source]
    else:
        path = Path(source)
        if not path.is_file():
            raise UnknownSuiteError(
                f"{str(source)!r} is neither a bundled BIRD suite ({', '.join(BIRD_SUITES)}) "
                "nor a file"
            )
        paths, split = [path], None
    tasks: list[BirdTask] = []
    seen: dict[int, str] = {}
    for path in paths:
        for item in iter_bird(path, db_dir=db_dir, split=split):
            if isinstance(item, TaskFormatError):
                raise item
            if item.question_id in seen:
                raise TaskFormatError(
                    f"{path}: field 'question_id': {item.question_id} appears twice "
                    f"(first in {seen[item.question_id]})"
                )
            seen[item.question_id] = str(path)
            tasks.append(item)
    return tasks


register_kind(BirdTask)
