"""The ``birdenv`` command, run the way a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from birdenv.cli import main
from tests.conftest import SHOP_TASKS


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "birdenv.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_evaluate_judges_good_rows_and_reports_bad_ones(
    shop_dir: Path, tmp_path: Path, capsys
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
    preds = tmp_path / "preds.jsonl"
    full_row = {**SHOP_TASKS[1], "pred_sqls": SHOP_TASKS[1]["sol_sql"]}
    preds.write_text(
        "\n".join(
            [
                json.dumps(
                    {
                        "instance_id": "shop_1",
                        "pred_sqls": ["SELECT name FROM customers WHERE city IS NULL"],
                    }
                ),
                "{this is not json",
                json.dumps({"instance_id": "shop_3", "pred_sqls": "SELECT 1"}),
                json.dumps({"instance_id": "nope", "pred_sqls": ["SELECT 1"]}),
                json.dumps(full_row),
                json.dumps({"instance_id": "shop_1", "pred_sqls": [1, 2]}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "evaluate",
            str(preds),
            "--tasks",
            str(tasks),
            "--db-dir",
            str(shop_dir),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == [
        "success",
        "failed",
        "failed",
        "failed",
        "success",
        "failed",
    ]
    assert rows[1]["phase"] == "input" and "not valid JSON" in rows[1]["error"]
    assert "split on [split]" in rows[2]["warnings"][0]
    assert "not in the task set" in rows[3]["error"]
    captured = capsys.readouterr()
    assert "overall" in captured.out and "33.33" in captured.out
    assert "Management" in captured.out


def test_validate_passes_on_valid_tasks_and_fails_otherwise(shop_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
    assert (
        main(["data", "validate", "--tasks", str(tasks), "--db-dir", str(shop_dir), "--jobs", "1"])
        == 0
    )
    broken = dict(SHOP_TASKS[0], sol_sql=SHOP_TASKS[0]["issue_sql"])
    tasks.write_text(json.dumps(broken) + "\n")
    assert main(["data", "validate", "--tasks", str(tasks), "--db-dir", str(shop_dir)]) == 1


def test_missing_prediction_file_and_doctor() -> None:
    proc = run_cli("evaluate", "/no/such/file.jsonl")
    assert proc.returncode == 2 and "no such file" in proc.stderr
    doctor = run_cli("doctor")
    assert doctor.returncode == 0 and "strategy" in doctor.stdout


def test_validate_bird_questions(capsys) -> None:
    assert main(["data", "validate", "--bird", "bird-mini-eval"]) == 0
    assert "51/51 questions valid" in capsys.readouterr().out
