"""Judging many instances: supervised workers, the slowest known first, verdicts in input order."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from birdenv.dialects import POSTGRESQL
from birdenv.errors import BirdEnvError
from birdenv.judge.cache import JudgeCache, schedule_key
from birdenv.judge.instance import Verdict, judge
from birdenv.judge.official import INSTANCE_TIMEOUT
from birdenv.replicas.placement import default_root
from birdenv.replicas.pool import ReplicaPool
from birdenv.tasks import Task
from birdenv.workers import KILL_GRACE, supervised_map

__all__ = ["judge_many", "validate_tasks"]


def _judge_job(
    pool: ReplicaPool, job: tuple[Task, list[str] | str, bool, float | None, float]
) -> Verdict:
    """One :func:`judge_many` instance, in a worker (module level: workers get it by name)."""
    task, pred_sqls, cache, statement_timeout, instance_timeout = job
    return judge(
        task,
        pred_sqls,
        pool=pool,
        statement_timeout=statement_timeout,
        instance_timeout=instance_timeout,
        cache=cache,
    )


def _database_bytes(task: Task) -> int:
    """The size of ``task``'s database (0 when it is missing: its worker reports that)."""
    try:
        return task.db_path.stat().st_size
    except (BirdEnvError, OSError):
        return 0


def _unjudged(job: tuple[Task, Any, Any, Any, Any], phase: str, why: str) -> Verdict:
    """The verdict of an instance whose worker was killed or died."""
    task = job[0]
    return Verdict(
        instance_id=task.instance_id,
        status="failed",
        phase=phase,
        error=why,
        tests_total=len(task.test_cases) or 1,
    )


def judge_many(
    jobs: Iterable[tuple[Task, list[str] | str]],
    *,
    processes: int | None = None,
    statement_timeout: float | None = None,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
    ray: bool = False,
) -> Iterator[Verdict]:
    """Judge many ``(task, pred_sqls)`` pairs, in order, in ``processes`` supervised workers.

    Every instance runs in a worker process (:func:`birdenv.workers.supervised_map`), as the
    official evaluator runs each in a subprocess: a worker still busy ``instance_timeout`` (+2 s)
    after it started an instance is killed (test code can swallow the in-process deadline; only a
    process boundary bounds it), the instance gets a ``"timeout"`` verdict, and a new worker takes
    over; a worker that dies gives its instance a ``"crash"`` verdict. The rest of the run
    continues either way.

    With ``cache=True`` instances start longest first, by the time their task took to judge last
    time (kept beside the issue-phase cache; never-judged tasks start before all others): a run
    ends when its slowest instance does, so that one should not start last. ``cache=False``
    remembers nothing. Where no time is known, the instance on the larger database starts first
    (ties in input order). Verdicts come out in input order either way.

    ``ray=True`` judges on Ray actors over the cluster at ``RAY_ADDRESS`` (else a local Ray),
    ``processes`` of them (default: one per CPU of the cluster); each node judges on its own copies
    of the databases, obtained by content hash, and the verdicts are the same as here.
    ``processes=None`` without Ray means one worker.

    Raises :class:`~birdenv.errors.WorkerStartError` when a worker dies before it is ready: that
    is a setup problem (most often a script that calls this without an ``if __name__ ==
    "__main__":`` guard), not a verdict.
    """
    work = [(task, pred, cache, statement_timeout, instance_timeout) for task, pred in jobs]
    # Largest database first where nothing better is known: bigger tables take longer to scan.
    sizes = [_database_bytes(job[0]) for job in work]
    order = sorted(range(len(work)), key=lambda i: -sizes[i])
    timings = None
    if cache and work:
        timings = JudgeCache.for_root(default_root())
        keys = [schedule_key(job[0]) for job in work]
        seconds = timings.judge_seconds(keys)
        # Unknown tasks go first (they may be slow); the rest longest first; ties by size.
        order.sort(key=lambda i: -seconds.get(keys[i], math.inf))
    judged: dict[str, float] = {}
    try:
        verdicts = supervised_map(
            _judge_job,
            work,
            processes=processes,
            kill_after=instance_timeout + KILL_GRACE,
            failed=_unjudged,
            order=order,
            # Workers fork from a server that has imported the judge once, not each on its own.
            preload=["birdenv.judge"],
            ray=ray,
        )
        for index, verdict in enumerate(verdicts):
            if timings is not None:  # a killed instance took at least its deadline
                judged[keys[index]] = verdict.timings.get("total", instance_timeout + KILL_GRACE)
            yield verdict
    finally:
        if timings is not None:
            timings.record_judge_seconds(judged)


def validate_tasks(
    tasks: list[Task],
    *,
    processes: int = 1,
    progress: Callable[[Iterator[Verdict]], Iterable[Verdict]] = lambda verdicts: verdicts,
) -> list[str]:
    """Problems of a debugging task set, one line each (empty when it is sound).

    Every task's gold must pass, hence its issue SQL must fail. Judging the gold runs the official
    first phase too, which fails the instance when the issue SQL passes the tests: one verdict
    checks both. ``progress`` wraps the verdict stream (a progress bar).
    """
    if any(t.dialect == POSTGRESQL.name for t in tasks):
        from birdenv.judge.postgres import validate_pg_tasks  # psycopg: PostgreSQL tasks only

        return validate_pg_tasks(tasks, processes=processes)
    verdicts = progress(judge_many(((t, t.sol_sql) for t in tasks), processes=processes))
    problems = []
    for task, verdict in zip(tasks, verdicts, strict=True):
        if not task.issue_sql:
            problems.append(f"{task.instance_id}: has no issue_sql")
        elif verdict.phase == "issue":
            problems.append(f"{task.instance_id}: issue_sql passes its own tests")
        elif not verdict.passed:
            problems.append(f"{task.instance_id}: gold fails ({verdict.phase}): {verdict.error}")
    return problems
