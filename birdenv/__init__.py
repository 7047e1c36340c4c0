"""birdenv: Gymnasium environments for stateful SQL debugging on SQLite.

Each trajectory gets its own persistent database session, isolated from every other trajectory,
on copy-on-write replicas of immutable base databases; the reward is the official BIRD-CRITIC
verdict.
"""

from birdenv.errors import BirdEnvError
from birdenv.tasks import Task, load_tasks

__version__ = "0.1.0"
__all__ = ["BirdEnvError", "Task", "__version__", "load_tasks"]
