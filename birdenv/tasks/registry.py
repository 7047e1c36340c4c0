"""The registry of the kinds of task beyond debugging tasks: one registration per kind."""

from __future__ import annotations

from birdenv.tasks.protocol import BaseTask

__all__ = ["register_kind", "registered_kinds"]

#: The kinds of task besides debugging tasks, in registration order.
_KINDS: list[type[BaseTask]] = []


def register_kind(kind: type[BaseTask]) -> type[BaseTask]:
    """Make ``kind`` (a :class:`BaseTask` subclass) one of :func:`birdenv.tasks.task_kinds`, so
    :func:`birdenv.tasks.load_tasks` reads its suites and files; return it. Its judge and
    environment are registered where they live (:func:`birdenv.judge.register_scorer`, a
    :class:`~birdenv.envs.ToolEnv` subclass naming it)."""
    if kind not in _KINDS:
        _KINDS.append(kind)
    return kind


def registered_kinds() -> tuple[type[BaseTask], ...]:
    """The kinds :func:`register_kind` made known, in registration order."""
    return tuple(_KINDS)
