"""Stage-2 data: tool-use trajectories recorded by running a policy in the real environment.

Every trajectory is ``{"messages": info["messages"], "tools": TOOL_SCHEMAS, "task_id": ...}`` of
a finished :class:`~birdenv.envs.critic.BirdCriticEnv` episode: the user prompt of
``render_prompt``, the policy's raw turns (one ``<tool_call>`` each) and the observations of the
one formatter, byte for byte what stage 4 and evaluation see. Only episodes whose submission the
judge accepted are kept.

The policy is a teacher (any OpenAI-compatible endpoint; it receives a short system message with
a reference fix, then the environment's messages and the tool schemas, and returns the next turn)
or, offline, :class:`OfflineExpert`: it runs the problematic SQL, looks at a few rows of the tables
it touches, tries the fix with ``execute_sql`` and submits, writing before each call a short
reasoning drawn from what it has observed and from the evidence of
:mod:`birdtrain.data.evidence`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

import gymnasium as gym

import birdenv  # noqa: F401 - registers BirdCritic-SQLite-v0
from birdenv.agents import SCHEMA_QUERY
from birdenv.dialects import SQLITE
from birdenv.envs import env_groups, env_id_for
from birdenv.errors import PreprocessError
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.tasks import Task
from birdenv.tools import TOOL_SCHEMAS, format_tool_call
from birdtrain.data.evidence import SCHEMA_QUERIES, Evidence, gather_evidence, summarize_run
from birdtrain.endpoint import Teacher

__all__ = [
    "TEACHER_AGENT_PROMPT",
    "OfflineExpert",
    "build_tool_trajectories",
    "summarize_observation",
]

#: The system message put before the environment's messages when a teacher plays the episode.
TEACHER_AGENT_PROMPT = (
    "You are an expert SQL debugger acting in a live database through tools. A fix known to be "
    "correct is given below for you only: reach it the way an expert would, by exploring with "
    "execute_sql (reproduce the problem, look at the data, try the fix) and then calling "
    "submit_solution, and never say or hint that you were given it. Each turn, write a short "
    "reasoning, then exactly one tool call.\n\nCorrect fix:\n{fix}"
)

_CREATE = re.compile(
    r"^\s*CREATE\s+(?:TEMP\s+|TEMPORARY\s+)?(?:UNIQUE\s+)?(TABLE|VIEW|TRIGGER|INDEX)\s+"
    r"(?:IF\s+NOT\s+EXISTS\s+)?((?:\"[^\"]+\"|`[^`]+`|\[[^\]]+\]|[\w.]+))",
    re.IGNORECASE,
)


def summarize_observation(observation: str) -> str:
    """What an ``execute_sql`` observation says, in one clause.

    >>> summarize_observation("status: error\\nerror: no such column: x")
    'it fails with `no such column: x`'
    >>> summarize_observation("status: ok\\nrows: 2\\n| a | b |\\n| 1 | 2 |\\n| 3 | 4 |")
    'it returns 2 rows (columns a, b)'
    """
    lines = observation.splitlines()
    if lines and lines[0] == "status: error":
        error = lines[1].removeprefix("error: ") if len(lines) > 1 else "an error"
        return f"it fails with `{error}`"
    rows = next((ln for ln in lines if ln.startswith("rows: ")), None)
    if rows is None:
        return "it runs without an error"
    count = rows.removeprefix("rows: ").split(" ")[0]
    header = next((ln for ln in lines if ln.startswith("| ")), "")
    columns = [c.strip() for c in header.strip("|").split(" | ")] if header else []
    noun = "row" if count == "1" else "rows"
    return f"it returns {count} {noun}" + (f" (columns {', '.join(columns)})" if columns else "")


def _table_of(inspection: str) -> str:
    """The table name of an inspection query ``SELECT * FROM "name" LIMIT 5``."""
    return inspection.split("FROM ", 1)[1].rsplit(" LIMIT", 1)[0].strip('"').replace('""', '"')


def _listed_names(observation: str) -> list[str]:
    """The ``name`` column of a :data:`SCHEMA_QUERY` observation (``| type | name |`` rows).

    >>> _listed_names("status: ok\\nrows: 2\\n| type | name |\\n| view | v |\\n| table | t |")
    ['v', 't']
    """
    lines = observation.splitlines()
    if not lines or lines[0] != "status: ok":
        return []
    rows = [ln.strip("| ").split(" | ") for ln in lines[3:] if ln.startswith("| ")]
    return [row[1] for row in rows if len(row) == 2]


def _created(sql: str) -> tuple[str, str] | None:
    match = _CREATE.match(sql)
    return (match.group(1).upper(), match.group(2)) if match else None


class PlannedExpert:
    """A scripted policy that follows a plan of ``(kind, sql)`` exploration steps, then submits.

    Subclasses build ``self.plan`` and say what they think: :meth:`_after` (what the last
    observation showed), :meth:`_explore_text` (the reasoning before a step) and
    :meth:`_submit_turn` (the whole submitting turn).
    """

    plan: list[tuple[str, str]]
    _step: int
    _last: tuple[str, str] | None

    def _after(self, observation: str) -> str:
        raise NotImplementedError

    def _explore_text(self, kind: str, sql: str, before: str) -> str:
        raise NotImplementedError

    def _submit_turn(self, before: str) -> str:
        raise NotImplementedError

    def act(self, observation: str, info: dict[str, Any] | None = None) -> str:
        """The next turn (reasoning, then one tool call) given the last observation.

        ``info`` (the environment's, unused) makes the expert a player for :func:`play_episode`.
        """
        before = self._after(observation)
        if self._step < len(self.plan):
            kind, sql = self.plan[self._step]
            self._step += 1
            self._last = (kind, sql)
            text = self._explore_text(kind, sql, before)
            return text.strip() + "\n" + format_tool_call("execute_sql", sql=sql)
        return self._submit_turn(before)


class OfflineExpert(PlannedExpert):
    """A reference-guided policy that explores like an expert, then submits the known fix.

    Its plan, within ``max_turns`` assistant turns: run the problematic SQL, show a few rows of
    the tables it touches, run every fix statement with ``execute_sql`` (dropping first what the
    problematic SQL created under the same name, so the try is meaningful), submit. Its reasoning
    before each call comes from the previous observation and the evidence.
    """

    def __init__(self, task: Task, evidence: Evidence, max_turns: int = 5) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.task = task
        self.evidence = evidence
        budget = max_turns - 1  # the last turn submits
        steps: list[tuple[str, str]] = []
        if budget >= 3:
            # An expert first looks at what the database holds; with few turns it goes straight
            # to reproducing the problem.
            steps.append(("schema", SCHEMA_QUERIES.get(task.dialect, SCHEMA_QUERY)))
        if budget >= 1 and task.issue_sql:
            steps.append(("issue", task.issue_sql[0]))
        tries: list[tuple[str, str]] = []
        issue_created = {c for c in map(_created, task.issue_sql) if c}
        for sql in task.sol_sql:
            created = _created(sql)
            if steps and created in issue_created:
                tries.append(("drop", f"DROP {created[0]} IF EXISTS {created[1]}"))
            tries.append(("fix", sql))
        if len(steps) + len(tries) > budget:
            tries = []  # a partial try of a multi-statement fix shows nothing useful
        room = budget - len(steps) - len(tries)
        inspections = [
            ("inspect", 'SELECT * FROM "' + table.replace('"', '""') + '" LIMIT 5')
            for table in evidence.tables[:room]
        ][:2]
        self.plan = [*steps, *inspections, *tries]
        self._step = 0
        self._last: tuple[str, str] | None = None
        self._explained = False

    def _diagnosis(self) -> str:
        self._explained = True
        changes = self.evidence.changes[:4]
        if not changes:
            return "The statement needs a rewrite."
        text = "Comparing the SQL with what the issue asks for: " + "; ".join(changes) + "."
        if self.evidence.functions_added:
            text += f" That needs {', '.join(self.evidence.functions_added)}."
        return text

    def _after(self, observation: str) -> str:
        """A sentence about the previous call's observation."""
        if self._last is None:
            return ""
        kind, sql = self._last
        seen = summarize_observation(observation)
        if kind == "schema":
            names = _listed_names(observation)
            return f"The database holds {', '.join(names)}." if names else f"Listing them: {seen}."
        if kind == "issue":
            run = self.evidence.issue_runs[0] if self.evidence.issue_runs else None
            # The evidence ran on an identical fresh session; it adds the changed-row count.
            same = run is not None and (run.error is None) == observation.startswith("status: ok")
            text = summarize_run(run) if same and run is not None else seen
            return text[:1].upper() + text[1:] + "."
        if kind == "inspect":
            return f"In {_table_of(sql)}, {seen}."
        if kind == "drop":
            return "The old object is gone."
        if observation.startswith("status: error"):
            index = self.task.sol_sql.index(sql)
            fresh = self.evidence.fix_runs[index] if index < len(self.evidence.fix_runs) else None
            if fresh is not None and fresh.error is None:
                # Honest and true: the same statement on a fresh state (the evidence) succeeds,
                # and the submission is judged on a fresh state.
                return (
                    f"The corrected statement: {seen}, but only because my run of the problematic "
                    "SQL already changed this copy; on a fresh copy, which is what gets judged, "
                    f"{summarize_run(fresh)}."
                )
        return f"The corrected statement: {seen}."

    def _explore_text(self, kind: str, sql: str, before: str) -> str:
        if kind == "schema":
            return "First I look at the tables and views this database holds."
        if kind == "issue":
            return (
                f"{before} Now I reproduce the problem by running the problematic SQL."
                if before
                else "First I reproduce the problem by running the problematic SQL."
            )
        if kind == "inspect":
            return f"{before} Let me look at a few rows of {_table_of(sql)}."
        if kind == "drop":
            return (
                f"{before} {self._diagnosis()} My run of the problematic SQL already created "
                "that object in this copy, so I drop it before trying the corrected one."
            )
        lead = "" if self._explained else f" {self._diagnosis()}"
        return f"{before}{lead} Let me run the corrected statement."

    def _submit_turn(self, before: str) -> str:
        lead = "" if self._explained else f" {self._diagnosis()}"
        text = f"{before}{lead} I submit the fix."
        return (
            text.strip()
            + "\n"
            + format_tool_call("submit_solution", sql_list=list(self.task.sol_sql))
        )


def _teacher_turn(
    teacher: Teacher, task: Task, params: dict[str, Any], observation: str, info: dict[str, Any]
) -> str:
    """The teacher's next turn: it reads the episode's messages after its own system prompt."""
    fix = "\n".join(f"```sql\n{sql}\n```" for sql in task.sol_sql)
    system = {"role": "system", "content": TEACHER_AGENT_PROMPT.format(fix=fix)}
    return teacher.chat([system, *info["messages"]], tools=TOOL_SCHEMAS, **params)


def play_episode(
    env: gym.Env, task_id: str, act: Callable[[str, dict[str, Any]], str]
) -> tuple[dict[str, Any], str]:
    """Play one episode of ``task_id`` in ``env``, each action from ``act(observation, info)``.

    Returns the stage-2 row (``messages``, ``tools``, ``task_id``) and how the episode ended:
    ``"kept"`` (an accepted submission), ``"failed_judge"`` or ``"truncated"`` (out of turns).
    """
    observation, info = env.reset(options={"task_id": task_id})
    terminated = truncated = False
    while not (terminated or truncated):
        observation, _, terminated, truncated, info = env.step(act(observation, info))
    row = {"messages": info["messages"], "tools": TOOL_SCHEMAS, "task_id": task_id}
    if terminated and info["verdict"]["status"] == "success":
        return row, "kept"
    return row, "failed_judge" if terminated else "truncated"


def build_tool_trajectories(
    tasks: Iterable[Task],
    *,
    teacher: Teacher | None = None,
    max_turns: int = 5,
    pool: ReplicaPool | None = None,
    teacher_params: dict[str, Any] | None = None,
    stats: dict[str, int] | None = None,
    rejected: list[dict[str, Any]] | None = None,
    progress: bool = True,
    prompt: Any = None,
) -> list[dict[str, Any]]:
    """Stage-2 trajectories for ``tasks``, played in a real episode each, in the environment of
    the task's dialect (``BirdCritic-SQLite-v0`` on ``pool``, or ``BirdCritic-PostgreSQL-v0``).

    ``teacher`` plays when given (a :class:`TeacherError` propagates), else :class:`OfflineExpert`;
    ``max_turns`` is the episode's step limit (the TimeLimit wrapper, as in stage 4). Episodes
    that end without an accepted submission are dropped. ``stats``, when given, is filled with
    counts: ``tasks``, ``kept``, ``failed_judge``, ``truncated``, ``no_fix``, ``preprocess_error``;
    ``rejected``, when given, receives the dropped episodes (same form, plus ``reason``) for
    inspection. ``prompt``: the environment's prompt options (the run's one prompt setting).
    """
    # the train extra: imported only where used
    from tqdm.auto import tqdm

    pool = pool or default_pool()
    task_list = [t for t in tasks]
    counts = {
        "tasks": len(task_list),
        "kept": 0,
        "failed_judge": 0,
        "truncated": 0,
        "no_fix": 0,
        "preprocess_error": 0,
    }
    trajectories: list[dict[str, Any]] = []
    if not task_list:
        if stats is not None:
            stats.update(counts)
        return trajectories
    # Each task in its dialect's environment (SQLite's on ``pool``; PostgreSQL's on its server).
    envs = {
        env_id: gym.make(
            env_id,
            tasks=group,
            max_episode_steps=max_turns,
            prompt_options=prompt,
            **({"pool": pool} if group[0].dialect == SQLITE.name else {}),
        )
        for env_id, group in env_groups(task_list).items()
    }
    try:
        for task in tqdm(task_list, desc="stage-2 trajectories", disable=not progress):
            if not task.sol_sql:
                counts["no_fix"] += 1
                continue
            env = envs[env_id_for(task)]
            try:
                if teacher is not None:
                    act = functools.partial(_teacher_turn, teacher, task, teacher_params or {})
                else:
                    act = OfflineExpert(task, gather_evidence(task, pool), max_turns).act
                row, ending = play_episode(env, task.instance_id, act)
            except PreprocessError:  # the task's preprocess_sql failed at reset
                counts["preprocess_error"] += 1
                continue
            if ending == "kept":
                trajectories.append(row)
                continue
            counts[ending] += 1
            if rejected is not None:
                rejected.append({**row, "reason": ending})
    finally:
        for env in envs.values():
            env.close()
    counts["kept"] = len(trajectories)
    if stats is not None:
        stats.update(counts)
    return trajectories
