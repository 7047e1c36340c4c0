"""Many trajectories at once: isolation, rewards equal to the judge's, Gymnasium's constructors.

The scripted policy writes a marker unique to its trajectory into a TEMP table and into a real
table that every trajectory creates under the same name, reads both back, and looks for anybody
else's marker. With shared state anywhere (the pool, a worker reusing a session, a base written
to) a CREATE would fail or a read would show a foreign marker.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import uuid

import gymnasium as gym
import numpy as np
import pytest

import birdenv  # noqa: F401 - registers the environments
from birdenv.judge import judge
from birdenv.ray_vector import RayVectorEnv
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec

# Tasks on the small databases: the copy strategy (until the overlay lands) copies the base for
# every session, and retail_orders is 165 MB.
SMALL_DBS = ("hospital_records", "movie_platform")
STEPS = 6  # explore, temp write, real write, read back, look for others, submit


@functools.cache
def _tasks() -> dict[str, Task]:
    return {t.instance_id: t for t in load_tasks("critic-mini") if t.db_id in SMALL_DBS}


@functools.cache
def _expected(task_id: str, kind: str) -> bool:
    """The judge's verdict on the gold or issue SQL, computed here, not by the environment."""
    task = _tasks()[task_id]
    return judge(task, task.sol_sql if kind == "gold" else task.issue_sql).passed


def _turn(step: int, task: Task, marker: str, kind: str) -> str:
    """The scripted policy's action at ``step`` of an episode."""
    sql = [
        task.issue_sql[0],
        f"CREATE TEMP TABLE vec_temp AS SELECT '{marker}' AS m",
        f"CREATE TABLE vec_real AS SELECT '{marker}' AS m",
        "SELECT 'temp' AS src, m FROM temp.vec_temp UNION ALL SELECT 'real', m FROM main.vec_real",
        f"SELECT m FROM temp.vec_temp WHERE m <> '{marker}' "
        f"UNION ALL SELECT m FROM main.vec_real WHERE m <> '{marker}'",
    ]
    if step < len(sql):
        return format_tool_call("execute_sql", sql=sql[step])
    return format_tool_call(
        "submit_solution", sql_list=task.sol_sql if kind == "gold" else task.issue_sql
    )


def _run(envs: gym.vector.VectorEnv, episodes: int) -> list[dict]:
    """Drive ``episodes`` episodes per copy in lockstep through next-step autoreset."""
    n = envs.num_envs
    run = uuid.uuid4().hex[:8]
    obs, info = envs.reset(seed=123)
    trajectories: list[dict] = []
    current: list[dict] = []

    def start(i: int, episode: int, prompt: str, task_id: str) -> dict:
        traj = {
            "env": i,
            "episode": episode,
            "task_id": str(task_id),
            "kind": "gold" if (i + episode) % 2 == 0 else "issue",
            "marker": f"m-{run}-{i}-{episode}",
            "observations": [prompt],
        }
        trajectories.append(traj)
        return traj

    current = [start(i, 0, obs[i], info["task_id"][i]) for i in range(n)]
    for episode in range(episodes):
        for step in range(STEPS):
            actions = [_turn(step, _tasks()[t["task_id"]], t["marker"], t["kind"]) for t in current]
            obs, reward, terminated, truncated, info = envs.step(actions)
            assert not truncated.any()
            for i, traj in enumerate(current):
                traj["observations"].append(obs[i])
            if step < STEPS - 1:
                assert not terminated.any() and not reward.any()
        assert terminated.all()
        for i, traj in enumerate(current):
            traj["reward"] = float(reward[i])
            assert info["_verdict"][i]
            # Nested dicts are batched key by key: infos["verdict"]["status"][i].
            traj["status"] = str(info["verdict"]["status"][i])
        if episode + 1 < episodes:
            # Next-step autoreset: this step's actions are ignored and the new prompts arrive.
            obs, reward, terminated, truncated, info = envs.step(["ignored"] * n)
            assert not reward.any() and not terminated.any() and not truncated.any()
            current = [start(i, episode + 1, obs[i], info["task_id"][i]) for i in range(n)]
    return trajectories


def _check(trajectories: list[dict]) -> None:
    """Every reward is the judge's verdict; every observation shows only its own marker."""
    markers = {t["marker"] for t in trajectories}
    assert len(markers) == len(trajectories)
    for traj in trajectories:
        own, observations = traj["marker"], traj["observations"]
        expected = _expected(traj["task_id"], traj["kind"])
        assert traj["reward"] == float(expected), traj
        assert traj["status"] == ("success" if expected else "failed")
        # Explore (the issue SQL may well fail: that is an observation too), two writes (a CREATE
        # that would fail if another trajectory's table were visible), then the read-back shows
        # exactly its own marker twice.
        assert observations[1].startswith(("status: ok\n", "status: error\n")), observations[1]
        assert (
            observations[2] == observations[3] == "status: ok\nstatement executed; no rows returned"
        )
        assert (
            observations[4]
            == f"status: ok\nrows: 2\n| src | m |\n| temp | {own} |\n| real | {own} |"
        )
        assert observations[5] == "status: ok\nrows: 0\n| m |"
        for text in observations:
            assert not any(m in text for m in markers - {own}), text


