"""Faults: killed workers, full disks, tampered bases, hostile test code.

Nothing may be lost and nobody may escape: after each fault the bases keep their sha256, the
store never serves a changed base, a new session is pristine and passes ``integrity_check``, and
the rest of the run goes on.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from birdenv import cli
from birdenv.judge import judge, judge_many
from birdenv.replicas import ReplicaPool
from birdenv.replicas.placement import default_sessions_dir
from birdenv.tasks import Task, load_tasks, parse_task
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec
from tests.conftest import SHOP_TASKS, build_shop

ROOT = Path(__file__).resolve().parents[1]

# A write that takes long enough (about a second here) to be killed in the middle.
LONG_WRITE = (
    "CREATE TABLE w AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r "
    "LIMIT 400000) SELECT i, randomblob(200) AS b FROM r"
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def shop(tmp_path: Path) -> tuple[Path, Path, list[Task]]:
    """(tasks JSONL, db_dir, tasks) for the small shop database."""
    db_dir = tmp_path / "dbs"
    build_shop(db_dir)
    path = tmp_path / "shop.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
    return path, db_dir, load_tasks(path, db_dir=db_dir)


def _check_pristine(root: Path, tasks: list[Task], hashes: dict[Path, str]) -> None:
    """Bases unchanged and intact; a new session sees none of anybody's writes."""
    for path, sha in hashes.items():
        assert _sha256(path) == sha == path.stem, path
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    with ReplicaPool(root=root) as pool, pool.session(tasks[0]) as session:
        result = session.execute("SELECT count(*) FROM sqlite_master WHERE name = 'w'")
        assert result.rows == [(0,)], result
        assert session.execute("PRAGMA integrity_check").rows == [("ok",)]


def _kill_loop(iterations: int, shop, root: Path) -> None:
    tasks_path, db_dir, tasks = shop
    rng = random.Random(7)
    hashes: dict[Path, str] = {}
    for i in range(iterations):
        envs = make_vec(
            2, tasks=str(tasks_path), db_dir=str(db_dir), pool_options={"root": str(root)}, seed=i
        )
        try:
            envs.reset(options={"task_id": "shop_1"})
            if not hashes:
                hashes = {p: _sha256(p) for p in (root / "bases").glob("*.sqlite")}
            envs.step_async(
                [
                    format_tool_call("execute_sql", sql=LONG_WRITE),
                    format_tool_call("execute_sql", sql="INSERT INTO customers(name) VALUES ('x')"),
                ]
            )
            time.sleep(rng.uniform(0.05, 0.6))
            victim = envs.processes[0]
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
        finally:
            # With a step pending on a dead worker, close() terminates and joins the survivors.
            envs.close()
        # The replacement worker (a new vector env on the same root) sweeps the dead pools'
        # files, and its sessions start from the pristine base.
        envs = make_vec(
            1, tasks=str(tasks_path), db_dir=str(db_dir), pool_options={"root": str(root)}
        )
        try:
            obs, _ = envs.reset(options={"task_id": "shop_1"})
            probe = "SELECT (SELECT count(*) FROM sqlite_master WHERE name = 'w'), count(*) FROM customers"
            obs, *_ = envs.step([format_tool_call("execute_sql", sql=probe)])
            assert "| 0 | 3 |" in obs[0], obs[0]
            dead = [p for p in default_sessions_dir(root).glob("*") if not p.name.endswith(".lock")]
            # Only the replacement's own session (its files share one prefix) may remain.
            assert len({p.name.split("-")[0] for p in dead}) <= 1, dead
        finally:
            envs.close()
    _check_pristine(root, tasks, hashes)
    sessions = default_sessions_dir(root)
    # A pool removes its folder in memory when it closes and the folder is empty.
    leftovers = list(sessions.iterdir()) if sessions.exists() else []
    with ReplicaPool(root=root) as pool:
        pass
    remaining = list(sessions.iterdir()) if sessions.exists() else []
    assert not [p for p in remaining if not p.name.endswith(".lock")], (leftovers, pool.swept)


def test_sigkill_worker_mid_write(shop, tmp_path: Path) -> None:
    _kill_loop(5, shop, tmp_path / "replicas")


@pytest.mark.slow
def test_sigkill_worker_mid_write_100(shop, tmp_path: Path) -> None:
    _kill_loop(100, shop, tmp_path / "replicas")


