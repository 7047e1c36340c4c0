"""SkyRL-gym: both kinds as registered ``BaseTextEnv``s, one database session per trajectory.

Importing this module registers ``BirdCritic-SQLite-v0`` (debugging) and ``BirdSQL-SQLite-v0``
(text-to-SQL) with ``skyrl_gym``, under the same ids as in Gymnasium. SkyRL's generator drives them
as it drives any text environment: ``skyrl_gym.make(env_class, env_config=..., extras=row)`` per
trajectory, ``init(prompt)``, ``step(model_turn)`` (possibly from a thread pool) until ``done``,
then ``close()``. Unlike SkyRL-gym's own SQL environment (a fresh connection per query on one
database file shared by every trajectory, rolled back after each query), a trajectory here owns a
persistent, isolated session: its writes persist across its turns, nobody else sees them, and the
reward is the judge's verdict on fresh states.

``env_config`` (SkyRL's ``environment.skyrl_gym.<env_class>`` section) may set ``suite`` or
``tasks`` with ``db_dir``, ``reward``, ``statement_timeout`` ...; a row's ``extras`` name the task
(``task_id``) and SkyRL adds ``max_turns``. :func:`skyrl_rows` builds the rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from birdenv.integrations.trajectory import Trajectory, kind_env_ids, task_list

__all__ = ["BirdCriticSkyRLEnv", "BirdSQLSkyRLEnv", "skyrl_rows"]

# Settings of env_config that choose the tasks and the environment (SkyRL may add others).
_SETTINGS = (
    "suite",
    "tasks",
    "db_dir",
    "reward",
    "statement_timeout",
    "max_rows",
    "max_result_bytes",
)


class BirdCriticSkyRLEnv(BaseTextEnv):
    """A SkyRL-gym text environment on debugging tasks (``BirdCritic-SQLite-v0``).

    ``init`` starts the episode on ``extras["task_id"]`` and returns the environment's prompt (a
    system message of the row's prompt is kept); ``step`` plays the model's turn and returns the
    tool's response as a user message; the episode ends on a submission or after ``max_turns``.
    """

    kind: ClassVar[str] = "critic"

    def __init__(
        self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        extras = dict(extras or {})
        config = dict(env_config or {})
        self.max_turns = int(extras.get("max_turns") or config.get("max_turns") or 5)
        self.task_id = extras.get("task_id")
        self.trajectory = Trajectory(
            self.kind,
            max_turns=self.max_turns,
            **{key: config[key] for key in _SETTINGS if config.get(key) is not None},
        )

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Start the episode; return the conversation to give the model and the task's metadata."""
        text = self.trajectory.start(self.task_id)
        system = [dict(m) for m in prompt or [] if m.get("role") == "system"]
        task = self.trajectory.task
        return [*system, {"role": "user", "content": text}], {
            "task_id": str(task.instance_id),
            "category": task.category,
        }

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Play one turn; the observation is the tool's response (or the verdict) as a user turn."""
        self.turns += 1
        turn = self.trajectory.turn(action)
        return BaseTextEnvStepOutput(
            observations=[] if turn.done else [{"role": "user", "content": turn.observation}],
            reward=turn.reward,
            done=turn.done,
            metadata={"observation": turn.observation, "verdict": turn.verdict},
        )

    def close(self) -> None:
        """Free the trajectory's session (SkyRL calls this when the trajectory ends)."""
        self.trajectory.close()

    def get_metrics(self) -> dict[str, Any]:
        """``passed`` (1/0 once judged) and ``turns``."""
        return {"passed": float(self.trajectory.passed), "turns": self.turns}


class BirdSQLSkyRLEnv(BirdCriticSkyRLEnv):
    """:class:`BirdCriticSkyRLEnv` on text-to-SQL questions (``BirdSQL-SQLite-v0``)."""

    kind: ClassVar[str] = "bird"


def skyrl_rows(
    kind: str = "critic",
    *,
    suite: str | None = None,
    tasks: str | Path | list[Any] | None = None,
    db_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """SkyRL dataset rows for every task of ``kind``: ``prompt`` (an empty user turn: ``init``
    fills it in), ``env_class`` (the registered id) and ``task_id`` (SkyRL passes the row's other
    fields to the environment as ``extras``)."""
    return [
        {
            "prompt": [{"role": "user", "content": ""}],
            "env_class": kind_env_ids()[kind],
            "task_id": str(task.instance_id),
        }
        for task in task_list(kind, suite=suite, tasks=tasks, db_dir=db_dir)
    ]


for _env_class in (BirdCriticSkyRLEnv, BirdSQLSkyRLEnv):
    if kind_env_ids()[_env_class.kind] not in skyrl_gym.registry:
        skyrl_gym.register(
            id=kind_env_ids()[_env_class.kind],
            entry_point=f"{__name__}:{_env_class.__name__}",
        )
