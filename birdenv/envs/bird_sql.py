"""``BirdSQL-SQLite-v0``: answer a question about a live database with one SQL query (BIRD)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym

from birdenv.bird import BirdTask, ExVerdict, execution_accuracy, load_bird
from birdenv.envs.critic import MAX_TEXT, UnicodeText, _in_charset
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.replicas.session import Limits, Session
from birdenv.schema import render_schema
from birdenv.tools import (
    TOOL_INSTRUCTIONS,
    TOOL_SCHEMAS,
    ToolCallError,
    format_observation,
    format_verdict,
    parse_tool_call,
)

__all__ = ["BirdSQLEnv", "render_prompt"]

_REWARDS = ("binary", "fraction")

_PROMPT = """You are a SQL assistant. Your task is to answer the user's question with one SQLite query, given the database schema and the external knowledge. You can explore the database before you answer.

# Database Schema:
{schema}

# Question:
{question}

# External knowledge:
{evidence}

{tools}
Submit exactly one SELECT statement as the only element of sql_list; it is judged by running it on a fresh copy of the database and comparing its rows with the correct answer's (order and duplicates ignored)."""


def render_prompt(task: BirdTask) -> str:
    """The user prompt of a BIRD question: schema, question, evidence and the tool instructions."""
    return _PROMPT.format(
        schema=render_schema(task.db_path),
        question=task.question,
        evidence=task.evidence or "(none)",
        tools=TOOL_INSTRUCTIONS,
    )


class BirdSQLEnv(gym.Env[str, str]):
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
      ``BirdCritic-SQLite-v0``.

    ## Version History
    - v0: initial release.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}

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
    ) -> None:
        if reward not in _REWARDS:
            raise ValueError(f"reward must be one of {_REWARDS}, got {reward!r}")
        if suite is not None and tasks is not None:
            raise ValueError("give either suite= or tasks= (with db_root=), not both")
        if isinstance(tasks, list):
            self.tasks = list(tasks)
        else:
            self.tasks = load_bird(
                tasks if tasks is not None else (suite or "bird-mini-eval"), db_root=db_root
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
        self.task: BirdTask | None = None
        self.session: Session | None = None
        self.messages: list[dict[str, str]] = []
        self.verdict: ExVerdict | None = None

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
            "category": self.task.difficulty,
            "messages": [dict(m) for m in self.messages],
            "tools": TOOL_SCHEMAS,
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode on a question (random, or ``options["task_id"]``) with a fresh session."""
        super().reset(seed=seed)
        self._release()
        task_id = (options or {}).get("task_id")
        if task_id is not None:
            if str(task_id) not in self._by_id:
                raise KeyError(f"unknown task_id {task_id!r}")
            self.task = self._by_id[str(task_id)]
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        base = self.pool.store.base_for(self.task.db_path)
        self.session = self.pool.open_base(
            base, task_id=self.task.instance_id, limits=self.limits, exclusive=True
        )
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
                statements = call.arguments["sql_list"]
                if statements:
                    # Judged on a fresh state, never on this trajectory's mutated one.
                    self.verdict = execution_accuracy(
                        self.task,
                        statements[-1],
                        pool=self.pool,
                        statement_timeout=self.limits.statement_timeout,
                    )
                else:
                    self.verdict = ExVerdict(
                        instance_id=self.task.instance_id,
                        correct=False,
                        phase="prediction",
                        error="sql_list is empty: submit one SELECT statement",
                    )
                reward = self.verdict.fraction
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
