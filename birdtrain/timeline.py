"""Where the wall-clock time of an evaluation went: generation, judge, environment (env), other.

Work is recorded as intervals on the wall clock (``time.perf_counter``) from any thread, and
:meth:`Timeline.split` gives each instant to one kind, so the parts add up to the total even when
threads or worker processes overlap.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["KINDS", "Timeline"]

#: Kinds of work, in the order an instant is given to them when several are in progress.
KINDS = ("generation", "judge", "env")


class Timeline:
    """Intervals of work on the wall clock, recorded from any thread.

    :meth:`split` gives every instant of a window to the first kind of :data:`KINDS` with work in
    progress at that instant, and to ``other`` when there is none: the parts add up to the window.

    >>> t = Timeline()
    >>> t.add("env", 0.0, 4.0)
    >>> t.add("judge", 3.0, 5.0)
    >>> t.add("generation", 1.0, 2.0)
    >>> t.split(0.0, 6.0)
    {'generation': 1.0, 'judge': 2.0, 'env': 2.0, 'other': 1.0}
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, start: float, end: float) -> None:
        """Record ``kind`` of work from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind of work {kind!r}; the kinds are {', '.join(KINDS)}")
        with self._lock:
            self.intervals.append((kind, start, end))

    def add_judge(self, verdict: dict[str, Any] | None, end: float) -> None:
        """Record the judge's run that gave ``verdict`` (its ``timings["total"]`` seconds) as
        ending at ``end``; a verdict without that timing (an environment's own) adds nothing.

        >>> t = Timeline()
        >>> t.add_judge({"status": "success", "timings": {"total": 2.0}}, 5.0)
        >>> t.add_judge({"status": "failed"}, 9.0)
        >>> t.intervals
        [('judge', 3.0, 5.0)]
        """
        seconds = ((verdict or {}).get("timings") or {}).get("total")
        if seconds is not None:
            self.add("judge", end - seconds, end)

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Record the ``with`` block as ``kind`` of work."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, start, time.perf_counter())

    def extend(self, other: Timeline) -> None:
        """Add ``other``'s intervals to this timeline."""
        with self._lock:
            self.intervals.extend(other.intervals)

    def split(self, start: float, end: float) -> dict[str, float]:
        """Seconds of ``[start, end]`` given to each kind of :data:`KINDS` and to ``other``."""
        events = sorted(
            (t, delta, kind)
            for kind, a, b in self.intervals
            if min(b, end) > max(a, start)
            for t, delta in ((max(a, start), 1), (min(b, end), -1))
        )
        seconds = dict.fromkeys((*KINDS, "other"), 0.0)
        running = dict.fromkeys(KINDS, 0)
        now = start
        for t, delta, kind in events:
            busy = next((k for k in KINDS if running[k] > 0), "other")
            seconds[busy] += t - now
            running[kind] += delta
            now = t
        seconds["other"] += end - now
        return seconds
