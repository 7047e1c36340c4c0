"""BIRD text-to-SQL: loading questions, execution accuracy (EX) and ``BirdSQL-SQLite-v0``."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import birdenv
from birdenv import suites
from birdenv.errors import DatabaseNotFoundError, TaskFormatError, UnknownSuiteError
from birdenv.judge.ex import execution_accuracy, execution_accuracy_many, validate_bird
from birdenv.tasks import BirdTask, load_bird
from birdenv.tools import format_tool_call
from tests.conftest import build_shop

pytestmark = pytest.mark.long  # conftest.py: started first

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


def pair_params(field: str) -> list:
    """One pytest param per fixture pair, expecting ``field`` (else ``official``); pairs where
    ours deliberately differs from the official script are strict xfails naming the reason."""
    params = []
    for row in PAIR_ROWS:
        marks = []
        if "ours" in row:
            marks.append(pytest.mark.xfail(strict=True, reason=row["why"]))
        params.append(pytest.param(row, row.get(field, row["official"]), id=row["id"], marks=marks))
    return params


# -- the borderline fixture -------------------------------------------------------------------
def test_fixture_has_enough_borderline_pairs_with_reasons() -> None:
    assert len(PAIR_ROWS) >= 40
    assert len({row["id"] for row in PAIR_ROWS}) == len(PAIR_ROWS)
    assert all(row["note"] and isinstance(row["official"], bool) for row in PAIR_ROWS)
    assert {True, False} <= {row["official"] for row in PAIR_ROWS}
    assert all(row["why"] and row["ours"] != row["official"] for row in PAIR_ROWS if "ours" in row)


@pytest.mark.parametrize(("row", "official"), pair_params("official"))
def test_ex_agrees_with_the_official_script(
    row: dict, official: bool, shop_root: Path, pool
) -> None:
    task = shop_task(row["gold"], shop_root)
    verdict = execution_accuracy(
        task, row["pred"], pool=pool, statement_timeout=row.get("timeout", 30.0)
    )
    assert verdict.correct == official, f"{row['note']}: {verdict.error}"


def test_isolated_gold_agrees_except_where_the_prediction_writes(shop_root: Path, pool) -> None:
    """``official=False`` gives the official verdict on every pair, except the reward hacks
    (the prediction writes until the gold's result equals its own), which score 0."""
    wrong = []
    for row in PAIR_ROWS:
        if "ours" in row:  # a deliberate difference, tested above
            continue
        verdict = execution_accuracy(
            shop_task(row["gold"], shop_root),
            row["pred"],
            pool=pool,
            statement_timeout=row.get("timeout", 30.0),
            official=False,
        )
        if verdict.correct != row.get("isolated", row["official"]):
            wrong.append(f"{row['id']}: {verdict.correct} ({row['note']})")
    assert wrong == []
    assert sum("isolated" in row for row in PAIR_ROWS) >= 4


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
    # The statement never ends by itself: its verdict is the deadline's (a deadline that did not
    # hold would not return at all).
    assert (verdict.correct, verdict.phase) == (False, "timeout")


def test_predictions_never_change_the_base_or_each_other(shop_root: Path, pool) -> None:
    task = shop_task("SELECT COUNT(*) FROM orders", shop_root)
    assert not execution_accuracy(task, "DELETE FROM orders", pool=pool).correct
    # The next prediction starts from a fresh state: the four orders are back.
    assert execution_accuracy(task, "SELECT 4", pool=pool).correct


def test_a_writing_prediction_cannot_win_with_an_isolated_gold(shop_root: Path, pool) -> None:
    task = shop_task("SELECT id FROM orders WHERE total > 100", shop_root)
    # The hack is real under the official rule: the gold, run after the DELETE, is empty too.
    assert execution_accuracy(task, "DELETE FROM orders", pool=pool).correct
    safe = execution_accuracy(task, "DELETE FROM orders", pool=pool, official=False)
    assert (safe.correct, safe.phase, safe.pred_rows, safe.gold_rows) == (False, "mismatch", 0, 2)
    # The gold's outcome is kept per database content and SQL: the second time it does not run.
    again = execution_accuracy(task, "SELECT id FROM big_orders", pool=pool, official=False)
    assert again.correct and again.timings["gold"] == 0.0
    # A failing gold is a verdict in both modes.
    bad = shop_task("SELECT nope FROM orders", shop_root)
    for official in (True, False):
        verdict = execution_accuracy(bad, "SELECT 1", pool=pool, official=official)
        assert (verdict.correct, verdict.phase) == (False, "gold")


def test_many_in_worker_processes_equals_one_by_one(shop_root: Path) -> None:
    tasks = [shop_task("SELECT name FROM customers", shop_root, i) for i in (1, 2, 3)]
    preds = ["SELECT name FROM customers", "SELECT city FROM customers", "SELEC"]
    jobs = list(zip(tasks, preds, strict=True))
    serial = [v.phase for v in execution_accuracy_many(jobs)]
    parallel = [v.phase for v in execution_accuracy_many(jobs, processes=2)]
    assert serial == parallel == [None, "mismatch", "prediction"]


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
    from_jsonl = load_bird(write_jsonl(tmp_path / "q.jsonl", rows), db_dir=shop_root)
    array = tmp_path / "dev.json"
    array.write_text(json.dumps(rows, indent=2))
    from_array = load_bird(array, db_dir=shop_root)
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
    with pytest.raises(DatabaseNotFoundError, match="db_dir"):
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


def test_validate_bounds_the_gold_by_the_cpu_time_it_takes(shop_root: Path, pool) -> None:
    # A million-row recursive count costs SQLite a few hundred CPU-milliseconds; the bound is on
    # CPU time, so a busy machine, which stretches only the wall time, changes no verdict.
    slow = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000) "
    tasks = [
        shop_task(slow + "SELECT count(*) FROM n", shop_root, 1),
        shop_task("SELECT name FROM customers", shop_root, 2),
    ]
    problems = validate_bird(tasks, pool=pool, max_seconds=0.02)
    assert len(problems) == 1
    assert re.fullmatch(
        r"question 1 \(shop\): the gold SQL takes \d+\.\d\d s of CPU \(> 0\.02 s\)", problems[0]
    )
    assert validate_bird(tasks, pool=pool, max_seconds=30.0) == []


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
    env = gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_dir=suites.ensure().db_dir)
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


