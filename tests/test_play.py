"""``birdenv play`` as a person uses it: lines in, the model's view and a verdict out."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from birdenv.play import HELP, play
from birdenv.tasks import load_tasks

ROOT = Path(__file__).resolve().parents[1]
# A trigger task: its gold has a ';' inside BEGIN ... END, which must not end the statement.
TRIGGER_TASK = "hospital_records_031"
QUERY_TASK = "hospital_records_001"
TRIGGER_GOLD = """\\submit
CREATE TRIGGER trg_lab_autoflag AFTER INSERT ON lab_results WHEN NEW.value IS NOT NULL
BEGIN
  UPDATE lab_results SET flag = CASE WHEN NEW.value > NEW.ref_high THEN 'H'
    WHEN NEW.value < NEW.ref_low THEN 'L' ELSE NULL END WHERE lab_id = NEW.lab_id;
END;

"""


def run(task_id: str | None, lines: str, **kwargs: object) -> tuple[int, str]:
    """Play with ``lines`` as the person's input; return the exit status and the transcript."""
    out = io.StringIO()
    status = play(task_id, stdin=io.StringIO(lines), stdout=out, **kwargs)
    return status, out.getvalue()


def test_explore_then_submit_gold_passes() -> None:
    task = next(t for t in load_tasks("critic-mini") if t.instance_id == TRIGGER_TASK)
    status, out = run(
        TRIGGER_TASK,
        # Multi-line statements end at ';' or at a blank line; TEMP tables persist.
        "SELECT name\n  FROM sqlite_master\n WHERE name = 'lab_results';\n"
        "CREATE TEMP TABLE scratch AS SELECT 41 + 1 AS v\n\n"
        "SELECT v FROM scratch;\n" + TRIGGER_GOLD,
    )
    assert status == 0
    assert task.query in out and "# Database Schema:" in out  # the model's own prompt
    assert "[turn 1/5]\nstatus: ok\nrows: 1\n| name |\n| lab_results |" in out
    assert "[turn 2/5]\nstatus: ok\nstatement executed; no rows returned" in out
    assert "[turn 3/5]\nstatus: ok\nrows: 1\n| v |\n| 42 |" in out
    assert out.rstrip().endswith("verdict: success (1/1 tests passed)")


def test_submit_issue_sql_fails() -> None:
    task = next(t for t in load_tasks("critic-mini") if t.instance_id == QUERY_TASK)
    status, out = run(QUERY_TASK, f"\\submit {task.issue_sql[0]};\n\n")
    assert status == 1
    assert "verdict: failed" in out


def test_help_schema_unknown_command_and_quit() -> None:
    status, out = run(QUERY_TASK, "\\help\n\\schema\n\\frobnicate\n\\quit\nSELECT 'never run';\n")
    assert status == 0
    assert HELP in out
    assert out.count("CREATE TABLE departments") == 2  # in the prompt, then from \schema
    assert "unknown command \\frobnicate" in out
    assert "never run" not in out  # nothing after \quit is read
    assert "verdict" not in out and out.rstrip().endswith("nothing submitted")


def test_errors_are_observations_and_end_of_input_quits() -> None:
    status, out = run(QUERY_TASK, "SELEC 1;\nSELECT * FROM no_such_table;\n")
    assert status == 0
    assert 'status: error\nerror: near "SELEC": syntax error' in out
    assert "status: error\nerror: no such table: no_such_table" in out
    assert out.rstrip().endswith("end of input; nothing submitted")


def test_empty_or_cancelled_submission_keeps_the_episode() -> None:
    status, out = run(QUERY_TASK, "\\submit\n\n\\submit\nSELECT 1;\n\\cancel\nSELECT 7;\n")
    assert status == 0
    assert out.count("nothing submitted; carry on exploring") == 2
    assert "[turn 1/5]\nstatus: ok\nrows: 1\n| 7 |\n| 7 |" in out


def test_unknown_task() -> None:
    status, out = run("no_such_task", "")
    assert status == 2 and "unknown task 'no_such_task'" in out


def test_official_layout_with_tasks_and_db_dir() -> None:
    task = next(t for t in load_tasks("critic-mini") if t.instance_id == QUERY_TASK)
    suite_file = task.db_dir.parent / "critic-mini.jsonl"
    status, out = run(
        QUERY_TASK, f"\\submit {task.sol_sql[0]}\n\n", tasks=suite_file, db_dir=task.db_dir
    )
    assert status == 0 and "verdict: success" in out


def test_cli_play_in_a_subprocess() -> None:
    task = next(t for t in load_tasks("critic-mini") if t.instance_id == QUERY_TASK)
    done = subprocess.run(
        [sys.executable, "-m", "birdenv", "play", QUERY_TASK, "--suite", "critic-mini"],
        input=f"SELECT count(*) AS n FROM departments;\n\\submit\n{task.sol_sql[0]};\n\n",
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "status: ok\nrows: 1\n| n |" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: success (1/1 tests passed)")
