"""Judging one instance: the two phases of the official evaluation, and the verdict."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from typing import Any

from birdenv.errors import BirdEnvError
from birdenv.judge.cache import IssueOutcome, JudgeCache, cache_key, cacheable_task
from birdenv.judge.official import DEFAULT_TEST, INSTANCE_TIMEOUT
from birdenv.judge.runner import Phase, Runner
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.replicas.session import Limits
from birdenv.tasks import Task, split_sql_field

__all__ = ["JUDGE_LIMITS", "Verdict", "judge"]


@dataclasses.dataclass
class Verdict:
    """The judge's decision on one instance.

    ``status`` is ``"success"`` or ``"failed"``; ``phase`` says where it failed: ``"issue"`` (the
    issue SQL passed every test, so the task cannot be judged), ``"prediction"`` (a predicted
    statement raised), ``"timeout"`` (a deadline passed), ``"tests"`` (a test failed) or
    ``"setup"`` (the database could not be prepared); ``tests_passed``/``tests_total`` count the
    tests of the prediction phase (the default test counts as one); ``issue_cached`` is true when
    the issue phase's outcome came from the :mod:`birdenv.judge.cache` instead of running again.
    """

    instance_id: str
    status: str
    phase: str | None = None
    error: str | None = None
    tests_passed: int = 0
    tests_total: int = 0
    failed_tests: list[str] = dataclasses.field(default_factory=list)
    issue_passed: bool = False
    issue_cached: bool = False
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when the instance succeeded."""
        return self.status == "success"

    @property
    def fraction(self) -> float:
        """Tests passed ÷ tests run in the prediction phase (0 when it never reached the tests)."""
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict (``instance_id``, ``status`` and the details)."""
        return dataclasses.asdict(self)


#: Sessions the judge leases: its own deadlines per statement, no byte cap on results.
JUDGE_LIMITS = Limits(statement_timeout=None, max_result_bytes=None)


def _run_phase(
    runner: Runner,
    pool: ReplicaPool,
    task: Task,
    statements: list[str],
    tests: list[str],
    *,
    clean_up: bool = False,
) -> Phase:
    """One phase of the official evaluation: a fresh state, ``preprocess_sql`` (errors ignored),
    ``statements``, the tests; then ``clean_up_sql`` when asked (errors ignored)."""
    with pool.session(task, preprocess=False, limits=JUDGE_LIMITS) as session:
        runner.fresh_state(session)
        runner.execute_queries(task.preprocess_sql, session.db_path, session.conn)
        runner.after_preprocess()
        phase = runner.evaluation_phase(statements, task, tests)
        if clean_up and task.clean_up_sql:
            runner.execute_queries(task.clean_up_sql, session.db_path, session.conn)
        runner.close_extra_connections()
    return phase


def judge(
    task: Task,
    pred_sqls: list[str] | str,
    *,
    pool: ReplicaPool | None = None,
    statement_timeout: float | None = None,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
) -> Verdict:
    """Judge a prediction for ``task`` exactly as the official BIRD-CRITIC-SQLite evaluator does.

    ``pred_sqls`` is the list of statements (a string is split on ``[split]``, as the official
    reader does). ``statement_timeout`` bounds each statement (default: only the instance
    deadline, like the official evaluator); ``instance_timeout`` bounds the whole instance.
    ``cache=True`` reuses the issue phase's outcome (it does not depend on the prediction) from
    :class:`~birdenv.judge.cache.JudgeCache` in the pool's root when a reproducible run left one,
    and records it otherwise; ``False`` always runs both phases. Problems with the prediction are
    verdicts, never exceptions; a missing database is a ``"setup"`` failure.
    """
    pool = pool or default_pool()
    statements = split_sql_field(pred_sqls)
    tests = list(task.test_cases) or [DEFAULT_TEST]
    runner = Runner(time.monotonic() + instance_timeout, statement_timeout)
    verdict = Verdict(instance_id=task.instance_id, status="failed", tests_total=len(tests))
    started = time.perf_counter()
    try:
        store, key = None, None
        if cache and task.issue_sql and cacheable_task(task):
            store = JudgeCache.for_root(pool.root)
            key = cache_key(task, pool.store.base_for(task.db_path).sha256, statement_timeout)
            outcome = store.get(key)
            if outcome is not None:
                verdict.issue_passed, verdict.issue_cached = outcome.issue_passed, True
                runner.memo = dict(outcome.memo)
        if task.issue_sql and not verdict.issue_cached:
            issue_phase = _run_phase(runner, pool, task, list(task.issue_sql), tests)
            verdict.timings["issue"] = time.perf_counter() - started
            verdict.issue_passed = issue_phase.clean
            # Remember only what would come out the same again: no deadline, nothing volatile.
            if store is not None and not issue_phase.timeout and not runner.ever_volatile:
                memo = runner.memo if runner.memo_enabled else {}
                store.put(key, IssueOutcome(verdict.issue_passed, dict(memo)))
        mark = time.perf_counter()
        phase = _run_phase(runner, pool, task, statements, tests, clean_up=True)
        verdict.timings["prediction"] = time.perf_counter() - mark
    except (BirdEnvError, sqlite3.Error, OSError) as exc:
        verdict.phase, verdict.error = "setup", f"{type(exc).__name__}: {exc}"
        verdict.timings["total"] = time.perf_counter() - started
        return verdict
    verdict.tests_passed, verdict.failed_tests = phase.passed, phase.failed
    errors = list(phase.errors)
    if verdict.issue_passed:
        errors.insert(0, "issue_sql passed all tests: the task does not demonstrate a problem")
        verdict.phase = "issue"
    elif phase.timeout:
        verdict.phase = "timeout"
    elif phase.execution_error:
        verdict.phase = "prediction"
    elif phase.assertion_error:
        verdict.phase = "tests"
    else:
        verdict.status = "success"
    verdict.error = "\n".join(errors) or None
    verdict.timings["total"] = time.perf_counter() - started
    return verdict
