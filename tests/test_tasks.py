"""Loading tasks: the official form, its aliases and defaults, and errors that say where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from birdenv import load_tasks
from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.tasks import iter_tasks, parse_task


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
    assert task.conditions == {} and task.category == "Query" and task.dialect == "SQLite"
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
