"""Judge throughput in the shape RL rewards have: the same tasks judged over and over.

Every critic-mini task is judged on its gold and on its issue SQL (138 verdicts a pass) by three
schemes, timed task by task in alternation so drift hits them alike:

* ``cached``: ours as the environment runs it, overlay sessions and the issue-phase cache (warmed
  by one earlier pass, as any task judged before in a training run is);
* ``uncached``: overlay sessions, every issue phase run again (``cache=False``);
* ``copy``: the naive scheme, a full private copy of the database for each phase (the official
  evaluator's and the reference pool's way), every phase run.

All three must give the same verdicts (checked). Figures in ``extra_info``: verdicts/s of each
and the speed-ups of ``cached`` over the other two.
"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import overlay_or_skip

from birdenv.judge import judge
from birdenv.replicas import ReplicaPool
from birdenv.tasks import load_tasks


def test_judge_throughput(benchmark, tmp_path: Path) -> None:
    overlay_or_skip()
    tasks = load_tasks("critic-mini")
    jobs = [(t, list(t.sol_sql)) for t in tasks] + [(t, list(t.issue_sql)) for t in tasks]
    pools = {
        "cached": ReplicaPool(root=tmp_path / "cached"),
        "uncached": ReplicaPool(root=tmp_path / "uncached"),
        "copy": ReplicaPool(root=tmp_path / "copy", strategy="copy"),
    }
    use_cache = {"cached": True, "uncached": False, "copy": False}
    for task, pred in jobs:  # warm: bases materialised for all, issue outcomes for "cached"
        for name, pool in pools.items():
            judge(task, pred, pool=pool, cache=use_cache[name])
    seconds = dict.fromkeys(pools, 0.0)
    statuses: dict[str, list[tuple[str, str | None]]] = {name: [] for name in pools}
    for task, pred in jobs:
        for name, pool in pools.items():
            start = time.perf_counter()
            verdict = judge(task, pred, pool=pool, cache=use_cache[name])
            seconds[name] += time.perf_counter() - start
            statuses[name].append((verdict.status, verdict.phase))
    assert statuses["cached"] == statuses["uncached"] == statuses["copy"]
    assert sum(s == "success" for s, _ in statuses["cached"]) == len(tasks)

    def cached_pass() -> None:
        for task, pred in jobs:
            judge(task, pred, pool=pools["cached"])

    benchmark.pedantic(cached_pass, rounds=1, iterations=1)
    for pool in pools.values():
        pool.close()
    benchmark.extra_info.update(
        verdicts=len(jobs),
        **{f"{name}_verdicts_per_s": len(jobs) / s for name, s in seconds.items()},
        **{f"{name}_s": s for name, s in seconds.items()},
        speedup_over_uncached=seconds["uncached"] / seconds["cached"],
        speedup_over_copy=seconds["copy"] / seconds["cached"],
    )
