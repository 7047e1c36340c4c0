"""BIRD's execution accuracy (EX), on the judge's execution path, and BIRD's submission rule.

:func:`execution_accuracy` is BIRD's official rule: the prediction and the gold run on the same
fresh state, prediction first, and the answer is correct when ``set(rows)`` are equal. With
``official=False`` (what rewards use) the gold runs on a pristine state of its own instead, so
a prediction that writes cannot change what it is compared with. :func:`score_submission` is the
rule for a submitted ``sql_list`` (the environment's, the rewards' and evaluation's): an empty
list fails, otherwise the last statement is the answer.
"""

from __future__ import annotations

import dataclasses
import math
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from birdenv.errors import BirdEnvError
from birdenv.judge.instance import JUDGE_LIMITS
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.replicas.session import Session, StatementTimeout
from birdenv.replicas.store import Base
from birdenv.tasks.bird import BirdTask
from birdenv.workers import KILL_GRACE, supervised_map

__all__ = [
    "EX_MAX_ROWS",
    "ExVerdict",
    "execution_accuracy",
    "execution_accuracy_many",
    "score_many",
    "score_submission",
    "validate_bird",
]

#: Rows fetched per query when judging. The official ``fetchall()`` has no cap; a result longer
#: than this is not compared (memory) and scores 0, with an error saying so.
EX_MAX_ROWS = 1_000_000


@dataclasses.dataclass
class ExVerdict:
    """BIRD's execution-accuracy decision on one prediction.

    ``correct`` is the EX score as a bool. ``phase`` says why it is not: ``"prediction"`` (the
    prediction raised), ``"timeout"`` (a statement passed its deadline), ``"mismatch"`` (the row
    sets differ), ``"gold"`` (the gold query raised or was too long; a verdict, not a pass),
    ``"setup"`` (the database could not be opened) or, from worker processes, ``"crash"`` (the
    worker died). ``pred_rows``/``gold_rows`` count the rows
    fetched (``None`` when that query did not complete). ``status``, ``passed``,
    ``tests_passed``/``tests_total`` and ``fraction`` read like :class:`birdenv.judge.Verdict`'s,
    so one formatter and one reward path serve both.
    """

    instance_id: str
    correct: bool
    phase: str | None = None
    error: str | None = None
    pred_rows: int | None = None
    gold_rows: int | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        """``"success"`` or ``"failed"``, like a judge verdict."""
        return "success" if self.correct else "failed"

    @property
    def passed(self) -> bool:
        """The same as ``correct``."""
        return self.correct

    @property
    def tests_passed(self) -> int:
        """1 when correct: EX is a single test."""
        return int(self.correct)

    @property
    def tests_total(self) -> int:
        """Always 1: EX is a single test."""
        return 1

    @property
    def fraction(self) -> float:
        """The EX score as a float."""
        return float(self.correct)

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict, ``status`` included."""
        return {**dataclasses.asdict(self), "status": self.status}


class _TooLong(Exception):
    """A result had more rows than :data:`EX_MAX_ROWS`."""


# How many SQLite VM instructions run between deadline checks.
_PROGRESS_STEPS = 2_000
# Gold results kept for ``official=False`` (LRU): ``(base sha256, gold SQL) -> outcome``.
_GOLD_CACHE: OrderedDict[tuple[str, str], _Outcome] = OrderedDict()
_GOLD_CACHE_SIZE = 4096
_GOLD_CACHE_MAX_ROWS = 100_000  # larger results are recomputed rather than kept in memory
_GOLD_CACHE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One query's result as EX sees it: its row set, or the phase and error that stopped it."""

    rows: frozenset[tuple[Any, ...]] | None = None
    count: int | None = None
    phase: str | None = None
    error: str | None = None
    seconds: float = 0.0
    # The CPU time the query took in this thread: what its cost is, whatever else the machine runs.
    cpu_seconds: float = 0.0


