"""Reward functions for TRL's ``GRPOTrainer``, judged by the one official judge.

Every function has TRL's signature ``fn(prompts, completions, **kwargs) -> list[float | None]``:
``completions`` are strings (standard datasets) or one-message lists (conversational datasets),
and every other dataset column arrives as a keyword list, one value per completion. The task of a
completion comes from the ``task_id`` column.

- :func:`solution_reward`: 1.0 when the statements of the completion's ``<solution>`` (parsed by
  :func:`birdtrain.prompts.parse_solution`) are correct, else 0.0: for a debugging task the judge
  (:func:`birdenv.judge.judge`) decides, for a BIRD question execution accuracy
  (:func:`birdenv.judge.ex.execution_accuracy`) on the last statement, as ``BirdSQL-SQLite-v0`` does.
  One reward function serves a mixture of both kinds (:func:`score_submission`).
- :func:`format_reward`: 1.0 for a well-formed ``<thought>…</thought><solution>…</solution>``
  answer, else 0.0.

Look them up by name with :func:`get_reward` (``"solution"``, ``"format"``, or a dotted path).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from birdenv.judge import score
from birdenv.tasks import BIRD_SUITES, BirdTask, Task, load_tasks
from birdtrain.prompts import parse_solution

__all__ = [
    "REWARDS",
    "completion_text",
    "format_reward",
    "get_reward",
    "register_tasks",
    "score_submission",
    "score_text",
    "solution_reward",
]

RewardFunc = Callable[..., list[float | None]]

# Tasks the rewards can judge, by instance id: what ``register_tasks`` added, then (on a miss) the
# bundled suites. TRL hands reward functions dataset columns, never Python objects, so the Task
# behind a ``task_id`` has to be found here.
_TASKS: dict[str, Task | BirdTask] = {}
_BUNDLED_SUITES = ("gym-mini", "critic-mini", *BIRD_SUITES)
_bundled_loaded = False

# One <thought>, then one <solution>, nothing of substance around them. A leading <think> block
# is the chat template's reasoning slot (Qwen3's templates open every assistant turn with one, and
# a model without a <think> special token keeps it in decoded text), not part of the answer.
_FORMAT = re.compile(
    r"\A\s*(?:<think>(?:(?!</think>).)*</think>\s*)?<thought>(?P<thought>(?:(?!<thought>|</thought>).)+?)</thought>\s*"
    r"<solution>(?P<solution>(?:(?!<solution>|</solution>).)+?)</solution>\s*\Z",
    re.DOTALL,
)


def register_tasks(tasks: Iterable[Task | BirdTask]) -> None:
    """Make ``tasks`` findable by their ``instance_id`` (the ``task_id`` column) for the rewards.

    Tasks of the bundled suites are found without registering them.
    """
    for task in tasks:
        _TASKS[task.instance_id] = task


def _task(task_id: str, tasks: Mapping[str, Task | BirdTask] | None) -> Task | BirdTask:
    global _bundled_loaded
    if tasks is not None and task_id in tasks:
        return tasks[task_id]
    if task_id not in _TASKS and not _bundled_loaded:
        _bundled_loaded = True
        for suite in _BUNDLED_SUITES:
            for task in load_tasks(suite):
                _TASKS.setdefault(task.instance_id, task)
    if task_id not in _TASKS:
        raise KeyError(
            f"unknown task_id {task_id!r}: call birdtrain.rewards.register_tasks(tasks) with the "
            "training tasks, or pass tasks={id: Task} to the reward function"
        )
    return _TASKS[task_id]


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of one completion, standard (a string) or conversational (a list of messages).

    >>> completion_text([{"role": "assistant", "content": "hi"}])
    'hi'
    """
    if isinstance(completion, str):
        return completion
    return "".join(
        str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant"
    )


