"""The one scoring entry point: a judge per task kind and dialect, looked up, never guessed."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from birdenv.errors import TaskKindError
from birdenv.judge import Scorer, register_scorer, score, score_many, scorer_for
from birdenv.judge.ex import score_submission
from birdenv.tasks import load_tasks


def test_each_kind_is_scored_by_its_own_judge() -> None:
    task, question = load_tasks("critic-mini")[0], load_tasks("bird-mini-eval")[0]
    critic_verdict = score(task, task.sol_sql)
    assert (critic_verdict.status, critic_verdict.tests_total) == (
        "success",
        len(task.test_cases) or 1,
    )
    # BIRD: the kind's official deadline unless one is given; the submission rule either way.
    assert score(question, [question.SQL]).to_dict() | {"timings": None} == score_submission(
        question, [question.SQL], statement_timeout=30.0
    ).to_dict() | {"timings": None}
    assert score(question, ["SELECT 'wrong'"], statement_timeout=None).phase == "mismatch"


def test_pairs_of_both_kinds_come_back_in_order() -> None:
    task, question = load_tasks("critic-mini")[0], load_tasks("bird-mini-eval")[0]
    pairs = [
        (question, [question.SQL]),
        (task, task.issue_sql),
        (task, task.sol_sql),
        (question, []),
    ]
    verdicts = list(score_many(pairs))
    assert [v.instance_id for v in verdicts] == [t.instance_id for t, _ in pairs]
    assert [v.passed for v in verdicts] == [True, False, True, False]
    assert list(score_many([])) == []


def test_a_dialect_without_a_judge_is_named() -> None:
    task = dataclasses.replace(load_tasks("critic-mini")[0], dialect="Nowhere")
    with pytest.raises(
        TaskKindError, match=r"no judge for critic tasks in nowhere .*critic in sqlite"
    ):
        score(task, task.sol_sql)
    with pytest.raises(TaskKindError, match="no judge for critic tasks in nowhere"):
        score_many([(task, task.sol_sql)])


def test_a_registered_judge_scores_its_dialect() -> None:
    task = dataclasses.replace(load_tasks("critic-mini")[0], dialect="Elsewhere")
    seen: list[tuple] = []

    def one(task, sql_list, *, pool, statement_timeout, official):
        seen.append((task.instance_id, sql_list, statement_timeout, official))
        return score(dataclasses.replace(task, dialect="SQLite"), sql_list)

    def many(jobs, *, processes, statement_timeout, official, ray):
        return iter(
            [
                one(t, s, pool=None, statement_timeout=statement_timeout, official=official)
                for t, s in jobs
            ]
        )

    options = frozenset({"official", "ray"})  # the keywords its two functions take
    register_scorer("critic", "elsewhere", Scorer(one, many, 7.0, options=options))
    try:
        assert scorer_for(task).statement_timeout == 7.0
        assert score(task, task.sol_sql, official=True).passed
        assert [v.passed for v in score_many([(task, task.issue_sql)])] == [False]
        assert seen == [
            (task.instance_id, task.sol_sql, 7.0, True),
            (task.instance_id, task.issue_sql, 7.0, False),
        ]
    finally:
        from birdenv.judge import scoring

        del scoring._SCORERS["critic", "elsewhere"]


def test_the_old_home_of_bird_questions_still_imports() -> None:
    import birdenv.bird as old
    from birdenv.judge import ex
    from birdenv.tasks import BirdTask, load_bird

    assert (old.BirdTask, old.load_bird) == (BirdTask, load_bird)
    with pytest.warns(DeprecationWarning, match=r"birdenv\.judge\.ex\.execution_accuracy"):
        assert old.execution_accuracy is ex.execution_accuracy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            old.nothing  # noqa: B018
