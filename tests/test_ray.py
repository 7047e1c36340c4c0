"""The Ray backend on a real two-node cluster on 127.0.0.1 (see tests/private_network.py).

The second node has a ``BIRDENV_HOME`` of its own: it shares no files with the driver, so every
database it uses must reach it by content hash. The copies of a vector env sit on both nodes;
killing or hanging an actor breaks only its copies' episodes; judging on the cluster,
``birdenv evaluate --ray`` and ``birdtrain eval --ray`` give the local verdicts; stage 4 of
birdtrain trains through it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import birdenv  # noqa: F401 - registers the environments
from birdenv.cli import main as birdenv_main
from birdenv.files import file_sha256, home
from birdenv.judge import judge_many, score_many
from birdenv.judge.ex import execution_accuracy_many
from birdenv.tasks import load_bird, load_tasks, parse_task
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec

pytestmark = [pytest.mark.private_network, pytest.mark.long]  # long: conftest.py starts it first

SMALL_DBS = ("hospital_records", "movie_platform")
SQL = functools.partial(format_tool_call, "execute_sql")


def _node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_copies_on_both_nodes_and_databases_by_content_hash(
    ray_cluster: Any, shop_tasks: list
) -> None:
    with contextlib.closing(make_vec(4, tasks=shop_tasks, backend="ray")) as envs:
        assert set(envs.node_ids) == _node_ids() and len(_node_ids()) == 2
        envs.reset(seed=0)
        obs, *_ = envs.step([SQL(sql="SELECT count(*) AS n FROM customers")] * 4)
    assert obs == ("status: ok\nrows: 1\n| n |\n| 3 |",) * 4
    sha = file_sha256(shop_tasks[0].db_path)
    second = Path(ray_cluster.second_home)
    copy = second / "cluster" / "databases" / sha / "shop" / "shop_template.sqlite"
    assert file_sha256(copy) == sha
    # The second node built its own base from that copy; the driver's node used the driver's file.
    assert list((second / "replicas" / "bases").glob("*.sqlite"))
    assert not (home() / "cluster" / "databases" / sha).exists()

    # A damaged copy fails its check and is fetched again before anything reads it.
    copy.chmod(0o644)
    with copy.open("r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff\xff\xff\xff")
    with contextlib.closing(make_vec(2, tasks=shop_tasks, backend="ray")) as envs:
        envs.reset(seed=0)
        obs, *_ = envs.step([SQL(sql="SELECT count(*) AS n FROM customers")] * 2)
    assert obs == ("status: ok\nrows: 1\n| n |\n| 3 |",) * 2
    assert file_sha256(copy) == sha


def test_a_mixture_of_both_kinds_on_the_cluster(ray_cluster: Any) -> None:
    tasks = [t for t in load_tasks("critic-mini") if t.db_id in SMALL_DBS][:4]
    tasks += [q for q in load_bird("bird-mini-eval") if q.db_id in SMALL_DBS][:4]
    with contextlib.closing(make_vec(4, tasks=tasks, backend="ray", seed=3)) as envs:
        assert set(envs.node_ids) == _node_ids()
        _, info = envs.reset(options={"task_id": tasks[-1].instance_id})
        assert list(info["source"]) == ["bird"] * 4
        _, info = envs.reset(options={"task_id": tasks[0].instance_id})
        assert list(info["source"]) == ["critic"] * 4
        obs, *_ = envs.step([SQL(sql="SELECT 6 * 7 AS answer")] * 4)
    assert obs == ("status: ok\nrows: 1\n| answer |\n| 42 |",) * 4


def test_killed_actor_breaks_only_its_copies(ray_cluster: Any, shop_tasks: list) -> None:
    with contextlib.closing(
        make_vec(4, tasks=shop_tasks, backend="ray", max_episode_steps=10)
    ) as envs:
        envs.reset(seed=0)
        envs.step([SQL(sql=f"CREATE TABLE mark AS SELECT 'm{i}' AS m") for i in range(4)])
        victim = envs.actor_pids[0]
        lost = [i for i, pid in enumerate(envs.actor_pids) if pid == victim]
        kept = [i for i in range(4) if i not in lost]
        assert lost == [0, 1] and kept == [2, 3]
        os.kill(victim, signal.SIGKILL)

        obs, reward, terminated, truncated, info = envs.step([SQL(sql="SELECT m FROM mark")] * 4)
        for i in lost:
            assert truncated[i] and not terminated[i] and reward[i] == 0.0 and obs[i] == ""
            assert info["_broken"][i] and "died" in info["broken"][i]
        for i in kept:  # the other actor's episodes go on, their state intact
            assert obs[i] == f"status: ok\nrows: 1\n| m |\n| m{i} |"
            assert not truncated[i] and not info["_broken"][i]
        assert envs.restarts == 1 and envs.actor_pids[0] != victim

        # Next step: the lost copies start new episodes on the new actor (next-step autoreset).
        obs, reward, terminated, truncated, info = envs.step([SQL(sql="SELECT m FROM mark")] * 4)
        for i in lost:
            assert "# User issue:" in obs[i] and info["_task_id"][i]
            assert not (terminated[i] or truncated[i] or reward[i])
        for i in kept:
            assert obs[i] == f"status: ok\nrows: 1\n| m |\n| m{i} |"
        obs, *_ = envs.step([SQL(sql="SELECT m FROM mark")] * 4)
        for i in lost:  # fresh sessions: nothing of the lost episodes survived
            assert obs[i].startswith("status: error") and "no such table" in obs[i]


def test_hung_actor_is_killed_at_the_step_timeout(ray_cluster: Any, shop_tasks: list) -> None:
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    # The step timeout bounds every call, the healthy reset and SELECT 7 too: 20 s, far from
    # their cost on any machine (4 s failed the reset under two CPU hogs per core), while the
    # endless statement's own deadline (600 s) is further still.
    with contextlib.closing(
        make_vec(
            2,
            tasks=shop_tasks,
            backend="ray",
            statement_timeout=600.0,
            vector_kwargs={"step_timeout": 20.0, "envs_per_actor": 1},
        )
    ) as envs:
        envs.reset(seed=0)
        obs, _, _, truncated, info = envs.step([SQL(sql=endless), SQL(sql="SELECT 7 AS n")])
        assert truncated[0] and "did not answer within step_timeout=20 s" in info["broken"][0]
        assert obs[1] == "status: ok\nrows: 1\n| n |\n| 7 |" and not truncated[1]
        assert envs.restarts == 1


def _summary(out: tuple) -> tuple:
    """A step's result without timings: what a Sync and a Ray vector env must agree on."""
    obs, reward, terminated, truncated, info = out

    def keep(infos: dict) -> dict:
        picked = {}
        for key in ("task_id", "category", "final_obs"):
            if key in infos:
                mask = infos[f"_{key}"]
                picked[key] = [str(v) if m else None for v, m in zip(infos[key], mask, strict=True)]
        if "verdict" in infos:
            picked["verdict"] = [
                str(s) if m else None
                for s, m in zip(infos["verdict"]["status"], infos["_verdict"], strict=True)
            ]
        if "final_info" in infos:
            picked["final_info"] = keep(infos["final_info"])
        return picked

    return tuple(obs), reward.tolist(), terminated.tolist(), truncated.tolist(), keep(info)