def _run_query(
    session: Session, sql: str, statement_timeout: float | None
) -> tuple[frozenset[tuple[Any, ...]], int]:
    """Run one query as BIRD's ``execute_sql`` does: ``cursor.execute(sql)``, then ``fetchall()``.

    No commit between the two (unlike :func:`birdenv.replicas.session.run_statement`, which
    follows BIRD-CRITIC): a ``DELETE ... RETURNING`` gives its rows, and what it changed stays in
    the connection's open transaction for the gold to read, as in the official script. Bounded
    by ``statement_timeout`` (:class:`StatementTimeout`) and :data:`EX_MAX_ROWS`.
    """
    conn = session.conn
    if statement_timeout is not None:
        deadline = time.monotonic() + statement_timeout
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    cursor = conn.cursor()
    try:
        cursor.execute(sql)
        rows: list[tuple[Any, ...]] = []
        while batch := cursor.fetchmany(4096):
            rows.extend(batch)
            if len(rows) > EX_MAX_ROWS:
                raise _TooLong(f"more than {EX_MAX_ROWS:,} rows: not compared")
        return frozenset(rows), len(rows)
    except sqlite3.OperationalError as exc:
        if (
            statement_timeout is not None
            and time.monotonic() > deadline
            and "interrupt" in str(exc)
        ):
            raise StatementTimeout(f"deadline of {statement_timeout:g} s exceeded") from exc
        raise
    finally:
        cursor.close()
        if statement_timeout is not None:
            conn.set_progress_handler(None, 0)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, sqlite3.Error) else str(exc)


def _outcome(session: Session, sql: str, who: str, statement_timeout: float | None) -> _Outcome:
    """Run ``sql`` (the ``"prediction"`` or the ``"gold"``) and say how it ended."""
    started, cpu = time.perf_counter(), time.thread_time()
    label = "prediction" if who == "prediction" else "gold SQL"
    try:
        rows, count = _run_query(session, sql, statement_timeout)
        return _Outcome(
            rows,
            count,
            seconds=time.perf_counter() - started,
            cpu_seconds=time.thread_time() - cpu,
        )
    except StatementTimeout:
        phase, error = "timeout", f"{label} timed out after {statement_timeout:g} s"
    # Two statements in one string: ProgrammingError on Python 3.11, sqlite3.Warning before.
    except (
        sqlite3.Error,
        sqlite3.Warning,
        ValueError,
        OverflowError,
        MemoryError,
        _TooLong,
    ) as exc:
        phase, error = who, f"{label}: {_error_text(exc)}"
    return _Outcome(phase=phase, error=error, seconds=time.perf_counter() - started)


def _pristine_gold(
    task: BirdTask, base: Base, pool: ReplicaPool, statement_timeout: float | None
) -> tuple[_Outcome, bool]:
    """The gold's outcome on a fresh state of its own, and whether it came from the cache.

    A gold query is deterministic on an immutable base, so its outcome is kept per
    ``(base content hash, gold SQL)``; timeouts (which depend on the deadline) and very large
    results are not kept.
    """
    key = (base.sha256, task.SQL)
    with _GOLD_CACHE_LOCK:
        cached = _GOLD_CACHE.get(key)
        if cached is not None:
            _GOLD_CACHE.move_to_end(key)
            return cached, True
    with pool.open_base(base, task_id=task.instance_id, limits=JUDGE_LIMITS) as session:
        outcome = _outcome(session, task.SQL, "gold", statement_timeout)
    if outcome.phase != "timeout" and (outcome.count or 0) <= _GOLD_CACHE_MAX_ROWS:
        with _GOLD_CACHE_LOCK:
            _GOLD_CACHE[key] = outcome
            while len(_GOLD_CACHE) > _GOLD_CACHE_SIZE:
                _GOLD_CACHE.popitem(last=False)
    return outcome, False


