"""Evaluation statistics: unbiased pass@k, and intervals for rates measured on few tasks (an SR of
3/24 means little without one).

>>> lo, hi = wilson_interval(3, 24)
>>> round(lo, 3), round(hi, 3)
(0.043, 0.31)
>>> wilson_interval(0, 0)
(0.0, 1.0)
"""

from __future__ import annotations

import math

__all__ = ["pass_at_k", "wilson_interval"]


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
