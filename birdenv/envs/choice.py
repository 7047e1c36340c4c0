"""Which environment plays a task: the one of its kind and dialect (:data:`ENVIRONMENTS`:
``BirdCritic-SQLite-v0``, ``BirdCritic-PostgreSQL-v0``, ``BirdSQL-SQLite-v0``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# The environment classes register themselves in ENVIRONMENTS as they are defined: import them all.
from birdenv.dialects import dialect_name
from birdenv.envs import bird_sql, critic, critic_pg  # noqa: F401
from birdenv.envs.base import ENVIRONMENTS, ToolEnv
from birdenv.errors import TaskKindError
from birdenv.tasks import BaseTask

__all__ = ["ENVIRONMENTS", "env_class_for", "env_groups", "env_id_for"]


def env_class_for(task: BaseTask | type[BaseTask]) -> type[ToolEnv]:
    """The environment class that plays ``task`` (by its kind and dialect), without the wrappers
    ``gymnasium.make`` adds; a kind of task alone (a class) gets its kind's default dialect's.
    :class:`TaskKindError` when no environment plays that kind in that dialect.

    >>> from birdenv.tasks import BirdTask, load_tasks
    >>> env_class_for(BirdTask).__name__, env_class_for(load_tasks("critic-mini-pg")[0]).__name__
    ('BirdSQLEnv', 'BirdCriticPgEnv')
    """
    key = (task.kind, dialect_name(task.dialect))
    try:
        return ENVIRONMENTS[key]
    except KeyError:
        known = ", ".join(f"{kind} in {dialect}" for kind, dialect in sorted(ENVIRONMENTS))
        name = getattr(task, "instance_id", None)
        raise TaskKindError(
            f"no environment plays {task.kind} tasks in {task.dialect}"
            + (f" (task {name})" if name is not None else "")
            + f"; environments exist for {known}"
        ) from None


def env_id_for(task: BaseTask | type[BaseTask]) -> str:
    """The Gymnasium id of :func:`env_class_for` ``(task)``, e.g. ``"BirdCritic-PostgreSQL-v0"``."""
    return env_class_for(task).env_id


def env_groups(tasks: Iterable[Any]) -> dict[str, list[Any]]:
    """``tasks`` grouped by the id of the environment that plays them, in order of first appearance."""
    groups: dict[str, list[Any]] = {}
    for task in tasks:
        groups.setdefault(env_id_for(task), []).append(task)
    return groups
