"""The curriculum: the run directory, resuming, the stage order, the evaluations between stages,
and the curriculum's own steps.

- :mod:`birdtrain.curriculum.run`: the runner (run directory, resume, stages, evaluations).
- :mod:`birdtrain.curriculum.difficulty`: each training task's pass rate before an RL stage.
- :mod:`birdtrain.curriculum.mixture`: choosing a mixture's weights (``data.mixture: auto``).
"""

from birdtrain.curriculum.run import (
    estimate_difficulty,
    open_run,
    prepare_run,
    run_curriculum,
    run_stage,
    start_checkpoint,
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
