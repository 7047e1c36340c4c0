"""The ``birdenv`` command, run the way a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from birdenv.cli import main
from tests.conftest import SHOP_TASKS


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "birdenv", *args], capture_output=True, text=True, timeout=300
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
    sessions = doctor.stdout.split("sessions ", 1)[1].splitlines()[0].strip()
    assert sessions.endswith(("(disk)", "GiB free)")), doctor.stdout
    assert "open files       soft limit" in doctor.stdout
    assert "observations     C\n" in doctor.stdout  # the C table formatter is built and in use


def test_validate_bird_questions(capsys) -> None:
    assert main(["data", "validate", "--bird", "bird-mini-eval"]) == 0
    assert "51/51 questions valid" in capsys.readouterr().out


# -- BIRD text-to-SQL predictions -------------------------------------------------------------
REWRITES = Path(__file__).parent / "fixtures" / "bird_ex" / "rewrites.jsonl"


def bird_eval_tasks() -> list:
    from birdenv.tasks import load_bird

    return load_bird("bird-mini-eval")


def official_prediction_file(path: Path, sqls: dict[int, str], db_ids: dict[int, str]) -> Path:
    """Predictions the way BIRD's own scripts write them: one JSON object."""
    path.write_text(
        json.dumps({str(q): f"{sql}\t----- bird -----\t{db_ids[q]}" for q, sql in sqls.items()})
    )
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bird_oracle_scores_100_percent_by_difficulty(tmp_path: Path, capsys) -> None:
    tasks = bird_eval_tasks()
    preds = official_prediction_file(
        tmp_path / "predict_dev.json",
        {t.question_id: t.SQL for t in tasks},
        {t.question_id: t.db_id for t in tasks},
    )
    out = tmp_path / "verdicts.jsonl"
    assert main(["evaluate", str(preds), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "official BIRD prediction file" in captured.err
    table = {line.split()[0]: line.split()[1:] for line in captured.out.splitlines()[1:5]}
    assert set(table) == {"simple", "moderate", "challenging", "overall"}
    assert all(cells[-1] == "100.00" for cells in table.values())
    assert table["overall"][:2] == [str(len(tasks))] * 2
    rows = read_rows(out)
    assert [r["question_id"] for r in rows] == [t.question_id for t in tasks]
    assert all(r["status"] == "success" and r["difficulty"] for r in rows)


def test_bird_wrong_column_scores_0_percent_in_worker_processes(tmp_path: Path, capsys) -> None:
    preds = tmp_path / "wrong.jsonl"
    preds.write_text(
        "".join(
            json.dumps({"question_id": t.question_id, "pred_sql": f"SELECT *, 0 FROM ({t.SQL})"})
            + "\n"
            for t in bird_eval_tasks()
        )
    )
    out = tmp_path / "out.jsonl"
    args = ["evaluate", str(preds), "--suite", "bird-mini-eval", "--out", str(out), "--jobs", "2"]
    assert main(args) == 0
    assert re.search(r"^overall\s+51\s+0\s+0\.00$", capsys.readouterr().out, re.MULTILINE)
    assert {r["phase"] for r in read_rows(out)} == {"mismatch"}


def test_bird_equivalent_rewrites_score_100_percent_on_official_layout(
    tmp_path: Path, capsys
) -> None:
    """Hand-written rewrites (other aliases, other join order, subqueries) of 20 questions,
    judged against those questions in BIRD's own layout: dev.json + {db_id}/{db_id}.sqlite."""
    rewrites = read_rows(REWRITES)
    wanted = {r["question_id"] for r in rewrites}
    tasks = [t for t in bird_eval_tasks() if t.question_id in wanted]
    assert len(tasks) == len(rewrites) >= 20
    assert {t.difficulty for t in tasks} == {"simple", "moderate", "challenging"}
    dev = tmp_path / "dev.json"
    dev.write_text(json.dumps([t.to_dict() for t in tasks], indent=2))
    root = tmp_path / "dev_databases"
    for task in tasks:
        (root / task.db_id).mkdir(parents=True, exist_ok=True)
        official_name = root / task.db_id / f"{task.db_id}.sqlite"
        if not official_name.exists():
            official_name.symlink_to(task.db_path)
    out = tmp_path / "out.jsonl"
    args = ["evaluate", str(REWRITES), "--tasks", str(dev), "--db-dir", str(root)]
    assert main([*args, "--out", str(out)]) == 0
    assert re.search(r"^overall\s+20\s+20\s+100\.00$", capsys.readouterr().out, re.MULTILINE)
    # --db-root, the old name of --db-dir, still works and says so.
    args[-2] = "--db-root"
    assert main([*args, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "--db-root is deprecated, use --db-dir" in captured.err
    assert re.search(r"^overall\s+20\s+20\s+100\.00$", captured.out, re.MULTILINE)
    # ... and they are not equal to the gold text: each is a real rewrite.
    gold = {t.question_id: " ".join(t.SQL.split()) for t in tasks}
    assert all(" ".join(r["pred_sql"].split()) != gold[r["question_id"]] for r in rewrites)


def test_bird_bad_entries_are_named_and_the_rest_still_scored(tmp_path: Path, capsys) -> None:
    tasks = bird_eval_tasks()
    first, second, third = tasks[:3]
    preds = tmp_path / "predict.json"
    preds.write_text(
        json.dumps(
            {
                str(first.question_id): f"{first.SQL}\t----- bird -----\t{first.db_id}",
                str(second.question_id): 7,
                "99999": "SELECT 1\t----- bird -----\tnowhere",
                "abc": "SELECT 1",
                str(third.question_id): f"{third.SQL}\t----- bird -----\tother_db",
            }
        )
    )
    out = tmp_path / "out.jsonl"
    assert main(["evaluate", str(preds), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = read_rows(out)
    errors = [r["error"] for r in rows if r["phase"] == "input"]
    assert len(errors) == 3
    assert "entry 2" in errors[0] and "expected a string" in errors[0]
    assert "99999 is not in the task set (bird-mini-eval)" in errors[1]
    assert "'abc' is not an integer" in errors[2]
    assert all(f"warning: {e}" in captured.err for e in errors)
    scored = {r["question_id"]: r for r in rows if r.get("question_id")}
    assert scored[first.question_id]["status"] == "success"
    assert "other_db" in scored[third.question_id]["warnings"][0]
    assert scored[third.question_id]["status"] == "success"  # scored on its own database
    missing = [r for r in rows if r["phase"] == "missing"]
    assert len(missing) == len(tasks) - 2 and second.question_id in {
        r["question_id"] for r in missing
    }
    assert f"{len(tasks) - 2} of the {len(tasks)} questions have no prediction" in captured.err
    assert re.search(rf"^overall\s+{len(tasks)}\s+2\s", captured.out, re.MULTILINE)


def test_bird_jsonl_rows_bad_lines_and_duplicates(tmp_path: Path, capsys) -> None:
    task = bird_eval_tasks()[0]
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "\n".join(
            [
                json.dumps({"question_id": str(task.question_id), "SQL": task.SQL}),
                "{not json",
                json.dumps({"question_id": task.question_id, "pred_sql": "SELECT 0"}),
                json.dumps({"question_id": task.question_id}),
                json.dumps(["question_id", 1]),
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert main(["evaluate", str(preds), "--scorer", "ex", "--out", str(out)]) == 0
    rows = read_rows(out)
    assert rows[0]["status"] == "success"
    assert [r["line"] for r in rows[1:5]] == [2, 3, 4, 5]
    assert "preds.jsonl:2: not valid JSON" in rows[1]["error"]
    assert f"question_id {task.question_id} again (first at {preds}:1)" in rows[2]["error"]
    assert "field 'pred_sql' (or 'SQL')" in rows[3]["error"]
    assert "expected an object with 'question_id'" in rows[4]["error"]
    assert "--scorer ex" in capsys.readouterr().err
    # The same rows in one JSON array are read the same way (found without --scorer).
    array = tmp_path / "preds.json"
    array.write_text(json.dumps([json.loads(line) for line in preds.read_text().splitlines()[2:3]]))
    assert main(["evaluate", str(array), "--out", str(out)]) == 0
    assert read_rows(out)[0]["phase"] == "mismatch" and read_rows(out)[0]["line"] == 1
    assert "the prediction rows are BIRD rows" in capsys.readouterr().err


def test_scorer_detection_and_forcing(tmp_path: Path, shop_dir: Path, capsys) -> None:
    bird_rows = tmp_path / "bird.jsonl"
    bird_rows.write_text(json.dumps({"question_id": 1, "pred_sql": "SELECT 1"}) + "\n")
    out = tmp_path / "out.jsonl"
    # Forced onto the BIRD-CRITIC judge, BIRD rows are bad rows for it (and named).
    assert main(["evaluate", str(bird_rows), "--scorer", "critic", "--out", str(out)]) == 0
    assert "expected an object with 'pred_sqls'" in read_rows(out)[0]["error"]
    assert "SR %" in capsys.readouterr().out
    # BIRD-CRITIC rows with a task file stay on the BIRD-CRITIC judge, as before.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"instance_id": "shop_1", "pred_sqls": ["SELECT 1"]}) + "\n")
    args = ["evaluate", str(preds), "--tasks", str(tasks), "--db-dir", str(shop_dir)]
    assert main([*args, "--out", str(out)]) == 0
    assert read_rows(out)[0]["instance_id"] == "shop_1"
    # BIRD questions from a file need their database root.
    dev = tmp_path / "dev.json"
    dev.write_text(
        json.dumps([{"question_id": 1, "db_id": "x", "question": "?", "SQL": "SELECT 1"}])
    )
    assert main(["evaluate", str(bird_rows), "--tasks", str(dev)]) == 2
    assert "--db-dir" in capsys.readouterr().err


def test_a_prediction_file_that_is_not_utf8_ends_in_one_line(tmp_path: Path) -> None:
    preds = tmp_path / "preds.jsonl"
    preds.write_bytes(
        b'{"instance_id": "x", "pred_sqls": ["SELECT 1"]}\n'
        b'{"instance_id": "y", "pred_sqls": ["SELECT \'caf\xe9\'"]}\n'
    )
    done = run_cli("evaluate", str(preds))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"birdenv: {preds}:2: not UTF-8 text (byte 0xe9 at column 48): save the file as UTF-8"
    ]
    # The same for a task file that is not UTF-8.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"instance_id": "y", "db_id": "d", "query": "\xff"}\n')
    preds.write_text(json.dumps({"instance_id": "y", "pred_sqls": ["SELECT 1"]}) + "\n")
    done = run_cli("evaluate", str(preds), "--tasks", str(tasks), "--db-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "scoring success rate (the prediction rows are BIRD-CRITIC rows)",
        f"birdenv: {tasks}:1: not UTF-8 text (byte 0xff at column 46): save the file as UTF-8",
    ]


def test_demo_plays_the_reference_agents_and_evaluates_what_they_submitted(
    tmp_path: Path, capsys
) -> None:
    assert main(["demo", "--limit", "3", "--out", str(tmp_path), "--jobs", "1"]) == 0
    oracle = read_rows(tmp_path / "oracle.predictions.jsonl")
    assert len(oracle) == 3 and all(row["pred_sqls"] for row in oracle)
    out = capsys.readouterr().out
    assert "oracle agent: mean reward 1.000 over 3 episodes" in out
    assert "echo agent: mean reward 0.000 over 3 episodes" in out
    assert re.search(r"^overall\s+3\s+3\s+100\.00$", out, re.MULTILINE)