def score_submission(task: Task | BirdTask, sql_list: list[str], *, official: bool = False) -> Any:
    """The verdict on a submission, by the judge of the task's kind (:func:`birdenv.judge.score`):
    the BIRD-CRITIC judge's, or BIRD's execution accuracy.

    A BIRD question's answer is the last statement of ``sql_list`` (the rule of
    ``BirdSQL-SQLite-v0``); an empty list fails without running anything. ``official=False``
    (rewards, the default) runs the gold on an untouched state, as the environment rewards;
    ``True`` is BIRD's official rule, for evaluation (:func:`birdenv.judge.ex.execution_accuracy`).
    Both verdicts have ``passed``, ``status``, ``fraction`` and ``to_dict()``.

    >>> from birdenv.tasks import load_tasks
    >>> question = load_tasks("bird-mini-eval")[0]
    >>> score_submission(question, ["SELECT 1", question.SQL]).passed
    True
    >>> score_submission(question, []).status
    'failed'
    """
    return score(task, sql_list, official=official)


def solution_reward(
    prompts: list[Any],
    completions: list[Any],
    *,
    task_id: list[str],
    tasks: Mapping[str, Task | BirdTask] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the completion's ``<solution>`` is correct (:func:`score_submission`), else 0.0.

    The statements are those :func:`birdtrain.prompts.parse_solution` finds; a completion without a
    solution scores 0.0 without being judged. ``task_id`` is the dataset column naming each
    completion's task; ``tasks`` (optional) maps ids to tasks not registered with
    :func:`register_tasks` and not in a bundled suite.

    >>> from birdenv.tasks import load_tasks
    >>> task = load_tasks("gym-mini")[0]
    >>> blocks = "".join(f"```sql\\n{sql}\\n```\\n" for sql in task.sol_sql)
    >>> gold = f"<thought>Fixed.</thought>\\n<solution>\\n{blocks}</solution>"
    >>> solution_reward([None] * 3, [gold, "no answer", "<solution>SELECT</solution>"],
    ...                 task_id=[task.instance_id] * 3)
    [1.0, 0.0, 0.0]
    """
    return [
        score_text(_task(tid, tasks), completion_text(completion))
        for completion, tid in zip(completions, task_id, strict=True)
    ]


def score_text(task: Task | BirdTask, text: str) -> float:
    """1.0 when the ``<solution>`` of an answer's text is correct for ``task``, else 0.0.

    An answer without statements scores 0.0 without being judged. Judged in this process, in
    order: measured faster than judge_many's worker pool for GRPO-sized batches.
    """

    statements = [s for s in parse_solution(text) if s.strip()]
    if not statements:
        return 0.0
    return float(score_submission(task, statements).passed)


def format_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 for a well-formed ``<thought>…</thought>`` then ``<solution>…</solution>`` answer, else 0.0.

    Both parts must be non-empty, appear once each, in that order, with nothing but white space
    around them; the chat template's ``<think>…</think>`` block may open the answer.

    >>> format_reward(None, [
    ...     "<thought>The join drops NULLs.</thought>\\n<solution>\\n```sql\\nSELECT 1\\n```\\n</solution>",
    ...     "<solution>SELECT 1</solution>",
    ...     "<thought>a</thought><solution>SELECT 1</solution> and more",
    ...     [{"role": "assistant", "content": "<thought>a</thought><solution>b</solution>"}],
    ...     "<think>\\n\\n</think>\\n\\n<thought>a</thought><solution>b</solution>",
    ... ])
    [1.0, 0.0, 0.0, 1.0, 1.0]
    """
    return [
        1.0 if (m := _FORMAT.match(completion_text(c))) and m["solution"].strip() else 0.0
        for c in completions
    ]


#: Reward functions by registry name.
REWARDS: dict[str, RewardFunc] = {"solution": solution_reward, "format": format_reward}


def get_reward(name: str) -> RewardFunc:
    """A reward function by registry name (``"solution"``, ``"format"``) or dotted path.

    >>> get_reward("format").__name__
    'format_reward'
    >>> get_reward("birdtrain.rewards.solution_reward").__name__
    'solution_reward'
    >>> get_reward("typo")
    Traceback (most recent call last):
    ...
    ValueError: unknown reward 'typo'; valid names: solution, format (or a dotted path such as package.module.function)
    """
    if name in REWARDS:
        return REWARDS[name]
    module_name, _, attribute = name.replace(":", ".").rpartition(".")
    if module_name:
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load reward function {name!r}: {exc}") from exc
        if not callable(function):
            raise ValueError(f"{name!r} is not callable")
        return function
    raise ValueError(
        f"unknown reward {name!r}; valid names: {', '.join(REWARDS)} "
        "(or a dotted path such as package.module.function)"
    )
