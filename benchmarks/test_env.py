"""Environment benchmarks (issue 4): vector-env throughput and the cost of one ``execute_sql`` step.

Run: ``.venv/bin/python -m pytest benchmarks/test_env.py --benchmark-only -q``. The environment is
``BirdCriticEnv`` on the bundled ``critic-mini`` suite with the default pool (overlay where it
registers); the scripted policy explores twice and then submits the gold SQL, so every episode
also pays one judge call (two fresh sessions, the issue SQL, the gold SQL, the tests).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from conftest import interleaved_medians

from birdenv.envs.critic import BirdCriticEnv
from birdenv.replicas import overlay
from birdenv.replicas.pool import ReplicaPool
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call

#: Vector steps timed per configuration: enough for several full episodes in every sub-env.
VECTOR_STEPS = 16


class ScriptedPolicy:
    """Turn 0 lists the tables, turn 1 runs the issue SQL, turn 2 submits the gold SQL."""

    def __init__(self, tasks: list[Task], n: int) -> None:
        self.by_id = {t.instance_id: t for t in tasks}
        self.task_ids = [""] * n
        self.turns = [0] * n

    def observe(self, info: dict[str, Any], reset_mask: np.ndarray | None = None) -> None:
        """Record each sub-env's task; a sub-env that (auto)reset starts again at turn 0."""
        ids, mask = info.get("task_id"), info.get("_task_id")
        for i in range(len(self.task_ids)):
            if ids is not None and mask is not None and mask[i] and ids[i] != self.task_ids[i]:
                self.task_ids[i], self.turns[i] = ids[i], 0
            if reset_mask is not None and reset_mask[i]:
                self.turns[i] = 0

    def actions(self) -> list[str]:
        out = []
        for i, task_id in enumerate(self.task_ids):
            task, turn = self.by_id[task_id], self.turns[i]
            if turn == 0:
                out.append(format_tool_call("execute_sql", sql="SELECT name FROM sqlite_master"))
            elif turn == 1:
                out.append(format_tool_call("execute_sql", sql=task.issue_sql[0]))
            else:
                out.append(format_tool_call("submit_solution", sql_list=task.sol_sql))
            self.turns[i] += 1
        return out


def run_vector(kind: str, n: int, tasks: list[Task], steps: int) -> dict[str, float]:
    """Reset, then ``steps`` vector steps with the scripted policy; env steps per second.

    ``kind``: ``sync``, ``async`` or ``ray`` (:class:`~birdenv.ray_vector.RayVectorEnv` on the
    Ray this process is connected to); the same builders for all three.
    """
    fns = [lambda: BirdCriticEnv(suite="critic-mini") for _ in range(n)]
    if kind == "sync":
        envs = gym.vector.SyncVectorEnv(fns)
    elif kind == "async":
        envs = gym.vector.AsyncVectorEnv(fns, shared_memory=False)
    else:
        from birdenv.ray_vector import RayVectorEnv

        envs = RayVectorEnv(fns)
    try:
        start = time.perf_counter()
        _, info = envs.reset(seed=list(range(n)))
        startup = time.perf_counter() - start
        policy = ScriptedPolicy(tasks, n)
        policy.observe(info)
        episodes = 0
        done = np.zeros(n, dtype=bool)
        start = time.perf_counter()
        for _ in range(steps):
            # Gymnasium's default autoreset: the step after an episode ends resets that sub-env.
            _, _, term, trunc, info = envs.step(policy.actions())
            policy.observe(info, reset_mask=done)
            done = term | trunc
            episodes += int(done.sum())
        elapsed = time.perf_counter() - start
    finally:
        envs.close()
    return {
        "env_steps": steps * n,
        "seconds": elapsed,
        "steps_per_s": steps * n / elapsed,
        "episodes": episodes,
        "startup_s": startup,
    }


@pytest.fixture(scope="module")
def critic_tasks() -> list[Task]:
    return load_tasks("critic-mini")


@pytest.mark.parametrize("n", [1, 8, 32])
def test_vector_throughput(benchmark, n, critic_tasks) -> None:
    """Steps per second, SyncVectorEnv vs AsyncVectorEnv, measured side by side in one run."""
    sync = run_vector("sync", n, critic_tasks, VECTOR_STEPS)
    async_ = benchmark.pedantic(
        run_vector, args=("async", n, critic_tasks, VECTOR_STEPS), rounds=1, iterations=1
    )
    benchmark.extra_info.update(
        n=n,
        strategy="overlay" if overlay.available() else "copy",
        **{f"sync_{k}": v for k, v in sync.items()},
        **{f"async_{k}": v for k, v in async_.items()},
        async_over_sync=async_["steps_per_s"] / sync["steps_per_s"],
    )


