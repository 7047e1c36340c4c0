"""A third kind of task, defined outside the package: one module's worth of code and its
registrations, then loaded, played in its own Gymnasium environment, judged and evaluated from a
prediction file through the same entry points as the two bundled kinds."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import pytest

import birdenv  # noqa: F401 - registers the bundled environments
from birdenv.envs import ToolEnv, env_class_for
from birdenv.errors import PredictionFormatError, TaskKindError
from birdenv.integrations.trajectory import kind_env_ids, task_list
from birdenv.judge import Scorer, register_scorer, score
from birdenv.predictions import Layout, Prediction, evaluate_file, register_layout
from birdenv.replicas.pool import default_pool
from birdenv.rows import read_rows
from birdenv.tasks import BaseTask, Mentions, load_tasks, register_kind, source_kind
from birdenv.tools import format_tool_call


# -- the toy kind: what a new module holds --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CountTask(BaseTask):
    """A question whose answer is one number: how many rows match."""

    kind = "count"
    env_id = "CountSQL-SQLite-v0"
    metric = "SR"
    metric_name = "success_rate"
    category_name = "category"
    categories = ("count",)
    skill = "counting"
    goal = "count the rows the user asks about with one SQL query"
    submission_rule = "Submit one SELECT that returns the count as its only value."
    suites: ClassVar[tuple[str, ...]] = ()
    eval_suite = ""

    instance_id: str
    db_id: str
    question: str
    count: int
    db_dir: Path | None = dataclasses.field(default=None, compare=False)
    preprocess_sql: list[str] = dataclasses.field(default_factory=list)

    @property
    def category(self) -> str:
        return "count"

    @property
    def db_path(self) -> Path:
        assert self.db_dir is not None
        return self.db_dir / f"{self.db_id}.sqlite"

    def prompt_sections(self) -> list[tuple[str, str]]:
        return [("Question", self.question)]

    def mentions(self) -> Mentions:
        return Mentions(text=self.question)

    @classmethod
    def load(cls, source: str | Path, *, db_dir: str | Path | None = None) -> list[CountTask]:
        folder = Path(db_dir) if db_dir is not None else None
        fields = {"instance_id", "db_id", "question", "count"}
        return [
            cls(**{k: v for k, v in row.items() if k in fields}, db_dir=folder)
            for _, row in read_rows(Path(source))
        ]

    @classmethod
    def matches(cls, row: Any) -> bool:
        return isinstance(row, dict) and "count" in row and "question" in row

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "db_id": self.db_id, "question": self.question}


@dataclasses.dataclass
class CountVerdict:
    instance_id: str
    passed: bool
    phase: str | None = None
    error: str | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        return "success" if self.passed else "failed"

    @property
    def fraction(self) -> float:
        return float(self.passed)

    @property
    def tests_passed(self) -> int:
        return int(self.passed)

    @property
    def tests_total(self) -> int:
        return 1

    def to_dict(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "status": self.status, "error": self.error}


def judge_count(
    task: CountTask, sql_list: list[str] | str, *, pool: Any, statement_timeout: float | None
) -> CountVerdict:
    """The last statement, run on a fresh state of the task's database, must return the count."""
    statements = [sql_list] if isinstance(sql_list, str) else list(sql_list)
    if not statements:
        return CountVerdict(task.instance_id, False, "prediction", "nothing submitted")
    with (pool or default_pool()).session(task) as session:
        result = session.execute(statements[-1])
    if result.error is not None:
        return CountVerdict(task.instance_id, False, "prediction", result.error)
    return CountVerdict(task.instance_id, result.rows == [(task.count,)])


def judge_counts(
    jobs: Iterable[tuple[CountTask, list[str] | str]],
    *,
    processes: int | None,
    statement_timeout: float | None,
) -> Iterator[CountVerdict]:
    for task, sql_list in jobs:
        yield judge_count(task, sql_list, pool=None, statement_timeout=statement_timeout)


def read_count_predictions(
    path: Path, task_set: Any, source: str, db_dir: Any
) -> Iterator[Prediction | PredictionFormatError]:
    """Rows of ``instance_id`` and ``sql``."""
    by_id = {task.instance_id: task for task in task_set()}
    for line, row in read_rows(path, error=PredictionFormatError):
        yield Prediction(line, by_id[row["instance_id"]], [row["sql"]])


