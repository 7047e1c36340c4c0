"""PostgreSQL tasks through every entry point that plays tasks, on the project's real cluster:
the environment chosen by kind and dialect, ``make_vec`` (sync, async, SQLite and PostgreSQL
tasks in one vector env, mixtures), the TRL adapter and ``birdtrain eval``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import birdenv  # noqa: F401 - registers the environments
from birdenv.envs import BirdCriticEnv, BirdCriticPgEnv, BirdSQLEnv, env_class_for, task_env
from birdenv.errors import TaskKindError
from birdenv.tasks import BirdTask, Task, load_tasks
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec
from tests.conftest import SHOP_TASKS

pytest.importorskip("psycopg")

VERSION = format_tool_call("execute_sql", sql="SELECT version()")


def _submit(sql: list[str]) -> str:
    return format_tool_call("submit_solution", sql_list=sql)


@pytest.fixture(scope="module")
def sqlite_tasks() -> list[Any]:
    return load_tasks("critic-mini")[:3]


@pytest.fixture(scope="module")
def pg_tasks() -> list[Any]:
    return [t for t in load_tasks("critic-mini-pg") if t.instance_id.startswith("pg_bank_")][:3]


def test_the_environment_is_chosen_by_kind_and_dialect(pg_tasks: list, sqlite_tasks: list) -> None:
    assert env_class_for(pg_tasks[0]) is BirdCriticPgEnv
    assert env_class_for(sqlite_tasks[0]) is BirdCriticEnv
    assert env_class_for(Task) is BirdCriticEnv and env_class_for(BirdTask) is BirdSQLEnv
    mysql = dataclasses.replace(sqlite_tasks[0], dialect="MySQL")  # held by its name, "mysql"
    with pytest.raises(TaskKindError, match="no environment plays critic tasks in mysql"):
        env_class_for(mysql)


@pytest.mark.parametrize("backend", ["sync", "async"])
def test_make_vec_plays_a_postgresql_suite_on_postgresql(backend: str) -> None:
    task = next(t for t in load_tasks("critic-mini-pg") if t.instance_id == "pg_bank_distinct_on")
    with contextlib.closing(make_vec(2, suite="critic-mini-pg", backend=backend, seed=0)) as envs:
        envs.reset(options={"task_id": task.instance_id})
        observations, *_ = envs.step([VERSION] * 2)
        assert all("| PostgreSQL 1" in o for o in observations)
        _, reward, terminated, _, info = envs.step([_submit(task.sol_sql), _submit(task.issue_sql)])
    assert list(terminated) == [True, True] and list(reward) == [1.0, 0.0]
    assert list(info["verdict"]["status"]) == ["success", "failed"]


def test_make_vec_plays_sqlite_and_postgresql_tasks_each_on_its_own(
    sqlite_tasks: list, pg_tasks: list
) -> None:
    tasks = sqlite_tasks + pg_tasks
    with contextlib.closing(make_vec(2, tasks=tasks, backend="async", seed=0)) as envs:
        for task, probe, answer in (
            (pg_tasks[0], VERSION, "| PostgreSQL 1"),
            (
                sqlite_tasks[0],
                format_tool_call("execute_sql", sql="SELECT sqlite_version()"),
                "| 3.",
            ),
        ):
            _, info = envs.reset(options={"task_id": task.instance_id})
            assert list(info["source"]) == ["critic"] * 2
            observations, *_ = envs.step([probe] * 2)
            assert all(answer in o for o in observations), observations
            _, reward, terminated, _, _ = envs.step([_submit(task.sol_sql)] * 2)
            assert list(terminated) == [True, True] and list(reward) == [1.0, 1.0]
            envs.step(["", ""])  # the next-step autoreset
        # Drawn at random, both dialects come up, from the one source of debugging tasks.
        drawn = set()
        envs.reset(seed=1)
        for _ in range(12):
            _, info = envs.reset()
            drawn |= set(info["task_id"])
    assert drawn & {t.instance_id for t in pg_tasks} and drawn & {
        t.instance_id for t in sqlite_tasks
    }


def test_a_mixture_of_sqlite_and_postgresql_suites_draws_both_by_weight() -> None:
    mixture = {"gym-mini": 0.5, "gym-mini-pg": 0.5}
    with contextlib.closing(make_vec(1, mixture=mixture, backend="sync", seed=0)) as envs:
        sources = [envs.reset(seed=0 if i == 0 else None)[1]["source"][0] for i in range(40)]
        _, info = envs.reset(options={"task_id": "pg_bank_window_frame"})
        assert info["source"][0] == "gym-mini-pg"
        observations, *_ = envs.step([VERSION])
    assert "| PostgreSQL 1" in observations[0]
    assert 8 <= sources.count("gym-mini-pg") <= 32, sources


def test_one_env_over_both_dialects_and_both_kinds(
    sqlite_tasks: list, pg_tasks: list, tmp_path: Path
) -> None:
    from birdenv.replicas import ReplicaPool

    questions = load_tasks("bird-mini-eval")[:2]
    # The replica pool serves the SQLite environments; PostgreSQL's clones come from its server.
    env = task_env(sqlite_tasks + pg_tasks + questions, pool_options={"root": tmp_path / "r"})
    try:
        assert isinstance(env.envs["BirdCritic-SQLite-v0"].pool, ReplicaPool)
        assert env.envs["BirdCritic-SQLite-v0"].pool.root == tmp_path / "r"
        assert sorted(env.names) == sorted(
            ["BirdCritic-SQLite-v0", "BirdCritic-PostgreSQL-v0", "BirdSQL-SQLite-v0"]
        )
        np.testing.assert_allclose(sorted(env.weights.values()), [2 / 8, 3 / 8, 3 / 8])
        _, info = env.reset(options={"task_id": pg_tasks[1].instance_id})
        assert info["source"] == "BirdCritic-PostgreSQL-v0"
        assert "| PostgreSQL 1" in env.step(VERSION)[0]
    finally:
        env.close()


def test_the_trl_adapter_plays_postgresql_tasks(sqlite_tasks: list, pg_tasks: list) -> None:
    from birdenv.integrations.trl import BirdCriticTRLEnv, environment_factories

    env = BirdCriticTRLEnv(suite="critic-mini-pg")
    task = pg_tasks[0]
    assert "# Database Schema:" in env.reset(task_id=task.instance_id)
    assert "| PostgreSQL 1" in env.execute_sql("SELECT version()")
    assert env.submit_solution(task.sol_sql).startswith("verdict: success")
    assert env.get_reward() == 1.0
    # One factory over both dialects (TRL's multi-environment form keys it by kind).
    factory = environment_factories([sqlite_tasks[0], *pg_tasks], "bird-mini-eval")["critic"]
    both = factory()
    for one in (sqlite_tasks[0], pg_tasks[1]):
        both.reset(task_id=one.instance_id)
        assert both.submit_solution(one.sol_sql).startswith("verdict: success"), one.instance_id
    both.reset(task_id=pg_tasks[2].instance_id)
    assert both.submit_solution(pg_tasks[2].issue_sql).startswith("verdict: failed")
    assert both.get_reward() == 0.0


@pytest.mark.parametrize(("policy", "rate"), [("oracle", 100.0), ("echo", 0.0)])
def test_birdtrain_eval_scores_postgresql_tasks(policy: str, rate: float, tmp_path: Path) -> None:
    from birdtrain.cli import main

    out = tmp_path / policy
    args = ["eval", "--policy", policy, "--suite", "critic-mini-pg", "--num-envs", "2"]
    assert main([*args, "--limit", "8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["n"], summary["success_rate"]) == (8, rate)


# -- the curriculum on a mixture of SQLite and PostgreSQL tasks -------------------------------------
_PG_MIX = [
    "--preset",
    "smoke",
    "data.mixture={gym-mini: 0.5, gym-mini-pg: 0.5}",
    "data.max_train_tasks=4",
    "data.eval_suite=critic-mini-pg",
    "stage4.max_steps=1",
    "stage4.max_turns=2",
    "stage4.max_new_tokens=16",
    "stage4.vector=sync",
    "eval.before=false",
    "eval.after=[stage4]",
    "eval.max_tasks=2",
    "eval.max_turns=1",
    "eval.max_new_tokens=8",
]
#: Shortest: stage 4 from the base model on the mixture, and its evaluation (~40 s on 2 cores).
_STAGE4_ONLY = ["stage1.enabled=false", "stage2.enabled=false", "stage3.enabled=false"]


def _check_pg_run(run: Path, stages: tuple[str, ...]) -> None:
    from birdtrain.trajectory_store import TrajectoryStore

    for stage in stages:
        assert (run / stage / "DONE").is_file(), stage
    pg_ids = {t.instance_id for t in load_tasks("gym-mini-pg")}
    store = TrajectoryStore(run / "stage4")
    rolled = {row[0] for row in store.query("SELECT DISTINCT task_id FROM trajectories")}
    # Stage 4 rolled out tasks of both dialects in its one vector env.
    assert rolled & pg_ids and rolled - pg_ids, rolled
    summary = json.loads((run / "summary.json").read_text())["after_stage4"]
    assert (summary["suite"], summary["n"], summary["metric"]) == ("critic-mini-pg", 2, "SR")


@pytest.mark.slow
def test_stage4_rolls_out_a_mixture_of_sqlite_and_postgresql_tasks(tmp_path: Path) -> None:
    from birdtrain.cli import main

    assert main(["curriculum", "--output-dir", str(tmp_path), *_PG_MIX, *_STAGE4_ONLY]) == 0
    _check_pg_run(tmp_path / "smoke", ("stage4",))


@pytest.mark.slow
def test_the_curriculum_runs_every_stage_on_a_mixture_with_postgresql_tasks(
    tmp_path: Path,
) -> None:
    from birdtrain.cli import main

    fast = ["stage1.max_steps=1", "stage2.max_steps=1", "stage3.max_steps=1"]
    args = [*_PG_MIX, *fast, "stage3.max_completion_length=16"]
    assert main(["curriculum", "--output-dir", str(tmp_path), *args]) == 0
    run = tmp_path / "smoke"
    _check_pg_run(run, ("stage1", "stage2", "stage3", "stage4"))
    # Synthesis kept the PostgreSQL tasks: their gold judged on PostgreSQL, their stage-2
    # episodes played in BirdCritic-PostgreSQL-v0.
    pg_ids = {t.instance_id for t in load_tasks("gym-mini-pg")}
    for name in ("stage1", "stage2"):
        rows = [json.loads(x) for x in (run / "data" / f"{name}.jsonl").read_text().splitlines()]
        ids = {r["task_id"] for r in rows}
        assert ids & pg_ids and ids - pg_ids, (name, ids)


# -- the official PostgreSQL layout: task rows and the server's own {db_id}_template ----------------
@pytest.fixture()
def official_tasks(official_shop: str, tmp_path: Path) -> Path:
    """A task file of the official PostgreSQL layout (dialect PostgreSQL, no SQLite file) over
    the server's own ``{db_id}_template``, made as the official images make theirs."""
    check = (  # the official PostgreSQL test signature and helpers
        "def test_case(pred_sqls, sol_sqls, db_name, conn):\n"
        "    res, _ = perform_query_on_postgresql_databases("
        "'SELECT count(*) FROM orders WHERE total IS NULL', db_name, conn)\n"
        "    assert res[0][0] == 0, res\n"
        "    return 1\n"
    )
    same = (  # without a test, the official PostgreSQL evaluator passes any prediction that runs
        "def test_case(pred_sqls, sol_sqls, db_name, conn):\n"
        "    assert ex_base(pred_sqls, sol_sqls, db_name, conn) == 1\n"
        "    return 1\n"
    )
    rows = [
        {
            **SHOP_TASKS[0],
            "db_id": official_shop,
            "instance_id": "shop_1_pg",
            "dialect": "PostgreSQL",
            "test_cases": [same],
        },
        {
            **SHOP_TASKS[1],
            "db_id": official_shop,
            "instance_id": "shop_2_pg",
            "dialect": "PostgreSQL",
            "test_cases": [check],
        },
    ]
    path = tmp_path / "official_pg.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_official_layout_plays_end_to_end_with_the_servers_schema(
    official_tasks: Path, tmp_path: Path
) -> None:
    from birdtrain.cli import main

    tasks = load_tasks(official_tasks)
    assert {t.db_dir for t in tasks} == {None} and env_class_for(tasks[0]) is BirdCriticPgEnv
    with contextlib.closing(make_vec(1, tasks=official_tasks, backend="sync")) as envs:
        prompts, _ = envs.reset(options={"task_id": "shop_1_pg"})
        # The prompt's schema is the server's: PostgreSQL's types, keys, views and rows.
        assert "CREATE TABLE customers (\n    id integer NOT NULL," in prompts[0]
        assert (
            "ALTER TABLE orders ADD FOREIGN KEY (customer_id) REFERENCES customers(id)"
            in (prompts[0])
        )
        assert "CREATE VIEW big_orders AS" in prompts[0] and "  1  Ann Paris" in prompts[0]
        _, reward, *_ = envs.step([_submit(tasks[0].sol_sql)])
        assert list(reward) == [1.0]
    linked = task_env(tasks, prompt_options={"schema": "named", "sample_rows": False})
    try:
        prompt, _ = linked.reset(options={"task_id": "shop_2_pg"})
    finally:
        linked.close()
    assert "CREATE TABLE orders" in prompt and "CREATE TABLE customers" not in prompt
    # Without the environment (a single-turn prompt), there is no file to read: said so.
    from birdenv.errors import DatabaseNotFoundError
    from birdenv.schema import task_schema

    with pytest.raises(DatabaseNotFoundError, match="BirdCritic-PostgreSQL-v0 reads it from"):
        task_schema(tasks[0])
    for policy, rate in (("oracle", 100.0), ("echo", 0.0)):
        out = tmp_path / policy
        args = ["eval", "--policy", policy, "--tasks", str(official_tasks), "--out", str(out)]
        assert main(args) == 0
        assert json.loads((out / "summary.json").read_text())["success_rate"] == rate
    # birdenv evaluate on predictions for the same file: judged on the server's templates.
    from birdenv.cli import main as birdenv_main

    predictions = tmp_path / "predictions.jsonl"
    rows = [{"instance_id": t.instance_id, "pred_sqls": t.sol_sql} for t in tasks]
    rows[1]["pred_sqls"] = tasks[1].issue_sql
    predictions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdicts = tmp_path / "verdicts.jsonl"
    args = [str(predictions), "--tasks", str(official_tasks), "--out", str(verdicts)]
    assert birdenv_main(["evaluate", *args]) == 0
    statuses = [json.loads(line)["status"] for line in verdicts.read_text().splitlines()]
    assert statuses == ["success", "failed"]


