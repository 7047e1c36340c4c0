"""The environments of birdenv: one per kind of task and dialect, on one core (:class:`ToolEnv`).

Which environment plays a task is one rule, :func:`env_class_for`: the environment registered for
the task's :attr:`~birdenv.tasks.BaseTask.kind` and :attr:`~birdenv.tasks.BaseTask.dialect`
(:data:`ENVIRONMENTS`), the way :mod:`birdenv.judge.scoring` picks its judge. Every entry point
that plays tasks (:func:`birdenv.vector.make_vec` and its Ray backend, the TRL adapter,
``birdtrain eval``, mixtures and the curriculum) asks it, through :func:`task_env` for a task set
that may hold several.
"""

from __future__ import annotations

from birdenv.envs.base import ToolEnv
from birdenv.envs.bird_sql import BirdSQLEnv
from birdenv.envs.choice import ENVIRONMENTS, env_class_for, env_groups, env_id_for
from birdenv.envs.critic import BirdCriticEnv
from birdenv.envs.critic_pg import BirdCriticPgEnv
from birdenv.envs.mixed import MixedTaskEnv, task_env

__all__ = [
    "ENVIRONMENTS",
    "BirdCriticEnv",
    "BirdCriticPgEnv",
    "BirdSQLEnv",
    "MixedTaskEnv",
    "ToolEnv",
    "env_class_for",
    "env_groups",
    "env_id_for",
    "task_env",
]
