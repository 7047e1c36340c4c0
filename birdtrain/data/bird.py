"""Stage-1 and stage-2 data for BIRD text-to-SQL questions, and BIRD reference policies.

The same two forms as the debugging data, so one SFT stage trains on a mixture of both:

- stage 1: ``{"prompt": [single_turn_prompt(question)], "completion": [<thought>…</thought>
  <solution>gold SQL</solution>], "task_id"}``. The thought is written from real evidence: the
  tables the gold query reads (those the database really has), the shape of the query (joins,
  filters, grouping, ordering, aggregates, read from its sqlglot syntax tree), the external
  knowledge, and what the gold query returns when run on a fresh session of the database. A
  teacher (any OpenAI-compatible endpoint) can write the thought instead, from the same evidence.
- stage 2: ``{"messages", "tools", "task_id"}`` of a finished ``BirdSQL-SQLite-v0`` episode played
  by :class:`BirdExpert` (or a teacher): it lists the tables, looks at a few rows of the tables
  the answer needs, runs its query with ``execute_sql`` and submits it. Observations come from the
  environment's one formatter, byte for byte what stage 4 and evaluation see.

Only examples that execution accuracy accepts are kept (the parsed ``<solution>``'s last
statement, or the episode's verdict).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import gymnasium as gym
from sqlglot import exp
from tqdm.auto import tqdm

import birdenv  # noqa: F401 - registers BirdSQL-SQLite-v0
from birdenv.agents import SCHEMA_QUERY
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.tasks import BirdTask
from birdenv.tools import TOOL_SCHEMAS, format_tool_call
from birdtrain.data.evidence import StatementRun, _parse, run_statements, summarize_run
from birdtrain.data.evidence import tables_touched as _tables_touched
from birdtrain.data.reasoning import _clean_teacher_thought
from birdtrain.data.tool_use import (
    PlannedExpert,
    _table_of,
    play_episode,
    summarize_observation,
)
from birdtrain.endpoint import Teacher
from birdtrain.prompts import format_answer, parse_solution, single_turn_prompt
from birdtrain.rewards import score_submission

__all__ = [
    "BIRD_TEACHER_AGENT_PROMPT",
    "BIRD_TEACHER_SYSTEM_PROMPT",
    "BirdEvidence",
    "BirdExpert",
    "bird_reference_turns",
    "build_bird_reasoning_examples",
    "build_bird_tool_trajectories",
    "gather_bird_evidence",
    "offline_bird_thought",
    "wrong_column_sql",
]

#: What the teacher is asked to do for a stage-1 thought on a BIRD question.
BIRD_TEACHER_SYSTEM_PROMPT = (
    "You write the reasoning of worked examples for training a text-to-SQL assistant. You are "
    "given a question about a database, its external knowledge, a query known to answer it, and "
    "evidence from running that query. Write the reasoning an expert would go through to arrive "
    "at that query on their own: which tables and columns hold the answer, how they are joined, "
    "filtered and aggregated. Never say or hint that the query was given to you. Output only the "
    "reasoning as plain prose: no <thought> or <solution> tags and no final SQL block."
)
#: The system message put before the environment's messages when a teacher plays a BIRD episode.
BIRD_TEACHER_AGENT_PROMPT = (
    "You are an expert SQL analyst answering a question about a live database through tools. A "
    "query known to be correct is given below for you only: reach it the way an expert would, by "
    "exploring with execute_sql (look at the tables and the data, try the query) and then calling "
    "submit_solution with it, and never say or hint that you were given it. Each turn, write a "
    "short reasoning, then exactly one tool call.\n\nCorrect query:\n```sql\n{sql}\n```"
)


@dataclasses.dataclass
class BirdEvidence:
    """What a question's gold query reads (tables, clause shape) and returns, on a fresh session."""

    tables: list[str]
    shape: list[str]
    run: StatementRun


def _shape(sql: str) -> list[str]:
    """Phrases for the clauses of a query: joins, filters, grouping, ordering, aggregates."""
    tree = _parse(sql)
    if tree is None:
        return []
    parts = []
    joins = len(list(tree.find_all(exp.Join)))
    if joins:
        parts.append(f"{joins} join{'s' * (joins > 1)}")
    if tree.find(exp.Where) is not None:
        parts.append("a WHERE filter")
    if tree.find(exp.Group) is not None:
        parts.append("a GROUP BY")
    if tree.find(exp.Having) is not None:
        parts.append("a HAVING condition")
    if tree.find(exp.Order) is not None:
        parts.append("an ORDER BY")
    if tree.find(exp.Limit) is not None:
        parts.append("a LIMIT")
    aggregates = sorted({type(node).__name__.upper() for node in tree.find_all(exp.AggFunc)})
    if aggregates:
        parts.append(f"the aggregate{'s' * (len(aggregates) > 1)} {', '.join(aggregates)}")
    if tree.find(exp.Subquery) is not None or tree.find(exp.CTE) is not None:
        parts.append("a subquery")
    return parts


