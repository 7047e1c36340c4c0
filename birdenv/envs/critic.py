"""``BirdCritic-SQLite-v0``: debug a user's SQL on a live database, over several turns."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
from gymnasium import spaces

from birdenv.judge import Verdict, judge
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.replicas.session import Limits, Session
from birdenv.schema import render_schema
from birdenv.tasks import Task, load_tasks
from birdenv.tools import (
    TOOL_INSTRUCTIONS,
    TOOL_SCHEMAS,
    ToolCallError,
    format_observation,
    format_verdict,
    parse_tool_call,
)

__all__ = ["CHARSET", "MAX_TEXT", "BirdCriticEnv", "UnicodeText", "render_prompt"]

#: Characters a text observation or action may hold: the Basic Multilingual Plane without
#: surrogates. Anything else (emoji, other planes) is replaced by U+FFFD in observations.
CHARSET = frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)
#: Longest observation or action, in characters.
MAX_TEXT = 1 << 20
_REWARDS = ("binary", "fraction")


@functools.cache
def _charset_tables() -> tuple[Any, ...]:
    # Built once per process (~40 ms) and shared, read-only, by every UnicodeText.
    text = spaces.Text(max_length=1, charset=CHARSET)
    return text._char_set, text._char_list, text._char_index, text._char_str


class UnicodeText(spaces.Text):
    """``spaces.Text`` over :data:`CHARSET` whose copies cost microseconds, not a second.

    Gymnasium deep-copies each sub-environment's spaces to batch them and pickles them to every
    ``AsyncVectorEnv`` worker; a plain ``Text`` over 63,488 characters (a dict of numpy scalars)
    took 0.3-1 s per copy, 9-30 s to start 8 workers. Equal to ``Text(max_length, charset=CHARSET)``.
    """

    def __init__(self, max_length: int = MAX_TEXT, *, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=0, charset="0", seed=seed)
        self._char_set, self._char_list, self._char_index, self._char_str = _charset_tables()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.max_length,), {"_np_random": self._np_random})


_PROMPT = """You are a SQL assistant. Your task is to understand the user's issue and fix their problematic SQL, given the database schema. You can explore the database before you answer.

# Database Schema:
{schema}

# User issue:
{query}

# Problematic SQL:
{issue_sql}

{tools}"""


def render_prompt(task: Task) -> str:
    """The user prompt of a task: schema, issue, problematic SQL and the tool instructions."""
    return _PROMPT.format(
        schema=render_schema(task.db_path),
        query=task.query,
        issue_sql="\n".join(f"```sql\n{sql}\n```" for sql in task.issue_sql),
        tools=TOOL_INSTRUCTIONS,
    )


def _in_charset(text: str) -> str:
    return "".join(c if c in CHARSET else "\ufffd" for c in text) if not text.isascii() else text


class BirdCriticEnv(gym.Env[str, str]):
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
    - ``statement_timeout``, ``max_rows``, ``max_result_bytes``: bounds of every ``execute_sql``.

    ## Version History
    - v0: initial release.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}

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
    ) -> None:
        if reward not in _REWARDS:
            raise ValueError(f"reward must be one of {_REWARDS}, got {reward!r}")
        if suite is not None and tasks is not None:
            raise ValueError("give either suite= or tasks= (with db_dir=), not both")
        if isinstance(tasks, list):
            self.tasks = list(tasks)
        else:
            self.tasks = load_tasks(
                tasks if tasks is not None else (suite or "critic-mini"), db_dir=db_dir
            )
        if not self.tasks:
            raise ValueError("the task set is empty")
        self._by_id = {t.instance_id: t for t in self.tasks}
        self.reward_mode = reward
        self.render_mode = render_mode
        self._pool = pool
        self._pool_options = pool_options
        self._owns_pool = False
        self.limits = Limits(
            statement_timeout=statement_timeout,
            max_rows=max_rows,
            max_result_bytes=max_result_bytes,
        )
        self.observation_space = UnicodeText(MAX_TEXT)
        self.action_space = UnicodeText(MAX_TEXT)
        self.task: Task | None = None
        self.session: Session | None = None
        self.messages: list[dict[str, str]] = []
        self.verdict: Verdict | None = None

    @property
    def pool(self) -> ReplicaPool:
        """The replica pool sessions are leased from (created lazily, inside worker processes)."""
        if self._pool is None:
            if self._pool_options:
                self._pool, self._owns_pool = ReplicaPool(**self._pool_options), True
            else:
                self._pool = default_pool()
        return self._pool

    def _info(self) -> dict[str, Any]:
        assert self.task is not None
        return {
            "task_id": self.task.instance_id,
            "db_id": self.task.db_id,
            "category": self.task.category,
            "messages": [dict(m) for m in self.messages],
            "tools": TOOL_SCHEMAS,
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode on a task (random, or ``options["task_id"]``) with a fresh session."""
        super().reset(seed=seed)
        self._release()
        task_id = (options or {}).get("task_id")
        if task_id is not None:
            if task_id not in self._by_id:
                raise KeyError(f"unknown task_id {task_id!r}")
            self.task = self._by_id[task_id]
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        # The trajectory is the only user of its session (submissions are judged on fresh ones).
        self.session = self.pool.session(self.task, limits=self.limits, exclusive=True)
        self.verdict = None
        prompt = _in_charset(render_prompt(self.task))
        self.messages = [{"role": "user", "content": prompt}]
        return prompt, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the turn's tool call: explore with ``execute_sql`` or end with ``submit_solution``."""
        if self.task is None or self.session is None:
            raise gym.error.ResetNeeded("call reset() before step() (the episode has ended)")
        action = str(action)
        self.messages.append({"role": "assistant", "content": action})
        reward, terminated = 0.0, False
        try:
            call = parse_tool_call(action)
        except ToolCallError as exc:
            observation = f"status: error\nerror: {exc}"
        else:
            if call.name == "execute_sql":
                observation = format_observation(self.session.execute(call.arguments["sql"]))
            else:
                # Judged on fresh states, never on this trajectory's mutated one.
                self.verdict = judge(
                    self.task,
                    call.arguments["sql_list"],
                    pool=self.pool,
                    statement_timeout=self.limits.statement_timeout,
                )
                reward = (
                    float(self.verdict.passed)
                    if self.reward_mode == "binary"
                    else self.verdict.fraction
                )
                observation = format_verdict(self.verdict)
                terminated = True
        observation = _in_charset(observation)
        self.messages.append({"role": "tool", "content": observation})
        info = self._info()
        if terminated:
            info["verdict"] = self.verdict.to_dict()
            self._release()
        return observation, reward, terminated, False, info

    def render(self) -> str | None:
        """The conversation so far as text (``render_mode="ansi"``)."""
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def _release(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def close(self) -> None:
        """Release the session, and the pool if this env built it (safe to call twice)."""
        self._release()
        if self._owns_pool and self._pool is not None:
            self._pool.close()
            self._pool, self._owns_pool = None, False
        super().close()
