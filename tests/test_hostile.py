"""The hostile catalogue: every case through ``env.step`` and through the judge.

An RL policy tries every strange statement there is, by accident. Each case of
``tests/fixtures/hostile/catalogue.jsonl`` (file access, runaway work, state escape, encoding, the
tool protocol; the fields are described in the folder's README) must give a clear error
observation or a correct result, within its deadline, with the session still usable and every
base byte-for-byte unchanged. The robustness corpus runs the real SQL six frontier models wrote
for BIRD-CRITIC-SQLite through the splitter, the classifier and a live session.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from birdenv import sql as sqlkit
from birdenv.envs.critic import BirdCriticEnv
from birdenv.judge import Verdict, judge
from birdenv.replicas import ReplicaPool
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call
from tests.conftest import SHOP_TASKS, build_shop

pytestmark = pytest.mark.long  # conftest.py: started first

HERE = Path(__file__).parent
CATALOGUE = HERE / "fixtures" / "hostile" / "catalogue.jsonl"
CORPUS_DIR = HERE.parent.parent / "shared" / "data" / "bird-critic"
CATEGORIES = ("file_access", "runaway", "state_escape", "encoding", "tool_protocol")
#: Every execute_sql statement's deadline in these tests: runaway cases cost about this much.
STATEMENT_TIMEOUT = 1.0
#: Rows in the ``big`` table the cartesian cases join with itself (20k^2 = 4e8 pairs).
BIG_ROWS = 20_000


def _expand(parts: list[Any]) -> str:
    """``[prefix, unit, count, suffix]`` -> prefix + unit * count + suffix (keeps the file small)."""
    prefix, unit, count, suffix = parts
    return prefix + unit * count + suffix


def load_catalogue() -> list[dict[str, Any]]:
    """The catalogue's cases, with generated fields expanded."""
    cases = []
    for line in CATALOGUE.read_text(encoding="utf-8").splitlines():
        case = json.loads(line)
        if "sql_parts" in case:
            case["sql"] = _expand(case.pop("sql_parts"))
        if "turn_parts" in case:
            case["turn"] = _expand(case.pop("turn_parts"))
        if "sql_list_parts" in case:
            item, count = case.pop("sql_list_parts")
            case["sql_list"] = [item] * count
        cases.append(case)
    return cases


CASES = load_catalogue()


def _params(cases: list[dict[str, Any]]) -> list[Any]:
    marks = lambda c: (  # noqa: E731
        [pytest.mark.xfail(strict=True, reason=c["xfail"])] if "xfail" in c else []
    )
    return [pytest.param(c, id=c["id"], marks=marks(c)) for c in cases]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class World:
    """One database, tasks, pool and environment shared by the module's cases (built once)."""

    def __init__(self, root: Path) -> None:
        template = build_shop(root / "dbs")
        with sqlite3.connect(template) as conn:
            conn.execute(
                "CREATE TABLE big AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 "
                f"FROM n LIMIT {BIG_ROWS}) SELECT i, 'row ' || i AS s FROM n"
            )
        conn.close()
        tasks_path = root / "shop.jsonl"
        tasks_path.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
        self.tasks: list[Task] = load_tasks(tasks_path, db_dir=root / "dbs")
        self.task = self.tasks[0]  # shop_1: its issue SQL fails its test, so predictions are run
        self.template = template
        self.pool = ReplicaPool(root=root / "replicas")
        self.env = BirdCriticEnv(
            tasks=self.tasks, pool=self.pool, statement_timeout=STATEMENT_TIMEOUT
        )
        self.env.reset(options={"task_id": self.task.instance_id})
        self.hashes = self.base_hashes()
        assert self.hashes, "the pool materialised no base"

    def base_hashes(self) -> dict[str, str]:
        """sha256 of the template and of every base file in the store."""
        files = [self.template, *self.pool.store.bases()]
        return {str(p): _sha256(p) for p in files}

    def close(self) -> None:
        self.env.close()
        self.pool.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    w = World(tmp_path_factory.mktemp("hostile"))
    yield w
    w.close()


