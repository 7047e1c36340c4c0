"""The core both environments share: a task set, one session per episode, the tool protocol.

A subclass names the kind of task it plays (:class:`birdenv.tasks.BaseTask`), its default suite
and its manual; the task itself says how its prompt reads and how a submission is judged, so
everything else (loading, spaces, the pool, the prompt, ``reset``/``step`` bookkeeping, error
observations, ``render``, ``close``) lives here once.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
from gymnasium import spaces

from birdenv.compat import db_dir_argument
from birdenv.errors import ArgumentError, TaskKindError
from birdenv.judge import score
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.replicas.session import Limits, Session
from birdenv.schema import PromptOptions, ServerCatalog, task_schema
from birdenv.tasks import BaseTask, load_tasks
from birdenv.tools import (
    TOOL_SCHEMAS,
    ToolCallError,
    format_observation,
    format_verdict,
    parse_tool_call,
    tool_instructions,
)

__all__ = [
    "CHARSET",
    "ENVIRONMENTS",
    "MAX_TEXT",
    "REWARDS",
    "ToolEnv",
    "UnicodeText",
    "in_charset",
    "render_prompt",
]

#: Characters a text observation or action may hold: the Basic Multilingual Plane without
#: surrogates. Anything else (emoji, other planes) is replaced by U+FFFD in observations.
CHARSET = frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)
#: Longest observation or action, in characters.
MAX_TEXT = 1 << 20
#: Reward modes: the verdict (1/0), or the fraction of tests passed.
REWARDS = ("binary", "fraction")


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


def in_charset(text: str) -> str:
    """``text`` with every character outside :data:`CHARSET` replaced by U+FFFD."""
    return "".join(c if c in CHARSET else "\ufffd" for c in text) if not text.isascii() else text


_PROMPT = """You are a SQL assistant. Your task is to {goal}. You can explore the database before you answer.

# Database Schema:
{schema}

{sections}

{tools}"""


def render_prompt(
    task: BaseTask, options: PromptOptions | None = None, *, catalog: ServerCatalog | None = None
) -> str:
    """The user prompt of a task of either kind: the schema (under ``options``; ``catalog``: the
    database as a PostgreSQL server holds it, for a task without a database file), the task's own
    sections (:meth:`~birdenv.tasks.BaseTask.prompt_sections`), the tool instructions and the
    kind's submission rule, if it has one."""
    prompt = _PROMPT.format(
        goal=task.goal,
        schema=task_schema(task, options, catalog=catalog),
        sections=task.prompt_text(),
        tools=tool_instructions(task.dialect),
    )
    return f"{prompt}\n{task.submission_rule}" if task.submission_rule else prompt


#: The environment class of each ``(kind, dialect)`` of task (dialect in lower case): the first
#: :class:`ToolEnv` subclass defined for it, as each names its :attr:`~ToolEnv.task_type` and
#: :attr:`~ToolEnv.dialect` (:func:`birdenv.envs.env_class_for` reads it).
ENVIRONMENTS: dict[tuple[str, str], type[ToolEnv]] = {}


# Phases whose message is the task's own code speaking: a test's assertion message, or the error
# of the gold SQL a test (or BIRD's judge) ran, can quote the gold SQL or its rows.
_ANSWER_PHASES = frozenset({"tests", "gold"})


def shown_verdict(verdict: Any) -> Any:
    """``verdict`` as the agent (its observation) and a client (the info dict) see it: where its
    message comes from the task's tests or gold SQL, only the kind of failure is kept (its first
    words, up to a colon); the full verdict stays on the environment's ``verdict``."""
    if getattr(verdict, "phase", None) not in _ANSWER_PHASES or not verdict.error:
        return verdict
    kind = verdict.error.split("\n", 1)[0].split(":", 1)[0].strip()
    return dataclasses.replace(
        verdict, error=f"{kind} (the message is not shown: it can quote the answer)"
    )


