"""BIRD text-to-SQL: loading questions, execution accuracy (EX) and ``BirdSQL-SQLite-v0``."""

from __future__ import annotations

import json
import shutil
import sqlite3
import warnings
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import birdenv
from birdenv import suites
from birdenv.bird import (
    BirdTask,
    execution_accuracy,
    load_bird,
    validate_bird,
)
from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.tools import format_tool_call
from tests.conftest import build_shop

PAIRS = Path(__file__).parent / "fixtures" / "bird_ex" / "pairs.jsonl"
PAIR_ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]

# A few questions over the bundled hospital_records database, for the env and the loader.
HOSPITAL = [
    {
        "question_id": 1,
        "db_id": "hospital_records",
        "question": "How many departments are there?",
        "evidence": "",
        "SQL": "SELECT COUNT(*) FROM departments",
        "difficulty": "simple",
    },
    {
        "question_id": 2,
        "db_id": "hospital_records",
        "question": "List the names of the departments on floor 2.",
        "evidence": "floor 2 refers to floor = 2",
        "SQL": "SELECT name FROM departments WHERE floor = 2",
        "difficulty": "simple",
    },
    {
        "question_id": 3,
        "db_id": "hospital_records",
        "question": "How many physicians work in each department? Give the department name.",
        "evidence": "",
        "SQL": "SELECT d.name, COUNT(p.physician_id) FROM departments d "
        "JOIN physicians p ON p.dept_id = d.dept_id GROUP BY d.name",
        "difficulty": "moderate",
    },
]


def submit(statements: list[str]) -> str:
    return format_tool_call("submit_solution", sql_list=statements)


@pytest.fixture
def shop_root(tmp_path: Path) -> Path:
    """A database root holding ``shop`` under the bundled name ``shop_template.sqlite``."""
    root = tmp_path / "dbs"
    build_shop(root)
    return root


def shop_task(gold: str, root: Path, question_id: int = 1) -> BirdTask:
    return BirdTask(question_id=question_id, db_id="shop", question="?", SQL=gold, db_dir=root)


def official_ex(db_file: Path, pred: str, gold: str, scratch: Path) -> bool:
    """BIRD's official rule, as its evaluation script runs it: a plain connection on the
    database, the prediction then the gold on one cursor, ``set(fetchall())`` compared, any
    exception 0. Run on a private copy (the prediction may write)."""
    copy = scratch / f"official-{abs(hash((pred, gold)))}.sqlite"
    shutil.copyfile(db_file, copy)
    conn = sqlite3.connect(copy)
    try:
        cursor = conn.cursor()
        cursor.execute(pred)
        predicted = cursor.fetchall()
        cursor.execute(gold)
        expected = cursor.fetchall()
        return set(predicted) == set(expected)
    except Exception:
        return False
    finally:
        conn.close()


# -- the borderline fixture -------------------------------------------------------------------
def test_fixture_has_enough_borderline_pairs_with_reasons() -> None:
    assert len(PAIR_ROWS) >= 40
    assert len({row["id"] for row in PAIR_ROWS}) == len(PAIR_ROWS)
    assert all(row["note"] and isinstance(row["expected"], bool) for row in PAIR_ROWS)
    assert {True, False} <= {row["expected"] for row in PAIR_ROWS}


def test_ex_agrees_with_the_official_rule_on_borderline_pairs(
    shop_root: Path, pool, tmp_path: Path
) -> None:
    disagreements = []
    for row in PAIR_ROWS:
        task = shop_task(row["gold"], shop_root)
        official = official_ex(task.db_path, row["pred"], row["gold"], tmp_path)
        ours = execution_accuracy(task, row["pred"], pool=pool).correct
        if not official == ours == row["expected"]:
            disagreements.append(
                f"{row['id']}: expected {row['expected']}, official rule {official}, ours {ours}"
                f" ({row['note']})"
            )
    assert disagreements == []


# -- EX itself ----------------------------------------------------------------------------------
def test_verdict_fields_and_failure_phases(shop_root: Path, pool) -> None:
    task = shop_task("SELECT name FROM customers", shop_root)
    ok = execution_accuracy(task, "SELECT name FROM customers ORDER BY id DESC", pool=pool)
    assert ok.correct and ok.passed and ok.status == "success" and ok.phase is None
    assert (ok.pred_rows, ok.gold_rows, ok.fraction) == (3, 3, 1.0)
    assert {"prediction", "gold", "total"} <= set(ok.timings)
    assert ok.to_dict()["status"] == "success"

    wrong = execution_accuracy(task, "SELECT city FROM customers", pool=pool)
    assert (wrong.correct, wrong.phase, wrong.tests_passed, wrong.tests_total) == (
        False,
        "mismatch",
        0,
        1,
    )
    broken = execution_accuracy(task, "SELECT nope FROM customers", pool=pool)
    assert broken.phase == "prediction" and "nope" in broken.error
    bad_gold = execution_accuracy(shop_task("SELECT nope FROM t", shop_root), "SELECT 1", pool=pool)
    assert bad_gold.phase == "gold" and not bad_gold.correct


