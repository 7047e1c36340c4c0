"""MkDocs hook: the configuration reference, rendered from the config dataclasses' help strings.

Each field of :class:`birdtrain.config.CurriculumConfig` carries its help in
``metadata={"help": ...}``; the page ``configuration.md`` holds the marker below, and this hook
replaces it with one table per section at build time, so the help is written once, in the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

MARKER = "<!-- config-reference -->"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return ""
    return f"`{_cell(json.dumps(value, default=str))}`"


def _table(instance: Any, prefix: str) -> list[str]:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            continue
        help_text = field.metadata.get("help")
        if not help_text:
            raise ValueError(f"config field {prefix}{field.name} has no help text")
        rows.append(f"| `{prefix}{field.name}` | {_default(value)} | {_cell(help_text)} |")
    return rows


def render() -> str:
    """The reference: top-level keys, then one section per nested config (``model``, ``stage3``...)."""
    from birdtrain.config import CurriculumConfig

    config = CurriculumConfig()
    lines = ["## Run", "", *_table(config, ""), ""]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not dataclasses.is_dataclass(value):
            continue
        # The class docstring's first paragraph introduces the section.
        doc = " ".join(inspect.cleandoc(type(value).__doc__ or "").split("\n\n")[0].split())
        lines += [f"## `{field.name}`", "", doc, "", *_table(value, f"{field.name}."), ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker in the configuration page with the rendered tables."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
