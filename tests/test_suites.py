"""The bundled suites: built on first use, verified by hash, and valid 100 %."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from birdenv import load_tasks, suites
from birdenv.cli import main


@pytest.fixture(scope="module")
def both() -> dict:
    return {name: load_tasks(name) for name in suites.names()}


def test_sizes_categories_and_disjointness(both: dict) -> None:
    gym, critic = both["gym-mini"], both["critic-mini"]
    assert len(gym) >= 140 and len(critic) >= 60
    assert not {t.instance_id for t in gym} & {t.instance_id for t in critic}
    assert not {tuple(t.issue_sql) for t in gym} & {tuple(t.issue_sql) for t in critic}
    counts = Counter(t.category for t in gym + critic)
    total = sum(counts.values())
    assert 0.45 <= counts["Query"] / total <= 0.65
    assert 0.10 <= counts["Management"] / total <= 0.25
    assert 0.20 <= counts["Personalization"] / total <= 0.35
    databases = {t.db_id for t in gym + critic}
    assert len(databases) >= 6
    sizes = [t.db_path.stat().st_size for t in critic]
    assert max(sizes) >= 100e6


def test_the_postgresql_suites_sizes_categories_and_disjointness(both: dict) -> None:
    gym, critic = both["gym-mini-pg"], both["critic-mini-pg"]
    assert len(gym) >= 80 and len(critic) >= 40
    assert not {t.instance_id for t in gym} & {t.instance_id for t in critic}
    assert not {tuple(t.issue_sql) for t in gym} & {tuple(t.issue_sql) for t in critic}
    assert {t.dialect for t in gym + critic} == {"postgresql"}
    assert {t.to_dict()["dialect"] for t in gym + critic} == {"PostgreSQL"}
    for tasks in (gym, critic):
        counts = Counter(t.category for t in tasks)
        assert counts["Management"] / len(tasks) >= 0.10, counts
        assert counts["Personalization"] / len(tasks) >= 0.15, counts
        # DDL, triggers and functions are written for every database, not for one of them
        beyond_query = {t.db_id for t in tasks if t.category != "Query"}
        assert len(beyond_query) == 6, beyond_query


@pytest.mark.parametrize(
    "suite",
    # The PostgreSQL suites take minutes (a clone per judgement): tests/test_postgres_env.py
    # validates their own-feature tasks in the default run.
    [pytest.param(s, marks=pytest.mark.slow) if s.endswith("-pg") else s for s in suites.names()],
)
def test_every_gold_passes_and_every_issue_fails(suite: str) -> None:
    assert main(["data", "validate", "--suite", suite, "--jobs", "2"]) == 0


def test_a_corrupted_database_is_rebuilt(tmp_path, monkeypatch, both: dict) -> None:
    import shutil

    source = suites.home()
    monkeypatch.setenv("BIRDENV_HOME", str(tmp_path))
    shutil.copytree(source / f"suites-v{suites.FORMAT}", tmp_path / f"suites-v{suites.FORMAT}")
    suite = suites.ensure("critic-mini")
    victim = min(suite.db_dir.glob("*/*_template.sqlite"), key=lambda p: p.stat().st_size)
    good = suites.file_sha256(victim)
    victim.chmod(0o644)
    with victim.open("r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 64)
    suites.ensure("critic-mini", verify=True)
    assert suites.file_sha256(victim) == good


def test_test_runs_keep_out_of_the_users_cache() -> None:
    # The root conftest points every cache left to its default into the temporary directory;
    # worker processes and command-line runs inherit it.
    user_cache = (Path.home() / ".cache").resolve()
    for variable in ("BIRDENV_HOME", "HF_HOME", "XDG_CACHE_HOME"):
        assert not Path(os.environ[variable]).resolve().is_relative_to(user_cache), variable
    code = "from birdenv import suites; print(suites.home())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(suites.home()) == os.environ["BIRDENV_HOME"]
