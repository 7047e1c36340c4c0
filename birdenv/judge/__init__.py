"""The official evaluations, exactly, and faster; and one scoring entry point for every task.

:func:`score` (and :func:`score_many`) judges a submission for any task with the judge of its
kind and dialect (:mod:`~birdenv.judge.scoring`): the BIRD-CRITIC judge below, or BIRD's
execution accuracy (:mod:`~birdenv.judge.ex`).

:func:`judge` gives the verdict the official evaluator gives, including its quirks:

1. A fresh state; ``preprocess_sql`` (errors ignored, the first one stops it); the *issue* SQL; the
   tests. If the issue SQL passes every test, the instance fails whatever was predicted.
2. A fresh state again; ``preprocess_sql``; the prediction, one list element per ``execute``,
   committed after each, the first error stops it and fails the instance (two statements in one
   string is such an error); then every test on the same connection (the default ``ex_base`` test
   when the task has none). Any failed assertion or exception fails the instance.
3. ``clean_up_sql``, errors ignored.

What differs is only how: states are copy-on-write sessions from a
:class:`~birdenv.replicas.ReplicaPool` instead of file copies, statements run in-process, every
statement can have a deadline (the official evaluator has none) and the instance has an overall
deadline (the official 180 s), and test code's output is captured with a bound.

Test code runs with the official helper names in scope: ``perform_query_on_sqlite_databases``,
``execute_queries``, ``ex_base``, ``check_sql_function_usage``, ``remove_distinct``,
``remove_comments``, ``remove_round``, ``preprocess_results``, ``pred_query_result`` and ``date``.

The package: :mod:`~birdenv.judge.official` (the helpers and constants test code sees),
:mod:`~birdenv.judge.runner` (statements and test code of one phase), :mod:`~birdenv.judge.instance`
(:func:`judge`: the two phases and the verdict), :mod:`~birdenv.judge.cache` (the issue phase's
remembered outcomes), :mod:`~birdenv.judge.scheduling` (:func:`judge_many`),
:mod:`~birdenv.judge.ex` (BIRD's execution accuracy) and :mod:`~birdenv.judge.scoring` (the
registry of judges by task kind and dialect).
"""

from birdenv.judge.instance import JUDGE_LIMITS, Verdict, judge
from birdenv.judge.official import (
    DEFAULT_TEST,
    INSTANCE_TIMEOUT,
    check_sql_function_usage,
    preprocess_results,
    remove_comments,
    remove_distinct,
    remove_round,
)
from birdenv.judge.scheduling import judge_many, validate_tasks
from birdenv.judge.scoring import Scorer, register_scorer, score, score_many, scorer_for

__all__ = [
    "DEFAULT_TEST",
    "INSTANCE_TIMEOUT",
    "JUDGE_LIMITS",
    "Scorer",
    "Verdict",
    "check_sql_function_usage",
    "judge",
    "judge_many",
    "preprocess_results",
    "register_scorer",
    "remove_comments",
    "remove_distinct",
    "remove_round",
    "score",
    "score_many",
    "scorer_for",
    "validate_tasks",
]
