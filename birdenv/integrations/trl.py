"""An adapter for TRL's ``GRPOTrainer(environment_factory=...)``, over the same environment core.

TRL creates one environment per rollout, calls ``reset(**dataset_row)``, exposes every public method
as a tool (its signature and Google docstring become the tool schema) and scores a finished rollout
with ``get_reward()``. :class:`BirdCriticTRLEnv` does each of these by driving a
:class:`~birdenv.envs.critic.BirdCriticEnv` with the tool-call text a model would write, so the
prompt, the tool schemas, the observations and the judge are exactly those of the Gymnasium
environment. Nothing here imports TRL.

.. code-block:: python

    from trl import GRPOConfig, GRPOTrainer
    from birdenv.integrations.trl import BirdCriticTRLEnv, suite_dataset

    trainer = GRPOTrainer(
        model=model_path,
        args=GRPOConfig(...),
        train_dataset=suite_dataset("gym-mini"),
        environment_factory=BirdCriticTRLEnv,
    )
"""

from __future__ import annotations

from typing import Any

from birdenv import tools
from birdenv.envs.critic import BirdCriticEnv
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call

__all__ = ["BirdCriticTRLEnv", "suite_dataset"]


class BirdCriticTRLEnv:
    """One rollout's environment for TRL: ``reset``, two tools, ``get_reward``.

    Keyword arguments are those of :class:`BirdCriticEnv` (``suite``, ``tasks``, ``db_dir``,
    ``reward``, ``pool``, ...); pass them with ``functools.partial`` as the factory.
    """

    def __init__(self, **env_kwargs: Any) -> None:
        self.env = BirdCriticEnv(**env_kwargs)
        self.reward = 0.0
        self.done = False

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


def suite_dataset(source: str | list[Task] = "gym-mini", *, db_dir: str | None = None) -> Any:
    """A ``datasets.Dataset`` of a suite's tasks in the form TRL's ``environment_factory`` expects.

    Each row has an empty user ``prompt`` (the environment's ``reset`` fills it in) plus
    ``task_id``, ``db_id`` and ``category``.
    """
    from datasets import Dataset

    tasks = source if isinstance(source, list) else load_tasks(source, db_dir=db_dir)
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": ""}],
                "task_id": t.instance_id,
                "db_id": t.db_id,
                "category": t.category,
            }
            for t in tasks
        ]
    )
