"""``BirdSQL-SQLite-v0``: answer a question about a live database with one SQL query (BIRD)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from birdenv.bird import BirdTask, ExVerdict, execution_accuracy, load_bird
from birdenv.envs.base import ToolEnv
from birdenv.replicas.pool import ReplicaPool
from birdenv.schema import PromptOptions, task_schema
from birdenv.tools import TOOL_INSTRUCTIONS

__all__ = ["BirdSQLEnv", "render_prompt"]

_PROMPT = """You are a SQL assistant. Your task is to answer the user's question with one SQLite query, given the database schema and the external knowledge. You can explore the database before you answer.

# Database Schema:
{schema}

# Question:
{question}

# External knowledge:
{evidence}

{tools}
Submit exactly one SELECT statement as the only element of sql_list; it is judged by running it on a fresh copy of the database and comparing its rows with the correct answer's (order and duplicates ignored)."""


def render_prompt(task: BirdTask, options: PromptOptions | None = None) -> str:
    """The user prompt of a BIRD question: schema (under ``options``), question, evidence and the
    tool instructions."""
    return _PROMPT.format(
        schema=task_schema(task, options),
        question=task.question,
        evidence=task.evidence or "(none)",
        tools=TOOL_INSTRUCTIONS,
    )


class BirdSQLEnv(ToolEnv):
    """
    ## Description
    Text-to-SQL in the style of BIRD: the agent gets a database schema, a question in natural
    language and its external knowledge ("evidence"), explores the SQLite database with
    ``execute_sql`` over several turns and ends with ``submit_solution``. The reward is BIRD's
    execution accuracy (:func:`birdenv.bird.execution_accuracy`): the submitted query and the gold
    query run on the same fresh state and their rows are compared as sets. Every episode owns one
    persistent database session, isolated from every other episode; nothing it writes reaches the
    state the submission is judged on.

    ```python
    >>> import gymnasium as gym, birdenv
    >>> env = gym.make("BirdSQL-SQLite-v0")
    >>> obs, info = env.reset(seed=0)
    >>> sorted(info)
    ['category', 'db_id', 'messages', 'task_id', 'tools']

    ```

    ## Action Space
    ``Text``: the model's turn holding exactly one tool call, as in ``BirdCritic-SQLite-v0``, e.g.
    ``<tool_call>{"name": "submit_solution", "arguments": {"sql_list": ["SELECT ..."]}}</tool_call>``.

    ## Observation Space
    ``Text``: after ``reset``, the user prompt (schema with three rows per table, the question, the
    evidence, the tool instructions); after a step, the tool's response formatted by
    :func:`birdenv.tools.format_observation`, or the verdict by :func:`birdenv.tools.format_verdict`.

    ## Rewards
    1.0 when the submission is correct under BIRD's execution-accuracy rule, else 0.0 (``reward=
    "binary"`` and ``"fraction"`` are the same here: EX is one test). Exploration steps and
    malformed calls give 0. ``sql_list`` should hold one statement; when it holds more, **only the
    last one is the answer** and the others are ignored (not run); an empty list scores 0.

    The gold query runs on a pristine state of its own (``isolate_gold=True``, its result cached
    per question), not after the submission on the same state as the official script does: there
    a submission that writes (``DELETE FROM t``) can empty the gold's result and then equal it, a
    reward hack. Here writes only reach the submission's own result. On every submission that
    does not write, the reward is the official EX.

    ## Starting State
    A question drawn with ``self.np_random`` (or ``options={"task_id": ...}``, the question id as
    an int or a string), on a fresh state of its database.

    ## Episode End
    Terminated after ``submit_solution``. Truncated after ``max_episode_steps`` turns (5 by default,
    the TimeLimit wrapper) with reward 0 and no verdict. A turn with no call, two calls, malformed
    JSON or an unknown tool gets an error observation and still counts.

    ## Info
    The keys of ``BirdCritic-SQLite-v0``: ``task_id`` (the question id as a string), ``db_id``,
    ``category`` (the difficulty), ``messages``, ``tools``; ``verdict`` after a submission.

    ## Arguments
    - ``suite``: a bundled suite name (default ``"bird-mini-eval"``; also ``"bird-mini-train"``), or
    - ``tasks`` (a BIRD JSONL/JSON path or a list of :class:`~birdenv.bird.BirdTask`) with
      ``db_root`` (the folder holding ``{db_id}/{db_id}.sqlite``);
    - ``reward``: ``"binary"`` or ``"fraction"`` (equal here);
    - ``pool`` / ``pool_options``, ``statement_timeout``, ``max_rows``, ``max_result_bytes``: as in
      ``BirdCritic-SQLite-v0``;
    - ``prompt_options``: as in ``BirdCritic-SQLite-v0``; ``schema="linked"`` keeps the tables
      whose names or columns' names the question or its evidence mention, and their foreign-key
      neighbours.

    ## Version History
    - v0: initial release.
    """

    def __init__(
        self,
        suite: str | None = None,
        *,
        tasks: str | Path | list[BirdTask] | None = None,
        db_root: str | Path | None = None,
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
            raise ValueError("give either suite= or tasks= (with db_root=), not both")
        self.prompt_options = PromptOptions.of(prompt_options)
        if not isinstance(tasks, list):
            tasks = load_bird(
                tasks if tasks is not None else (suite or "bird-mini-eval"), db_root=db_root
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
        self.task: BirdTask | None = None
        self.verdict: ExVerdict | None = None

    def prompt(self, task: BirdTask) -> str:
        """The question's prompt: :func:`render_prompt` under the env's prompt options."""
        return render_prompt(task, self.prompt_options)

    def category(self, task: BirdTask) -> str:
        """The question's difficulty: simple, moderate or challenging."""
        return task.difficulty

    def judge_submission(self, sql_list: list[str]) -> tuple[ExVerdict, float]:
        """Execution accuracy of the last statement (the answer), the gold on a pristine state."""
        if not sql_list:
            verdict = ExVerdict(
                instance_id=self.task.instance_id,
                correct=False,
                phase="prediction",
                error="sql_list is empty: submit one SELECT statement",
            )
        else:
            verdict = execution_accuracy(
                self.task,
                sql_list[-1],
                pool=self.pool,
                statement_timeout=self.limits.statement_timeout,
                isolate_gold=True,  # a submission that writes must not change the gold's result
            )
        return verdict, verdict.fraction