@pytest.mark.parametrize("mode", list(gym.vector.AutoresetMode), ids=lambda m: m.value)
def test_reset_step_and_autoreset_as_sync(
    ray_cluster: Any, shop_tasks: list, mode: gym.vector.AutoresetMode
) -> None:
    fix = {
        "shop_1": ["SELECT name FROM customers WHERE city IS NULL"],
        "shop_2": ["UPDATE orders SET total = 0 WHERE total IS NULL"],
        "shop_3": ["SELECT customer_id, SUM(total) FROM orders GROUP BY 1 ORDER BY 2 DESC"],
    }
    results = {}
    for backend in ("sync", "ray"):
        with contextlib.closing(
            make_vec(
                3,
                tasks=shop_tasks,
                backend=backend,
                max_episode_steps=3,
                vector_kwargs={"autoreset_mode": mode},
            )
        ) as envs:
            obs, info = envs.reset(seed=5)
            current = [str(t) for t in info["task_id"]]
            steps: list[Any] = [(obs, list(current))]
            # Explore, submit the fixes, then one more step (an autoreset in NEXT_STEP mode,
            # an explicit reset in DISABLED mode); twice, and a last exploring step.
            for turn in range(7):
                if turn % 3 == 2 and mode == gym.vector.AutoresetMode.DISABLED:
                    obs, info = envs.reset(options={"reset_mask": np.ones(3, dtype=np.bool_)})
                    current = [str(t) for t in info["task_id"]]
                    steps.append((obs, list(current)))
                    continue
                if turn % 3 == 1:
                    actions = [
                        format_tool_call("submit_solution", sql_list=fix[t]) for t in current
                    ]
                else:
                    actions = [SQL(sql="SELECT count(*) AS n FROM orders")] * 3
                out = envs.step(actions)
                steps.append(_summary(out))
                new = out[4]
                for i in np.flatnonzero(new.get("_task_id", np.zeros(3, dtype=np.bool_))):
                    current[i] = str(new["task_id"][i])
            results[backend] = steps
    assert results["ray"] == results["sync"]
    assert sum(r[1] == [1.0, 1.0, 1.0] for r in results["ray"][1:]) == 2  # the fixes were judged


