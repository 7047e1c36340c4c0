"""Griffe extension: the project's plain-text docstrings, read as Markdown by the API reference.

The docstrings are written for ``help()`` and doctest, not for Markdown: doctest examples become
``pycon`` code blocks, Sphinx roles (``:class:`X```) inline code, and square brackets in prose
(``[--jobs N]``, ``[0, 1]``) are escaped so that Markdown does not read ``[a][b]`` as a reference
link.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_CODE_SPAN = re.compile(r"(`+[^`]*`+)")
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    """A Sphinx cross-reference role as inline code (``~`` keeps the last name only)."""
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def _escape(line: str) -> str:
    if line.startswith("    "):  # an indented literal block: shown as written
        return line
    parts = _CODE_SPAN.split(_ROLE.sub(_role, line))
    return "".join(p if p.startswith("`") else p.replace("[", "\\[") for p in parts)


def markdown_docstring(text: str) -> str:
    r"""Fence doctest blocks, show Sphinx roles as code and escape brackets in the rest.

    >>> markdown_docstring("Bounds [0, 1]:\n>>> f([1])\n[2]").splitlines()
    ['Bounds \\[0, 1]:', '```pycon', '>>> f([1])', '[2]', '```']
    >>> markdown_docstring("See :class:`~birdenv.tasks.Task` and :func:`birdenv.judge.score`.")
    'See `Task` and `birdenv.judge.score`.'
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if stripped.startswith(">>>"):
            indent = len(lines[i]) - len(stripped)
            out.append("```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i][indent:])
                i += 1
            out.append("```")
            continue
        out.append(_escape(lines[i]))
        i += 1
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring once the object tree is built."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Convert ``obj``'s docstring in place."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
