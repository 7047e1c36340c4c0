"""Dynamic sampling for the GRPO stages: keep only groups whose rewards differ.

GRPO's advantage is a reward minus its group's mean: a group whose rewards are all equal (every
rollout failed, or every one passed) has zero advantage everywhere and teaches nothing. Dynamic
sampling (DAPO's "dynamic sampling") drops such groups and rolls out replacement tasks, up to
``max_rounds`` extra rounds, so a step's batch holds as many informative groups as the budget
allows. What it cost and what it achieved is recorded in :class:`SamplingStats`.

The batch keeps its size: when the rounds run out, the first zero-variance groups fill the gaps
(they are harmless: zero advantage, no policy gradient).

>>> import random
>>> outcomes = {"a": [0.0, 0.0], "b": [1.0, 0.0], "c": [0.0, 1.0], "d": [1.0, 1.0]}
>>> def generate(ids):
...     return [Group(t, outcomes[t], [f"{t}{g}" for g in range(2)]) for t in ids]
>>> batch, stats = dynamic_sample(["a", "b"], generate, pool=list(outcomes), max_rounds=3,
...                               rng=random.Random(0))
>>> sorted(g.task_id for g in batch)
['b', 'c']
>>> stats.zero_std_before, stats.zero_std_after, stats.resampled_groups >= 1
(0.5, 0.0, True)
>>> stats.reward_before, stats.reward_before_sq  # groups a, b: means 0.0 and 0.5
(0.25, 0.125)
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Group", "SamplingStats", "dynamic_sample", "read_groups", "record_groups"]


@dataclasses.dataclass
class Group:
    """The rollouts of one task and their rewards (``None``: a rollout that broke, unscored)."""

    task_id: str
    rewards: list[float | None]
    items: list[Any]

    @property
    def scored(self) -> list[float]:
        """The rewards of the rollouts that did not break."""
        return [r for r in self.rewards if r is not None]

    @property
    def zero_std(self) -> bool:
        """True when the scored rewards are all equal (or fewer than two were scored)."""
        scored = self.scored
        return len(scored) < 2 or max(scored) - min(scored) < 1e-9

    @property
    def mean_reward(self) -> float | None:
        """The mean of the scored rewards (``None`` when none was scored)."""
        scored = self.scored
        return sum(scored) / len(scored) if scored else None


@dataclasses.dataclass
class SamplingStats:
    """What one step's dynamic sampling saw and spent.

    ``zero_std_before``: fraction of the first round's groups with equal rewards;
    ``zero_std_after``: the same fraction in the batch handed to the trainer;
    ``resampled_groups``: replacement groups rolled out; ``rollouts``: rollouts generated in all
    rounds; ``rounds``: extra rounds used.

    ``reward_before`` is the mean over the first round's groups of each group's mean reward, and
    ``reward_before_sq`` the mean of their squares. The first round is the step's own draw, before
    any group is dropped, so its reward measures the policy (the trained batch over-represents
    tasks it solves sometimes); the squares give the spread between groups, the noise a reward
    trend is judged against (:func:`birdtrain.stats.reward_trend`). ``first_round`` holds each
    of those groups as ``(task_id, mean reward)``, for a trend compared task by task
    (:func:`record_groups`, :func:`birdtrain.stats.reward_trend_within_tasks`).
    """

    groups: int
    zero_std_before: float
    zero_std_after: float
    resampled_groups: int
    rollouts: int
    rounds: int
    reward_before: float = 0.0
    reward_before_sq: float = 0.0
    first_round: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def metrics(self, prefix: str) -> dict[str, float]:
        """The figures as ``metrics.jsonl`` names (``{prefix}/frac_reward_zero_std_before`` ...)."""
        return {
            f"{prefix}/frac_reward_zero_std_before": self.zero_std_before,
            f"{prefix}/frac_reward_zero_std_after": self.zero_std_after,
            f"{prefix}/resampled_groups": float(self.resampled_groups),
            f"{prefix}/rollouts": float(self.rollouts),
            f"{prefix}/groups": float(self.groups),
            f"{prefix}/reward_before": self.reward_before,
            f"{prefix}/reward_before_sq": self.reward_before_sq,
        }


def dynamic_sample(
    task_ids: Sequence[str],
    generate: Callable[[list[str]], list[Group]],
    *,
    pool: Sequence[str],
    max_rounds: int,
    rng: random.Random,
) -> tuple[list[Group], SamplingStats]:
    """Roll out ``task_ids``, then replace zero-variance groups with groups of other tasks.

    Args:
        task_ids: The step's tasks (distinct); the batch returned has one group per task slot.
        generate: Rolls out a list of tasks and returns their groups, in the same order.
        pool: Tasks replacements are drawn from (without repeating a task within the step).
        max_rounds: Extra rounds of replacements; 0 turns dynamic sampling off.
        rng: The draw's random source (seed it for reproducible runs).

    Returns:
        The batch (informative groups first, in the order they were rolled out, then as many
        zero-variance groups as it takes to fill every slot) and the step's :class:`SamplingStats`.
    """
    if max_rounds < 0:
        raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
    wanted = len(task_ids)
    first = generate(list(task_ids))
    rollouts = sum(len(g.items) for g in first)
    kept = [g for g in first if not g.zero_std]
    spare = [g for g in first if g.zero_std]
    tried = set(task_ids)
    resampled = rounds = 0
    while len(kept) < wanted and rounds < max_rounds:
        candidates = [t for t in pool if t not in tried]
        if not candidates:
            break
        draw = rng.sample(candidates, min(wanted - len(kept), len(candidates)))
        tried.update(draw)
        groups = generate(draw)
        rounds += 1
        resampled += len(groups)
        rollouts += sum(len(g.items) for g in groups)
        kept += [g for g in groups if not g.zero_std]
        spare += [g for g in groups if g.zero_std]
    batch = kept[:wanted] + spare[: max(wanted - len(kept), 0)]
    scored = [(g.task_id, g.mean_reward) for g in first if g.mean_reward is not None]
    means = [m for _, m in scored]
    stats = SamplingStats(
        groups=wanted,
        zero_std_before=sum(g.zero_std for g in first) / max(len(first), 1),
        zero_std_after=sum(g.zero_std for g in batch) / max(len(batch), 1),
        resampled_groups=resampled,
        rollouts=rollouts,
        rounds=rounds,
        reward_before=sum(means) / len(means) if means else 0.0,
        reward_before_sq=sum(m * m for m in means) / len(means) if means else 0.0,
        first_round=scored,
    )
    return batch, stats


def record_groups(path: Path, step: int, stats: SamplingStats) -> None:
    """Append a step's own draw to ``path`` (a stage's ``groups.jsonl``), one line a group:
    ``{"step", "group", "task_id", "reward"}`` (its place in the draw, its mean reward)."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"step": step, "group": i, "task_id": t, "reward": r}) + "\n"
            for i, (t, r) in enumerate(stats.first_round)
        )


def read_groups(path: Path) -> list[tuple[int, str, float]]:
    """The ``(step, task_id, reward)`` groups :func:`record_groups` wrote (empty without the file).

    A run resumed from a checkpoint redoes the steps after it and writes them again: a draw of a
    step at or below one already read discards every group from that step on, so each step keeps
    the draw of the run that went on.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "groups.jsonl"
    >>> for step, task in [(1, "a"), (2, "b"), (3, "c"), (2, "d"), (3, "e"), (3, "f")]:
    ...     record_groups(path, step, SamplingStats(1, 0, 0, 0, 4, 0, first_round=[(task, 0.5)]))
    >>> read_groups(path)
    [(1, 'a', 0.5), (2, 'd', 0.5), (3, 'f', 0.5)]
    """
    if not Path(path).exists():
        return []
    groups: list[tuple[int, str, float]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            step = int(row["step"])
            if row["group"] == 0 and groups and step <= groups[-1][0]:
                groups = [g for g in groups if g[0] < step]
            groups.append((step, str(row["task_id"]), float(row["reward"])))
    return groups
