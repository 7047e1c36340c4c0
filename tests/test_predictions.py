"""Reading prediction files: every entry is a prediction matched to its task, or an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

from birdenv.errors import PredictionFormatError
from birdenv.predictions import Prediction, choose_kind, read_predictions
from birdenv.tasks import BirdTask, Task, load_tasks


def test_entries_that_cannot_be_scored_are_errors_with_their_line(tmp_path: Path) -> None:
    task = load_tasks("critic-mini")[0]
    preds = tmp_path / "preds.jsonl"
    lines = [
        json.dumps({"instance_id": task.instance_id, "pred_sqls": task.sol_sql}),
        json.dumps("a JSON string is a row, not an error"),
        json.dumps({"instance_id": "nope", "pred_sqls": []}),
    ]
    preds.write_text("\n".join(lines) + "\n", encoding="utf-8")
    entries, _, source = read_predictions(preds, Task, suite="critic-mini")
    assert source == "critic-mini"
    assert [type(e) for e in entries] == [Prediction, PredictionFormatError, PredictionFormatError]
    assert (entries[0].task, entries[0].sql_list) == (task, task.sol_sql)
    assert [e.line for e in entries] == [1, 2, 3]
    assert "expected an object with 'pred_sqls'" in str(entries[1])
    assert "'nope' is not in the task set" in str(entries[2])


def test_the_kind_of_a_file_is_read_from_its_rows(tmp_path: Path) -> None:
    bird = tmp_path / "bird.jsonl"
    bird.write_text(json.dumps({"question_id": 1, "pred_sql": "SELECT 1"}) + "\n")
    critic = tmp_path / "critic.jsonl"
    critic.write_text(json.dumps({"instance_id": "x", "pred_sqls": ["SELECT 1"]}) + "\n")
    assert choose_kind(bird) == (BirdTask, "the prediction rows are BIRD rows")
    assert choose_kind(critic) == (Task, "the prediction rows are BIRD-CRITIC rows")
    assert choose_kind(critic, scorer="ex") == (BirdTask, "--scorer ex")
    assert choose_kind(bird, suite="gym-mini") == (Task, "--suite gym-mini")