def test_call_get_attr_set_attr_as_sync(ray_cluster: Any, shop_tasks: list) -> None:
    seen = {}
    for backend in ("sync", "ray"):
        with contextlib.closing(
            make_vec(3, tasks=shop_tasks, backend=backend, render_mode="ansi")
        ) as envs:
            envs.reset(seed=1)
            envs.step([SQL(sql="SELECT 1 AS one")] * 3)
            envs.set_attr("tag", ["a", "b", "c"])
            tags = envs.get_attr("tag")
            envs.set_attr("tag", "z")
            with pytest.raises(AttributeError):
                envs.get_attr("no_such_attribute")
            seen[backend] = (
                tags,
                envs.get_attr("tag"),
                envs.call("render"),
                envs.render(),
                tuple(t.instance_id for t in envs.get_attr("task")),
            )
    assert seen["ray"] == seen["sync"]
    assert seen["ray"][:2] == (("a", "b", "c"), ("z", "z", "z"))
    assert "SELECT 1 AS one" in seen["ray"][2][0]


def _comparable(verdict: Any) -> dict:
    # Timings differ between runs; whether the issue phase came from a cache is how, not what.
    data = verdict.to_dict() if hasattr(verdict, "to_dict") else dict(vars(verdict))
    data.pop("timings", None)
    data.pop("issue_cached", None)
    return data


def test_judging_on_the_cluster_gives_the_local_verdicts(ray_cluster: Any, shop_dir: Path) -> None:
    tasks = [t for t in load_tasks("critic-mini") if t.db_id in SMALL_DBS][:8]
    jobs = [(t, t.sol_sql) for t in tasks] + [(t, t.issue_sql) for t in tasks]
    dies = parse_task(
        {
            "instance_id": "dies",
            "db_id": "shop",
            "query": "",
            "issue_sql": ["SELECT 1"],
            "test_cases": [
                "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n"
                "    import os\n    os._exit(7)\n"
            ],
        },
        db_dir=shop_dir,
    )
    jobs.append((dies, ["SELECT 1"]))
    local = list(judge_many(jobs, processes=2))
    on_ray = list(judge_many(jobs, ray=True))
    assert [_comparable(v) for v in on_ray[:-1]] == [_comparable(v) for v in local[:-1]]
    assert {v.status for v in local} == {"success", "failed"}
    # A worker that dies is a crash verdict either way, and the run goes on.
    assert (on_ray[-1].status, on_ray[-1].phase) == (local[-1].status, local[-1].phase)
    assert on_ray[-1].phase == "crash"

    questions = [q for q in load_bird("bird-mini-eval") if q.db_id in SMALL_DBS][:8]
    pairs = [(q, q.SQL if i % 2 else "SELECT 1") for i, q in enumerate(questions)]
    local_ex = [_comparable(v) for v in execution_accuracy_many(pairs)]
    assert [_comparable(v) for v in execution_accuracy_many(pairs, ray=True)] == local_ex
    # The one scoring entry point: BIRD's submission rule, then the same scoring on the cluster.
    official = score_many(pairs, official=True, ray=True)
    assert [_comparable(v) for v in official] == local_ex


