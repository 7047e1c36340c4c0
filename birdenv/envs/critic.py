"""``BirdCritic-SQLite-v0``: debug a user's SQL on a live database, over several turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from birdenv.envs.base import CHARSET, MAX_TEXT, ToolEnv, UnicodeText
from birdenv.judge import Verdict, judge
from birdenv.replicas.pool import ReplicaPool
from birdenv.replicas.session import Session
from birdenv.schema import PromptOptions, task_schema
from birdenv.tasks import Task, load_tasks
from birdenv.tools import TOOL_INSTRUCTIONS

__all__ = ["CHARSET", "MAX_TEXT", "BirdCriticEnv", "UnicodeText", "render_prompt"]


_PROMPT = """You are a SQL assistant. Your task is to understand the user's issue and fix their problematic SQL, given the database schema. You can explore the database before you answer.

# Database Schema:
{schema}

# User issue:
{query}

# Problematic SQL:
{issue_sql}

{tools}"""


def render_prompt(task: Task, options: PromptOptions | None = None) -> str:
    """The user prompt of a task: schema (under ``options``), issue, problematic SQL and the tool
    instructions."""
    return _PROMPT.format(
        schema=task_schema(task, options),
        query=task.query,
        issue_sql="\n".join(f"```sql\n{sql}\n```" for sql in task.issue_sql),
        tools=TOOL_INSTRUCTIONS,
    )


class BirdCriticEnv(ToolEnv):
    """
    ## Description
    A user posts an issue and the SQL that misbehaves; the agent explores their SQLite database with
    ``execute_sql`` over several turns and ends with ``submit_solution``. The reward is the verdict
    of the official BIRD-CRITIC-SQLite evaluator on the submitted statements. Every episode owns one
    persistent database session, isolated from every other episode (copy-on-write replicas): writes,
    TEMP tables and pragmas persist across its turns and nobody else sees them.

    ```python
    >>> import gymnasium as gym, birdenv
    >>> env = gym.make("BirdCritic-SQLite-v0")
    >>> obs, info = env.reset(seed=0)
    >>> sorted(info)
    ['category', 'db_id', 'messages', 'task_id', 'tools']

    ```

    ## Action Space
    ``Text``: the model's turn, free text holding exactly one tool call in the format chat
    templates and TRL use, e.g.
    ``<tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}</tool_call>``;
    :func:`birdenv.tools.format_tool_call` builds one.

    ## Observation Space
    ``Text``: after ``reset``, the user prompt (schema with three rows per table, the issue, the
    problematic SQL, the tool instructions); after a step, the tool's response, formatted by
    :func:`birdenv.tools.format_observation` (status, columns, first rows, row count, notices or the
    SQLite error) or the verdict.

    ## Rewards
    ``reward="binary"`` (default): 1.0 when the judge accepts the submission, else 0.0.
    ``reward="fraction"``: tests passed ÷ tests run. Exploration steps and malformed calls give 0.

    ## Starting State
    A task drawn with ``self.np_random`` (or ``options={"task_id": ...}``), on a fresh state of its
    database with ``preprocess_sql`` applied.

    ## Episode End
    Terminated after ``submit_solution``. Truncated after ``max_episode_steps`` turns (5 by
    default, the TimeLimit wrapper) with reward 0 and no verdict. A turn with no call, two calls,
    malformed JSON or an unknown tool gets an error observation and still counts.

    ## Arguments
    - ``suite``: a bundled suite name (default ``"critic-mini"``), or
    - ``tasks`` (a JSONL path or a list of :class:`~birdenv.tasks.Task`) with ``db_dir``;
    - ``reward``: ``"binary"`` or ``"fraction"``;
    - ``pool``: a :class:`~birdenv.replicas.ReplicaPool` to share (default: the process's pool),
      or ``pool_options`` to build one;
    - ``statement_timeout``, ``max_rows``, ``max_result_bytes``: bounds of every ``execute_sql``;
    - ``prompt_options``: how the prompt shows the database, a
      :class:`~birdenv.schema.PromptOptions` or a mapping of its fields: ``schema="full"``
      (default, every table) or ``"linked"`` (the tables the issue SQL names and their
      foreign-key neighbours), ``sample_rows=True`` (default) or ``False``.

    ## Version History
    - v0: initial release.
    """

    def __init__(
        self,
        suite: str | None = None,
        *,
        tasks: str | Path | list[Task] | None = None,
        db_dir: str | Path | None = None,
        reward: str = "binary",
        pool: ReplicaPool | None = None,
        pool_options: dict[str, Any] | None = None,
        statement_timeout: float = 30.0,
        max_rows: int = 10_000,
        max_result_bytes: int = 4 << 20,
        render_mode: str | None = None,
        prompt_options: PromptOptions | dict[str, Any] | None = None,
    ) -> None:
        if suite is not None and tasks is not None:
            raise ValueError("give either suite= or tasks= (with db_dir=), not both")
        self.prompt_options = PromptOptions.of(prompt_options)
        if not isinstance(tasks, list):
            tasks = load_tasks(
                tasks if tasks is not None else (suite or "critic-mini"), db_dir=db_dir
            )
        super().__init__(
            tasks,
            reward=reward,
            pool=pool,
            pool_options=pool_options,
            statement_timeout=statement_timeout,
            max_rows=max_rows,
            max_result_bytes=max_result_bytes,
            render_mode=render_mode,
        )
        self.task: Task | None = None
        self.verdict: Verdict | None = None

    def prompt(self, task: Task) -> str:
        """The task's prompt: :func:`render_prompt` under the env's prompt options."""
        return render_prompt(task, self.prompt_options)

    def category(self, task: Task) -> str:
        """Query, Management or Personalization."""
        return task.category

    def lease(self, task: Task) -> Session:
        """A fresh session with ``preprocess_sql`` applied, for this trajectory alone."""
        return self.pool.session(task, limits=self.limits, exclusive=True)

    def judge_submission(self, sql_list: list[str]) -> tuple[Verdict, float]:
        """The official verdict, under the env's statement deadline."""
        verdict = judge(
            self.task, sql_list, pool=self.pool, statement_timeout=self.limits.statement_timeout
        )
        return verdict, float(verdict.passed) if self.reward_mode == "binary" else verdict.fraction
