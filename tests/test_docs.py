"""The documentation's examples run: every ```python block of README.md and docs/*.md.

A page's blocks run in order in one namespace, as a reader would paste them, in a fresh working
directory. A block that cannot run here (it needs the official data set, a GPU, a cluster) is
marked by an HTML comment on the line before it: ``<!-- not run: the reason -->``. Commands and
output are in ```bash / ```text blocks, which are not run.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*\S[^>]*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ``python`` blocks of a Markdown text meant to run, as (first line number, code)."""
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if _NOT_RUN.search(before):
            continue
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(2)))
    return blocks


def test_blocks_are_found_and_not_run_marks_are_honoured() -> None:
    text = "x\n```python\na = 1\n```\n<!-- not run: needs data -->\n```python\nb\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n")]


PAGES = [
    page
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if python_blocks(page.read_text())
]


def test_the_front_page_has_examples_that_run() -> None:
    assert ROOT / "README.md" in PAGES


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(page.read_text())
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, code in blocks:
        # The file:line name puts a failing block's place in the traceback.
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)


def test_docs_hooks_doctests() -> None:
    """The helpers that render the API reference (docs/hooks/) keep their examples true."""
    pytest.importorskip("griffe", reason="the docs tools come with the dev extra")
    for path in sorted((ROOT / "docs" / "hooks").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"docs_hooks_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, path.name


def test_no_tracked_file_names_a_path_of_one_machine() -> None:
    """Docs, benchmarks and code name no folder of the machine they were written on."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    pattern = r"(^|[ `\"(=])/(work|root)/|/tmp/[A-Za-z0-9_.-]+\.py"
    found = subprocess.run(
        ["git", "grep", "-nE", pattern, "--", ".", ":!tests/test_docs.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 1, found.stdout[:2000]  # 1: no match
