"""The judge's issue-phase cache: reused only when the outcome would come out the same again."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from birdenv.judge import judge, judge_many
from birdenv.judge.cache import CACHE_FILE, IssueOutcome, JudgeCache, schedule_key
from birdenv.replicas import ReplicaPool
from birdenv.replicas.placement import default_root
from birdenv.tasks import parse_task
from tests.conftest import SHOP_TASKS


def by_id(tasks: list, instance_id: str):
    return next(t for t in tasks if t.instance_id == instance_id)


def test_second_judgement_reuses_the_issue_phase_with_the_same_verdicts(
    shop_tasks: list, pool
) -> None:
    for task in shop_tasks:
        for pred in (task.sol_sql, task.issue_sql, ["SELECT 1"]):
            first = judge(task, pred, pool=pool)
            again = judge(task, pred, pool=pool)
            cold = judge(task, pred, pool=pool, cache=False)
            assert again.issue_cached and not cold.issue_cached
            strip = ("issue_cached", "timings")
            assert {k: v for k, v in again.to_dict().items() if k not in strip} == {
                k: v for k, v in cold.to_dict().items() if k not in strip
            }
            assert (first.status, first.phase) == (again.status, again.phase)


def _judge_in_new_process(root: Path, row: dict, db_dir: Path, pred: list[str]) -> dict:
    script = (
        "import json, sys\n"
        "from birdenv.judge import judge\nfrom birdenv.replicas import ReplicaPool\n"
        "from birdenv.tasks import parse_task\n"
        "row, db_dir, root, pred = json.loads(sys.argv[1])\n"
        "task = parse_task(row, db_dir=db_dir)\n"
        "with ReplicaPool(root=root) as pool:\n"
        "    print(json.dumps(judge(task, pred, pool=pool).to_dict()))\n"
    )
    args = json.dumps([row, str(db_dir), str(root), pred])
    proc = subprocess.run(
        [sys.executable, "-c", script, args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


SHOP_2 = next(row for row in SHOP_TASKS if row["instance_id"] == "shop_2")


def test_the_cache_outlives_the_process_and_follows_the_base(
    shop_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "replicas"
    first = _judge_in_new_process(root, SHOP_2, shop_dir, SHOP_2["sol_sql"])
    second = _judge_in_new_process(root, SHOP_2, shop_dir, SHOP_2["sol_sql"])
    assert first["status"] == second["status"] == "success"
    assert (first["issue_cached"], second["issue_cached"]) == (False, True)
    # New content in the template is a new base: the old outcome is not used for it.
    template = shop_dir / "shop" / "shop_template.sqlite"
    with sqlite3.connect(template) as conn:
        conn.execute("UPDATE orders SET total = 1 WHERE total IS NULL")
    changed = _judge_in_new_process(root, SHOP_2, shop_dir, SHOP_2["sol_sql"])
    assert not changed["issue_cached"]
    # ... and with no NULL totals left the issue SQL passes the test: judged, not remembered.
    assert changed["phase"] == "issue"
    # Another task text (here other tests) is another key as well.
    other = dict(SHOP_2, test_cases=[SHOP_2["test_cases"][0].replace("== 0", "== 0 or True")])
    assert not _judge_in_new_process(root, other, shop_dir, SHOP_2["sol_sql"])["issue_cached"]


@pytest.mark.parametrize(
    "change",
    [
        {"preprocess_sql": ["CREATE TABLE r AS SELECT random() AS x"]},
        {"issue_sql": ["UPDATE orders SET total = abs(random()) % 1 WHERE total = NULL"]},
        {
            "test_cases": [
                SHOP_2["test_cases"][0].replace("return 1", "import random\n    return 1")
            ]
        },
    ],
    ids=["volatile-preprocess", "volatile-issue-sql", "test-uses-random"],
)
def test_what_may_differ_next_time_is_never_remembered(shop_dir: Path, pool, change: dict) -> None:
    task = parse_task({**SHOP_2, **change}, db_dir=shop_dir)
    for _ in range(2):
        verdict = judge(task, task.sol_sql, pool=pool)
        assert not verdict.issue_cached


def test_an_instance_that_timed_out_is_not_remembered(shop_dir: Path, pool) -> None:
    slow = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    row = {**SHOP_2, "issue_sql": [slow]}
    task = parse_task(row, db_dir=shop_dir)
    for _ in range(2):
        verdict = judge(task, task.sol_sql, pool=pool, statement_timeout=0.2)
        assert not verdict.issue_cached and verdict.passed


def test_a_broken_cache_file_changes_no_verdict(shop_tasks: list, tmp_path: Path) -> None:
    root = tmp_path / "replicas"
    root.mkdir()
    (root / CACHE_FILE).write_bytes(b"this is not a database" * 100)
    task = by_id(shop_tasks, "shop_1")
    with ReplicaPool(root=root) as pool:
        assert judge(task, task.sol_sql, pool=pool).passed
        assert not judge(task, task.issue_sql, pool=pool).passed
        # remembered in memory all the same
        assert judge(task, task.sol_sql, pool=pool).issue_cached


def test_judge_many_starts_the_slowest_known_task_first(
    shop_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BIRDENV_HOME", str(tmp_path / "home"))
    log = tmp_path / "started.log"
    # Each task's test code notes that it ran; outputs still come back in input order.
    tasks = [
        parse_task(
            dict(
                SHOP_2,
                instance_id=name,
                test_cases=[
                    "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n"
                    f"    with open({str(log)!r}, 'a') as fh:\n"
                    f"        fh.write('{name}\\n')\n"
                    "    return 1\n"
                ],
            ),
            db_dir=shop_dir,
        )
        for name in ("quick", "slow", "new", "big")
    ]
    # "big" plays the same task on a larger copy of the database.
    big_db = shop_dir / "bigshop" / "bigshop_template.sqlite"
    big_db.parent.mkdir()
    shutil.copyfile(tasks[3].db_path, big_db)
    with closing(sqlite3.connect(big_db)) as conn, conn:
        conn.execute("CREATE TABLE padding AS SELECT zeroblob(100000) AS b")
    tasks[3] = dataclasses.replace(tasks[3], db_id="bigshop")
    cache = JudgeCache.for_root(default_root())
    # "slow": a time no judging of these tiny tasks reaches, however loaded the machine.
    cache.record_judge_seconds({schedule_key(tasks[0]): 0.01, schedule_key(tasks[1]): 9000.0})

    def started(**options) -> list[str]:
        log.unlink(missing_ok=True)
        verdicts = list(judge_many([(t, t.sol_sql) for t in tasks], processes=1, **options))
        assert [v.instance_id for v in verdicts] == ["quick", "slow", "new", "big"]
        assert all(v.phase == "issue" for v in verdicts)  # these tests pass anything
        return list(dict.fromkeys(log.read_text().split()))

    # Never judged first, then the longest; where no time is known, the larger database first.
    assert started(cache=False) == ["big", "quick", "slow", "new"]
    assert started() == ["big", "new", "slow", "quick"]
    # The run recorded what it measured: now "slow" is no longer known as slow.
    seconds = cache.judge_seconds([schedule_key(t) for t in tasks])
    assert len(seconds) == 4 and max(seconds.values()) < 9000.0


def test_judge_many_workers_judge_on_the_callers_root(
    shop_tasks: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker server outlives a change of BIRDENV_HOME; the workers must follow the caller.
    task = by_id(shop_tasks, "shop_2")
    for home in ("first", "second"):
        monkeypatch.setenv("BIRDENV_HOME", str(tmp_path / home))
        (verdict,) = judge_many([(task, task.sol_sql)], processes=1)
        assert verdict.passed
        assert list((tmp_path / home / "replicas" / "bases").glob("*.sqlite"))


def test_a_cache_busy_when_first_opened_is_used_once_it_is_free(tmp_path: Path) -> None:
    """Another process writing the cache file when this one first opens it (24 evaluation workers
    starting at once on a loaded machine): this use skips the cache, the next ones use it. Before,
    one busy moment left the process on its memory alone for the rest of its life."""
    holder = sqlite3.connect(tmp_path / CACHE_FILE, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    cache = JudgeCache(tmp_path)
    assert cache.get("issue") is None
    holder.execute("COMMIT")
    holder.close()
    cache.put("issue", IssueOutcome(True, {"SELECT 1": [(1,)]}))
    # a new process's cache (a fresh connection) finds the entry on disk
    assert JudgeCache(tmp_path).get("issue") == IssueOutcome(True, {"SELECT 1": [(1,)]})
