"""The GPU check's device mode (``benchmarks/gpu_smoke.sh --device``) on this CPU.

The dry run is the device mode's own driver and checks with a tiny model of the same architecture;
``make test`` runs it in the ``.venv-vllm`` lane, whose transformers (5.17) and TRL (1.16) are the
device image's. The check of the carried wheels' requirements runs on wheels made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_smoke_device import BUDGET_S, DRY_RUN_SLACK, carried_wheels  # noqa: E402

pytestmark = pytest.mark.long  # conftest.py: started first


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel holding only its METADATA (what the check reads)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    header = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    header += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as archive:
        text = "\n".join(header) + "\n\nRequires-Dist: in-the-description 1.0\n"
        archive.writestr(f"{name}-{version}.dist-info/METADATA", text)
    return path


@pytest.mark.stack
def test_carried_wheels_name_every_unmet_requirement(tmp_path: Path) -> None:
    """A requirement missing, one out of its bounds and a carried version shadowed by another are
    each named; a requirement behind a marker that does not hold here, and text below the
    header, are not requirements."""
    import numpy
    import pytest as installed

    _wheel(
        tmp_path,
        "pytest",
        installed.__version__,
        f"numpy>={numpy.__version__}",
        "numpy<1; python_version < '3'",
        "no-such-distribution-here>=1",
        "tomli; extra == 'toml'",
    )
    _wheel(tmp_path, "numpy", "0.1", "pytest<1")
    carried, problems = carried_wheels(tmp_path)
    assert carried == {"pytest": installed.__version__, "numpy": "0.1"}
    assert sorted(problems) == sorted(
        [
            f"numpy 0.1 carried, {numpy.__version__} imported",
            f"numpy needs pytest<1: {installed.__version__} here",
            "pytest needs no-such-distribution-here>=1: missing",
        ]
    )


@pytest.mark.stack
def test_carried_wheels_met_by_what_is_installed(tmp_path: Path) -> None:
    import numpy

    _wheel(tmp_path, "numpy", numpy.__version__)
    assert carried_wheels(tmp_path) == ({"numpy": numpy.__version__}, [])


@pytest.mark.device
def test_the_device_mode_dry_run_passes(tmp_path: Path) -> None:
    """``gpu_smoke.sh --device --dry-run OUT``: every check passes or (install, the memory
    figures) skips, one line each; the summary and the logs are in OUT, the scratch folder is
    gone; stage 3 trained on completions of the configured length and both stages' rewards
    varied within each group; the tokens/s figures are there."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_smoke.sh"), "--device", "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=env,
        # the dry run's own budget, and time to end its last process and write its summary
        timeout=BUDGET_S * DRY_RUN_SLACK + 300,
    )
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*.log")}
    assert proc.returncode == 0, proc.stdout + proc.stderr + json.dumps(logs, indent=1)
    lines = [x for x in proc.stdout.splitlines() if x.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert [x.split(":")[0] for x in lines] == [
        "SKIP install",
        "PASS environment",
        "PASS birdtrain plan",
        "PASS stage 3, one step, completions of the paper's length",
        "SKIP stage 3 peak GPU memory within the plan",
        "PASS stage 3, two steps sampled by TransformersPolicy",
        "PASS LoRA, gradient checkpointing, frozen base bit-identical",
        "PASS stage 4, two steps of multi-turn rollouts in async env workers",
        "SKIP stage 4 peak GPU memory within the plan",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["mode"] == "dry-run"
    assert (out / "checks.txt").read_text().splitlines() == lines
    assert sorted(p.name for p in out.iterdir()) == ["chained.log", "checks.txt", "summary.json"]
    scratch = Path(proc.stdout.split("scratch: ")[1].split()[0])
    assert not scratch.exists()
    results = summary["results"]
    # the dry run's completions (benchmarks/gpu_smoke_device.py DRY_RUN), all of full length
    assert results["stage3_peak"]["completion_length"] == 600
    assert results["stage3_peak"]["plan"]["fits"]
    for check in ("stage3_peak", "stage3_speed", "stage4"):
        assert all(std > 0 for std in results[check]["reward_std"]), check
    speed = results["stage3_speed"]
    assert speed["sampler"] == "TransformersPolicy" and speed["planted"] == 2 * 1
    assert speed["sampling_tokens_per_s"] > 0 and speed["training_tokens_per_s"] > 0
    # each step: the planted rollout submits at its first turn, the sampled one plays both
    assert results["stage4"]["turns"] == [1.5, 1.5] and results["stage4"]["planted"] == 2
    assert results["stage4"]["checkpoint_parameters"] == results["prepare"]["parameters"]