# -- disk full -----------------------------------------------------------------------------------
@pytest.fixture
def small_fs(mount_tmpfs) -> Path:
    """A 6 MB tmpfs mounted for the test (needs root); skipped when mounting is not allowed."""
    return mount_tmpfs("6m")


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_disk_full(shop, small_fs: Path) -> None:
    _, _, tasks = shop
    root = small_fs / "replicas"
    with ReplicaPool(root=root, sessions_dir=root / "sessions") as pool:
        other = pool.session(tasks[0])
        other.execute("INSERT INTO customers(name) VALUES ('other')")
        base = pool.store.base_for(tasks[0].db_path)
        before_sha, before_used = _sha256(base.path), _used(small_fs)
        filler = pool.session(tasks[0])
        result = filler.execute(
            "CREATE TABLE fill AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r "
            "LIMIT 100000) SELECT randomblob(1000) AS b FROM r"
        )
        assert result.error is not None and "full" in result.error, result
        # The filler's session is still usable, and so is everybody else's.
        assert filler.execute("SELECT count(*) FROM customers").rows == [(3,)]
        assert other.execute("SELECT count(*) FROM customers").rows == [(4,)]
        assert other.execute("INSERT INTO customers(name) VALUES ('again')").error in (
            None,
            "database or disk is full",  # the disk may still be full: an error, not a crash
        )
        filler.close()
        assert _used(small_fs) <= before_used + (256 << 10), "space not reclaimed at reset"
        assert other.execute("INSERT INTO customers(name) VALUES ('after')").ok
        assert _sha256(base.path) == before_sha
        other.close()
        with pool.session(tasks[0]) as fresh:
            assert fresh.execute("SELECT count(*) FROM customers").rows == [(3,)]
            assert fresh.execute("PRAGMA integrity_check").rows == [("ok",)]


# -- a base modified behind the store's back ---------------------------------------------------
def _tamper(path: Path, *, keep_mtime: bool = False) -> None:
    st = path.stat()
    path.chmod(0o644)
    with open(path, "r+b") as fh:
        fh.seek(st.st_size - 100)
        fh.write(b"\xff" * 50)
    path.chmod(0o444)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_tampered_base_is_detected_and_never_served(shop, tmp_path: Path) -> None:
    _, _, tasks = shop
    root = tmp_path / "replicas"
    with ReplicaPool(root=root) as pool:
        base = pool.store.base_for(tasks[0].db_path)
        _tamper(base.path)
        assert not pool.store.verify(base)
        with pool.session(tasks[0]) as session:  # this process's cache
            assert session.execute("PRAGMA integrity_check").rows == [("ok",)]
    with ReplicaPool(root=root) as pool:  # a new process reading the shared index
        again = pool.store.base_for(tasks[0].db_path)
        assert again.sha256 == base.sha256 and pool.store.verify(again)
        _tamper(again.path)
        with pool.session(tasks[0]) as session:
            assert session.execute("SELECT count(*) FROM customers").rows == [(3,)]
        served = pool.store.base_for(tasks[0].db_path)
        assert _sha256(served.path) == served.sha256
    assert list((root / "bases").glob("*.corrupt-*")), "the tampered file is kept aside"


def test_tampered_base_with_restored_mtime_is_not_served(shop, tmp_path: Path) -> None:
    _, _, tasks = shop
    with ReplicaPool(root=tmp_path / "replicas") as pool:
        base = pool.store.base_for(tasks[0].db_path)
        _tamper(base.path, keep_mtime=True)
        served = pool.store.base_for(tasks[0].db_path)
        assert _sha256(served.path) == served.sha256


# -- hostile test code in the judge ------------------------------------------------------------
def _task(db_dir: Path, instance_id: str, test: str) -> dict:
    return {
        "instance_id": instance_id,
        "db_id": "shop",
        "category": "Management",
        "query": "q",
        "issue_sql": ["SELECT 1"],
        "sol_sql": ["SELECT 1"],
        "test_cases": [
            "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n"
            "    if pred_sqls == ['SELECT 1']:\n        assert False, 'issue'\n" + test
        ],
    }


TESTS = {
    "raises": "    raise RuntimeError('boom')\n",
    "loops": "    while True:\n        pass\n",
    "prints": "    for _ in range(2000):\n        print('x' * 4096)\n    return 1\n",
    "exits": "    raise SystemExit(3)\n",
    "passes": "    return 1\n",
}


def test_judge_bounds_hostile_test_code(shop, tmp_path: Path, capsys) -> None:
    _, db_dir, _ = shop
    with ReplicaPool(root=tmp_path / "replicas") as pool:
        for name, body in TESTS.items():
            task = parse_task(_task(db_dir, name, body), db_dir=db_dir)
            # "loops" never ends by itself: its timeout verdict is the deadline's doing (a broken
            # deadline would not return at all), whatever the machine's speed.
            verdict = judge(task, ["SELECT 2"], pool=pool, instance_timeout=2.0)
            assert verdict.passed == (name in ("passes", "prints")), (name, verdict)
            if name == "loops":
                assert verdict.phase == "timeout", verdict
        assert pool.stats()["open_sessions"] == 0
    assert len(capsys.readouterr().out) < 1 << 20, "test output reached the terminal"