def _action(case: dict[str, Any]) -> str:
    if "turn" in case:
        return case["turn"]
    if "sql_list" in case:
        return format_tool_call("submit_solution", sql_list=case["sql_list"])
    return format_tool_call("execute_sql", sql=case["sql"])


def _assert_usable(env: BirdCriticEnv) -> None:
    """A statement that needs the schema still runs in the episode's session."""
    obs, *_ = env.step(format_tool_call("execute_sql", sql="SELECT count(*) FROM sqlite_master"))
    assert obs.startswith("status: ok"), obs


# -- the catalogue itself ------------------------------------------------------------------------
def test_catalogue_covers_every_bullet() -> None:
    assert len(CASES) >= 80
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    for case in CASES:
        assert case["category"] in CATEGORIES, case["id"]
        assert case["expect"] in ("ok", "error", "any"), case["id"]
        assert sum(k in case for k in ("sql", "turn", "sql_list")) == 1, case["id"]
    counts = {cat: sum(c["category"] == cat for c in CASES) for cat in CATEGORIES}
    assert min(counts.values()) >= 10, counts


@pytest.mark.parametrize("case", _params(CASES))
def test_through_env_step(world: World, case: dict[str, Any]) -> None:
    if "statement_timeout" in case:  # a case of real work, judged on its answer, not its speed
        env = BirdCriticEnv(
            tasks=world.tasks, pool=world.pool, statement_timeout=case["statement_timeout"]
        )
    else:
        env = world.env
    try:
        _step_case(world, env, case)
    finally:
        if env is not world.env:
            env.close()


def _step_case(world: World, env: BirdCriticEnv, case: dict[str, Any]) -> None:
    env.reset(options={"task_id": world.task.instance_id})
    for sql in case.get("setup", []):
        env.step(format_tool_call("execute_sql", sql=sql))
    start = time.monotonic()
    obs, _reward, terminated, _truncated, info = env.step(_action(case))
    elapsed = time.monotonic() - start
    assert isinstance(obs, str) and obs, "an observation is always text"
    assert elapsed <= case.get("deadline", 10.0), f"took {elapsed:.1f} s"
    if "sql_list" in case:
        assert terminated and obs.startswith("verdict: "), obs[:300]
        assert info["verdict"]["status"] in ("success", "failed")
        env.reset(options={"task_id": world.task.instance_id})
    else:
        assert not terminated
        if case["expect"] != "any":
            assert obs.startswith(f"status: {case['expect']}"), obs[:500]
        if "match" in case:
            assert case["match"].lower() in obs.lower(), obs[:500]
    # No text outside the declared charset reaches a policy.
    assert all(c in env.observation_space.character_set for c in obs[:10_000])
    _assert_usable(env)
    assert world.base_hashes() == world.hashes, "a base or the template changed"


JUDGED = [c for c in CASES if c.get("judge", True)]


@pytest.mark.parametrize("case", _params(JUDGED))
def test_through_judge(world: World, case: dict[str, Any]) -> None:
    preds = case.get("setup", []) + (case["sql_list"] if "sql_list" in case else [case["sql"]])
    deadline = case.get("deadline", 10.0)
    start = time.monotonic()
    verdict = judge(
        world.task,
        preds,
        pool=world.pool,
        statement_timeout=case.get("statement_timeout", STATEMENT_TIMEOUT),
        instance_timeout=deadline,
    )
    elapsed = time.monotonic() - start
    assert isinstance(verdict, Verdict)
    assert elapsed <= deadline + 1.0, f"took {elapsed:.1f} s"
    assert verdict.status == "failed"  # none of these answers shop_1
    if "sql" in case and case["expect"] == "error":
        assert verdict.phase in ("prediction", "timeout"), verdict
        assert verdict.error
    if "sql" in case and case["expect"] == "ok" and not case.get("setup"):
        assert verdict.phase == "tests", verdict
    assert world.pool.stats()["open_sessions"] == 1  # only the env's own episode
    assert world.base_hashes() == world.hashes, "a base or the template changed"