def test_a_prediction_past_its_deadline_scores_zero(shop_root: Path, pool) -> None:
    task = shop_task("SELECT 1", shop_root)
    forever = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) FROM r"
    verdict = execution_accuracy(task, forever, pool=pool, statement_timeout=0.2)
    assert (verdict.correct, verdict.phase) == (False, "timeout")
    assert verdict.timings["total"] < 5


def test_predictions_never_change_the_base_or_each_other(shop_root: Path, pool) -> None:
    task = shop_task("SELECT COUNT(*) FROM orders", shop_root)
    assert not execution_accuracy(task, "DELETE FROM orders", pool=pool).correct
    # The next prediction starts from a fresh state: the four orders are back.
    assert execution_accuracy(task, "SELECT 4", pool=pool).correct


def test_a_missing_database_is_a_setup_verdict(tmp_path: Path, pool) -> None:
    verdict = execution_accuracy(shop_task("SELECT 1", tmp_path), "SELECT 1", pool=pool)
    assert verdict.phase == "setup" and "shop" in verdict.error


# -- loading ----------------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_official_jsonl_and_json_array(tmp_path: Path, shop_root: Path) -> None:
    rows = [
        {
            "question_id": 7,
            "db_id": "shop",
            "question": "Names?",
            "evidence": "",
            "SQL": "SELECT name FROM customers",
            "difficulty": "simple",
            "note": "kept",
        }
    ]
    from_jsonl = load_bird(write_jsonl(tmp_path / "q.jsonl", rows), db_root=shop_root)
    array = tmp_path / "dev.json"
    array.write_text(json.dumps(rows, indent=2))
    from_array = load_bird(array, db_root=shop_root)
    assert from_jsonl == from_array
    task = from_jsonl[0]
    assert (task.question_id, task.instance_id, task.difficulty) == (7, "7", "simple")
    assert task.extra == {"note": "kept"} and task.to_dict()["note"] == "kept"
    assert task.db_path == shop_root / "shop" / "shop_template.sqlite"


def test_db_path_prefers_the_official_bird_name(shop_root: Path) -> None:
    task = shop_task("SELECT 1", shop_root)
    assert task.db_path.name == "shop_template.sqlite"
    shutil.copyfile(task.db_path, shop_root / "shop" / "shop.sqlite")
    assert task.db_path.name == "shop.sqlite"
    with pytest.raises(DatabaseNotFoundError, match="db_root"):
        _ = BirdTask(question_id=1, db_id="shop", question="?", SQL="SELECT 1").db_path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"question_id": "7"}, "question_id"),
        ({"question_id": True}, "question_id"),
        ({"db_id": "../x"}, "db_id"),
        ({"SQL": ""}, "SQL"),
        ({"question": None}, "question"),
        ({"evidence": 3}, "evidence"),
        ({"difficulty": "hard"}, "difficulty"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path: Path, change: dict, field: str) -> None:
    good = dict(HOSPITAL[0])
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {**HOSPITAL[1], **change}])
    with pytest.raises(TaskFormatError, match=rf"bad\.jsonl:2: field '{field}'"):
        load_bird(path)


def test_duplicate_ids_bad_json_and_unknown_sources(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dup.jsonl", [HOSPITAL[0], HOSPITAL[0]])
    with pytest.raises(TaskFormatError, match=r"question_id.*appears twice"):
        load_bird(path)
    (tmp_path / "broken.jsonl").write_text('{"question_id": 1,\n')
    with pytest.raises(TaskFormatError, match=r"broken\.jsonl:1: not valid JSON"):
        load_bird(tmp_path / "broken.jsonl")
    with pytest.raises(UnknownSuiteError, match="bird-mini-eval"):
        load_bird("no-such-suite")


def test_difficulty_is_optional_as_in_the_official_train_set(tmp_path: Path) -> None:
    row = {k: v for k, v in HOSPITAL[0].items() if k != "difficulty"}
    assert load_bird(write_jsonl(tmp_path / "train.jsonl", [row]))[0].difficulty == ""


# -- validation -------------------------------------------------------------------------------
def test_validate_reports_gold_errors_and_empty_results(shop_root: Path, pool) -> None:
    tasks = [
        shop_task("SELECT name FROM customers", shop_root, 1),
        shop_task("SELECT nope FROM customers", shop_root, 2),
        shop_task("SELECT name FROM customers WHERE 0", shop_root, 3),
    ]
    problems = validate_bird(tasks, pool=pool)
    assert len(problems) == 2
    assert problems[0].startswith("question 2 (shop): the gold SQL fails")
    assert problems[1] == "question 3 (shop): the gold SQL returns no rows"


# -- the bundled suite --------------------------------------------------------------------------
def bundled(name: str) -> list[BirdTask]:
    tasks = load_bird(name)
    if not tasks:
        pytest.skip(f"no {name} questions yet")
    return tasks


@pytest.mark.parametrize("name", ["bird-mini-eval", "bird-mini-train"])
def test_oracle_wrong_column_and_rewrite_on_bird_mini(name: str) -> None:
    tasks = bundled(name)
    assert {t.difficulty for t in tasks} <= {"simple", "moderate", "challenging"}
    failures = []
    for task in tasks:
        gold = task.SQL.strip().rstrip(";")
        checks = {
            "oracle": (task.SQL, True),
            # An extra column: a wrong-column answer whatever the gold selects.
            "wrong column": (f"SELECT *, 'x' AS wrong FROM ({gold})", False),
            # The gold under another alias, as a derived table: an equivalent rewrite.
            "rewrite": (f"SELECT q_alias.* FROM ({gold}) AS q_alias", True),
        }
        for what, (pred, expected) in checks.items():
            verdict = execution_accuracy(task, pred)
            if verdict.correct != expected:
                failures.append(f"{task.question_id} {what}: {verdict.error}")
    assert failures == []


# -- the environment ------------------------------------------------------------------------------
@pytest.fixture
def hospital_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "hospital.jsonl", HOSPITAL)


