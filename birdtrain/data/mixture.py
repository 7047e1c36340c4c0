"""Mixtures of task sources: debugging tasks and BIRD questions in one curriculum, by weight.

A mixture maps task sources (bundled suite names or files, see :func:`birdenv.tasks.load_tasks`)
to weights, e.g. ``{"gym-mini": 0.7, "bird-mini-train": 0.3}``. Every stage draws from it:
stages 1-2 synthesize their examples for the mixed task list, stage 3 takes its prompts from it
(rewards by task kind: the judge or execution accuracy), stage 4 rolls it out in one vector env
holding both environments.

Drawing by weight (:func:`mix_tasks`) is deterministic given the seed: each source's tasks are
shuffled with a generator seeded by ``(seed, source index)``, a source of weight ``w`` contributes
``w * total`` tasks (largest-remainder rounding, so the counts are exact), and the sources are
interleaved by one more seeded shuffle. ``total`` defaults to the largest list that repeats no
task; a larger one cycles through a source's tasks again.

Choosing the weights (``data.mixture: auto``, or ``birdtrain mixture``) is a step of the
curriculum: :mod:`birdtrain.curriculum.mixture`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from birdenv.tasks import load_tasks

__all__ = [
    "apportion",
    "load_sources",
    "mix_tasks",
    "normalize",
    "split_holdout",
]


def normalize(weights: Mapping[str, float]) -> dict[str, float]:
    """Weights scaled to sum to 1.

    >>> normalize({"a": 3, "b": 1})
    {'a': 0.75, 'b': 0.25}
    """
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError("weights must not all be 0")
    return {name: float(w) / total for name, w in weights.items()}


def apportion(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest remainder).

    >>> apportion({"a": 0.7, "b": 0.3}, 10), apportion({"a": 1, "b": 1, "c": 1}, 4)
    ({'a': 7, 'b': 3}, {'a': 2, 'b': 1, 'c': 1})
    """
    shares = {name: w * total for name, w in normalize(weights).items()}
    counts = {name: math.floor(s + 1e-9) for name, s in shares.items()}
    left = total - sum(counts.values())
    # Ties go to the earlier source, so the result depends on nothing but the arguments.
    order = sorted(shares, key=lambda n: -(shares[n] - counts[n]))
    for name in order[:left]:
        counts[name] += 1
    return counts


def _permutation(n: int, seed: int, index: int) -> np.ndarray:
    return np.random.default_rng([seed, index]).permutation(n)


def mix_tasks(
    sources: Mapping[str, Sequence[Any]],
    weights: Mapping[str, float],
    *,
    total: int | None = None,
    seed: int = 0,
) -> list[Any]:
    """A seeded, reproducible draw of ``total`` items from ``sources`` in the ``weights``' proportions.

    Args:
        sources: Source name → its items (tasks, or examples).
        weights: Source name → weight (the same names as ``sources``).
        total: How many items; default the most that repeats none
            (``min(len(source) / weight)`` over the sources with a weight).
        seed: The draw's seed; the same arguments give the same list.

    Returns:
        The items, sources interleaved; source ``s`` holds exactly ``apportion(weights, total)[s]``.
    """
    if set(sources) != set(weights):
        raise ValueError(f"weights name {sorted(weights)} but the sources are {sorted(sources)}")
    shares = normalize(weights)
    names = list(sources)
    if total is None:
        total = int(
            min(len(sources[n]) / shares[n] for n in names if shares[n] > 0 and len(sources[n]))
            if any(shares[n] > 0 and len(sources[n]) for n in names)
            else 0
        )
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    counts = apportion({n: shares[n] for n in names}, total)
    queues: dict[str, list[Any]] = {}
    for index, name in enumerate(names):
        items, need = list(sources[name]), counts[name]
        if need and not items:
            raise ValueError(f"task source {name!r} is empty but has weight {shares[name]:.3g}")
        drawn: list[Any] = []
        rounds = 0
        while len(drawn) < need:
            # Each pass over the source is a new permutation: repeats are spread, not blocks.
            drawn += [items[i] for i in _permutation(len(items), seed + rounds, index)]
            rounds += 1
        queues[name] = drawn[:need]
    labels = [name for name in names for _ in range(counts[name])]
    order = np.random.default_rng([seed, len(names)]).permutation(len(labels))
    cursor = dict.fromkeys(names, 0)
    mixed = []
    for i in order:
        name = labels[i]
        mixed.append(queues[name][cursor[name]])
        cursor[name] += 1
    return mixed


def load_sources(names: Sequence[str], db_dir: str | None = None) -> dict[str, list[Any]]:
    """The tasks of each named source (:func:`birdenv.tasks.load_tasks`); ids must not collide."""

    sources: dict[str, list[Any]] = {}
    owner: dict[str, str] = {}
    for name in names:
        tasks = load_tasks(name, db_dir=db_dir)
        if not tasks:
            raise ValueError(f"task source {name!r} holds no tasks")
        for task in tasks:
            other = owner.setdefault(task.instance_id, name)
            if other != name:
                raise ValueError(
                    f"task id {task.instance_id!r} is in both {other!r} and {name!r}: ids must be "
                    "unique across the sources of a mixture"
                )
        sources[name] = tasks
    return sources


def split_holdout(
    sources: Mapping[str, Sequence[Any]], per_source: int, seed: int
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(train, held out): ``per_source`` tasks of each source held out, drawn with ``seed``."""
    train, held = {}, {}
    for index, (name, tasks) in enumerate(sources.items()):
        if len(tasks) <= per_source:
            raise ValueError(
                f"task source {name!r} has {len(tasks)} tasks: too few to hold out {per_source} "
                "(lower data.mixture_holdout)"
            )
        order = [tasks[i] for i in _permutation(len(tasks), seed, index)]
        held[name], train[name] = order[:per_source], order[per_source:]
    return train, held