def test_the_reward_resists_a_submission_that_empties_the_gold(
    env: gym.Env, hospital_file: Path
) -> None:
    # Question 2's gold lists the departments on floor 2. Under the official rule, deleting every
    # department returns no rows and leaves the gold (run after it, same state) empty too: 1.
    task = load_bird(hospital_file, db_dir=suites.ensure().db_dir)[1]
    assert execution_accuracy(task, "DELETE FROM departments").correct
    env.reset(options={"task_id": 2})
    _, reward, terminated, _, info = env.step(submit(["DELETE FROM departments"]))
    assert (reward, terminated, info["verdict"]["phase"]) == (0.0, True, "mismatch")
    env.reset(options={"task_id": 2})
    _, reward, *_ = env.step(submit(["SELECT name FROM departments WHERE floor = 2"]))
    assert reward == 1.0


def test_running_out_of_turns_truncates(env: gym.Env) -> None:
    env.reset(seed=0)
    for _ in range(5):
        _, reward, terminated, truncated, info = env.step(
            format_tool_call("execute_sql", sql="SELECT 1")
        )
    assert (reward, terminated, truncated) == (0.0, False, True) and "verdict" not in info


def test_unknown_task_and_bad_arguments(hospital_file: Path) -> None:
    root = suites.ensure().db_dir
    env = gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_dir=root)
    try:
        with pytest.raises(KeyError):
            env.reset(options={"task_id": 99})
    finally:
        env.close()
    with pytest.raises(ValueError, match="reward"):
        gym.make("BirdSQL-SQLite-v0", tasks=hospital_file, db_dir=root, reward="dense")


def test_training_rewards_cannot_be_won_by_emptying_the_gold_table() -> None:
    from birdtrain.rewards import score_submission

    question = next(q for q in load_bird("bird-mini-eval") if "FROM districts" in q.SQL)
    hack = "DELETE FROM districts"
    assert execution_accuracy(question, hack).correct  # the official rule falls for it
    assert not score_submission(question, [hack]).passed
    assert score_submission(question, [question.SQL]).passed
