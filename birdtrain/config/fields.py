"""What every section of the configuration is built from: a field with its help, the stage names."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

__all__ = ["STAGES", "setting"]


#: The curriculum's stages, in order.
STAGES = ("stage1", "stage2", "stage3", "stage4")


def setting(default: Any, help: str) -> Any:
    """A dataclass field with ``default`` (a list or dict copied for each instance) and its
    ``help``, which the CLI and the configuration reference show."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=lambda: copy.deepcopy(default), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help})