#: Statements for the per-step overhead, from cheap (fixed costs dominate) to a task's real query.
STATEMENTS = {
    "point_lookup": "SELECT * FROM customers WHERE customer_id = 4242",
    "index_lookup": "SELECT order_id, order_ts, total_amount FROM orders WHERE customer_id = 4242",
    "task_issue_sql": None,  # retail_orders' first task's issue SQL, filled in below
}


#: Episodes of the per-turn timings (four turns each).
TURN_EPISODES = 200


@pytest.mark.parametrize("sharing", ["unshared", "shared"])
@pytest.mark.parametrize("kind", list(STATEMENTS))
def test_execute_sql_overhead(benchmark, kind, sharing, private_copy) -> None:
    """One ``env.step`` with an ``execute_sql`` call vs a raw ``sqlite3`` execute (goals: <= 1.5x on
    the lookups, <= 1.1x on the task's statement), in wall and in thread CPU time.

    ``unshared`` runs every statement (the step's own cost); ``shared`` is the default pool, whose
    result cache answers the repeated statement from the episode's first run of it.
    ``turn_ratios``: each of the four turns of an episode on its own, against raw."""
    tasks = [t for t in load_tasks("gym-mini") if t.db_id == "retail_orders"]
    sql = STATEMENTS[kind] or tasks[0].issue_sql[0]
    pool = ReplicaPool(share_results=sharing == "shared")
    env = BirdCriticEnv(tasks=tasks, pool=pool)
    options = {"task_id": tasks[0].instance_id}
    env.reset(seed=0, options=options)
    action = format_tool_call("execute_sql", sql=sql)
    conn = private_copy(tasks[0].db_path)
    turns = [0]

    def env_step() -> None:
        # A fresh episode every 4 turns (untimed cost aside, it is what training does): the env
        # copies its whole message history into info on every step, so long episodes would
        # measure that instead of the step.
        if turns[0] == 4:
            env.reset(options=options)
            turns[0] = 0
        env.step(action)
        turns[0] += 1

    def raw() -> None:
        conn.execute(sql).fetchall()

    medians = interleaved_medians({"env": env_step, "raw": raw}, rounds=101, warmup=3)
    # The same, in CPU time of this thread: steady where other jobs share the cores.
    cpu = interleaved_medians(
        {"env": env_step, "raw": raw}, rounds=101, warmup=0, clock=time.thread_time
    )

    # Each turn on its own (the medians above mix them): a new connection's first statement
    # reads the schema and switches the state to WAL, and the turn after it runs colder.
    per_turn: list[list[float]] = [[] for _ in range(4)]
    raws: list[float] = []
    for _ in range(TURN_EPISODES):
        env.reset(options=options)
        for turn in range(4):
            start = time.perf_counter()
            env.step(action)
            middle = time.perf_counter()
            raw()
            per_turn[turn].append(middle - start)
            raws.append(time.perf_counter() - middle)
    turn_medians = [statistics.median(ts) for ts in per_turn]
    raw_turn = statistics.median(raws)

    def fresh_episode() -> None:  # setup must return None, not reset()'s (obs, info)
        env.reset(options=options)

    benchmark.pedantic(env.step, args=(action,), setup=fresh_episode, rounds=30)
    env.close()
    pool.close()
    ratio = medians["env"] / medians["raw"]
    cpu_ratio = cpu["env"] / cpu["raw"]
    goal = 1.5 if kind != "task_issue_sql" else 1.1  # issue 17: a micro-statement / a real one
    benchmark.extra_info.update(
        statement=kind,
        sharing=sharing,
        env_ms=1000 * medians["env"],
        raw_ms=1000 * medians["raw"],
        overhead_ms=1000 * (medians["env"] - medians["raw"]),
        ratio=ratio,
        cpu_env_ms=1000 * cpu["env"],
        cpu_raw_ms=1000 * cpu["raw"],
        cpu_ratio=cpu_ratio,
        goal=goal,
        goal_met=ratio <= goal,
        turn_ms=[1000 * m for m in turn_medians],
        turn_ratios=[m / raw_turn for m in turn_medians],
    )