def _base_untouched(trajectories: list[dict]) -> None:
    """The immutable bases never saw a marker table."""
    for db_path in {_tasks()[t["task_id"]].db_path for t in trajectories}:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
            found = conn.execute(
                "SELECT name FROM sqlite_master WHERE name LIKE 'vec_%'"
            ).fetchall()
        conn.close()
        assert found == []


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """A make_vec backend; "ray" runs on the two-node test cluster."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


RAY = pytest.param("ray", marks=pytest.mark.private_network)


@pytest.mark.parametrize("backend", ["async", RAY], indirect=True)
def test_32_trajectories_are_isolated_and_judged(backend: str) -> None:
    # 8 copies x 4 episodes: 32 trajectories, each in its own session, 8 in flight at once. On a
    # 2-core machine 32 workers would spend most of the test starting processes (each imports
    # gymnasium and builds two 64k-character text spaces) and contending for the cores; 8 still
    # run many sessions concurrently on one replica root, and autoreset re-leases a fresh session
    # per episode in every copy. With Ray: two actors of four copies, one on each node.
    tasks = list(_tasks().values())
    with contextlib.closing(
        make_vec(8, tasks=tasks, backend=backend, max_episode_steps=STEPS + 2)
    ) as envs:
        expected = gym.vector.AsyncVectorEnv if backend == "async" else RayVectorEnv
        assert isinstance(envs, expected)
        trajectories = _run(envs, episodes=4)
    assert len(trajectories) == 32
    assert len({t["task_id"] for t in trajectories}) > 1
    assert {t["kind"] for t in trajectories} == {"gold", "issue"}
    _check(trajectories)
    _base_untouched(trajectories)


def test_sync_trajectories_are_isolated_and_judged() -> None:
    tasks = list(_tasks().values())
    with contextlib.closing(
        make_vec(3, tasks=tasks, asynchronous=False, max_episode_steps=STEPS + 2)
    ) as envs:
        assert isinstance(envs, gym.vector.SyncVectorEnv)
        trajectories = _run(envs, episodes=2)
    assert len(trajectories) == 6
    _check(trajectories)
    _base_untouched(trajectories)


@pytest.mark.parametrize("backend", ["sync", RAY], indirect=True)
def test_make_vec_seed_equals_seeded_reset(backend: str) -> None:
    with contextlib.closing(make_vec(3, backend=backend, seed=7)) as envs:
        _, seeded_at_construction = envs.reset()
    with contextlib.closing(make_vec(3, backend=backend)) as envs:
        _, seeded_at_reset = envs.reset(seed=7)
    assert list(seeded_at_construction["task_id"]) == list(seeded_at_reset["task_id"])


def test_make_vec_rejects_what_cannot_work() -> None:
    from birdenv.replicas.pool import default_pool

    with pytest.raises(ValueError, match="pool_options"):
        make_vec(2, pool=default_pool())
    with pytest.raises(ValueError, match="pool_options"):
        make_vec(2, backend="ray", pool=default_pool())
    with pytest.raises(ValueError, match="backend must be one of async, sync, ray"):
        make_vec(2, backend="threads")
    with pytest.raises(ValueError, match="stale observations"):
        make_vec(2, vector_kwargs={"shared_memory": True})
    with pytest.raises(ValueError, match="num_envs"):
        make_vec(0)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gymnasium_make_vec(mode: str) -> None:
    # Without shared_memory=False, Gymnasium's async mode returns stale text (see birdenv.vector).
    vector_kwargs = {"shared_memory": False} if mode == "async" else {}
    envs = gym.make_vec(
        "BirdCritic-SQLite-v0", num_envs=4, vectorization_mode=mode, vector_kwargs=vector_kwargs
    )
    try:
        prompts, _ = envs.reset(seed=0)
        assert len(prompts) == 4 and all("# User issue:" in p for p in prompts)
        obs, reward, terminated, truncated, _ = envs.step(
            [format_tool_call("execute_sql", sql="SELECT 6 * 7 AS answer")] * 4
        )
        assert obs == ("status: ok\nrows: 1\n| answer |\n| 42 |",) * 4
        assert np.array_equal(reward, np.zeros(4)) and not terminated.any()
        assert not truncated.any()
        assert all(envs.single_observation_space.contains(o) for o in obs)
    finally:
        envs.close()


def test_birdenv_imports_without_ray_and_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import sys

    from birdenv.errors import MissingExtraError

    code = (
        "import sys, birdenv.vector, birdenv.ray_vector, birdenv.cluster, birdenv.judge;"
        "sys.exit('ray' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray sees
    with pytest.raises(MissingExtraError, match=r"pip install 'bird-rl\[ray\]'"):
        make_vec(2, backend="ray")


@pytest.mark.parametrize("pending", [False, True], ids=["idle", "mid-step"])
def test_close_after_the_workers_died_of_the_groups_sigterm(pending: bool) -> None:
    """SIGTERM to the process group (timeout, Slurm, systemd) ends the async workers at once,
    while the parent unwinds: its ``close()`` must end and join them all, not raise the broken
    pipe of a dead worker in place of the parent's interrupt."""
    import os
    import signal

    envs = make_vec(2, suite="critic-mini", seed=0)
    envs.reset(seed=0)
    if pending:  # the parent was waiting for a step when they died
        envs.step_async(["ignored"] * 2)
    processes = list(envs.processes)
    os.kill(processes[0].pid, signal.SIGTERM)
    processes[0].join()
    envs.close()
    assert all(p.exitcode is not None for p in processes)
