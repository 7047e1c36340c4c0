"""birdtrain: training small language models as SQL-debugging agents on the birdenv environments."""

from __future__ import annotations

import importlib
from types import ModuleType

from birdenv.errors import MissingExtraError

__all__ = ["EXTRAS", "missing_extra", "require"]

#: The extra of the ``bird-rl`` distribution that installs each optional module birdtrain imports.
EXTRAS = {
    **dict.fromkeys(
        (
            "torch",
            "transformers",
            "trl",
            "peft",
            "accelerate",
            "datasets",
            "yaml",
            "duckdb",
            "matplotlib",
        ),
        "train",
    ),
    "vllm": "vllm",
    "ray": "ray",
}


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


def missing_extra(exc: ModuleNotFoundError) -> MissingExtraError | None:
    """The error naming the extra to install when ``exc`` is about an optional module of
    :data:`EXTRAS`; None for any other module (a real bug, or a broken install).

    >>> str(missing_extra(ModuleNotFoundError("No module named 'torch'", name="torch")))
    "torch is not installed; install it with: pip install 'bird-rl[train]'"
    >>> missing_extra(ModuleNotFoundError("No module named 'x'", name="x")) is None
    True
    """
    module = (exc.name or "").split(".")[0]
    return MissingExtraError(module, EXTRAS[module]) if module in EXTRAS else None
