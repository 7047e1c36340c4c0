"""Ray backend benchmarks (issue 15): the Ray vector env against ``AsyncVectorEnv``, its per-step
overhead against ``SyncVectorEnv``, and ``birdenv evaluate`` on worker processes against Ray.

They run on a local Ray (one node: this machine's CPUs, one actor per CPU) inside a private network
namespace, as the Ray tests do (``tests/private_network.py``: ``make bench`` routes them there and
shows their output). The throughput figures are ``test_env.py``'s workload and builders: the
scripted policy lists the tables, runs the issue SQL, then submits the gold SQL (one judge call per
episode); the ``BirdCriticEnv`` builders are the same for both vector envs.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import interleaved_medians
from test_env import run_vector

from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call
from birdenv.vector import make_vec

pytestmark = pytest.mark.private_network

#: Vector steps timed per configuration (as in test_env.py).
VECTOR_STEPS = 16


@pytest.fixture(scope="module")
def critic_tasks() -> Iterator[list[Task]]:
    import ray

    from birdenv.cluster import connect

    connect()  # a local Ray, started once for the module (its start is not a step)
    yield load_tasks("critic-mini")
    ray.shutdown()


@pytest.mark.parametrize("n", [8, 32, 128])
def test_ray_vector_throughput(benchmark: Any, n: int, critic_tasks: list[Task]) -> None:
    """Steps per second, AsyncVectorEnv vs the Ray vector env, side by side in one run."""
    async_ = run_vector("async", n, critic_tasks, VECTOR_STEPS)
    ray_ = benchmark.pedantic(
        run_vector, args=("ray", n, critic_tasks, VECTOR_STEPS), rounds=1, iterations=1
    )
    benchmark.extra_info.update(
        n=n,
        **{f"async_{k}": v for k, v in async_.items()},
        **{f"ray_{k}": v for k, v in ray_.items()},
        ray_over_async=ray_["steps_per_s"] / async_["steps_per_s"],
    )


@pytest.mark.parametrize("n", [1, 8])
def test_ray_step_overhead(benchmark: Any, n: int, critic_tasks: list[Task]) -> None:
    """One vector step of a cheap statement: the Ray vector env vs SyncVectorEnv (same work)."""
    tasks = [t for t in critic_tasks if t.db_id == "hospital_records"]
    action = [format_tool_call("execute_sql", sql="SELECT 1 AS one")] * n
    with (
        contextlib.closing(make_vec(n, tasks=tasks, backend="sync", seed=0)) as sync,
        contextlib.closing(make_vec(n, tasks=tasks, backend="ray", seed=0)) as ray_,
    ):
        sync.reset(seed=0)
        ray_.reset(seed=0)
        # Episodes end after 5 steps (TimeLimit) and autoreset on the next: both pay the same.
        medians = interleaved_medians(
            {"sync": lambda: sync.step(action), "ray": lambda: ray_.step(action)},
            rounds=101,
            warmup=3,
        )
        benchmark.pedantic(ray_.step, args=(action,), rounds=30)
    benchmark.extra_info.update(
        n=n,
        sync_ms=1000 * medians["sync"],
        ray_ms=1000 * medians["ray"],
        overhead_ms=1000 * (medians["ray"] - medians["sync"]),
        overhead_per_copy_ms=1000 * (medians["ray"] - medians["sync"]) / n,
    )


def test_evaluate_local_vs_ray(benchmark: Any, tmp_path: Path) -> None:
    """``birdenv evaluate`` of gym-mini's gold SQL: 2 worker processes vs Ray (a command each,
    start-up included; ``--no-cache``), alternated twice; the verdicts must be the same."""
    tasks = load_tasks("gym-mini")
    pred = tmp_path / "gold.jsonl"
    pred.write_text(
        "".join(
            json.dumps({"instance_id": t.instance_id, "pred_sqls": t.sol_sql}) + "\n" for t in tasks
        )
    )

    def evaluate(name: str, *extra: str) -> float:
        out = tmp_path / f"{name}.jsonl"
        command = [
            sys.executable,
            "-m",
            "birdenv",
            "evaluate",
            str(pred),
            "--suite",
            "gym-mini",
        ]
        start = time.perf_counter()
        subprocess.run(
            [*command, "--no-cache", "--out", str(out), *extra], check=True, capture_output=True
        )
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"local": [], "ray": []}
    for _ in range(2):
        times["local"].append(evaluate("local", "--jobs", "2"))
        times["ray"].append(evaluate("ray", "--ray"))

    def verdicts(name: str) -> list[dict]:
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("timings", "issue_cached")} for r in rows]

    assert verdicts("ray") == verdicts("local")
    benchmark.pedantic(evaluate, args=("ray", "--ray"), rounds=1, iterations=1)
    benchmark.extra_info.update(
        instances=len(tasks),
        local_s=min(times["local"]),
        ray_s=min(times["ray"]),
        ray_over_local=min(times["ray"]) / min(times["local"]),
        passed=sum(r["status"] == "success" for r in verdicts("ray")),
    )