# -- the Ray backend: copies on two nodes, each node with its own PostgreSQL cluster ---------------
@pytest.mark.private_network
def test_the_ray_backend_plays_postgresql_tasks_on_both_nodes(
    ray_cluster: Any, official_tasks: Path
) -> None:
    import ray

    small = ("hospital_records", "movie_platform")
    sqlite = [t for t in load_tasks("critic-mini") if t.db_id in small][:1]
    pg = [t for t in load_tasks("critic-mini-pg") if t.db_id in small][:2]
    with contextlib.closing(make_vec(2, tasks=sqlite + pg, backend="ray")) as envs:
        assert len(set(envs.node_ids)) == 2 == len([n for n in ray.nodes() if n["Alive"]])
        for task in (pg[0], sqlite[0], pg[1]):
            envs.reset(options={"task_id": task.instance_id})
            _, reward, terminated, _, _ = envs.step([_submit(task.sol_sql)] * 2)
            assert list(terminated) == [True, True] and list(reward) == [1.0, 1.0], task
            envs.step(["", ""])  # the next-step autoreset
        envs.reset(options={"task_id": pg[0].instance_id})
        observations, *_ = envs.step([VERSION] * 2)
        assert all("| PostgreSQL 1" in o for o in observations)
    # The second node has a server of its own, which does not hold the driver's shop template:
    # the copy there says so, naming the way out (a BIRDENV_PG_DSN every node reaches).
    with (
        contextlib.closing(make_vec(2, tasks=official_tasks, backend="ray")) as envs,
        pytest.raises(Exception, match=r"holds none(.|\n)*BIRDENV_PG_DSN"),
    ):
        envs.reset(options={"task_id": "shop_1_pg"})


