"""birdenv: Gymnasium environments for stateful SQL work on SQLite: debugging and text-to-SQL.

Each trajectory gets its own persistent database session, isolated from every other trajectory,
on copy-on-write replicas of immutable base databases; the reward is the official verdict of the
task's kind (BIRD-CRITIC's judge, or BIRD's execution accuracy). ``import birdenv`` registers the
environments::

    import gymnasium as gym
    import birdenv

    env = gym.make("BirdCritic-SQLite-v0")   # or "BirdSQL-SQLite-v0"

``birdenv.load_tasks`` loads tasks of either kind (:class:`birdenv.tasks.BaseTask`).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.abc
    import importlib.machinery

    from birdenv.tasks import Task, load_tasks

from birdenv.errors import BirdEnvError

__version__ = "0.1.0"
__all__ = ["ENV_IDS", "BirdEnvError", "Task", "__version__", "load_tasks"]


def __getattr__(name: str) -> Any:
    # The tasks load on first use: every `import birdenv.<module>` runs this package first, and
    # the replicas or the tools need no task.
    if name in ("Task", "load_tasks"):
        from birdenv import tasks

        return getattr(tasks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Every environment id this package registers.
ENV_IDS = ("BirdCritic-SQLite-v0", "BirdSQL-SQLite-v0", "BirdCritic-PostgreSQL-v0")


def _register() -> None:
    # gymnasium takes ~0.8 s of CPU to import: imported only where used
    from gymnasium.envs.registration import register, registry

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
    if "BirdCritic-PostgreSQL-v0" not in registry:
        register(
            id="BirdCritic-PostgreSQL-v0",
            entry_point="birdenv.envs.critic_pg:BirdCriticPgEnv",
            max_episode_steps=5,
        )


class _RegisterAfterGymnasium:
    """Registers the environments the moment ``gymnasium`` finishes importing.

    Importing gymnasium (and numpy with it) costs ~0.15 s of CPU, which ``birdenv evaluate`` and
    every judging worker would pay for nothing: they never make an environment. So ``import
    birdenv`` registers at once only when gymnasium is already loaded, and otherwise leaves this
    finder on ``sys.meta_path``: it finds gymnasium with the other finders, lets its own loader
    run, then registers. Nobody can call ``gym.make`` before that. It is a finder and a loader by
    its methods, as the import system asks, not by ``importlib.abc``'s classes: importing that
    module (and ``importlib.resources`` with it) would cost every process ~10 ms.
    """

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "gymnasium" or self._loader is not None:
            return None
        for finder in sys.meta_path:  # the search the import system would make without us
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._loader, spec.loader = spec.loader, self
                return spec
        return None  # not installed: the import fails as it would without birdenv

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        assert self._loader is not None
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        assert self._loader is not None
        # The module keeps its own loader (importlib.resources and reloads look it up there).
        loader, self._loader = self._loader, None  # a failed import may be retried
        module.__loader__ = module.__spec__.loader = loader
        loader.exec_module(module)
        sys.meta_path.remove(self)
        _register()


if "gymnasium" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterGymnasium())
