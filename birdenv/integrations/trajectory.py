"""One trajectory on the Gymnasium environments, for the adapters of other RL frameworks.

verl, OpenEnv and SkyRL-gym each hand an adapter either the model's turn as text or a parsed tool
call. :class:`Trajectory` turns both into a ``step`` of the registered Gymnasium environment
(``gymnasium.make``), so the prompt, the tool schemas, the observations, the turn limit and the
judge are exactly the environment's, and a trajectory owns one database session from
:meth:`Trajectory.start` until it ends or :meth:`Trajectory.close` frees it.

>>> from birdenv.integrations.trajectory import Trajectory
>>> from birdenv.tools import format_tool_call
>>> trajectory = Trajectory(kind="critic", suite="gym-mini")
>>> prompt = trajectory.start(trajectory.task_ids[0])
>>> trajectory.turn(format_tool_call("execute_sql", sql="SELECT 1 AS x")).observation.splitlines()[0]
'status: ok'
>>> trajectory.call("execute_sql", {"query": "SELECT 1"}).observation.splitlines()[0]
'status: error'
>>> trajectory.close()
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym

import birdenv
from birdenv.envs import env_id_for, task_env
from birdenv.errors import TaskKindError
from birdenv.tasks import task_kinds
from birdenv.tools import format_tool_call

__all__ = ["Trajectory", "Turn", "kind_env_ids", "task_list"]


_OVER = "status: error\nerror: the episode is over (submitted or out of turns); start a new one"
_CLOSED = (
    "status: error\nerror: the episode's session was closed before the episode ended (a server "
    "closes a session idle past its timeout); start a new one"
)


@dataclass(frozen=True)
class Turn:
    """What one turn gave: the observation text, the reward, whether the episode ended, the
    verdict as a dict once a submission was judged (else None) and whether it passed."""

    observation: str
    reward: float
    done: bool
    verdict: dict[str, Any] | None = None
    passed: bool = False


def kind_env_ids() -> dict[str, str]:
    """Each kind of task's name (``task.kind``) -> the Gymnasium id of the SQLite environment
    that plays it, for every kind the registry knows (:func:`birdenv.tasks.task_kinds`)."""
    return {kind.kind: kind.env_id for kind in task_kinds()}


def _env_id(kind: str) -> str:
    ids = kind_env_ids()
    if kind not in ids:
        raise TaskKindError(f"kind must be one of {sorted(ids)}, got {kind!r}")
    return ids[kind]


@functools.lru_cache(maxsize=32)
def _cached_tasks(kind: str, source: str | None, db_dir: str | None) -> tuple[Any, ...]:
    if source is None:
        # The environment's own default suite for the kind.
        env = gym.make(_env_id(kind), disable_env_checker=True)
        try:
            return tuple(env.unwrapped.tasks)
        finally:
            env.close()
    return tuple(birdenv.load_tasks(source, db_dir=db_dir))


def task_list(
    kind: str = "critic",
    *,
    suite: str | None = None,
    tasks: str | Path | list[Any] | None = None,
    db_dir: str | Path | None = None,
) -> list[Any]:
    """The tasks an adapter plays: a bundled ``suite``, a ``tasks`` file (with ``db_dir``) or a list
    of tasks; with neither, the default suite of ``kind``'s environment. Loaded once per process."""
    if suite is not None and tasks is not None:
        raise ValueError("give either suite= or tasks= (with db_dir=), not both")
    if isinstance(tasks, list):
        return list(tasks)
    source = suite if suite is not None else (str(tasks) if tasks is not None else None)
    loaded = list(_cached_tasks(kind, source, str(db_dir) if db_dir is not None else None))
    env_id = _env_id(kind)
    wrong = next((t for t in loaded if t.env_id != env_id), None)
    if wrong is not None:
        raise ValueError(
            f"{source!r} holds {type(wrong).__name__} tasks ({wrong.env_id}), not {kind!r} tasks: "
            f"pass kind={wrong.kind!r}"
        )
    return loaded


