"""``birdtrain`` installed without its ``train`` extra (``pip install bird-rl``): what a user gets.

Each command runs in a fresh interpreter where the extra's modules cannot be imported (an import
hook raises ``ModuleNotFoundError`` for them, as Python does for a module that is not installed),
so the check holds whatever this machine has installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from birdtrain import EXTRAS

#: The modules of the train extra, made unimportable in the child.
TRAIN_ONLY = sorted(module for module, extra in EXTRAS.items() if extra in ("train", "vllm"))

_CHILD = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from birdtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def birdtrain_without_train_extra(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CHILD.format(blocked=TRAIN_ONLY), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_the_train_extra_names_every_heavy_module() -> None:
    assert {"torch", "transformers", "trl", "duckdb", "yaml"} <= set(TRAIN_ONLY)


def test_reference_policies_evaluate_without_the_train_extra(tmp_path: Path) -> None:
    """oracle, echo and scripted need no model: no torch, no duckdb. Everything but the
    trajectory store (DuckDB's) is written, and stderr says the store was left out and why."""
    for policy, expected in (("oracle", 100.0), ("echo", 0.0), ("scripted", 100.0)):
        out = tmp_path / policy
        argv = ["eval", "--policy", policy, "--suite", "critic-mini", "--limit", "3"]
        done = birdtrain_without_train_extra(*argv, "--out", str(out), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["success_rate"] == expected and summary["n"] == 3
        assert (out / "predictions.jsonl").is_file() and (out / "verdicts.jsonl").is_file()
        assert not (out / "trajectories").exists()
        assert (
            f"[eval {policy}] trajectory store not written: duckdb is not installed; install it "
            "with: pip install 'bird-rl[train]'" in done.stderr
        )


def test_commands_that_need_the_train_extra_say_so_in_one_line(tmp_path: Path) -> None:
    """A model, or training, needs the extra: one line naming it and exit status 2, no
    traceback."""
    for argv in (
        ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path / "runs")],
        ["eval", "--policy", "tiny", "--limit", "1", "--out", str(tmp_path / "tiny")],
    ):
        done = birdtrain_without_train_extra(*argv, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert lines[0].startswith("birdtrain: ") and lines[0].endswith(
            "is not installed; install it with: pip install 'bird-rl[train]'"
        ), (argv, lines)
