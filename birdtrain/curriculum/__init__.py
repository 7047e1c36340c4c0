"""The curriculum: the run directory, resuming, the stage order, the evaluations between stages,
and the curriculum's own steps.

- :mod:`birdtrain.curriculum.run`: the runner (the stages in order, the evaluations between them).
- :mod:`birdtrain.curriculum.directory`: the run directory's record, resuming and its checks.
- :mod:`birdtrain.curriculum.tasks`: which tasks each part of a run uses.
- :mod:`birdtrain.curriculum.isolation`: a stage or an evaluation in a process of its own.
- :mod:`birdtrain.curriculum.difficulty`: each training task's pass rate before an RL stage.
- :mod:`birdtrain.curriculum.mixture`: choosing a mixture's weights (``data.mixture: auto``).
"""

from birdtrain.curriculum.directory import open_run, prepare_run, start_checkpoint
from birdtrain.curriculum.run import (
    estimate_difficulty,
    run_curriculum,
    run_stage,
    synthesize,
)

__all__ = [
    "estimate_difficulty",
    "open_run",
    "prepare_run",
    "run_curriculum",
    "run_stage",
    "start_checkpoint",
    "synthesize",
]
