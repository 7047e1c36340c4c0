"""One environment over several task sources: debugging and text-to-SQL, SQLite and PostgreSQL.

:class:`MixedTaskEnv` routes each episode to the environment of its task's source; :func:`task_env`
builds the environment a task set needs, one environment or a :class:`MixedTaskEnv` over several.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from birdenv.compat import db_dir_argument
from birdenv.envs.choice import env_class_for, env_groups
from birdenv.tasks import load_tasks

__all__ = ["MixedTaskEnv", "task_env"]


class MixedTaskEnv(gym.Env[str, str]):
    """One environment over several task sources, debugging and text-to-SQL alike.

    Each source (a name and its tasks, or a suite name / file to load) gets the environment of its
    tasks' kind and dialect (``BirdCritic-SQLite-v0``, ``BirdCritic-PostgreSQL-v0``,
    ``BirdSQL-SQLite-v0``: :func:`birdenv.envs.env_class_for`); a source whose tasks need several
    gets a :class:`MixedTaskEnv` of its own, one source per environment weighted by its number of
    tasks (:func:`task_env`). ``reset(options={"task_id": id})``
    starts an episode in the env that owns ``id``; a plain ``reset()`` draws a source with
    probability proportional to its weight, using this env's ``np_random``, and the source's env
    draws the task. ``step``, ``render`` and the spaces are the active env's (the same text spaces
    for every kind). ``info["source"]`` names the episode's source. Task ids must be unique across
    sources.

    Args:
        sources: Source name → a list of tasks, or a suite name / file for
            :func:`birdenv.tasks.load_tasks`.
        weights: Source name → sampling weight (non-negative, not all 0); default: each source's
            number of tasks, i.e. uniform over all tasks.
        db_dir: Database folder for sources given as files (``db_root``: its old name).
        **env_kwargs: Passed to every source's env: ``reward``, ``statement_timeout``,
            ``max_rows``, ``max_result_bytes``, ``render_mode``, ``prompt_options``; ``pool`` and
            ``pool_options`` to the SQLite environments (a replica pool), ``pg_dsn`` to the
            PostgreSQL one (the server its databases are cloned on).
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012

    def __init__(
        self,
        sources: Mapping[str, Sequence[Any] | str | Path],
        weights: Mapping[str, float] | None = None,
        *,
        db_dir: str | Path | None = None,
        db_root: str | Path | None = None,
        **env_kwargs: Any,
    ) -> None:
        db_dir = db_dir_argument(db_dir, db_root, "MixedTaskEnv")
        if not sources:
            raise ValueError("a mixture needs at least one task source")
        self.envs: dict[str, Any] = {}
        self._owner: dict[str, str] = {}
        sizes = {}
        for name, source in sources.items():
            tasks = (
                load_tasks(source, db_dir=db_dir)
                if isinstance(source, (str, Path))
                else list(source)
            )
            if not tasks:
                raise ValueError(f"task source {name!r} holds no tasks")
            for task in tasks:
                other = self._owner.setdefault(task.instance_id, name)
                if other != name:
                    raise ValueError(
                        f"task id {task.instance_id!r} is in both {other!r} and {name!r}: ids must "
                        "be unique across the sources of a mixture"
                    )
            # The source's env (its tasks' own, or one per environment they need), without the
            # TimeLimit: this env carries one.
            self.envs[name] = _source_env(tasks, env_kwargs)
            sizes[name] = len(tasks)
        weights = dict(sizes if weights is None else weights)
        if set(weights) != set(self.envs):
            raise ValueError(
                f"weights name {sorted(weights)} but the sources are {sorted(self.envs)}"
            )
        values = np.array([float(weights[name]) for name in self.envs])
        if (values < 0).any() or not np.isfinite(values).all() or values.sum() <= 0:
            raise ValueError(f"weights must be finite, non-negative and not all 0, got {weights}")
        self.names = list(self.envs)
        self.weights = dict(zip(self.names, (values / values.sum()).tolist(), strict=True))
        self._p = values / values.sum()
        first = next(iter(self.envs.values()))
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        self.render_mode = env_kwargs.get("render_mode")
        self.active: str | None = None
        self._sub_seeds: dict[str, int] = {}

    def _seed_sources(self) -> None:
        # Every source's env draws its tasks from its own generator, seeded from this one's.
        draws = self.np_random.integers(2**31, size=len(self.names))
        self._sub_seeds = {name: int(s) for name, s in zip(self.names, draws, strict=True)}

    @property
    def env(self) -> Any:
        """The env of the current episode's source."""
        if self.active is None:
            raise gym.error.ResetNeeded("call reset() first")
        return self.envs[self.active]

    @property
    def task(self) -> Any:
        """The current episode's task (``None`` before the first reset)."""
        return None if self.active is None else self.envs[self.active].task

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode: on ``options["task_id"]``, else on a task of a source drawn by weight."""
        super().reset(seed=seed)
        if seed is not None:
            self._seed_sources()
        task_id = (options or {}).get("task_id")
        if task_id is not None:
            if str(task_id) not in self._owner:
                raise KeyError(f"unknown task_id {task_id!r}")
            name = self._owner[str(task_id)]
        else:
            name = self.names[int(self.np_random.choice(len(self.names), p=self._p))]
        if self.active is not None and self.active != name:
            # One session at a time per copy: leave the other source's episode behind.
            self._release()
        self.active = name
        observation, info = self.envs[name].reset(
            seed=self._sub_seeds.pop(name, None), options=options
        )
        info["source"] = name
        return observation, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The active env's step; ``info["source"]`` added."""
        observation, reward, terminated, truncated, info = self.env.step(action)
        info["source"] = self.active
        return observation, reward, terminated, truncated, info

    def render(self) -> str | None:
        """The active episode's conversation as text (``render_mode="ansi"``)."""
        return None if self.active is None else self.envs[self.active].render()

    def _release(self) -> None:
        """End the active episode's session (a source's env leaves it when another is drawn)."""
        if self.active is not None:
            self.envs[self.active]._release()

    def close(self) -> None:
        """Close every source's env (safe to call twice)."""
        for env in self.envs.values():
            env.close()
        super().close()