class CountEnv(ToolEnv):
    """``CountSQL-SQLite-v0``: count rows of a live database with SQL."""

    task_type = CountTask


# -- the registrations -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registered() -> None:
    register_kind(CountTask)
    register_scorer("count", "sqlite", Scorer(judge_count, judge_counts, statement_timeout=10.0))
    register_layout("count", Layout(read_count_predictions))
    if CountTask.env_id not in gym.registry:
        gym.register(id=CountTask.env_id, entry_point=CountEnv, max_episode_steps=4)


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    with sqlite3.connect(tmp_path / "zoo.sqlite") as conn:
        conn.execute("CREATE TABLE animals (name TEXT, legs INTEGER)")
        conn.executemany(
            "INSERT INTO animals VALUES (?, ?)",
            [("ant", 6), ("bee", 6), ("cat", 4), ("dog", 4), ("eel", 0)],
        )
    conn.close()
    rows = [
        {
            "instance_id": "zoo_1",
            "db_id": "zoo",
            "question": "How many animals have 4 legs?",
            "count": 2,
        },
        {"instance_id": "zoo_2", "db_id": "zoo", "question": "How many have 6 legs?", "count": 2},
    ]
    path = tmp_path / "count.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_third_kind_is_loaded_played_judged_and_evaluated(
    registered: None, task_file: Path, tmp_path: Path
) -> None:
    # Loading: the file's first row tells its kind, as for the bundled kinds.
    assert source_kind(task_file) is CountTask
    tasks = load_tasks(task_file, db_dir=tmp_path)
    assert [type(t) for t in tasks] == [CountTask, CountTask]

    # Playing: the kind's environment is chosen by kind and dialect, and an episode scores.
    assert env_class_for(tasks[0]) is CountEnv
    env = gym.make(CountTask.env_id, tasks=tasks)
    try:
        obs, info = env.reset(options={"task_id": "zoo_1"})
        assert "How many animals have 4 legs?" in obs and CountTask.submission_rule in obs
        explore = format_tool_call("execute_sql", sql="SELECT count(*) FROM animals")
        obs, reward, terminated, _, _ = env.step(explore)
        assert (reward, terminated) == (0.0, False) and "5" in obs
        wrong = format_tool_call("submit_solution", sql_list=["SELECT count(*) FROM animals"])
        assert env.step(wrong)[1:3] == (0.0, True)
        env.reset(options={"task_id": "zoo_1"})
        right = "SELECT count(*) FROM animals WHERE legs = 4"
        _, reward, terminated, _, info = env.step(
            format_tool_call("submit_solution", sql_list=[right])
        )
        assert (reward, terminated) == (1.0, True) and info["verdict"]["status"] == "success"
    finally:
        env.close()

    # Judging through the one entry point.
    assert score(tasks[1], ["SELECT count(*) FROM animals WHERE legs = 6"]).passed
    assert not score(tasks[1], []).passed

    # Evaluating a prediction file of the kind's layout.
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text(
        json.dumps({"instance_id": "zoo_1", "sql": right})
        + "\n"
        + json.dumps({"instance_id": "zoo_2", "sql": "SELECT 6"})
        + "\n"
    )
    result = evaluate_file(predictions, CountTask, tasks=str(task_file), db_dir=tmp_path)
    assert [row["status"] for row in result.counted] == ["success", "failed"]
    assert [row["category"] for row in result.rows] == ["count", "count"]

    # Serving (birdenv serve, verl, SkyRL-gym): the integrations' trajectories find its
    # environment by the kind's name, and an unknown name is refused naming the known ones.
    assert kind_env_ids()["count"] == CountTask.env_id
    served = task_list("count", tasks=task_file, db_dir=tmp_path)
    assert [t.instance_id for t in served] == ["zoo_1", "zoo_2"]
    with pytest.raises(TaskKindError, match=r"kind must be one of \[.*'count'.*\], got 'nope'"):
        task_list("nope")