def test_birdenv_play_plays_a_postgresql_task() -> None:
    import io

    from birdenv.play import play

    task = next(t for t in load_tasks("critic-mini-pg") if t.instance_id == "pg_bank_distinct_on")
    out = io.StringIO()
    lines = "SELECT version();\n\\schema\n\\submit " + ";\n".join(task.sol_sql) + ";\n\n"
    assert play(task.instance_id, suite="critic-mini-pg", stdin=io.StringIO(lines), stdout=out) == 0
    text = out.getvalue()
    assert "| PostgreSQL 1" in text and "GENERATED BY DEFAULT AS IDENTITY" in text
    assert text.rstrip().endswith("tests passed)") and "verdict: success" in text


def test_birdenv_demo_plays_a_postgresql_suite_on_postgresql(tmp_path: Path, capsys) -> None:
    from birdenv.cli import main

    argv = ["demo", "--suite", "critic-mini-pg", "--limit", "2", "--out", str(tmp_path)]
    assert main([*argv, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "oracle agent: mean reward 1.000 over 2 episodes" in out
    assert "echo agent: mean reward 0.000 over 2 episodes" in out


def test_judging_postgresql_tasks_on_ray_is_refused_clearly() -> None:
    from birdenv.errors import ArgumentError
    from birdenv.judge import score_many

    task = load_tasks("critic-mini-pg")[0]
    with pytest.raises(ArgumentError, match="judged on their server by threads"):
        list(score_many([(task, task.sol_sql)], ray=True))