class Trajectory:
    """One trajectory: a Gymnasium environment of ``kind`` over a task set, one episode at a time.

    ``kind`` is ``"critic"`` (``BirdCritic-SQLite-v0``, or ``BirdCritic-PostgreSQL-v0`` for
    PostgreSQL tasks: :func:`birdenv.envs.task_env`) or ``"bird"`` (``BirdSQL-SQLite-v0``);
    ``suite``/``tasks``/``db_dir`` choose the tasks (:func:`task_list`); ``max_turns`` is
    Gymnasium's ``max_episode_steps`` (None: the registered default); other keywords (``reward``,
    ``pool``, ``statement_timeout`` ...) go to the environment. Thread-safe: calls on one trajectory
    run one at a time, so a framework may step it from a thread pool.
    """

    def __init__(
        self,
        kind: str = "critic",
        *,
        suite: str | None = None,
        tasks: str | Path | list[Any] | None = None,
        db_dir: str | Path | None = None,
        max_turns: int | None = None,
        **env_kwargs: Any,
    ) -> None:
        self.kind = kind
        self.tasks = task_list(kind, suite=suite, tasks=tasks, db_dir=db_dir)
        self._by_id = {str(t.instance_id): t for t in self.tasks}
        # Each task plays in its own dialect's environment (PostgreSQL tasks on PostgreSQL), by
        # the rule every entry point follows; the turn limit is the registered one.
        steps = max_turns or gym.spec(env_id_for(self.tasks[0])).max_episode_steps
        self.env = gym.wrappers.TimeLimit(task_env(self.tasks, **env_kwargs), steps)
        self._lock = threading.Lock()
        self.task: Any = None
        self.reward = 0.0
        self.verdict: dict[str, Any] | None = None
        self.passed = False
        self.done = True
        # The episode was cut short by close() (a server's idle reaper, a disconnect): its next
        # turn says so, not that the episode was played out.
        self._closed_early = False

    @property
    def task_ids(self) -> list[str]:
        """The ids of the tasks this trajectory can play, in order."""
        return list(self._by_id)

    def start(self, task_id: str | None = None, *, seed: int | None = None) -> str:
        """Start an episode on ``task_id`` (else a task drawn with ``seed``) with a fresh session;
        return the user prompt. An episode still open is ended first (its session freed)."""
        with self._lock:
            if task_id is not None and str(task_id) not in self._by_id:
                raise KeyError(f"unknown task_id {task_id!r}")
            options = {"task_id": str(task_id)} if task_id is not None else None
            prompt, _ = self.env.reset(seed=seed, options=options)
            self.task = self.env.unwrapped.task
            self.reward, self.verdict, self.passed, self.done = 0.0, None, False, False
            self._closed_early = False
            return prompt

    def turn(self, text: str) -> Turn:
        """Play the model's turn (free text holding one tool call). A malformed or unknown call is an
        error observation, as is any turn after the episode ended; nothing here raises for it."""
        with self._lock:
            if self.done:
                message = _CLOSED if self._closed_early else _OVER
                return Turn(message, 0.0, True, self.verdict, self.passed)
            observation, reward, terminated, truncated, info = self.env.step(text)
            if terminated or truncated:
                self.reward, self.verdict, self.done = float(reward), info.get("verdict"), True
                played = self.env.unwrapped
                played = getattr(played, "env", played)  # a MixedTaskEnv's episode's own env
                self.passed = bool(getattr(played.verdict, "passed", False))
                # A truncated episode still holds its session: free it now, not at the next start.
                self.env.unwrapped.close()
            return Turn(observation, float(reward), self.done, self.verdict, self.passed)

    def call(self, name: str, arguments: Mapping[str, Any]) -> Turn:
        """Play a parsed tool call (``name`` and its ``arguments``) as the text a model would write."""
        return self.turn(format_tool_call(str(name), **dict(arguments)))

    def close(self) -> None:
        """End the episode and free its session (safe to call twice)."""
        with self._lock:
            self._closed_early = self._closed_early or not self.done
            self.done = True
            self.env.close()
