"""The environments of birdenv: one per kind of task, on one core (:class:`ToolEnv`)."""

from __future__ import annotations

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from birdenv.envs.base import ToolEnv
from birdenv.envs.bird_sql import BirdSQLEnv
from birdenv.envs.critic import BirdCriticEnv
from birdenv.tasks import BaseTask

__all__ = ["BirdCriticEnv", "BirdSQLEnv", "ToolEnv", "env_class_for"]


def env_class_for(kind: type[BaseTask]) -> type[ToolEnv]:
    """The environment class registered for a kind of task (``kind.env_id``), without the wrappers
    ``gymnasium.make`` adds.

    >>> from birdenv.tasks import BirdTask
    >>> env_class_for(BirdTask).__name__
    'BirdSQLEnv'
    """
    return load_env_creator(gym.spec(kind.env_id).entry_point)