def execution_accuracy(
    task: BirdTask,
    pred_sql: str,
    *,
    pool: ReplicaPool | None = None,
    statement_timeout: float | None = 30.0,
    official: bool = True,
) -> ExVerdict:
    """BIRD's execution accuracy of ``pred_sql`` for ``task``, as the official evaluator scores it.

    On one fresh state of the task's database, the prediction runs and then the gold, each as
    BIRD's script runs it (``cursor.execute`` then ``fetchall()`` on one connection, no commit in
    between). The prediction is correct when ``set(pred_rows) == set(gold_rows)``: row order and
    duplicates are ignored, values are compared exactly (``1 == 1.0``, no rounding,
    ``'a' != 'A'``), columns keep their order and count, and an empty result equals an empty
    result. A prediction that raises, holds two statements or runs past ``statement_timeout``
    seconds scores 0; so does every prediction when the gold itself fails. Problems are verdicts,
    never exceptions. ``tests/fixtures/bird_ex`` holds the borderline cases checked against the
    official scripts.

    ``official=True`` (the default) is the official rule, for evaluation: because the gold
    runs after the prediction on the same state, a prediction that writes changes what it is
    compared with (``DELETE FROM t`` empties the gold's result and then equals it). That is a
    reward hack, so rewards use ``official=False``: the gold runs on a pristine state of its
    own (its outcome cached per database content and gold SQL), and the prediction's writes only
    ever reach the prediction's own result. The two agree on every prediction that does not write.
    """
    pool = pool or default_pool()
    verdict = ExVerdict(instance_id=task.instance_id, correct=False)
    started = time.perf_counter()
    try:
        base = pool.store.base_for(task.db_path)
        session = pool.open_base(base, task_id=task.instance_id, limits=JUDGE_LIMITS)
    except (BirdEnvError, sqlite3.Error, OSError) as exc:
        verdict.phase, verdict.error = "setup", f"{type(exc).__name__}: {exc}"
        verdict.timings["total"] = time.perf_counter() - started
        return verdict
    gold: _Outcome | None = None
    with session:
        pred = _outcome(session, pred_sql, "prediction", statement_timeout)
        verdict.timings["prediction"] = pred.seconds
        verdict.timings["prediction_cpu"] = pred.cpu_seconds
        if pred.phase is None and official:
            gold = _outcome(session, task.SQL, "gold", statement_timeout)
            verdict.timings["gold"] = gold.seconds
    if pred.phase is None and not official:
        try:
            gold, cached = _pristine_gold(task, base, pool, statement_timeout)
        except (BirdEnvError, sqlite3.Error, OSError) as exc:
            gold = _Outcome(phase="setup", error=f"{type(exc).__name__}: {exc}")
        else:
            verdict.timings["gold"] = 0.0 if cached else gold.seconds
    verdict.pred_rows = pred.count
    if pred.phase is not None:
        verdict.phase, verdict.error = pred.phase, pred.error
    elif gold is not None and gold.phase is not None:
        verdict.phase, verdict.error = gold.phase, gold.error
    elif gold is not None:
        verdict.gold_rows = gold.count
        verdict.correct = pred.rows == gold.rows
        if not verdict.correct:
            verdict.phase = "mismatch"
            verdict.error = (
                f"the result differs from the gold result ({verdict.pred_rows} rows vs "
                f"{verdict.gold_rows}, compared as sets of rows)"
            )
    verdict.timings["total"] = time.perf_counter() - started
    return verdict


def _ex_job(pool: ReplicaPool | None, job: tuple[BirdTask, str, float | None, bool]) -> ExVerdict:
    """One :func:`execution_accuracy_many` pair (module level: workers get it by name)."""
    task, pred_sql, statement_timeout, official = job
    return execution_accuracy(
        task, pred_sql, pool=pool, statement_timeout=statement_timeout, official=official
    )


def _unscored(job: tuple[BirdTask, str, float | None, bool], phase: str, why: str) -> ExVerdict:
    """The verdict of a pair whose worker was killed or died: 0."""
    return ExVerdict(instance_id=job[0].instance_id, correct=False, phase=phase, error=why)


def execution_accuracy_many(
    jobs: Iterable[tuple[BirdTask, str]],
    *,
    processes: int | None = None,
    statement_timeout: float | None = 30.0,
    official: bool = True,
    ray: bool = False,
) -> Iterator[ExVerdict]:
    """:func:`execution_accuracy` of many ``(task, pred_sql)`` pairs, in order, over ``processes``.

    One process (the default) judges in this one. More run in supervised workers
    (:func:`birdenv.workers.supervised_map`), each with its own pool on the shared replica root:
    a worker still busy past both statement deadlines (+2 s) is killed and its pair scores 0 as a
    ``"timeout"``, a worker that dies scores its pair 0 as a ``"crash"``, and a worker that cannot
    start raises :class:`~birdenv.errors.WorkerStartError`. ``ray=True`` runs the workers as Ray
    actors over the cluster (``processes`` of them, default one per CPU of the cluster).
    """
    work = [(task, pred, statement_timeout, official) for task, pred in jobs]
    if not ray and (processes or 1) <= 1:
        for job in work:
            yield _ex_job(None, job)
        return
    kill_after = math.inf if statement_timeout is None else 2 * statement_timeout + KILL_GRACE
    yield from supervised_map(
        _ex_job,
        work,
        processes=processes,
        kill_after=kill_after,
        failed=_unscored,
        preload=["birdenv.judge.ex"],
        ray=ray,
    )


