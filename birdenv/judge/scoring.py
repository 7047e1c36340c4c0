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

from birdenv.dialects import dialect_name
from birdenv.errors import ArgumentError, TaskKindError
from birdenv.judge import ex
from birdenv.judge.instance import judge
from birdenv.judge.official import INSTANCE_TIMEOUT
from birdenv.judge.scheduling import judge_many
from birdenv.tasks import BaseTask, Judgement

__all__ = ["Scorer", "register_scorer", "score", "score_many", "scorer_for"]

Job = tuple[Any, "list[str] | str"]


@dataclasses.dataclass(frozen=True)
class Scorer:
    """How the tasks of one kind in one dialect are judged.

    ``one(task, sql_list, *, pool, statement_timeout, ...)`` gives the verdict on one submission;
    ``many(jobs, *, processes, statement_timeout, ...)`` the verdicts on ``(task, sql_list)``
    pairs, in order. ``statement_timeout`` is the deadline of each statement that the kind's
    official evaluator sets (``None``: none). ``options`` names the further keywords the two
    take, each passed only to a judge that takes it: ``official`` (``True`` scores exactly by the
    official rule, quirks included, for evaluation; ``False``, for rewards and environments,
    closes a reward hack where the kind's official rule has one), ``ray`` (spread over a Ray
    cluster), ``instance_timeout`` and ``cache``. ``no_ray`` says why a judge without ``ray``
    cannot be spread, for the error ``ray=True`` then raises.
    """

    one: Callable[..., Judgement]
    many: Callable[..., Iterator[Judgement]]
    statement_timeout: float | None
    options: frozenset[str] = frozenset()
    no_ray: str = ""

    def keywords(self, options: dict[str, Any]) -> dict[str, Any]:
        """The ``options`` this judge takes; :class:`ArgumentError` for ``ray=True`` where it
        takes no ``ray``."""
        if options.get("ray") and "ray" not in self.options:
            raise ArgumentError(self.no_ray or "these tasks are not judged on Ray")
        return {key: value for key, value in options.items() if key in self.options}


def _postgres(name: str) -> Callable[..., Any]:
    """The PostgreSQL judge's ``name``, imported when first called: psycopg is an optional extra,
    needed only where PostgreSQL tasks are judged."""

    def call(*args: Any, **kwargs: Any) -> Any:
        # the postgres extra (psycopg): imported when first called
        from birdenv.judge import postgres

        return getattr(postgres, name)(*args, **kwargs)

    return call


_SCORERS: dict[tuple[str, str], Scorer] = {
    # The official BIRD-CRITIC rule has no reward hack to close: it takes no `official`.
    ("critic", "sqlite"): Scorer(
        judge,
        judge_many,
        statement_timeout=None,
        options=frozenset({"ray", "instance_timeout", "cache"}),
    ),
    # The official PostgreSQL evaluator sets 60 s (15 s for WITH RECURSIVE) on every statement.
    ("critic", "postgresql"): Scorer(
        _postgres("judge_pg"),
        _postgres("judge_pg_many"),
        statement_timeout=60.0,
        # Each instance waits on the server, not on a CPU here: threads are the parallelism.
        no_ray="PostgreSQL tasks are judged on their server by threads of this process "
        "(processes=N of them); ray=True spreads SQLite judging only",
    ),
    # BIRD's evaluation scripts give each query 30 s (their `meta_time_out`); outside evaluation
    # the gold runs on a pristine state of its own, so a submission that writes cannot change
    # what it is compared with.
    ("bird", "sqlite"): Scorer(
        ex.score_submission,
        ex.score_many,
        statement_timeout=30.0,
        options=frozenset({"official", "ray"}),
    ),
}


def register_scorer(kind: str, dialect: str, scorer: Scorer) -> None:
    """Judge the tasks of ``kind`` in ``dialect`` with ``scorer`` (replacing any earlier one)."""
    _SCORERS[kind, dialect_name(dialect)] = scorer


def scorer_for(task: BaseTask) -> Scorer:
    """The judge of ``task``'s kind and dialect; :class:`TaskKindError` when none is registered."""
    try:
        return _SCORERS[task.kind, task.dialect]
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
        task,
        sql_list,
        pool=pool,
        statement_timeout=statement_timeout,
        **scorer.keywords({"official": official}),
    )


def score_many(
    jobs: Iterable[Job],
    *,
    processes: int | None = None,
    statement_timeout: float | Literal["official"] | None = "official",
    official: bool = False,
    ray: bool = False,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
) -> Iterator[Judgement]:
    """:func:`score` of many ``(task, sql_list)`` pairs, verdicts in order, over ``processes``
    supervised worker processes (default one; ``ray=True``: Ray actors over the cluster, by
    default one per CPU of it). Pairs of several kinds are judged kind by kind, each by its own
    judge. ``instance_timeout`` and ``cache`` go to the judges that take them (BIRD-CRITIC's on
    SQLite: :func:`birdenv.judge.judge_many`)."""
    pairs = list(jobs)
    groups: dict[Scorer, list[int]] = {}
    for i, (task, _) in enumerate(pairs):
        groups.setdefault(scorer_for(task), []).append(i)

    def run(scorer: Scorer, group: list[Job]) -> Iterator[Judgement]:
        timeout = scorer.statement_timeout if statement_timeout == "official" else statement_timeout
        options = {
            "official": official,
            "ray": ray,
            "instance_timeout": instance_timeout,
            "cache": cache,
        }
        return scorer.many(
            group, processes=processes, statement_timeout=timeout, **scorer.keywords(options)
        )

    if len(groups) == 1:  # one kind: verdicts stream as they come
        return run(next(iter(groups)), pairs)
    verdicts: list[Any] = [None] * len(pairs)
    for scorer, indices in groups.items():
        for i, verdict in zip(indices, run(scorer, [pairs[i] for i in indices]), strict=True):
            verdicts[i] = verdict
    return iter(verdicts)
