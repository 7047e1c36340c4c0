"""The old home of BIRD questions, kept so that 0.1 imports still work.

The task kind lives in :mod:`birdenv.tasks.bird` (importable from :mod:`birdenv.tasks`) and its
scoring in :mod:`birdenv.judge.ex`. The names below are importable from here; those that moved to
the judge warn.
"""

from __future__ import annotations

import warnings
from typing import Any

from birdenv.tasks.bird import (
    BIRD_SEPARATOR,
    BIRD_SUITES,
    DIFFICULTIES,
    BirdTask,
    iter_bird,
    load_bird,
    parse_bird_task,
)

__all__ = [
    "BIRD_SEPARATOR",
    "BIRD_SUITES",
    "DIFFICULTIES",
    "BirdTask",
    "iter_bird",
    "load_bird",
    "parse_bird_task",
]

# Scoring moved out of this module in 0.2: importable from here, with a warning, for one release.
_MOVED_TO_EX = (
    "EX_MAX_ROWS",
    "ExVerdict",
    "execution_accuracy",
    "execution_accuracy_many",
    "validate_bird",
)


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_EX:
        from birdenv.judge import ex  # the old home forwards on use: no judge at import

        warnings.warn(
            f"birdenv.bird.{name} moved to birdenv.judge.ex.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(ex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