class ToolEnv(gym.Env[str, str]):
    """An episode = a task, a fresh session on its database, turns of ``execute_sql`` and a
    ``submit_solution`` judged on fresh states by the judge of the task's kind (:func:`birdenv.judge.score`).

    A subclass sets :attr:`task_type`, the kind it plays (by default on the kind's
    ``eval_suite``); the constructor's arguments are described in the subclasses' manuals.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    #: The kind of task this environment plays.
    task_type: ClassVar[type[BaseTask]]
    #: The id this environment is registered under (default: its kind's).
    env_id: ClassVar[str] = ""
    #: The dialect (lower case) whose tasks of :attr:`task_type` this environment is chosen for
    #: (:func:`birdenv.envs.env_class_for`).
    dialect: ClassVar[str] = "sqlite"
    #: The dialects (lower case) of the tasks it plays: their databases are served by its pool.
    dialects: ClassVar[tuple[str, ...]] = ("sqlite",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("env_id") and "task_type" in cls.__dict__:
            cls.env_id = cls.task_type.env_id
        if "task_type" in cls.__dict__ or "dialect" in cls.__dict__:
            ENVIRONMENTS.setdefault((cls.task_type.kind, cls.dialect), cls)

    def __init__(
        self,
        suite: str | None = None,
        *,
        tasks: str | Path | list[Any] | None = None,
        db_dir: str | Path | None = None,
        reward: str = "binary",
        pool: ReplicaPool | None = None,
        pool_options: dict[str, Any] | None = None,
        statement_timeout: float = 30.0,
        max_rows: int = 10_000,
        max_result_bytes: int = 4 << 20,
        render_mode: str | None = None,
        prompt_options: PromptOptions | dict[str, Any] | None = None,
        db_root: str | Path | None = None,
        max_turns: int | None = None,
    ) -> None:
        name = type(self).__name__
        if max_turns is not None:
            raise ArgumentError(
                f"{name} takes no max_turns: a turn is a step, and the number of steps is "
                f'Gymnasium\'s max_episode_steps: gym.make("{self.env_id}", '
                f"max_episode_steps={max_turns})"
            )
        if suite is not None and tasks is not None:
            raise ArgumentError(f"{name}: give either suite= or tasks= (with db_dir=), not both")
        db_dir = db_dir_argument(db_dir, db_root, name)
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        self.prompt_options = PromptOptions.of(prompt_options)
        if not isinstance(tasks, list):
            tasks = load_tasks(
                tasks if tasks is not None else (suite or self.task_type.eval_suite), db_dir=db_dir
            )
        if not tasks:
            raise ValueError("the task set is empty")
        wrong = next((t for t in tasks if not isinstance(t, self.task_type)), None)
        if wrong is not None:
            raise TaskKindError(
                f"{name} plays {self.task_type.__name__} tasks, but {wrong.instance_id!r} is a "
                f"{type(wrong).__name__}: use {getattr(wrong, 'env_id', 'another environment')} "
                "(or birdenv.envs.task_env for tasks of several kinds)"
            )
        foreign = next((t for t in tasks if t.dialect not in self.dialects), None)
        if foreign is not None:
            home = ENVIRONMENTS.get((foreign.kind, foreign.dialect))
            raise TaskKindError(
                f"{name} plays tasks on {' or '.join(self.dialects)}, but {foreign.instance_id!r} "
                f"is a {foreign.dialect} task: use "
                f"{home.env_id if home else 'the environment of its dialect'}"
            )
        self.tasks = list(tasks)
        self._by_id = {str(t.instance_id): t for t in self.tasks}
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
        self.task: Any = None
        self.session: Session | None = None
        self.messages: list[dict[str, str]] = []
        self.verdict: Any = None

    def judge_submission(self, sql_list: list[str]) -> tuple[Any, float]:
        """The task's verdict on a submission, under the env's statement deadline, and its reward."""
        verdict = score(
            self.task, sql_list, pool=self.pool, statement_timeout=self.limits.statement_timeout
        )
        return verdict, float(verdict.passed) if self.reward_mode == "binary" else verdict.fraction

    def server_catalog(self, task: Any) -> ServerCatalog | None:
        """The task's database as its server holds it, for a task whose prompt cannot read a
        database file (``None``: the prompt reads the file)."""
        return None

    # -- the shared core ----------------------------------------------------------------------
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
        return {
            "task_id": str(self.task.instance_id),
            "db_id": self.task.db_id,
            "category": self.task.category,
            "messages": list(map(dict, self.messages)),  # copies: callers may edit them
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
            if str(task_id) not in self._by_id:
                raise KeyError(f"unknown task_id {task_id!r}")
            self.task = self._by_id[str(task_id)]
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        catalog = self.server_catalog(self.task)
        # A fresh state with the task's preprocess_sql applied, for this trajectory alone.
        self.session = self.pool.session(self.task, limits=self.limits, exclusive=True)
        self.verdict = None
        prompt = in_charset(render_prompt(self.task, self.prompt_options, catalog=catalog))
        self.messages = [{"role": "user", "content": prompt}]
        return prompt, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the turn's tool call: explore with ``execute_sql`` or end with ``submit_solution``."""
        if self.task is None or self.session is None:
            raise gym.error.ResetNeeded("call reset() before step() (the episode has ended)")
        action = str(action)
        self.messages.append({"role": "assistant", "content": action})
        reward, terminated, elapsed = 0.0, False, None
        try:
            call = parse_tool_call(action)
        except ToolCallError as exc:
            observation = f"status: error\nerror: {exc}"
        else:
            if call.name == "execute_sql":
                result = self.session.execute(call.arguments["sql"])
                observation, elapsed = format_observation(result), result.elapsed
            else:
                # Judged on fresh states, never on this trajectory's mutated one.
                self.verdict, reward = self.judge_submission(call.arguments["sql_list"])
                observation = format_verdict(shown_verdict(self.verdict))
                terminated = True
        observation = in_charset(observation)
        self.messages.append({"role": "tool", "content": observation})
        info = self._info()
        if elapsed is not None:
            info["elapsed"] = elapsed  # the statement's own seconds (for stores and reports)
        if terminated:
            info["verdict"] = shown_verdict(self.verdict).to_dict()
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
