"""Load on ``birdenv serve``: 64 concurrent OpenEnv sessions from one client process, on 127.0.0.1.

Every session plays gym-mini (SQLite) or critic-mini-pg (PostgreSQL) episodes back to back for a bounded time: reset, a write and a read
of its own table (which must read back its own value), then the oracle's turns (explore, reproduce,
check, submit: reward 1), after checking that one connection more than the limit is refused.
Recorded: each call's latency (reset and step), p50/p99 and calls per
second; checked: no error and no wrong answer, and no lease left once the clients disconnect.
``BIRDENV_LOAD_SECONDS`` (default 5) bounds the run; ``BIRDENV_LOAD_SESSIONS`` (default 64) sets
the sessions. The adapters lane of ``make test`` runs it at the defaults (the check); the recorded
figure is a longer run (benchmarks/README.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import time
from typing import Any

import pytest

SESSIONS = int(os.environ.get("BIRDENV_LOAD_SESSIONS", "64"))
# critic-mini-pg's episodes play on PostgreSQL clones: the adapters lane, whose check runs this
# file, has no PostgreSQL driver (the figure is measured in .venv: benchmarks/README.md).
PG = pytest.mark.skipif(
    importlib.util.find_spec("psycopg") is None, reason="needs the postgres extra (.venv)"
)
SECONDS = float(os.environ.get("BIRDENV_LOAD_SECONDS", "5"))


async def _session(
    client: Any, tasks: list[Any], index: int, deadline: float, latencies: list[float]
) -> int:
    """Play episodes until the deadline (one at least); return how many were finished."""
    from birdenv.agents import OracleAgent
    from birdenv.integrations.openenv import BirdAction
    from birdenv.tools import format_tool_call

    episodes = 0
    try:
        while episodes == 0 or time.monotonic() < deadline:
            task = tasks[(index + episodes) % len(tasks)]
            started = time.perf_counter()
            await client.reset(task_id=task.instance_id)
            latencies.append(time.perf_counter() - started)
            value = 1000 + index
            turns = [
                format_tool_call("execute_sql", sql=f"CREATE TABLE mine AS SELECT {value} AS v"),
                format_tool_call("execute_sql", sql="SELECT v FROM mine"),
                *OracleAgent().turns(task),
            ]
            for number, turn in enumerate(turns):
                started = time.perf_counter()
                result = await client.step(BirdAction(text=turn))
                latencies.append(time.perf_counter() - started)
                text = result.observation.text
                if (
                    number < 2
                ):  # its own write, then its own value read back (the issue SQL may fail)
                    assert text.startswith("status: ok"), (task.instance_id, turn, text)
                if number == 1:
                    assert text.rstrip().endswith(f"| {value} |"), text
            assert result.done and result.reward == 1.0, (task.instance_id, text)
            episodes += 1
    finally:
        await client.close()
    return episodes


@pytest.mark.parametrize("suite", ["gym-mini", pytest.param("critic-mini-pg", marks=PG)])
def test_openenv_concurrent_sessions(benchmark: Any, suite: str) -> None:
    pytest.importorskip("openenv", reason="in the .venv-adapters lane of make test")
    # tests/ is on the path (benchmarks/conftest.py)
    from test_adapters import HANG, Server, wait_for
    from websockets.exceptions import ConnectionClosed

    import birdenv
    from birdenv.integrations.openenv import BirdEnvClient

    tasks = birdenv.load_tasks(suite)
    server = Server("--suite", suite, "--max-sessions", str(SESSIONS), "--max-turns", "10")
    try:
        latencies: list[float] = []
        timed = {"seconds": 0.0}  # the timed phase alone: all sessions connected and warm

        async def load() -> int:
            clients = [
                BirdEnvClient(base_url=server.url, message_timeout_s=120) for _ in range(SESSIONS)
            ]
            await asyncio.gather(*(client.connect() for client in clients))
            # Every session exists once it answers; one more connection is refused, not queued.
            await asyncio.gather(*(client.state() for client in clients))
            extra = BirdEnvClient(base_url=server.url)
            # The server sends CAPACITY_REACHED and closes: the reset reads the error, or finds
            # the connection already closed.
            with pytest.raises((RuntimeError, ConnectionClosed), match=r"CAPACITY_REACHED|1000"):
                await extra.reset()
            await extra.close()
            # One episode first, untimed: the server's first submission imports the judge.
            await _session(clients[0], tasks, 0, 0.0, [])
            deadline = time.monotonic() + SECONDS
            started = time.perf_counter()
            done = await asyncio.gather(
                *(_session(c, tasks, i, deadline, latencies) for i, c in enumerate(clients))
            )
            timed["seconds"] = time.perf_counter() - started
            return sum(done)

        episodes = benchmark.pedantic(lambda: asyncio.run(load()), rounds=1, iterations=1)
        wait_for(lambda: server.leases() == 0, HANG, "every lease is freed after the clients left")
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        benchmark.extra_info.update(
            suite=suite,
            sessions=SESSIONS,
            seconds=SECONDS,
            episodes=episodes,
            calls=len(ordered),
            calls_per_second=len(ordered) / timed["seconds"],
            p50_ms=1000 * statistics.median(ordered),
            p99_ms=1000 * p99,
            leases_after=server.leases(),
        )
        print(f"\nopenenv load: {benchmark.extra_info}")
        assert episodes >= SESSIONS  # every session finished at least one episode
    finally:
        server.close()
