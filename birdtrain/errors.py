"""Errors birdtrain raises on purpose, under the project's one root, :class:`~birdenv.errors.BirdEnvError`.

An error that one module raises lives there (:class:`birdtrain.stages.training.StageError`,
:class:`birdtrain.endpoint.TeacherError`, :class:`birdtrain.curriculum.difficulty.DifficultyError`);
these are raised across the package.
"""

from __future__ import annotations

from birdenv.errors import BirdEnvError

__all__ = ["DamagedFileError", "GPUSetupError", "OutputWriteError", "ProcessDiedError"]


class GPUSetupError(BirdEnvError, RuntimeError):
    """The GPUs visible to a training process cannot be used as they are set up (e.g. several
    GPUs without a launcher); the message names the setting that fixes it."""


class ProcessDiedError(BirdEnvError, RuntimeError):
    """A process running one stage or evaluation of a curriculum ended without a result (killed,
    or a crash in native code); the message names it and its exit code."""


class OutputWriteError(BirdEnvError, OSError):
    """A file of results could not be written (a full disk, no permission); the message names the
    file, and what was written before it is kept."""


class DamagedFileError(BirdEnvError, RuntimeError):
    """A file a run wrote and now needs (a checkpoint's weights, synthesized data, a part of the
    trajectory store) is missing or differs from what its manifest recorded; the message names the
    file and how to make it again."""
