"""Reading settings into the configuration: YAML files and ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from birdtrain import require

__all__ = ["merge", "merge_file", "parse_value"]


def merge(target: Any, values: dict[str, Any], where: str) -> None:
    """Set dataclass fields from a nested dict; unknown keys raise and list the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"unknown key {where}{key!r}; valid keys: {', '.join(fields)}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"{where}{key} must be a mapping")
            merge(current, value, f"{where}{key}.")
        else:
            if (
                isinstance(current, float)
                and isinstance(value, (int, str))
                and not isinstance(value, bool)
            ):
                # YAML 1.1 reads "1e-6" as a string; the field says it is a number.
                try:
                    value = float(value)
                except ValueError:
                    raise ValueError(f"{where}{key} must be a number, got {value!r}") from None
            setattr(target, key, value)
    if hasattr(target, "__post_init__"):
        target.__post_init__()


def parse_value(text: str) -> Any:
    yaml = require("yaml")

    return yaml.safe_load(text)


def _read_yaml(path: Path) -> Any:
    """The YAML document of a configuration file; a ``ValueError`` naming the file, line and
    column when it cannot be read."""
    yaml = require("yaml")

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the configuration ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason}): save it as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML ({problem})") from None


def merge_file(config: Any, path: Path) -> None:
    """Set the fields of ``config`` (a configuration dataclass) from the YAML file at ``path`` (a
    preset or a ``--config`` file)."""
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    merge(config, data, "")
