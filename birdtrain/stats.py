"""Evaluation statistics: unbiased pass@k, intervals for rates measured on few tasks (an SR of
3/24 means little without one), two policies compared on the same tasks, and whether an RL
stage's reward rose beyond its noise.

>>> lo, hi = wilson_interval(3, 24)
>>> round(lo, 3), round(hi, 3)
(0.043, 0.31)
>>> wilson_interval(0, 0)
(0.0, 1.0)
"""

from __future__ import annotations

import math

__all__ = [
    "paired_difference",
    "pass_at_k",
    "reward_trend",
    "reward_trend_within_tasks",
    "steps_per_third",
    "student_t_975",
    "wilson_interval",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` successes.

    >>> round(pass_at_k(4, 1, 1), 3), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
    (0.25, 1.0, 0.0)
    """
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: int | float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % by default), as fractions.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes,
    which is where small evaluations usually are. ``successes`` may be fractional (a sum of
    per-task pass@k estimates). ``n = 0`` gives the uninformative (0, 1).

    >>> [round(x, 3) for x in wilson_interval(5, 10)]
    [0.237, 0.763]
    >>> wilson_interval(0, 10)[0], wilson_interval(10, 10)[1]
    (0.0, 1.0)
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # At 0 or n successes a bound is exactly 0 or 1; floating point would miss it by 1e-16.
    low = 0.0 if successes <= 0 else max(0.0, centre - margin)
    high = 1.0 if successes >= n else min(1.0, centre + margin)
    return low, high


def student_t_975(freedom: int) -> float:
    """The 97.5th percentile of Student's t with ``freedom`` degrees of freedom: the multiplier of
    a two-sided 95 % interval on a mean of ``freedom + 1`` values.

    Exact for one and two degrees of freedom, else the Cornish-Fisher expansion about the normal
    quantile (Abramowitz and Stegun 26.7.5), within 0.2 % of the tables from three on.

    >>> [round(student_t_975(v), 3) for v in (1, 2, 4, 9, 30)]
    [12.706, 4.303, 2.776, 2.262, 2.042]
    """
    if freedom < 1:
        raise ValueError(f"freedom must be >= 1, got {freedom}")
    if freedom == 1:
        return math.tan(math.pi * 0.475)
    if freedom == 2:
        return 0.95 / math.sqrt(2 * 0.975 * 0.025)
    z, v = 1.959963984540054, float(freedom)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


def paired_difference(
    a: dict[str, list[bool]], b: dict[str, list[bool]]
) -> dict[str, float | int | list[float]]:
    """Policy ``b`` against policy ``a`` on the tasks both were evaluated on, task by task.

    ``a`` and ``b`` map a task id to the outcomes of its samples (one with greedy decoding).
    Each task's pass rate is the share of its samples that passed; a policy's rate is the mean
    over tasks (the success rate with one sample a task, the mean pass@1 with more). The
    difference ``b - a`` is the mean of the per-task differences, with a paired t interval (95 %)
    over the tasks: each task is compared with itself, so the spread between easy and hard tasks
    is not counted as noise, and the samples of one task are never treated as independent tasks.
    Between two equal policies it calls a change about one time in twenty, on five tasks as on
    many (``tests/test_eval.py``), where a percentile bootstrap over tasks is too narrow on few
    tasks. ``improved`` and ``worsened`` count the tasks whose rate rose or fell; ``only_a`` and
    ``only_b`` those left out.

    >>> a = {"t1": [False] * 4, "t2": [True, False, False, False], "t3": [True] * 4}
    >>> b = {"t1": [True, False, False, False], "t2": [True, True, True, False], "t3": [True] * 4}
    >>> d = paired_difference(a, b)
    >>> round(d["a"], 3), round(d["b"], 3), round(d["difference"], 3), d["improved"], d["worsened"]
    (0.417, 0.667, 0.25, 2, 0)
    >>> [round(x, 3) for x in d["ci95"]]
    [-0.371, 0.871]
    >>> paired_difference({"t1": [True]}, {"t2": [True]})
    Traceback (most recent call last):
    ...
    ValueError: the two evaluations share no task (1 and 1 tasks)
    """
    shared = sorted(a.keys() & b.keys())
    if not shared:
        raise ValueError(f"the two evaluations share no task ({len(a)} and {len(b)} tasks)")
    empty = [t for t in shared if not a[t] or not b[t]]
    if empty:
        raise ValueError(f"task {empty[0]} has no samples in one of the evaluations")
    rate_a = [sum(a[t]) / len(a[t]) for t in shared]
    rate_b = [sum(b[t]) / len(b[t]) for t in shared]
    deltas = [y - x for x, y in zip(rate_a, rate_b, strict=True)]
    n = len(deltas)
    mean = sum(deltas) / n
    if n > 1:
        spread = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (n - 1))
        margin = student_t_975(n - 1) * spread / math.sqrt(n)
    else:
        margin = math.inf  # one task says nothing about the noise: the interval is [-1, 1]
    return {
        "tasks": n,
        "a": sum(rate_a) / n,
        "b": sum(rate_b) / n,
        "difference": mean,
        # A difference of two rates lies in [-1, 1] whatever the noise.
        "ci95": [max(-1.0, mean - margin), min(1.0, mean + margin)],
        "improved": sum(d > 0 for d in deltas),
        "worsened": sum(d < 0 for d in deltas),
        "only_a": len(a.keys() - b.keys()),
        "only_b": len(b.keys() - a.keys()),
    }


def steps_per_third(steps: int) -> int:
    """How many steps each of a trend's first and last thirds holds (at least one).

    >>> steps_per_third(26), steps_per_third(2)
    (8, 1)
    """
    return max(1, steps // 3)


def reward_trend(
    steps: list[tuple[float, float, int]], z: float = 1.96
) -> dict[str, float | int | list[float]] | None:
    """The mean reward of the last third of an RL stage's steps against the first third.

    Each step is ``(mean, mean_of_squares, groups)`` over its groups' mean rewards (the
    ``sampling/reward_before``, ``sampling/reward_before_sq`` and ``sampling/groups`` figures of
    ``metrics.jsonl``). The unit is a group (one task's rollouts), so the noise is the spread
    between groups, which is what differs most from one step's draw of tasks to the next. The
    interval on the difference is Welch's, with the normal quantile ``z`` (95 % by default).
    ``None`` with fewer than two steps.

    >>> t = reward_trend([(0.25, 0.125, 2), (0.0, 0.0, 2), (0.5, 0.5, 2)])
    >>> t["first"], t["last"], t["difference"], t["groups"]
    (0.25, 0.5, 0.25, [2, 2])
    >>> [round(x, 3) for x in t["ci95"]]
    [-0.846, 1.346]
    """
    if len(steps) < 2:
        return None
    k = steps_per_third(len(steps))

    def pooled(part: list[tuple[float, float, int]]) -> tuple[float, float, int]:
        n = sum(g for *_, g in part)
        mean = sum(m * g for m, _, g in part) / n
        square = sum(q * g for _, q, g in part) / n
        variance = max(square - mean * mean, 0.0) * n / (n - 1) if n > 1 else 0.0
        return mean, variance, n

    first, var_first, n_first = pooled(steps[:k])
    last, var_last, n_last = pooled(steps[-k:])
    margin = z * math.sqrt(var_first / n_first + var_last / n_last)
    difference = last - first
    return {
        "first": first,
        "last": last,
        "difference": difference,
        "ci95": [difference - margin, difference + margin],
        "groups": [n_first, n_last],
        "steps_per_third": k,
    }


def reward_trend_within_tasks(
    groups: list[tuple[int, str, float]], z: float = 1.96
) -> dict[str, float | int | list[float]] | None:
    """The reward trend of an RL stage compared task by task: :func:`reward_trend` without the
    spread between tasks.

    ``groups`` are ``(step, task_id, mean_reward)``, one for each group of each step's own draw
    (the stage's ``groups.jsonl``). The steps are split into thirds as in :func:`reward_trend`.
    A task drawn in both the first and the last third contributes the difference of its mean
    group reward between them; the difference reported is their average weighted by
    ``n_first * n_last / (n_first + n_last)`` (a stratified comparison: each task is compared
    with itself, so which tasks a third happened to draw no longer counts as a change). Its
    interval uses the spread of group rewards around their task's mean within a third, pooled
    over the tasks. ``first`` and ``last`` are the plain means of the two thirds. ``None`` with
    fewer than two steps, or when no task is in both thirds.

    >>> g = [(1, "a", 0.0), (1, "b", 1.0), (2, "a", 0.5), (3, "a", 0.5), (3, "c", 1.0),
    ...      (4, "a", 1.0), (4, "b", 1.0), (5, "a", 0.75), (6, "b", 1.0), (6, "a", 1.0)]
    >>> t = reward_trend_within_tasks(g)
    >>> t["tasks"], t["groups"], round(t["difference"], 3)
    (2, [3, 3], 0.417)
    >>> round(t["first"], 3), round(t["last"], 3), [round(x, 3) for x in t["ci95"]]
    (0.5, 0.917, [-0.031, 0.864])
    """
    steps = sorted({s for s, _, _ in groups})
    if len(steps) < 2:
        return None
    k = steps_per_third(len(steps))
    thirds = (set(steps[:k]), set(steps[-k:]))
    cells: list[dict[str, list[float]]] = [{}, {}]
    for step, task, reward in groups:
        for cell, third in zip(cells, thirds, strict=True):
            if step in third:
                cell.setdefault(task, []).append(reward)
    first, last = cells
    shared = sorted(first.keys() & last.keys())
    if not shared:
        return None
    # Spread of a group's reward around its task's mean in that third, pooled over every cell.
    squares = sum((r - sum(c) / len(c)) ** 2 for cell in cells for c in cell.values() for r in c)
    freedom = sum(len(c) - 1 for cell in cells for c in cell.values())
    variance = squares / freedom if freedom > 0 else 0.0
    weights = {t: len(first[t]) * len(last[t]) / (len(first[t]) + len(last[t])) for t in shared}
    total = sum(weights.values())
    difference = (
        sum(
            w * (sum(last[t]) / len(last[t]) - sum(first[t]) / len(first[t]))
            for t, w in weights.items()
        )
        / total
    )
    # Var(mean_last - mean_first) of a task is variance / weight; the weighted mean's is 1/total.
    margin = z * math.sqrt(variance / total)
    return {
        "first": sum(r for c in first.values() for r in c) / sum(len(c) for c in first.values()),
        "last": sum(r for c in last.values() for r in c) / sum(len(c) for c in last.values()),
        "difference": difference,
        "ci95": [difference - margin, difference + margin],
        "tasks": len(shared),
        "groups": [sum(len(first[t]) for t in shared), sum(len(last[t]) for t in shared)],
        "steps_per_third": k,
    }
