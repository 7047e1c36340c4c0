"""Intervals for rates measured on few tasks: an SR of 3/24 means little without one.

>>> lo, hi = wilson_interval(3, 24)
>>> round(lo, 3), round(hi, 3)
(0.043, 0.31)
>>> wilson_interval(0, 0)
(0.0, 1.0)
"""

from __future__ import annotations

import math

__all__ = ["wilson_interval"]


def wilson_interval(successes: int | float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % by default), as fractions.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes,
    which is where small evaluations usually are. ``n = 0`` gives the uninformative (0, 1).
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - margin), min(1.0, centre + margin)
