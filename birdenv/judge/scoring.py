"""One scoring entry point for every task: the judge of the task's kind and dialect.

:func:`score` and :func:`score_many` look the judge up by ``(task.kind, task.dialect)`` (the
dialect without regard to case) in a small registry: the BIRD-CRITIC judge for debugging tasks
(:func:`birdenv.judge.judge`) and BIRD's execution accuracy under its submission rule for
questions (:func:`birdenv.judge.ex.score_submission`). Environments, rewards and evaluation all
score through here, so they give the same verdicts. :func:`register_scorer` adds a judge for
another kind or dialect.

>>> from birdenv.tasks import load_tasks
>>> task = load_tasks("critic-mini")[0]
>>> score(task, task.sol_sql).status
'success'
>>> question = load_tasks("bird-mini-eval")[0]
>>> score(question, ["SELECT 1", question.SQL]).passed    # the last statement is the answer
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from birdenv.errors import ArgumentError, TaskKindError
from birdenv.judge import ex
from birdenv.judge.instance import judge
from birdenv.judge.scheduling import judge_many
from birdenv.tasks import BaseTask, Judgement

__all__ = ["Scorer", "register_scorer", "score", "score_many", "scorer_for"]

Job = tuple[Any, "list[str] | str"]


@dataclasses.dataclass(frozen=True)
class Scorer:
    """How the tasks of one kind in one dialect are judged.

    ``one(task, sql_list, *, pool, statement_timeout, official)`` gives the verdict on one
    submission; ``many(jobs, *, processes, statement_timeout, official, ray)`` the verdicts on
    ``(task, sql_list)`` pairs, in order. ``statement_timeout`` is the deadline of each statement
    that the kind's official evaluator sets (``None``: none). ``official=True`` scores exactly by
    the official rule, quirks included (evaluation); ``False`` (rewards, environments) closes a
    reward hack where the official rule of a kind has one.
    """

    one: Callable[..., Judgement]
    many: Callable[..., Iterator[Judgement]]
    statement_timeout: float | None


def _critic_one(
    task: Any,
    sql_list: list[str] | str,
    *,
    pool: Any,
    statement_timeout: float | None,
    official: bool,
) -> Judgement:
    # The official BIRD-CRITIC rule has no reward hack to close: `official` changes nothing.
    return judge(task, sql_list, pool=pool, statement_timeout=statement_timeout)


def _critic_many(
    jobs: Iterable[Job],
    *,
    processes: int | None,
    statement_timeout: float | None,
    official: bool,
    ray: bool,
) -> Iterator[Judgement]:
    return judge_many(jobs, processes=processes, statement_timeout=statement_timeout, ray=ray)


def _bird_one(
    task: Any,
    sql_list: list[str] | str,
    *,
    pool: Any,
    statement_timeout: float | None,
    official: bool,
) -> Judgement:
    # Outside evaluation the gold runs on a pristine state of its own, so a submission that
    # writes cannot change what it is compared with.
    return ex.score_submission(
        task, sql_list, pool=pool, statement_timeout=statement_timeout, isolate_gold=not official
    )


def _bird_many(
    jobs: Iterable[Job],
    *,
    processes: int | None,
    statement_timeout: float | None,
    official: bool,
    ray: bool,
) -> Iterator[Judgement]:
    return ex.score_many(
        jobs,
        processes=processes,
        statement_timeout=statement_timeout,
        isolate_gold=not official,
        ray=ray,
    )


def _critic_pg_one(
    task: Any,
    sql_list: list[str] | str,
    *,
    pool: Any,
    statement_timeout: float | None,
    official: bool,
) -> Judgement:
    from birdenv.judge.postgres import judge_pg  # psycopg: only where PostgreSQL is used

    return judge_pg(task, sql_list, pool=pool, statement_timeout=statement_timeout)


def _critic_pg_many(
    jobs: Iterable[Job],
    *,
    processes: int | None,
    statement_timeout: float | None,
    official: bool,
    ray: bool,
) -> Iterator[Judgement]:
    from birdenv.judge.postgres import judge_pg_many

    if ray:
        # Each instance waits on the server, not on a CPU here: threads are the parallelism.
        raise ArgumentError(
            "PostgreSQL tasks are judged on their server by threads of this process (processes=N "
            "of them); ray=True spreads SQLite judging only"
        )
    return judge_pg_many(jobs, processes=processes, statement_timeout=statement_timeout)


_SCORERS: dict[tuple[str, str], Scorer] = {
    ("critic", "sqlite"): Scorer(_critic_one, _critic_many, statement_timeout=None),
    # The official PostgreSQL evaluator sets 60 s (15 s for WITH RECURSIVE) on every statement.
    ("critic", "postgresql"): Scorer(_critic_pg_one, _critic_pg_many, statement_timeout=60.0),
    # BIRD's evaluation scripts give each query 30 s (their `meta_time_out`).
    ("bird", "sqlite"): Scorer(_bird_one, _bird_many, statement_timeout=30.0),
}


def register_scorer(kind: str, dialect: str, scorer: Scorer) -> None:
    """Judge the tasks of ``kind`` in ``dialect`` with ``scorer`` (replacing any earlier one)."""
    _SCORERS[kind, dialect.lower()] = scorer


def scorer_for(task: BaseTask) -> Scorer:
    """The judge of ``task``'s kind and dialect; :class:`TaskKindError` when none is registered."""
    try:
        return _SCORERS[task.kind, task.dialect.lower()]
    except KeyError:
        known = ", ".join(f"{kind} in {dialect}" for kind, dialect in sorted(_SCORERS))
        raise TaskKindError(
            f"no judge for {task.kind} tasks in {task.dialect} (task {task.instance_id}); "
            f"judges exist for {known}"
        ) from None