def _answer(sql_list: list[str] | str) -> str | None:
    """BIRD's submission rule: the last statement is the answer; an empty list has none."""
    statements = [sql_list] if isinstance(sql_list, str) else list(sql_list)
    return statements[-1] if statements else None


def _no_answer(task: BirdTask) -> ExVerdict:
    return ExVerdict(
        instance_id=task.instance_id,
        correct=False,
        phase="prediction",
        error="sql_list is empty: submit one SELECT statement",
    )


def score_submission(
    task: BirdTask,
    sql_list: list[str] | str,
    *,
    pool: ReplicaPool | None = None,
    statement_timeout: float | None = 30.0,
    official: bool = False,
) -> ExVerdict:
    """The verdict on a submitted ``sql_list`` for a BIRD question: the one submission rule.

    The last statement is the answer and the others are not run (a string is one statement); an
    empty list fails without running anything. The answer is scored by
    :func:`execution_accuracy`; ``official=False`` (the default: environments and rewards)
    keeps a submission that writes from changing the gold's result.

    >>> from birdenv.tasks import load_bird
    >>> question = load_bird("bird-mini-eval")[0]
    >>> score_submission(question, ["SELECT 1", question.SQL]).passed
    True
    >>> score_submission(question, []).error
    'sql_list is empty: submit one SELECT statement'
    """
    answer = _answer(sql_list)
    if answer is None:
        return _no_answer(task)
    return execution_accuracy(
        task, answer, pool=pool, statement_timeout=statement_timeout, official=official
    )


def score_many(
    jobs: Iterable[tuple[BirdTask, list[str] | str]],
    *,
    processes: int | None = None,
    statement_timeout: float | None = 30.0,
    official: bool = False,
    ray: bool = False,
) -> Iterator[ExVerdict]:
    """:func:`score_submission` of many ``(task, sql_list)`` pairs, in order, over ``processes``
    (:func:`execution_accuracy_many`; ``ray=True``: on Ray workers over the cluster)."""
    answers = [(task, _answer(sql_list)) for task, sql_list in jobs]
    scored = execution_accuracy_many(
        ((task, answer) for task, answer in answers if answer is not None),
        processes=processes,
        statement_timeout=statement_timeout,
        official=official,
        ray=ray,
    )
    for task, answer in answers:
        yield _no_answer(task) if answer is None else next(scored)


def validate_bird(
    tasks: list[BirdTask],
    *,
    pool: ReplicaPool | None = None,
    statement_timeout: float | None = 30.0,
    max_seconds: float | None = None,
) -> list[str]:
    """Problems of a BIRD task set, one line each (empty when it is sound).

    Every gold SQL must run without error on its database and return at least one row; with
    ``max_seconds``, a gold that takes more CPU time than that is a problem too (CPU time, not
    wall time: the verdict must not depend on what else the machine runs). Uses
    :func:`execution_accuracy` (the gold judged against itself, so timed as the prediction), so
    validation runs exactly what scoring runs.
    """
    problems = []
    for task in tasks:
        where = f"question {task.question_id} ({task.db_id})"
        verdict = execution_accuracy(task, task.SQL, pool=pool, statement_timeout=statement_timeout)
        if verdict.phase == "setup":
            problems.append(f"{where}: {verdict.error}")
        elif not verdict.correct:
            problems.append(f"{where}: the gold SQL fails: {verdict.error}")
        elif not verdict.gold_rows:
            problems.append(f"{where}: the gold SQL returns no rows")
        elif max_seconds is not None and verdict.timings["prediction_cpu"] > max_seconds:
            problems.append(
                f"{where}: the gold SQL takes {verdict.timings['prediction_cpu']:.2f} s of CPU "
                f"(> {max_seconds:g} s)"
            )
    return problems
