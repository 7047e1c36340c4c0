"""Loading tasks of either kind: from a bundled suite's name or a file whose first row tells its kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from birdenv.errors import UnknownSuiteError
from birdenv.rows import read_rows
from birdenv.tasks.critic import Task
from birdenv.tasks.protocol import BaseTask
from birdenv.tasks.registry import registered_kinds

__all__ = ["load_tasks", "source_kind", "task_kinds"]


def task_kinds() -> tuple[type[BaseTask], ...]:
    """Every kind of task, a file's first row matched in this order: the registered kinds
    (:class:`~birdenv.tasks.BirdTask` and any :func:`~birdenv.tasks.register_kind` added), then debugging tasks
    (:class:`~birdenv.tasks.Task`), whose rows name few fields: every other object row."""
    # BIRD questions register on first use: `import birdenv` stays light.
    import birdenv.tasks.bird  # noqa: F401

    return (*registered_kinds(), Task)


def source_kind(source: str | Path) -> type[BaseTask]:
    """The kind of the tasks a bundled suite's name or a task file holds.

    A file holds the kind of its first row: BIRD's rows carry ``question_id`` and ``SQL``, debugging
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

    ``critic-mini``/``gym-mini`` and debugging JSONL give :class:`~birdenv.tasks.Task`;
    ``bird-mini-train``/``bird-mini-eval`` and BIRD's files (JSONL, or one JSON array as
    ``dev.json``) give :class:`~birdenv.tasks.BirdTask`. A bundled suite is built on first use and its tasks know their
    database directory; for a file, ``db_dir`` is the folder holding ``{db_id}/{db_id}_template.sqlite``
    (or BIRD's ``{db_id}/{db_id}.sqlite``). The first malformed row raises
    :class:`TaskFormatError` naming the file, line and field; so does a repeated id.

    >>> [type(t).__name__ for t in load_tasks("gym-mini")[:1] + load_tasks("bird-mini-train")[:1]]
    ['Task', 'BirdTask']
    """
    return source_kind(source).load(source, db_dir=db_dir)