def gather_bird_evidence(task: BirdTask, pool: ReplicaPool) -> BirdEvidence:
    """Run the gold query on a fresh session of the question's database and read its shape."""
    base = pool.store.base_for(task.db_path)
    with pool.open_base(base, task_id=task.instance_id) as session:
        existing = {
            row[0].lower()
            for row in session.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
            ).rows
        }
        (run,) = run_statements(session, [task.SQL])
    return BirdEvidence(_tables_touched([task.SQL], existing), _shape(task.SQL), run)


def offline_bird_thought(task: BirdTask, evidence: BirdEvidence, *, rows: int = 3) -> str:
    """A derivation of the query told as a discovery, from the evidence only (no teacher).

    ``rows``: result rows it quotes (0: only their count and columns)."""
    parts = [f"The question asks: {task.question.strip()}"]
    if task.evidence.strip():
        parts.append(f"The external knowledge says: {task.evidence.strip()}")
    if evidence.tables:
        noun = "table" if len(evidence.tables) == 1 else "tables"
        parts.append(f"The answer lives in the {noun} {', '.join(evidence.tables)}.")
    if evidence.shape:
        parts.append(f"So the query needs {', '.join(evidence.shape)}.")
    run = summarize_run(evidence.run, rows=rows)
    parts.append(f"Checking it against the database, {run}.")
    return " ".join(p if p.endswith((".", "?", "!")) else p + "." for p in parts)


