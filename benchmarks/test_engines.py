"""The evaluation engines side by side: ``birdtrain eval`` on critic-mini with SmolLM2-135M under
``--engine vllm`` and ``--engine transformers``, in agent and single mode, both in bfloat16.

Each measurement is a whole ``birdtrain eval`` command as a user runs it (start-up, the engine's
start, generation, the environment and the judge); the summary's time split gives generation
alone. The engines alternate in one run, so a load from elsewhere on the machine falls on both.
Needs vLLM (on a CPU, the ``.venv-vllm`` environment ``make install-vllm`` builds):
``.venv-vllm/bin/python -m pytest benchmarks/test_engines.py --benchmark-only -m slow -s``;
figures in benchmarks/README.md ("Evaluation engines").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra (on a CPU: make install-vllm)")

# Minutes each on a 2-core CPU: outside the default benchmark set.
pytestmark = pytest.mark.slow

TASKS = 4
#: Seconds each command took, by (mode, engine), for the ratio printed at the end.
SECONDS: dict[tuple[str, str], dict[str, float]] = {}


@pytest.mark.parametrize("mode", ["agent", "single"])
@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_eval_engine(benchmark, tmp_path: Path, mode: str, engine: str) -> None:
    cmd = [
        *(sys.executable, "-m", "birdtrain.cli", "eval", "--policy", "smollm"),
        *("--suite", "critic-mini", "--limit", str(TASKS), "--mode", mode),
        *("--engine", engine, "--dtype", "bfloat16", "--enforce-eager"),
        *("--max-turns", "3", "--max-new-tokens", "128", "--num-envs", "4"),
        *("--max-context", "8192", "--out", str(tmp_path)),
    ]

    def run() -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    start = time.perf_counter()
    benchmark.pedantic(run, rounds=1, iterations=1)
    wall = time.perf_counter() - start
    split = json.loads((tmp_path / "summary.json").read_text())["time_split"]
    SECONDS[(mode, engine)] = {"wall": wall, "generation": split["generation_s"]}
    benchmark.extra_info.update(SECONDS[(mode, engine)])
    other = SECONDS.get((mode, "vllm" if engine == "transformers" else "transformers"))
    if other is not None:
        vllm, transformers = (
            (other, SECONDS[(mode, engine)])
            if engine == "transformers"
            else (SECONDS[(mode, engine)], other)
        )
        print(
            f"\n{mode}: transformers / vllm = {transformers['wall'] / vllm['wall']:.2f} (wall), "
            f"{transformers['generation'] / vllm['generation']:.2f} (generation); "
            f"vllm {vllm['wall']:.0f} s ({vllm['generation']:.0f} s generating), "
            f"transformers {transformers['wall']:.0f} s ({transformers['generation']:.0f} s)"
        )