def test_no_leak_after_catalogue(world: World) -> None:
    """After everything above: the judge's sessions are all gone and a fresh one is pristine."""
    probe = format_tool_call("execute_sql", sql="SELECT count(*) FROM big")

    def episode() -> str:
        world.env.reset(options={"task_id": world.task.instance_id})
        return world.env.step(probe)[0]

    episode()  # the same point of an episode (WAL files open) before and after
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        obs = episode()
    assert f"| {BIG_ROWS} |" in obs
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    sessions = list(world.pool.sessions_dir.glob(f"{world.pool._prefix}-*"))
    assert len({p.name.split(".db")[0] for p in sessions}) <= 1, sessions


def test_env_bounds_submitted_statements(world: World) -> None:
    # A runaway submitted statement is judged under the env's own statement deadline.
    forever = (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
    )
    env = BirdCriticEnv(tasks=[world.task], pool=world.pool, statement_timeout=0.5)
    env.reset(options={"task_id": world.task.instance_id})
    # It never ends by itself: the timeout verdict is the deadline's (a broken one would hang).
    _, reward, terminated, _, info = env.step(
        format_tool_call("submit_solution", sql_list=[forever])
    )
    assert terminated and reward == 0.0 and info["verdict"]["phase"] == "timeout"
    env.close()


def test_single_value_is_bounded(world: World) -> None:
    session = world.pool.session(world.task)
    with session:
        built = session.execute("SELECT length(printf('%.*c', 100000000, 'x'))", timeout=5)
        blob = session.execute("SELECT length(zeroblob(900000000))", timeout=5)
    # Past MAX_VALUE_BYTES SQLite's printf gives NULL and zeroblob an error: bounded either way,
    # without building the value (a value built would be 100 MB, not NULL; one cut by the
    # deadline would be a timeout).
    assert built.rows == [(None,)] and not built.timed_out, built
    assert blob.error is not None and "too big" in blob.error, blob


# -- the robustness corpus: real SQL from six frontier models ----------------------------------
def _corpus() -> list[tuple[str, str]]:
    files = sorted(CORPUS_DIR.glob("predictions-sqlite500-*.jsonl"))
    statements = []
    for path in files:
        model = path.stem.removeprefix("predictions-sqlite500-")
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            for sql in row.get("pred_sqls") or []:
                statements.append((f"{model}/{row['instance_id']}", sql))
    return statements


@functools.cache
def corpus() -> list[tuple[str, str]]:
    return _corpus()


def test_corpus_split_tables_execute(tmp_path: Path) -> None:
    """~2,900 real statements: split, their tables listed, and run on a bundled database, none
    raising.

    Run on ``school_district`` (bundled, 3 MB) where most fail with "no such table", in one
    session as an agent would; the corpus's own transactions are rolled back between statements.
    """
    if not CORPUS_DIR.is_dir():
        pytest.skip(f"robustness corpus not found at {CORPUS_DIR} (../shared/data/bird-critic)")
    statements = corpus()
    assert len(statements) > 2000, len(statements)
    task = next(t for t in load_tasks("critic-mini") if t.db_id == "school_district")
    pieces_seen = named = 0
    outcomes = {"ok": 0, "error": 0, "timeout": 0}
    with ReplicaPool(root=tmp_path / "replicas") as pool:
        base = pool.store.base_for(task.db_path)
        before = _sha256(base.path)
        with pool.session(task) as session:
            for where, sql in statements:
                pieces = sqlkit.split_statements(sql)
                for piece in pieces or [sql]:
                    names = sqlkit.referenced_tables(piece)
                    assert all(isinstance(n, str) and n for n in names), (where, piece)
                    pieces_seen, named = pieces_seen + 1, named + bool(names)
                # As the official evaluator runs it: the whole string in one execute.
                result = session.execute(sql, timeout=0.5)
                outcomes["timeout" if result.timed_out else "ok" if result.ok else "error"] += 1
                if len(pieces) > 1:
                    assert not result.ok, (where, "two statements in one string must fail")
                if session.conn.in_transaction:
                    session.execute("ROLLBACK")
            assert session.execute("PRAGMA integrity_check").rows == [("ok",)]
        assert _sha256(base.path) == before
    # Nearly every real statement names a table (the rest: transaction control, pragmas, VALUES).
    assert named > 0.9 * pieces_seen, (named, pieces_seen)
    assert outcomes["ok"] > 50, outcomes