def _teacher_messages(task: BirdTask, evidence: BirdEvidence) -> list[dict[str, str]]:

    user = (
        f"{single_turn_prompt(task)}\n\n"
        "# A correct query (for you only; never mention that you were given it)\n"
        f"```sql\n{task.SQL}\n```\n\n# Evidence from running it on the database\n"
        f"- it reads: {', '.join(evidence.tables) or 'no table'}\n"
        f"- its shape: {', '.join(evidence.shape) or 'a plain SELECT'}\n"
        f"- result: {summarize_run(evidence.run, rows=5)}\n\n"
        "Write the reasoning that leads from the question to this query."
    )
    return [
        {"role": "system", "content": BIRD_TEACHER_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


def build_bird_reasoning_examples(
    tasks: Iterable[BirdTask],
    *,
    teacher: Teacher | None = None,
    pool: ReplicaPool | None = None,
    teacher_params: dict[str, Any] | None = None,
    stats: dict[str, int] | None = None,
    prompt: Any = None,
    thought_rows: int = 3,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Stage-1 examples for BIRD questions; only those execution accuracy accepts are kept.

    ``stats``, when given, is filled with ``tasks``, ``kept``, ``failed_judge``, ``empty_thought``.
    ``prompt``: how the prompts show the database (the run's one prompt setting).
    ``thought_rows``: result rows an offline thought quotes (0: only their count and columns).
    ``progress``: a progress bar over the questions.
    """

    pool = pool or default_pool()
    counts = {"tasks": 0, "kept": 0, "failed_judge": 0, "empty_thought": 0}
    examples = []
    for task in tqdm(tasks, desc="stage-1 thoughts (BIRD)", disable=not progress):
        counts["tasks"] += 1
        evidence = gather_bird_evidence(task, pool)
        if teacher is not None:
            reply = teacher.chat(_teacher_messages(task, evidence), **(teacher_params or {}))
            thought = _clean_teacher_thought(reply)
        else:
            thought = offline_bird_thought(task, evidence, rows=thought_rows)
        if not thought:
            counts["empty_thought"] += 1
            continue
        answer = format_answer(thought, [task.SQL])
        if not score_submission(task, parse_solution(answer)).passed:
            counts["failed_judge"] += 1
            continue
        examples.append(
            {
                "prompt": [{"role": "user", "content": single_turn_prompt(task, prompt)}],
                "completion": [{"role": "assistant", "content": answer}],
                "task_id": task.instance_id,
            }
        )
    counts["kept"] = len(examples)
    if stats is not None:
        stats.update(counts)
    return examples


def _inspect(table: str) -> str:
    return 'SELECT * FROM "' + table.replace('"', '""') + '" LIMIT 5'


class BirdExpert(PlannedExpert):
    """A reference-guided policy for a BIRD question: explore, run the gold query, submit it.

    Its plan, within ``max_turns`` assistant turns: list the tables (with four turns or more), look
    at a few rows of up to two tables the answer reads (as the budget allows), run the query,
    submit it. Before each call it says what the previous observation showed.
    """

    def __init__(self, task: BirdTask, evidence: BirdEvidence, max_turns: int = 5) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.task = task
        self.evidence = evidence
        budget = max_turns - 1  # the last turn submits
        steps: list[tuple[str, str]] = []
        if budget >= 3:
            steps.append(("schema", SCHEMA_QUERY))
        room = budget - len(steps) - (1 if budget >= 1 else 0)
        steps += [("inspect", _inspect(t)) for t in evidence.tables[: max(room, 0)][:2]]
        if budget >= 1:
            steps.append(("query", task.SQL))
        self.plan = steps
        self._step = 0
        self._last: tuple[str, str] | None = None

    def _after(self, observation: str) -> str:
        if self._last is None:
            return ""
        kind, sql = self._last
        seen = summarize_observation(observation)
        if kind == "schema":
            return f"Listing its tables and views: {seen}."
        if kind == "inspect":
            table = sql.split("FROM ", 1)[1].rsplit(" LIMIT", 1)[0].strip('"').replace('""', '"')
            return f"In {table}, {seen}."
        return f"The query: {seen}."

    def _explore_text(self, kind: str, sql: str, before: str) -> str:
        if kind == "schema":
            return "First I look at the tables and views this database holds."
        if kind == "inspect":
            return (
                f"{before} The question needs {_table_of(sql)}; let me look at a few of its rows."
            )
        shape = ", ".join(self.evidence.shape)
        need = f" The answer needs {shape}." if shape else ""
        return f"{before}{need} Let me run the query."

    def _submit_turn(self, before: str) -> str:
        text = f"{before} It answers the question; I submit it."
        return text.strip() + "\n" + format_tool_call("submit_solution", sql_list=[self.task.SQL])


def wrong_column_sql(task: BirdTask) -> str:
    """The gold query with one extra column: a wrong answer whatever the gold selects."""
    return f"SELECT *, 'x' AS wrong_column FROM ({task.SQL.strip().rstrip(';')})"


def bird_reference_turns(policy: str, task: BirdTask) -> list[str]:
    """The turns of a fixed reference policy on a BIRD question.

    ``oracle`` lists the tables, runs the gold query and submits it (100 % on a validated suite);
    ``echo``, the counterpart of submitting the issue SQL unchanged, submits a wrong-column
    version of the gold (0 %).
    """
    if policy == "oracle":
        return [
            "First I look at the tables.\n" + format_tool_call("execute_sql", sql=SCHEMA_QUERY),
            "Let me run the query.\n" + format_tool_call("execute_sql", sql=task.SQL),
            format_tool_call("submit_solution", sql_list=[task.SQL]),
        ]
    if policy == "echo":
        return [format_tool_call("submit_solution", sql_list=[wrong_column_sql(task)])]
    raise ValueError(f"no fixed plan for policy {policy!r} on BIRD questions (oracle, echo)")


def _teacher_turn(
    teacher: Teacher, task: BirdTask, params: dict[str, Any], observation: str, info: dict[str, Any]
) -> str:
    """The teacher's next turn: it reads the episode's messages after its own system prompt."""
    system = {"role": "system", "content": BIRD_TEACHER_AGENT_PROMPT.format(sql=task.SQL)}
    return teacher.chat([system, *info["messages"]], tools=TOOL_SCHEMAS, **params)


def build_bird_tool_trajectories(
    tasks: Iterable[BirdTask],
    *,
    teacher: Teacher | None = None,
    max_turns: int = 5,
    pool: ReplicaPool | None = None,
    teacher_params: dict[str, Any] | None = None,
    stats: dict[str, int] | None = None,
    prompt: Any = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Stage-2 trajectories for BIRD questions, each played in a real ``BirdSQL-SQLite-v0`` episode.

    ``prompt``: the environment's prompt options (the run's one prompt setting); ``progress``: a
    progress bar over the questions.

    ``teacher`` plays when given, else :class:`BirdExpert`. Episodes that end without a correct
    submission are dropped. ``stats``, when given, is filled with ``tasks``, ``kept``,
    ``failed_judge``, ``truncated``.
    """
    pool = pool or default_pool()
    task_list = list(tasks)
    counts = {"tasks": len(task_list), "kept": 0, "failed_judge": 0, "truncated": 0}
    trajectories: list[dict[str, Any]] = []
    if task_list:
        env = gym.make(
            "BirdSQL-SQLite-v0",
            tasks=task_list,
            pool=pool,
            max_episode_steps=max_turns,
            prompt_options=prompt,
        )
        try:
            for task in tqdm(task_list, desc="stage-2 trajectories (BIRD)", disable=not progress):
                if teacher is not None:
                    act = functools.partial(_teacher_turn, teacher, task, teacher_params or {})
                else:
                    act = BirdExpert(task, gather_bird_evidence(task, pool), max_turns).act
                row, ending = play_episode(env, task.instance_id, act)
                if ending == "kept":
                    trajectories.append(row)
                else:
                    counts[ending] += 1
        finally:
            env.close()
    counts["kept"] = len(trajectories)
    if stats is not None:
        stats.update(counts)
    return trajectories