# What only the environments of one dialect take, in a mixture: the replica pool is SQLite's, the
# server PostgreSQL's.
_DIALECT_ONLY = {"pool": "sqlite", "pool_options": "sqlite", "pg_dsn": "postgresql"}


def _source_env(tasks: list[Any], env_kwargs: dict[str, Any]) -> Any:
    """A mixture's environment for one source: its tasks' own, with the arguments it takes."""
    groups = env_groups(tasks)
    if len(groups) > 1:
        return MixedTaskEnv(groups, **env_kwargs)
    env_class = env_class_for(tasks[0])
    mine = {
        k: v
        for k, v in env_kwargs.items()
        if _DIALECT_ONLY.get(k, env_class.dialect) == env_class.dialect
    }
    return env_class(tasks=tasks, **mine)


def task_env(tasks: Sequence[Any], **env_kwargs: Any) -> Any:
    """One environment over ``tasks`` (a non-empty list, of any kinds and dialects), unwrapped.

    Tasks that one environment plays get that environment (:func:`~birdenv.envs.env_class_for`);
    tasks that need several get a :class:`MixedTaskEnv` with one source per environment id,
    weighted by its number of tasks, which routes ``reset(options={"task_id": ...})`` to the
    task's own environment. ``env_kwargs`` go to the environment, those of another dialect left
    out (``pool`` is SQLite's, ``pg_dsn`` PostgreSQL's); in a :class:`MixedTaskEnv`, as it says.

    >>> from birdenv.tasks import load_tasks
    >>> env = task_env(load_tasks("critic-mini")[:2] + load_tasks("critic-mini-pg")[:2])
    >>> env.names
    ['BirdCritic-SQLite-v0', 'BirdCritic-PostgreSQL-v0']
    >>> env.close()
    """
    groups = env_groups(tasks)
    if not groups:
        raise ValueError("the task set is empty")
    if len(groups) == 1:  # with the arguments its dialect takes, as a mixture's source
        return _source_env(next(iter(groups.values())), env_kwargs)
    return MixedTaskEnv(groups, **env_kwargs)