@pytest.fixture
def env(hospital_file: Path) -> Iterator[gym.Env]:
    env = gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_root=suites.ensure().db_dir)
    yield env
    env.close()


def test_registered() -> None:
    assert "BirdSQL-SQLite-v0" in birdenv.ENV_IDS
    assert "BirdSQL-SQLite-v0" in gym.registry


def test_check_env_passes_without_warnings(env: gym.Env) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []


def test_scripted_episode(env: gym.Env) -> None:
    prompt, info = env.reset(options={"task_id": 3})
    assert sorted(info) == ["category", "db_id", "messages", "task_id", "tools"]
    assert (info["task_id"], info["db_id"], info["category"]) == (
        "3",
        "hospital_records",
        "moderate",
    )
    assert "CREATE TABLE departments" in prompt and "How many physicians" in prompt
    assert "submit_solution" in prompt

    # Exploration writes stay in the trajectory's session, never reach the judged state.
    obs, reward, terminated, truncated, _ = env.step(
        format_tool_call("execute_sql", sql="DELETE FROM physicians")
    )
    assert obs.startswith("status: ok") and (reward, terminated, truncated) == (0.0, False, False)
    obs, *_ = env.step(format_tool_call("execute_sql", sql="SELECT COUNT(*) FROM physicians"))
    assert "| 0 |" in obs
    obs, reward, *_ = env.step("I think I know.")  # no tool call: an error observation
    assert obs.startswith("status: error") and reward == 0.0

    rewrite = (
        "SELECT dep.name, COUNT(*) FROM physicians AS doc "
        "JOIN departments AS dep ON doc.dept_id = dep.dept_id GROUP BY dep.name"
    )
    obs, reward, terminated, truncated, info = env.step(submit([rewrite]))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert obs.startswith("verdict: success") and info["verdict"]["correct"] is True
    with pytest.raises(gym.error.ResetNeeded):
        env.step(submit([rewrite]))


@pytest.mark.parametrize(
    ("statements", "reward"),
    [
        (["SELECT COUNT(*) FROM departments"], 1.0),
        (["SELECT COUNT(*) FROM physicians"], 0.0),
        (["SELECT nope", "SELECT COUNT(*) FROM departments"], 1.0),  # the last one is the answer
        (["SELECT COUNT(*) FROM departments", "SELECT 0"], 0.0),
        ([], 0.0),
    ],
)
def test_submission_reward(env: gym.Env, statements: list[str], reward: float) -> None:
    env.reset(options={"task_id": "1"})
    obs, got, terminated, _, info = env.step(submit(statements))
    assert (got, terminated) == (reward, True)
    assert info["verdict"]["status"] == ("success" if reward else "failed")
    assert obs.startswith("verdict:")


def test_running_out_of_turns_truncates(env: gym.Env) -> None:
    env.reset(seed=0)
    for _ in range(5):
        _, reward, terminated, truncated, info = env.step(
            format_tool_call("execute_sql", sql="SELECT 1")
        )
    assert (reward, terminated, truncated) == (0.0, False, True) and "verdict" not in info


def test_unknown_task_and_bad_arguments(hospital_file: Path) -> None:
    root = suites.ensure().db_dir
    env = gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_root=root)
    try:
        with pytest.raises(KeyError):
            env.reset(options={"task_id": 99})
    finally:
        env.close()
    with pytest.raises(ValueError, match="reward"):
        gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_root=root, reward="dense")