def score(
    task: BaseTask,
    sql_list: list[str] | str,
    *,
    pool: Any = None,
    statement_timeout: float | Literal["official"] | None = "official",
    official: bool = False,
) -> Judgement:
    """The verdict on a submission, judged on fresh states of the task's database.

    ``statement_timeout`` bounds each statement; ``"official"`` (the default) is the kind's
    official evaluator's (none for BIRD-CRITIC, 30 s for BIRD). ``official=True`` scores exactly
    by the official rule, quirks included (evaluation); ``False`` (rewards, environments) closes a
    reward hack where the official rule of a kind has one. Problems with the submission are
    verdicts, never exceptions.
    """
    scorer = scorer_for(task)
    if statement_timeout == "official":
        statement_timeout = scorer.statement_timeout
    return scorer.one(
        task, sql_list, pool=pool, statement_timeout=statement_timeout, official=official
    )


def score_many(
    jobs: Iterable[Job],
    *,
    processes: int | None = None,
    statement_timeout: float | Literal["official"] | None = "official",
    official: bool = False,
    ray: bool = False,
) -> Iterator[Judgement]:
    """:func:`score` of many ``(task, sql_list)`` pairs, verdicts in order, over ``processes``
    supervised worker processes (default one; ``ray=True``: Ray actors over the cluster, by
    default one per CPU of it). Pairs of several kinds are judged kind by kind, each by its own
    judge."""
    pairs = list(jobs)
    groups: dict[Scorer, list[int]] = {}
    for i, (task, _) in enumerate(pairs):
        groups.setdefault(scorer_for(task), []).append(i)

    def run(scorer: Scorer, group: list[Job]) -> Iterator[Judgement]:
        timeout = scorer.statement_timeout if statement_timeout == "official" else statement_timeout
        return scorer.many(
            group, processes=processes, statement_timeout=timeout, official=official, ray=ray
        )

    if len(groups) == 1:  # one kind: verdicts stream as they come
        return run(next(iter(groups)), pairs)
    verdicts: list[Any] = [None] * len(pairs)
    for scorer, indices in groups.items():
        for i, verdict in zip(indices, run(scorer, [pairs[i] for i in indices]), strict=True):
            verdicts[i] = verdict
    return iter(verdicts)
