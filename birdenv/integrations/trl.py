"""Adapters for TRL's ``GRPOTrainer(environment_factory=...)``, over the same environment core.

TRL creates one environment per rollout, calls ``reset(**dataset_row)``, exposes every public method
as a tool (its signature and Google docstring become the tool schema) and scores a finished rollout
with ``get_reward()``. :class:`BirdCriticTRLEnv` (debugging) and :class:`BirdSQLTRLEnv`
(text-to-SQL) do each of these by driving the Gymnasium environment with the tool-call text a model
would write, so the prompt, the tool schemas, the observations and the judge are exactly the
environment's. Nothing here imports TRL.

.. code-block:: python

    import functools
    from trl import GRPOConfig, GRPOTrainer
    from birdenv.integrations.trl import BirdCriticTRLEnv, suite_dataset

    trainer = GRPOTrainer(
        model=model_path,
        args=GRPOConfig(...),
        train_dataset=suite_dataset("gym-mini"),
        environment_factory=functools.partial(BirdCriticTRLEnv, suite="gym-mini"),
    )

A mixture uses TRL's multi-environment form, in which each row's ``environment`` field picks its
factory: ``train_dataset=suite_dataset(["gym-mini", "bird-mini-train"])`` and
``environment_factory=environment_factories("gym-mini", "bird-mini-train")``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from birdenv import tools
from birdenv.compat import db_dir_argument
from birdenv.envs import task_env
from birdenv.errors import ArgumentError
from birdenv.tasks import BirdTask, Task, load_tasks
from birdenv.tools import format_tool_call

__all__ = [
    "BirdCriticTRLEnv",
    "BirdSQLTRLEnv",
    "TRLTools",
    "environment_factories",
    "suite_dataset",
]


def _task_env(
    default_suite: str,
    *,
    suite: str | None = None,
    tasks: str | Path | list[Any] | None = None,
    db_dir: str | Path | None = None,
    db_root: str | Path | None = None,
    **env_kwargs: Any,
) -> Any:
    """The environment of the tasks (of ``suite``, ``tasks`` or ``default_suite``): each task's own
    kind's and dialect's (:func:`birdenv.envs.task_env`), so PostgreSQL tasks play on PostgreSQL."""

    if suite is not None and tasks is not None:
        raise ArgumentError("give either suite= or tasks= (with db_dir=), not both")
    db_dir = db_dir_argument(db_dir, db_root, "the TRL adapter", stacklevel=4)
    if not isinstance(tasks, list):
        tasks = load_tasks(tasks if tasks is not None else (suite or default_suite), db_dir=db_dir)
    return task_env(tasks, **env_kwargs)


class TRLTools:
    """The methods TRL reads from an ``environment_factory``'s environment, besides ``reset``: the
    two tools (their schemas from :mod:`birdenv.tools`' docstrings) and ``get_reward``.

    A subclass sends a tool call with ``_call(name, **arguments)``, which returns the observation
    and sets ``reward`` when the episode ends. Everything else it defines is private: TRL makes a
    tool of every public method.
    """

    reward: float = 0.0

    def _call(self, name: str, **arguments: Any) -> str:
        raise NotImplementedError

    def execute_sql(self, sql: str) -> str:
        return self._call("execute_sql", sql=sql)

    def submit_solution(self, sql_list: list[str]) -> str:
        return self._call("submit_solution", sql_list=sql_list)

    # TRL builds the tool schemas from these docstrings: take them from the one definition.
    execute_sql.__doc__ = tools.execute_sql.__doc__
    submit_solution.__doc__ = tools.submit_solution.__doc__

    def get_reward(self) -> float:
        """The rollout's reward: the judge's verdict on the submission (0.0 if none was made)."""
        return self.reward


class BirdCriticTRLEnv(TRLTools):
    """One rollout's environment for TRL: ``reset``, two tools, ``get_reward``.

    Keyword arguments are those of :class:`~birdenv.envs.critic.BirdCriticEnv` (``suite``,
    ``tasks``, ``db_dir``, ``reward``, ``pool``, ...); pass them with ``functools.partial`` as the
    factory. Each task plays in the environment of its kind and dialect: PostgreSQL tasks
    (``suite="gym-mini-pg"``) on ``BirdCritic-PostgreSQL-v0``, a list of both dialects on both.
    """

    #: The suite played when neither ``suite=`` nor ``tasks=`` is given.
    default_suite = "critic-mini"

    def __init__(self, **env_kwargs: Any) -> None:
        self.env = _task_env(self.default_suite, **env_kwargs)
        self.reward = 0.0
        self.done = False
        # TRL never closes an environment: one it drops frees its session (an episode left open
        # holds one) then, not at the process's exit.
        weakref.finalize(self, self.env.close)

    def reset(self, **row: Any) -> str:
        """Start the rollout on the row's task (``task_id``; else a task drawn at random)."""
        task_id = row.get("task_id") or row.get("instance_id")
        prompt, _ = self.env.reset(options={"task_id": task_id} if task_id else None)
        self.reward, self.done = 0.0, False
        return prompt

    def _call(self, name: str, **arguments: Any) -> str:
        if self.done:
            return "status: error\nerror: the solution was already submitted; the task is over"
        observation, reward, terminated, _, _ = self.env.step(format_tool_call(name, **arguments))
        if terminated:
            self.reward, self.done = reward, True
        return observation


class BirdSQLTRLEnv(BirdCriticTRLEnv):
    """:class:`BirdCriticTRLEnv` for text-to-SQL questions: the reward is execution accuracy.

    Keyword arguments are those of :class:`~birdenv.envs.bird_sql.BirdSQLEnv` (``suite``, default
    ``"bird-mini-eval"``; or ``tasks`` with ``db_dir``; ``pool``, ...).
    """

    default_suite = "bird-mini-eval"


def _tasks(source: str | Path | Sequence[Any], db_dir: str | Path | None) -> list[Any]:
    """The tasks of a suite name or file, of a list of tasks, or of a list of names and files."""

    items = [source] if isinstance(source, (str, Path)) else source
    return [
        task
        for item in items
        for task in (load_tasks(item, db_dir=db_dir) if isinstance(item, (str, Path)) else [item])
    ]


def suite_dataset(
    source: str | Path | Sequence[Any] = "gym-mini",
    *,
    db_dir: str | Path | None = None,
) -> Any:
    """A ``datasets.Dataset`` of tasks in the form TRL's ``environment_factory`` expects.

    ``source`` is a bundled suite name or a file of either kind (``gym-mini``, ``bird-mini-train``
    ...), a list of tasks, or a list of several such names and files (a mixture; every task once).
    Each row has an empty user ``prompt`` (the environment's ``reset`` fills it in) plus
    ``task_id``, ``db_id``, ``category`` (Query/Management/Personalization, or a question's
    difficulty) and ``environment`` (``"critic"`` or ``"bird"``: the key of
    :func:`environment_factories` that TRL's multi-environment form reads).
    """
    # the train extra: imported only where used
    from datasets import Dataset

    tasks = _tasks(source, db_dir)
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": ""}],
                "task_id": task.instance_id,
                "db_id": task.db_id,
                "category": task.category,
                "environment": task.kind,
            }
            for task in tasks
        ]
    )


def environment_factories(
    critic: str | Path | Sequence[Any] = "gym-mini",
    bird: str | Path | Sequence[Any] = "bird-mini-train",
    *,
    db_dir: str | Path | None = None,
    **env_kwargs: Any,
) -> dict[str, Callable[[], BirdCriticTRLEnv]]:
    """TRL's multi-environment ``environment_factory`` for a mixture of both task kinds.

    Keys are the ``environment`` values of :func:`suite_dataset` rows: ``"critic"`` makes a
    :class:`BirdCriticTRLEnv` over ``critic`` (a suite name, a file or tasks, e.g.
    ``["gym-mini", "gym-mini-pg"]``: SQLite and PostgreSQL tasks), ``"bird"`` a
    :class:`BirdSQLTRLEnv` over ``bird``. Each task set is loaded once here and shared by every
    rollout's environment; ``env_kwargs`` (``reward``, ``pool``, ``statement_timeout`` ...) go to
    both.
    """

    return {
        Task.kind: functools.partial(BirdCriticTRLEnv, tasks=_tasks(critic, db_dir), **env_kwargs),
        BirdTask.kind: functools.partial(BirdSQLTRLEnv, tasks=_tasks(bird, db_dir), **env_kwargs),
    }
