"""birdtrain: training small language models as SQL-debugging agents on the birdenv environments."""

from __future__ import annotations

import importlib
from types import ModuleType

from birdenv.errors import MissingExtraError

__all__ = ["require"]


def require(module: str, extra: str = "train") -> ModuleType:
    """Import ``module``, an optional dependency; :class:`~birdenv.errors.MissingExtraError`
    (naming ``extra``) when it is not installed.

    >>> require("json").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports is not: a different problem
        raise MissingExtraError(module, extra) from exc
