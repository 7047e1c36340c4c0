"""Tasks: the protocol both kinds implement, the two kinds, and loading either kind.

Two kinds of task share one protocol, :class:`BaseTask` (:mod:`birdenv.tasks.protocol`): a
BIRD-CRITIC debugging task (:class:`Task`, :mod:`birdenv.tasks.critic`) and a BIRD text-to-SQL
question (:class:`BirdTask`, :mod:`birdenv.tasks.bird`). Every task says its kind and dialect, its
category, the sections of its prompt, what it mentions that names tables, and its database;
environments, prompts, judging and reports ask the task instead of testing which kind it is.
:func:`load_tasks` (:mod:`birdenv.tasks.loaders`) loads either kind from a bundled suite's name or
a file (the kind of a file is read from its first row).

Tasks are data: they never import a judge. :func:`birdenv.judge.score` judges a submission by the
judge of the task's kind and dialect.
"""

from __future__ import annotations

from typing import Any

from birdenv.tasks.critic import (
    CATEGORIES,
    Task,
    database_path,
    iter_tasks,
    parse_task,
    split_sql_field,
)
from birdenv.tasks.loaders import load_tasks, source_kind, task_kinds
from birdenv.tasks.protocol import BaseTask, Judgement, Mentions
from birdenv.tasks.registry import register_kind

__all__ = [
    "BIRD_SUITES",
    "CATEGORIES",
    "DIFFICULTIES",
    "BaseTask",
    "BirdTask",
    "Judgement",
    "Mentions",
    "Task",
    "database_path",
    "iter_tasks",
    "load_bird",
    "load_tasks",
    "parse_task",
    "register_kind",
    "source_kind",
    "split_sql_field",
    "task_kinds",
]

# The BIRD kind loads when first asked for: ``import birdenv`` (every judging worker, every CLI
# call) needs only the protocol, the debugging kind and the loaders.
_BIRD = ("BIRD_SUITES", "DIFFICULTIES", "BirdTask", "load_bird")


def __getattr__(name: str) -> Any:
    if name in _BIRD:
        # BIRD questions load on first use: `import birdenv` stays light
        from birdenv.tasks import bird

        return getattr(bird, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