def test_evaluate_run_continues_past_hostile_tests(
    shop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``birdenv evaluate``: each bad task fails alone, bounded, and the run goes on."""
    _, db_dir, _ = shop
    rows = [_task(db_dir, name, body) for name, body in TESTS.items()]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "\n".join(
            json.dumps({"instance_id": r["instance_id"], "pred_sqls": ["SELECT 2"]}) for r in rows
        )
    )
    out = tmp_path / "verdicts.jsonl"
    monkeypatch.setenv("BIRDENV_HOME", str(tmp_path / "home"))
    cli.main(
        [
            "evaluate",
            str(preds),
            "--tasks",
            str(tasks),
            "--db-dir",
            str(db_dir),
            "--out",
            str(out),
            "--instance-timeout",
            "2",
        ]
    )
    verdicts = {v["instance_id"]: v for v in map(json.loads, out.read_text().splitlines())}
    assert set(verdicts) == set(TESTS)
    assert {k for k, v in verdicts.items() if v["status"] == "success"} == {"passes", "prints"}
    assert verdicts["loops"]["phase"] == "timeout"


def test_judge_many_bounds_test_code_that_swallows_the_deadline(shop, tmp_path: Path) -> None:
    # The in-process deadline is an exception, which this test code catches forever: only the
    # worker process boundary bounds it, and the run goes on with the next instance.
    _, db_dir, _ = shop
    body = "    while True:\n        try:\n            while True:\n                pass\n        except BaseException:\n            pass\n"
    swallow = parse_task(_task(db_dir, "swallow", body), db_dir=db_dir)
    passes = parse_task(_task(db_dir, "passes", TESTS["passes"]), db_dir=db_dir)
    verdicts = list(
        judge_many(
            [(swallow, ["SELECT 2"]), (passes, ["SELECT 2"]), (swallow, ["SELECT 2"])],
            processes=1,
            instance_timeout=1.0,
        )
    )
    assert [(v.instance_id, v.phase) for v in verdicts] == [
        ("swallow", "timeout"),
        ("passes", None),
        ("swallow", "timeout"),
    ]
    assert "killed" in verdicts[0].error and verdicts[1].passed


def test_judge_many_survives_test_code_that_kills_its_process(shop) -> None:
    _, db_dir, _ = shop
    dies = parse_task(_task(db_dir, "dies", "    import os\n    os._exit(7)\n"), db_dir=db_dir)
    passes = parse_task(_task(db_dir, "passes", TESTS["passes"]), db_dir=db_dir)
    verdicts = list(judge_many([(dies, ["SELECT 2"]), (passes, ["SELECT 2"])], processes=2))
    assert [(v.instance_id, v.phase) for v in verdicts] == [("dies", "crash"), ("passes", None)]
    assert "exit code 7" in verdicts[0].error


# What a script runs in worker processes: the judge on the shop tasks, and BIRD's EX on questions.
SCRIPT_CALLS = {
    "judge_many": (
        "from birdenv.judge import judge_many\nfrom birdenv.tasks import load_tasks\n",
        "tasks = load_tasks({tasks!r}, db_dir={db_dir!r})\n"
        "print([v.status for v in judge_many([(t, t.sol_sql) for t in tasks], processes=2)])\n",
    ),
    "execution_accuracy_many": (
        "from birdenv.tasks import load_bird\nfrom birdenv.judge.ex import execution_accuracy_many\n",
        "qs = load_bird('bird-mini-eval')[:5]\n"
        "print([v.status for v in execution_accuracy_many([(q, q.SQL) for q in qs], processes=2)])\n",
    ),
}


@pytest.mark.parametrize("guarded", [True, False], ids=["main-guard", "no-main-guard"])
@pytest.mark.parametrize("runner", sorted(SCRIPT_CALLS))
def test_a_script_without_a_main_guard_gets_a_clear_error(
    shop_dir: Path, tmp_path: Path, runner: str, guarded: bool
) -> None:
    # Workers import the calling script's main module; unguarded, it would start workers again
    # (before, judge_many gave every instance a "crash" verdict and EX's worker pool never ended).
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in SHOP_TASKS))
    imports, call = SCRIPT_CALLS[runner]
    call = call.format(tasks=str(tasks), db_dir=str(shop_dir))
    if guarded:
        call = "if __name__ == '__main__':\n" + "".join(
            f"    {line}\n" for line in call.splitlines()
        )
    script = tmp_path / "script.py"
    script.write_text(imports + call)
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if guarded:
        assert done.returncode == 0, done.stderr[-2000:]
        assert set(ast.literal_eval(done.stdout)) == {"success"}  # the printed statuses
    else:
        assert done.returncode == 1
        assert "WorkerStartError" in done.stderr and "if __name__ == '__main__':" in done.stderr
        assert "crash" not in done.stdout
