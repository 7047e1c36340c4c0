"""Reference agents for sanity checks and demos: they act through the environment like a model.

``OracleAgent`` explores (runs the issue SQL, lists the tables), tries the gold fix with
``execute_sql`` and submits it: on a validated suite it must score 100 %. ``EchoAgent`` submits the
issue SQL unchanged: it must score 0 %. Both produce their turns with
:func:`birdenv.tools.format_tool_call`, the same text a model would write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from birdenv.tasks import Task
from birdenv.tools import format_tool_call, parse_tool_call

__all__ = ["AGENTS", "SCHEMA_QUERY", "EchoAgent", "OracleAgent", "play_tasks", "run_episode"]

#: The exploration call that lists what a database holds.
SCHEMA_QUERY = "SELECT type, name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name"


class OracleAgent:
    """Explore, try the gold fix, submit it."""

    name = "oracle"

    def turns(self, task: Task) -> list[str]:
        """The agent's turns for ``task``, in order."""
        turns = [
            "First I look at the tables.\n" + format_tool_call("execute_sql", sql=SCHEMA_QUERY),
            "Now I reproduce the user's problem.\n"
            + format_tool_call("execute_sql", sql=task.issue_sql[0]),
        ]
        if task.sol_sql and task.sol_sql[-1].lstrip().lower().startswith(("select", "with")):
            turns.append(
                "Let me check the fix.\n" + format_tool_call("execute_sql", sql=task.sol_sql[-1])
            )
        turns.append(format_tool_call("submit_solution", sql_list=list(task.sol_sql)))
        return turns


class EchoAgent:
    """Submit the issue SQL as it is."""

    name = "echo"

    def turns(self, task: Task) -> list[str]:
        """One turn: submit the problematic SQL."""
        return [format_tool_call("submit_solution", sql_list=list(task.issue_sql))]


AGENTS = {agent.name: agent for agent in (OracleAgent, EchoAgent)}


def run_episode(
    env: Any, agent: OracleAgent | EchoAgent, task_id: str
) -> tuple[float, dict[str, Any]]:
    """Play one episode of ``env`` (a BirdCriticEnv, wrapped or not) on ``task_id``; return (reward, last info)."""
    env.reset(options={"task_id": task_id})
    task = env.unwrapped.task
    reward, info = 0.0, {}
    for action in agent.turns(task):
        _, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return float(reward), info


def play_tasks(
    env: Any,
    agent: OracleAgent | EchoAgent,
    tasks: list[Task],
    progress: Callable[[Iterable[Task]], Iterable[Task]] = lambda tasks: tasks,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Play one episode per task; the prediction rows the agent submitted (``instance_id`` and
    ``pred_sqls``, what ``birdenv evaluate`` reads) and the episodes' rewards."""
    rows, rewards = [], []
    for task in progress(tasks):
        reward, info = run_episode(env, agent, task.instance_id)
        rewards.append(reward)
        submission = parse_tool_call(info["messages"][-2]["content"])
        rows.append(
            {"instance_id": task.instance_id, "pred_sqls": submission.arguments["sql_list"]}
        )
    return rows, rewards
