"""What the curriculum does with each kind of task: one :class:`TrainingKind` per kind, by name.

The task itself says what birdenv knows of its kind (its judge, environment, prompt pieces and
official files: :class:`birdenv.tasks.BaseTask`); this registry holds what training adds: the
stage-1 and stage-2 examples built for its tasks, the offline expert that plays one, the
reference turns of ``oracle`` and ``echo``, and the answer that changes nothing. Synthesis, the
mixture estimate and evaluations ask :func:`training_kind` for a task's, never test its class.
A new kind registers one with :func:`register_training_kind`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from birdenv.agents import AGENTS
from birdenv.errors import TaskKindError
from birdtrain.data.bird import (
    BirdExpert,
    bird_reference_turns,
    build_bird_reasoning_examples,
    build_bird_tool_trajectories,
    gather_bird_evidence,
)
from birdtrain.data.evidence import gather_evidence
from birdtrain.data.reasoning import build_reasoning_examples
from birdtrain.data.tool_use import OfflineExpert, build_tool_trajectories

__all__ = ["TrainingKind", "by_kind", "register_training_kind", "training_kind"]


@dataclasses.dataclass(frozen=True)
class TrainingKind:
    """What training does with the tasks of one kind.

    ``reasoning_examples(tasks, *, teacher, stats, prompt, thought_rows, progress)``: stage 1's
    single-turn examples; ``tool_trajectories(tasks, *, teacher, max_turns, stats, prompt,
    progress)``: stage 2's episodes (both keep only what the judge accepts, filling ``stats``
    with counts); ``expert(task, pool, max_turns)``: the offline expert of one task, whose
    ``act(observation, info)`` plays it; ``reference_turns(policy, task)``: the turns of the
    ``oracle`` and ``echo`` reference policies; ``unchanged(task)``: the submission that changes
    nothing (a debugging task's own issue SQL), ``None`` for a kind without one.
    """

    reasoning_examples: Callable[..., list[dict[str, Any]]]
    tool_trajectories: Callable[..., list[dict[str, Any]]]
    expert: Callable[[Any, Any, int], Any]
    reference_turns: Callable[[str, Any], Iterable[str]]
    unchanged: Callable[[Any], list[str]] | None = None


def _critic_expert(task: Any, pool: Any, max_turns: int) -> OfflineExpert:
    return OfflineExpert(task, gather_evidence(task, pool), max_turns)


def _bird_expert(task: Any, pool: Any, max_turns: int) -> BirdExpert:
    return BirdExpert(task, gather_bird_evidence(task, pool), max_turns)


_KINDS: dict[str, TrainingKind] = {
    "critic": TrainingKind(
        reasoning_examples=build_reasoning_examples,
        tool_trajectories=build_tool_trajectories,
        expert=_critic_expert,
        reference_turns=lambda policy, task: AGENTS[policy]().turns(task),
        unchanged=lambda task: task.issue_sql,
    ),
    "bird": TrainingKind(
        reasoning_examples=build_bird_reasoning_examples,
        tool_trajectories=build_bird_tool_trajectories,
        expert=_bird_expert,
        reference_turns=bird_reference_turns,
    ),
}


def register_training_kind(kind: str, training: TrainingKind) -> None:
    """Train on the tasks of ``kind`` (a kind's name, :attr:`birdenv.tasks.BaseTask.kind`) with
    ``training``'s builders and expert (replacing any earlier one)."""
    _KINDS[kind] = training


def training_kind(kind: str) -> TrainingKind:
    """The :class:`TrainingKind` of the kind named ``kind``; :class:`TaskKindError` naming the
    registered ones when there is none."""
    try:
        return _KINDS[kind]
    except KeyError:
        raise TaskKindError(
            f"birdtrain does not train on {kind} tasks: kinds registered for training are "
            f"{', '.join(sorted(_KINDS))} (birdtrain.data.kinds.register_training_kind adds one)"
        ) from None


def by_kind(tasks: Sequence[Any]) -> dict[str, list[Any]]:
    """``tasks`` by their kind's name, each kind's in their order, kinds in order of first sight."""
    groups: dict[str, list[Any]] = {}
    for task in tasks:
        groups.setdefault(task.kind, []).append(task)
    return groups
