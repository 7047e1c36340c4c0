"""The judge: official verdicts on a small real database, and its bounds."""

from __future__ import annotations

import pytest

from birdenv.judge import judge, remove_comments, remove_distinct, remove_round
from birdenv.tasks import parse_task


def by_id(tasks: list, instance_id: str):
    return next(t for t in tasks if t.instance_id == instance_id)


@pytest.mark.parametrize(
    ("pred", "status", "phase"),
    [
        (["SELECT name FROM customers WHERE city IS NULL"], "success", None),
        (["select DISTINCT name from customers where city is null; -- fixed"], "success", None),
        (["SELECT c.name AS n FROM customers AS c WHERE c.city IS NULL;"], "success", None),
        (["SELECT name FROM customers WHERE city = NULL"], "failed", "tests"),
        (["SELECT name FROM customers WHERE city IS NULL; SELECT 1"], "failed", "prediction"),
        (["SELECT 1", "SELECT nope FROM customers"], "failed", "prediction"),
        ([], "failed", "tests"),
        (["SELECT name FROM customers WHERE city IS NULL AND 0"], "failed", "tests"),
    ],
)
def test_query_task_default_test(shop_tasks: list, pool, pred: list, status: str, phase) -> None:
    verdict = judge(by_id(shop_tasks, "shop_1"), pred, pool=pool)
    assert (verdict.status, verdict.phase) == (status, phase), verdict.error


def test_string_prediction_is_split_like_the_official_reader(shop_tasks: list, pool) -> None:
    verdict = judge(
        by_id(shop_tasks, "shop_1"),
        "SELECT 1 [split] SELECT name FROM customers WHERE city IS NULL",
        pool=pool,
    )
    assert verdict.passed


def test_management_task_inspects_state_and_states_are_fresh(shop_tasks: list, pool) -> None:
    task = by_id(shop_tasks, "shop_2")
    assert judge(task, task.sol_sql, pool=pool).passed
    failed = judge(task, task.issue_sql, pool=pool)
    assert failed.phase == "tests" and "assertion" in failed.error
    # the gold's update above never leaked into a later state
    assert judge(task, ["SELECT 1"], pool=pool).phase == "tests"


def test_order_condition_and_preprocess(shop_tasks: list, pool) -> None:
    task = by_id(shop_tasks, "shop_3")
    assert judge(task, task.sol_sql, pool=pool).passed
    assert not judge(task, task.issue_sql, pool=pool).passed


def test_issue_sql_that_passes_fails_the_instance(shop_dir, pool) -> None:
    sql = ["SELECT name FROM customers WHERE city IS NULL"]
    task = parse_task(
        {"instance_id": "t", "db_id": "shop", "issue_sql": sql, "sol_sql": sql}, db_dir=shop_dir
    )
    verdict = judge(task, sql, pool=pool)
    assert verdict.status == "failed" and verdict.phase == "issue" and verdict.issue_passed


def test_empty_gold_result_fails(shop_dir, pool) -> None:
    gold = ["SELECT name FROM customers WHERE 0"]
    task = parse_task(
        {"instance_id": "t", "db_id": "shop", "issue_sql": ["SELECT 1"], "sol_sql": gold},
        db_dir=shop_dir,
    )
    assert judge(task, gold, pool=pool).phase == "tests"


def test_hostile_test_code_is_a_failure_not_a_crash(shop_dir, pool) -> None:
    tests = [
        "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n    raise SystemExit(3)\n",
        "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n    print('x' * 10_000_000)\n    return 1\n",
        "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n    while True:\n        pass\n",
    ]
    row = {
        "instance_id": "t",
        "db_id": "shop",
        "issue_sql": ["SELECT no_such_column"],
        "sol_sql": ["SELECT 1"],
        "test_cases": tests,
    }
    verdict = judge(parse_task(row, db_dir=shop_dir), ["SELECT 1"], pool=pool, instance_timeout=2)
    assert verdict.status == "failed"
    assert verdict.tests_passed == 1 and verdict.failed_tests == ["test_1", "test_3"]
    assert verdict.phase == "timeout"


def test_runaway_statement_hits_the_statement_deadline(shop_tasks: list, pool) -> None:
    forever = (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
    )
    verdict = judge(by_id(shop_tasks, "shop_1"), [forever], pool=pool, statement_timeout=0.3)
    # It never ends by itself: the verdict is the deadline's (one that did not hold would hang).
    assert verdict.phase == "timeout", verdict


def test_missing_database_is_a_setup_failure(tmp_path, pool) -> None:
    task = parse_task(
        {"instance_id": "t", "db_id": "ghost", "issue_sql": ["SELECT 1"]}, db_dir=tmp_path
    )
    verdict = judge(task, ["SELECT 1"], pool=pool)
    assert verdict.phase == "setup" and "ghost" in verdict.error


@pytest.mark.parametrize(
    ("fn", "given", "expected"),
    [
        (
            remove_round,
            "SELECT ROUND(AVG(ROUND(x, 2)), 1), round (y,0) FROM t",
            "SELECT AVG(x), y FROM t",
        ),
        (remove_round, "SELECT ROUND(x FROM t", "SELECT ROUND(x FROM t"),
        (remove_distinct, "SELECT  DISTINCT a FROM t", "SELECT  a FROM t"),
        (remove_distinct, "SELECT\nDISTINCT a", "SELECT\nDISTINCT a"),
        (remove_comments, "SELECT 1 -- trailing", "SELECT 1 -- trailing"),
        (remove_comments, "/* a */SELECT 1 -- c\n\n\nFROM t", "SELECT 1 \nFROM t"),
    ],
)
def test_official_text_transforms(fn, given: str, expected: str) -> None:
    assert fn([given]) == [expected]


def test_judging_from_threads_keeps_stdout(shop_dir, pool, capsys) -> None:
    import concurrent.futures
    import sys

    noisy = "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n    print('noise ' * 100)\n    return 1\n"
    row = {
        "instance_id": "t",
        "db_id": "shop",
        "issue_sql": ["SELECT nope"],
        "sol_sql": ["SELECT 1"],
        "test_cases": [noisy],
    }
    task = parse_task(row, db_dir=shop_dir)
    before = sys.stdout
    with concurrent.futures.ThreadPoolExecutor(4) as workers:
        verdicts = list(workers.map(lambda _: judge(task, ["SELECT 1"], pool=pool), range(16)))
    assert all(v.passed for v in verdicts)
    print("still here")
    assert "still here" in capsys.readouterr().out
    assert "noise" not in capsys.readouterr().out
    assert sys.stdout is before or getattr(sys.stdout, "real", None) is before
