"""The examples run as a user runs them, and print what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_trl_environment_factory_prints_its_losses_and_rewards(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="the example needs the train extra")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_environment_factory.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, done.stdout[-3000:]
    for number, line in enumerate(steps, start=1):
        assert re.fullmatch(rf"step {number}: loss -?\d+\.\d{{4}}, reward -?\d+\.\d{{3}}", line)
