"""Errors raised by birdenv, all under one root so callers can catch :class:`BirdEnvError`."""

from __future__ import annotations


class BirdEnvError(Exception):
    """Root of every error birdenv raises on purpose."""


class InputFormatError(BirdEnvError, ValueError):
    """An input file cannot be read as rows; the message names the file, the line and the field.

    ``line`` is the line (or item, or entry) it names, when it names one.
    """

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class TaskFormatError(InputFormatError):
    """A task row is malformed; the message names the file, the line and the field."""


class PredictionFormatError(InputFormatError):
    """A prediction cannot be scored as given; the message names the file, the entry and why."""


class ArgumentError(BirdEnvError, TypeError):
    """Keyword arguments that do not fit together, or one birdenv does not take; the message says
    what to pass instead."""


class TaskKindError(BirdEnvError, TypeError):
    """Tasks of one kind were given where another is needed, or a kind nothing is registered for;
    the message says which fits."""


class UnknownSuiteError(BirdEnvError, KeyError):
    """No bundled suite has this name and no such task file exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DatabaseNotFoundError(BirdEnvError, FileNotFoundError):
    """A task's database file does not exist where the layout says it should."""


class SuiteBuildError(BirdEnvError):
    """A bundled suite could not be built or failed its content-hash check."""


class PreprocessError(BirdEnvError):
    """A task's ``preprocess_sql`` failed while preparing a session (never swallowed)."""


class PoolClosedError(BirdEnvError):
    """The replica pool was used after it was closed."""


class PoolTimeoutError(BirdEnvError, TimeoutError):
    """No session could be leased before the timeout."""


class SessionClosedError(BirdEnvError):
    """A session was used after it was closed or reset."""


class WorkerStartError(BirdEnvError, RuntimeError):
    """A judging worker process died before it could judge anything (a setup problem, not a
    verdict: every instance would fail the same way)."""


class MissingExtraError(BirdEnvError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed; install it with: pip install 'bird-rl[{extra}]'"
        )
        self.name = module


class SchemaError(BirdEnvError, ValueError):
    """A schema prompt was asked for with an invalid setting or a table the database lacks."""


class DescriptorLimitError(BirdEnvError, OSError):
    """The process ran out of file descriptors; the message names the limit, the count in use and
    how to raise it."""


class ClusterError(BirdEnvError, RuntimeError):
    """A Ray actor holding environments or judging died or hung, and the call cannot be answered
    for every copy (``step`` never raises this: it marks the lost copies' episodes broken)."""


class StagingError(BirdEnvError, RuntimeError):
    """A node could not obtain a task database with the content hash the driver has."""


class DirectoryBusyError(BirdEnvError, RuntimeError):
    """Another live process writes the run or output directory; the message names it (PID,
    command, since when)."""
