"""Loading tasks: the official form, its aliases and defaults, and errors that say where."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import birdenv
from birdenv import load_tasks
from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.judge import score, score_many
from birdenv.tasks import CATEGORIES, BirdTask, Task, iter_tasks, parse_task, source_kind


def write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_official_row_with_split_strings_aliases_and_defaults(tmp_path: Path) -> None:
    row = {
        "instance_id": "SQLite_7",
        "selected_database": "shop",
        "query": "q",
        "error_sql": "SELECT 1;[split]  SELECT 2",
        "sol_sql": ["SELECT 3"],
        "external_knowledge": "kept",
    }
    (task,) = load_tasks(write(tmp_path / "t.jsonl", [row]), db_dir=tmp_path)
    assert task.db_id == "shop"
    assert task.issue_sql == ["SELECT 1;", "SELECT 2"]
    assert task.preprocess_sql == [] and task.clean_up_sql == [] and task.test_cases == []
    assert task.conditions == {} and task.category == "Query"
    # The dialect is read once, into its name; the official row spells it as BIRD-CRITIC does.
    assert task.dialect == "sqlite" and task.to_dict()["dialect"] == "SQLite"
    assert task.to_dict()["external_knowledge"] == "kept"
    assert task.to_dict()["issue_sql"] == ["SELECT 1;", "SELECT 2"]


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"db_id": "shop", "issue_sql": []}, "instance_id"),
        ({"instance_id": "a", "issue_sql": []}, "db_id"),
        ({"instance_id": "a", "db_id": "../etc", "issue_sql": []}, "db_id"),
        ({"instance_id": "a", "db_id": "..\\etc", "issue_sql": []}, "db_id"),
        ({"instance_id": "a", "db_id": "shop", "issue_sql": 5}, "issue_sql"),
        ({"instance_id": "a", "db_id": "shop", "sol_sql": ["ok", 3]}, "sol_sql"),
        ({"instance_id": "a", "db_id": "shop", "conditions": [1]}, "conditions"),
        ({"instance_id": "a", "db_id": "shop", "test_cases": [1]}, "test_cases"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path: Path, row: dict, field: str) -> None:
    path = write(tmp_path / "bad.jsonl", [{"instance_id": "ok", "db_id": "shop"}, row])
    with pytest.raises(TaskFormatError) as err:
        load_tasks(path)
    assert f"{path}:2" in str(err.value) and repr(field) in str(err.value)


def test_non_json_line_and_duplicate_ids(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl:1: not valid JSON"):
        load_tasks(write(tmp_path / "bad.jsonl", ["{nope"]))
    rows = [{"instance_id": "a", "db_id": "x"}] * 2
    with pytest.raises(TaskFormatError, match="appears twice"):
        load_tasks(write(tmp_path / "dup.jsonl", rows))


def test_iter_tasks_reports_broken_rows_and_keeps_going(tmp_path: Path) -> None:
    path = write(tmp_path / "mixed.jsonl", ["{", {"instance_id": "a", "db_id": "x"}, [1, 2]])
    items = list(iter_tasks(path))
    assert [type(i).__name__ for i in items] == ["TaskFormatError", "Task", "TaskFormatError"]


def test_missing_database_is_a_clear_error(tmp_path: Path) -> None:
    task = parse_task({"instance_id": "a", "db_id": "nowhere"}, db_dir=tmp_path)
    with pytest.raises(DatabaseNotFoundError, match=r"nowhere_template\.sqlite"):
        _ = task.db_path
    with pytest.raises(DatabaseNotFoundError, match="db_dir"):
        _ = parse_task({"instance_id": "a", "db_id": "x"}).db_path


def test_unknown_source() -> None:
    with pytest.raises(UnknownSuiteError, match="critic-mini"):
        load_tasks("no-such-suite")


def test_a_json_array_file_reads_like_jsonl(tmp_path: Path) -> None:
    rows = [{"instance_id": "a", "db_id": "x"}, {"instance_id": "b", "db_id": "x"}]
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    assert [t.instance_id for t in iter_tasks(path)] == ["a", "b"]


# -- the task protocol, both kinds ------------------------------------------------------------------
def test_both_kinds_load_by_name_and_from_files(tmp_path: Path) -> None:
    critic, bird = load_tasks("critic-mini")[:3], load_tasks("bird-mini-eval")[:3]
    assert {type(t) for t in critic} == {Task} and {type(t) for t in bird} == {BirdTask}
    # A file's kind is read from its rows: JSONL debugging tasks, a JSON array of BIRD questions.
    critic_file = write(tmp_path / "critic.jsonl", [t.to_dict() for t in critic])
    bird_file = tmp_path / "dev.json"
    bird_file.write_text(json.dumps([q.to_dict() for q in bird], indent=2), encoding="utf-8")
    assert (source_kind(critic_file), source_kind(bird_file)) == (Task, BirdTask)
    assert load_tasks(critic_file, db_dir=critic[0].db_dir) == critic
    assert load_tasks(bird_file, db_dir=bird[0].db_dir) == bird
    assert load_tasks(bird_file, db_dir=bird[0].db_dir)[0].db_path == bird[0].db_path


def test_the_protocol_describes_each_kind() -> None:
    task, question = load_tasks("critic-mini")[0], load_tasks("bird-mini-eval")[0]
    assert (task.kind, task.env_id, task.metric) == ("critic", "BirdCritic-SQLite-v0", "SR")
    assert (question.kind, question.env_id, question.metric) == ("bird", "BirdSQL-SQLite-v0", "EX")
    assert task.category in CATEGORIES and question.category == question.difficulty
    assert question.preprocess_sql == [] and task.db_path.is_file() and question.db_path.is_file()
    assert [h for h, _ in task.prompt_sections()] == ["User issue", "Problematic SQL"]
    assert [h for h, _ in question.prompt_sections()] == ["Question", "External knowledge"]
    assert task.issue_sql[0] in task.prompt_text() and question.question in question.prompt_text()


def test_score_judges_each_kind_by_its_own_rule() -> None:
    task, question = load_tasks("critic-mini")[0], load_tasks("bird-mini-eval")[0]
    assert score(task, task.sol_sql).passed and not score(task, task.issue_sql).passed
    # BIRD: the last statement is the answer; nothing submitted fails without running anything.
    assert score(question, ["SELECT nope", question.SQL]).passed
    assert not score(question, [question.SQL, "SELECT 'no'"]).passed
    empty = score(question, [])
    assert (empty.passed, empty.phase) == (False, "prediction") and "empty" in empty.error
    # Many at once, in order, each kind's way.
    assert [v.passed for v in score_many([(task, task.sol_sql), (task, [])])] == [True, False]
    pairs = [(question, []), (question, [question.SQL])]
    assert [v.passed for v in score_many(pairs, official=True)] == [False, True]


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b'{"instance_id": "a", "db_id": "x"}\n{"instance_id": "b", "query": "caf\xe9"}\n'
    )
    with pytest.raises(TaskFormatError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9"):
        load_tasks(path)


def test_a_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"instance_id": "a", "db_id": "x"}\n')
    assert [t.instance_id for t in load_tasks(path)] == ["a"]


def test_the_replica_layer_knows_no_task_and_no_suite() -> None:
    # DESIGN's layers: replicas know database files and content hashes only.
    replicas = Path(birdenv.__file__).parent / "replicas"
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for path in replicas.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    above = {"birdenv.tasks", "birdenv.bird", "birdenv.suites", "birdenv.judge", "birdenv.envs"}
    assert {m for m in imported if m and ".".join(m.split(".")[:2]) in above} == set()
