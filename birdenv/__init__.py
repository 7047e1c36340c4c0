"""birdenv: Gymnasium environments for stateful SQL debugging on SQLite.

Each trajectory gets its own persistent database session, isolated from every other trajectory,
on copy-on-write replicas of immutable base databases; the reward is the official BIRD-CRITIC
verdict. ``import birdenv`` registers the environments::

    import gymnasium as gym
    import birdenv

    env = gym.make("BirdCritic-SQLite-v0")
"""

from gymnasium.envs.registration import register, registry

from birdenv.errors import BirdEnvError
from birdenv.tasks import Task, load_tasks

__version__ = "0.1.0"
__all__ = ["ENV_IDS", "BirdEnvError", "Task", "__version__", "load_tasks"]

#: Every environment id this package registers.
ENV_IDS = ("BirdCritic-SQLite-v0", "BirdSQL-SQLite-v0")


def _register() -> None:
    # Safe to run twice: subprocess workers re-import the package.
    if "BirdCritic-SQLite-v0" not in registry:
        register(
            id="BirdCritic-SQLite-v0",
            entry_point="birdenv.envs.critic:BirdCriticEnv",
            vector_entry_point="birdenv.vector:make_vec",
            max_episode_steps=5,
        )
    if "BirdSQL-SQLite-v0" not in registry:
        register(
            id="BirdSQL-SQLite-v0",
            entry_point="birdenv.envs.bird_sql:BirdSQLEnv",
            max_episode_steps=5,
        )


_register()