def test_birdenv_evaluate_ray_writes_the_local_verdicts(ray_cluster: Any, tmp_path: Path) -> None:
    tasks = [t for t in load_tasks("gym-mini") if t.db_id in SMALL_DBS][:6]
    pred = tmp_path / "pred.jsonl"
    pred.write_text(
        "".join(
            json.dumps({"instance_id": t.instance_id, "pred_sqls": t.sol_sql if i % 3 else []})
            + "\n"
            for i, t in enumerate(tasks)
        )
    )
    rows = {}
    for name, extra in (("local", []), ("ray", ["--ray"])):
        out = tmp_path / f"{name}.jsonl"
        args = ["evaluate", str(pred), "--suite", "gym-mini", "--out", str(out), *extra]
        assert birdenv_main(args) == 0
        rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
        for row in rows[name]:
            row.get("verdict", row).pop("timings", None)
            row.get("verdict", row).pop("issue_cached", None)
    assert rows["ray"] == rows["local"] and len(rows["ray"]) == len(tasks)


# -- birdtrain on the cluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("trl", reason="TRL is in the train extra")
    from birdtrain.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_rollouts_of_a_killed_actor_are_dropped_and_the_batch_goes_on(
    ray_cluster: Any, shop_tasks: list, tiny: Path
) -> None:
    from test_agentic import DISABLED, ScriptedPolicy, _collect
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)

    class KillsAnActor(ScriptedPolicy):
        """Plays the scripts; before its second turn, kills the actor of copies 0 and 1."""

        calls = 0

        def generate(self, batch: list, **kwargs: Any) -> list:
            self.calls += 1
            if self.calls == 2:
                os.kill(envs.actor_pids[0], signal.SIGKILL)
            return super().generate(batch, **kwargs)

    with contextlib.closing(
        make_vec(4, tasks=shop_tasks, backend="ray", vector_kwargs=DISABLED)
    ) as envs:
        rollouts = _collect(envs, KillsAnActor(tokenizer, shop_tasks), ["shop_1", "shop_3"])
        assert envs.restarts == 1
        again = _collect(envs, ScriptedPolicy(tokenizer, shop_tasks), ["shop_1", "shop_3"])
    # shop_1's rollouts ran in copies 0 and 1 (their second turn was lost); shop_3's completed.
    assert [(t.task_id, t.dropped) for t in rollouts] == [
        ("shop_1", True),
        ("shop_1", True),
        ("shop_3", False),
        ("shop_3", False),
    ]
    assert all("broken" in t.error and "died" in t.error for t in rollouts[:2])
    assert not any(t.dropped for t in again)
    assert sorted(t.reward for t in again) == [0.0, 0.0, 1.0, 1.0]


def test_stage4_trains_on_the_cluster(
    ray_cluster: Any, shop_tasks: list, tiny: Path, tmp_path: Path
) -> None:
    from test_agentic import ScriptedPolicy, _read_metrics, _stage4_config

    from birdtrain.stages import agentic

    tasks = [t for t in shop_tasks if t.instance_id in ("shop_1", "shop_3")]
    cfg = _stage4_config(vector="ray", num_envs=2, max_new_tokens=200)
    checkpoint = agentic.run(
        cfg,
        model_path=str(tiny),
        out_dir=tmp_path / "stage4",
        tasks=tasks,
        policy=lambda trainer: ScriptedPolicy(trainer.processing_class, tasks),
    )
    assert (checkpoint / "config.json").is_file()
    steps = _read_metrics(tmp_path / "stage4" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["agentic/reward_mean"] == 0.5 and record["agentic/dropped"] == 0


def test_birdtrain_eval_ray_gives_the_local_verdicts(
    ray_cluster: Any, tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from birdtrain.cli import main as birdtrain_main

    common = ["eval", "--policy", str(tiny), "--suite", "critic-mini", "--limit", "2"]
    common += ["--max-turns", "2", "--max-new-tokens", "8", "--num-envs", "2"]
    for mode in ("agent", "single"):
        rows = {}
        for name, extra in (("local", []), ("ray", ["--ray"])):
            out = tmp_path / mode / name
            assert birdtrain_main([*common, "--mode", mode, "--out", str(out), *extra]) == 0
            lines = (out / "verdicts.jsonl").read_text().splitlines()
            rows[name] = [json.loads(line) for line in lines]
            for row in rows[name]:
                (row.get("verdict") or {}).pop("timings", None)
                (row.get("verdict") or {}).pop("issue_cached", None)
        assert rows["ray"] == rows["local"] and len(rows["ray"]) == 2, mode
    # Reference agents play in local threads: Ray refuses them instead of doing nothing.
    assert birdtrain_main(["eval", "--policy", "oracle", "--ray", "--out", str(tmp_path)]) == 2
    assert "evaluate this agent without Ray" in capsys.readouterr().err
