"""Crash consistency, in the spirit of SQLite's tests: the smoke curriculum is killed (SIGKILL, the
whole process group, as a machine that goes away) at seeded random moments and resumed each time;
the run it ends with equals an uninterrupted run with the same seed. Also a disk that fills during
a checkpoint's write (a real one: a small tmpfs in a private mount namespace), and two writers.

The slow form (``-m slow``) kills every stage's run 20 times, and signals it 12 times with SIGTERM
and SIGINT as a scheduler or a terminal does; ``make test`` kills a run of stage 4 alone (it writes
the trajectory store) twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from birdtrain.trajectory_store import TrajectoryStore
from tests.interrupting import (
    HANG,
    birdtrain,
    catches,
    foreground,
    no_process_left,
    session_processes,
    wait_for,
)

#: The smoke preset, every stage, cut to a few steps, and one evaluation of the final model.
FULL = [
    "--preset",
    "smoke",
    "data.max_train_tasks=2",
    "stage1.max_steps=1",
    "stage2.max_steps=2",
    "stage3.max_steps=1",
    "stage4.max_steps=2",
    "eval.before=false",
    "eval.after=[stage4]",
    "eval.max_tasks=2",
]
#: Stages 1 and 4 (stage 4 writes the trajectory store) and the evaluation of the final model.
TWO_STAGES = [*FULL, "stage2.enabled=false", "stage3.enabled=false"]
#: Shortest, for ``make test``: stage 4 from the base model, and its evaluation.
SHORT = [*TWO_STAGES, "stage1.enabled=false"]


def _argv(out: Path, config: list[str]) -> list[str]:
    return ["curriculum", "--output-dir", str(out), *config]


def _command(out: Path, config: list[str]) -> list[str]:
    return birdtrain(*_argv(out, config))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _session_alive(session: int) -> bool:
    return bool(session_processes(session))


def _run(out: Path, config: list[str], kill_after: float | None = None) -> int | None:
    """Run the curriculum; with ``kill_after``, SIGKILL its process group after that many seconds
    (None returned) unless it ended first (its exit status)."""
    log = (out / "log.txt").open("a")
    process = subprocess.Popen(
        _command(out, config), stdout=log, stderr=log, start_new_session=True, env=_env()
    )
    try:
        return process.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 30
        while _session_alive(process.pid):  # the kernel reaps the group's other processes
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return None
    finally:
        log.close()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint(run: Path) -> dict:
    """What a finished run must hold, whatever interrupted it: the data, each stage's weights and
    the tasks it drew from, each evaluation's verdicts, and the trajectory store's rows (without
    their random episode ids and wall-clock times), counted."""
    found: dict = {}
    for path in sorted((run / "data").glob("*.jsonl")):
        found[str(path.relative_to(run))] = _sha(path)
    for done in sorted(run.glob("stage*/DONE")):
        record = json.loads(done.read_text())
        stage = done.parent.name
        found[f"{stage}/weights"] = _sha(done.parent / "checkpoint" / "model.safetensors")
        found[f"{stage}/data"] = record["data_sha256"]
    for verdicts in sorted(run.glob("eval/*/verdicts.jsonl")):
        rows = [json.loads(line) for line in verdicts.read_text().splitlines()]
        found[str(verdicts.relative_to(run))] = sorted(
            (row["instance_id"], row.get("status")) for row in rows
        )
    rows = TrajectoryStore(run).query(
        "SELECT stage, step, task_id, turn, action, observation, verdict, reward, count(*) "
        "FROM trajectories GROUP BY ALL ORDER BY ALL"
    )
    found["store"] = [list(row) for row in rows]
    found["store episodes by step"] = TrajectoryStore(run).query(
        "SELECT stage, step, count(DISTINCT episode) FROM trajectories GROUP BY ALL ORDER BY ALL"
    )
    return found


def _reference(out: Path, config: list[str]) -> tuple[dict, float]:
    """An uninterrupted run: its fingerprint and wall time."""
    started = time.monotonic()
    assert _run(out, config) == 0, (out / "log.txt").read_text()
    return fingerprint(out / "smoke"), time.monotonic() - started


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    return _reference(tmp_path_factory.mktemp("reference-short"), SHORT)


@pytest.fixture(scope="module")
def two_stage_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    return _reference(tmp_path_factory.mktemp("reference-two"), TWO_STAGES)


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    return _reference(tmp_path_factory.mktemp("reference-full"), FULL)


def _kill_and_resume(
    root: Path, config: list[str], kills: int, seconds: float, seed: int
) -> list[tuple[Path, list]]:
    """Kill runs ``kills`` times in all at seeded random moments, resuming each time, and let
    each run finish; return each run's directory and its attempts (the moment, the exit status,
    None when killed, and the stages complete after it).

    The i-th attempt of a run is killed within the first (i + 1) / ``kills`` of an uninterrupted
    run's ``seconds``: a resumed run starts again from its last complete stage, so moments drawn
    over the whole run would all land in its last stages. An attempt that ends before its kill
    has finished the run: the next kills go to a new run.
    """
    rng = random.Random(seed)
    runs: list[tuple[Path, list]] = []
    landed = 0
    while landed < kills:
        out = root / f"run{len(runs)}"
        out.mkdir()
        attempts: list = []
        while landed < kills:
            moment = rng.uniform(0.5, seconds * min(1.0, (len(attempts) + 1) / kills))
            outcome = _run(out, config, kill_after=moment)
            done = ",".join(sorted(p.parent.name for p in (out / "smoke").glob("stage*/DONE")))
            attempts.append((round(moment, 1), outcome, done))
            if outcome is not None:
                break
            landed += 1
        if attempts[-1][1] is None:
            assert _run(out, config) == 0, (out / "log.txt").read_text()[-3000:]
        runs.append((out / "smoke", attempts))
    return runs


def _recorded_size(part: Path) -> int:
    """The size the manifest of ``part``'s folder recorded for it."""
    manifest = json.loads((part.parent / "MANIFEST.json").read_text())["files"]
    return manifest[part.name]["size"]


def _check_against(reference: dict, run: Path) -> None:
    found = fingerprint(run)
    assert found.keys() == reference.keys()
    for key in reference:
        assert found[key] == reference[key], key
    # No half-written checkpoint, part or record is left behind.
    assert not list(run.rglob(".checkpoint.partial")) and not list(run.rglob("*.tmp"))


def test_killed_at_random_moments_it_resumes_to_the_same_run(
    short_reference: tuple[dict, float], tmp_path: Path
) -> None:
    expected, seconds = short_reference
    runs = _kill_and_resume(tmp_path, SHORT, kills=2, seconds=seconds, seed=1)
    for run, _ in runs:
        _check_against(expected, run)
    # A part of the store cut short afterwards is found on the next resume, and named.
    part = sorted((run / "stage4" / "trajectories").glob("*.parquet"))[0]
    with part.open("r+b") as fh:
        fh.truncate(10)
    again = subprocess.run(_command(run.parent, SHORT), capture_output=True, text=True, env=_env())
    assert again.returncode == 2, again.stderr
    assert "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"birdtrain: {part} is damaged (10 bytes, {_recorded_size(part)} when written); "
        "retrain stage4: rerun the same command with --from stage4"
    )


@pytest.mark.slow
def test_killed_20_times_it_resumes_to_the_same_run(
    full_reference: tuple[dict, float], tmp_path: Path
) -> None:
    expected, seconds = full_reference
    runs = _kill_and_resume(tmp_path, FULL, kills=20, seconds=seconds, seed=20)
    for run, attempts in runs:
        print(f"{run}: kill moments (s), exit status (None: killed), stages complete after:")
        print(attempts)
        _check_against(expected, run)


def _signalled(out: Path, config: list[str], signum: int, after: float) -> int:
    """Run the curriculum; ``after`` seconds once it handles ``signum`` (its handler installed, as
    the command's first act, before its modules load), send ``signum`` to its whole process
    group, as ``timeout``, Slurm and Ctrl-C do, unless it ended first. Returns its exit status,
    after checking that a signalled run ended in one line saying what it interrupted and that the
    same command resumes, with no traceback and no process left."""
    err_file = out / "err.txt"
    with (out / "log.txt").open("a") as log, err_file.open("w") as err:
        # A terminal's job, its SIGINT at the default: a run in the background inherits Ctrl-C
        # ignored, and the SIGINT attempts would never land.
        command = foreground(_argv(out, config), _env(), stdout=log, stderr=err)
        wait_for(
            lambda: catches(command.pid, signum) or command.poll() is not None,
            "the command handles the signal",
        )
        try:
            return command.wait(timeout=after)
        except subprocess.TimeoutExpired:
            os.killpg(command.pid, signum)
        status = command.wait(timeout=HANG)
    error = err_file.read_text()
    if status == 0:  # it finished as the signal came
        return status
    assert status == 128 + signum, error[-3000:]
    assert "Traceback" not in error, error[-3000:]
    last = error.strip().splitlines()[-1]
    # Its handler is in place while its modules load too: a signal then has nothing to resume.
    assert re.fullmatch(
        rf"birdtrain: interrupted by {signal.Signals(signum).name} (during .+; "
        r".*run the same command to resume|while starting, before doing anything; run the same "
        r"command again)",
        last,
    ), last
    no_process_left(command.pid)
    return status


@pytest.mark.slow
def test_signalled_at_random_moments_each_ends_in_one_line_and_resumes_to_the_same_run(
    full_reference: tuple[dict, float], tmp_path: Path
) -> None:
    """SIGTERM and SIGINT in turn to the process group, at seeded random moments of every stage
    and evaluation; each attempt is checked by :func:`_signalled`, and each run, resumed by the
    same command, ends as the uninterrupted run did."""
    expected, seconds = full_reference
    rng = random.Random(12)
    signals, landed, runs = 12, 0, []
    while landed < signals:
        out = tmp_path / f"run{len(runs)}"
        out.mkdir()
        attempts: list = []
        while landed < signals:
            signum = (signal.SIGTERM, signal.SIGINT)[landed % 2]
            moment = rng.uniform(0.0, seconds * min(1.0, (len(attempts) + 1) / signals))
            status = _signalled(out, FULL, signum, moment)
            attempts.append((signal.Signals(signum).name, round(moment, 1), status))
            if status == 0:
                break
            landed += 1
        if attempts[-1][2] != 0:
            assert _run(out, FULL) == 0, (out / "log.txt").read_text()[-3000:]
        print(f"{out}: signal, moment after its handler (s), exit status:", attempts)
        runs.append(out / "smoke")
    for run in runs:
        _check_against(expected, run)


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no private mount namespace for a tmpfs")
def test_a_disk_that_fills_during_a_checkpoint_write(
    two_stage_reference: tuple[dict, float], tmp_path: Path
) -> None:
    """The run directory on a 3 MB tmpfs: stage 1's checkpoint (2.2 MB) fits, stage 4's does not.
    The run ends in one line; nothing half-written is taken for done; with room made, the same
    command resumes to the uninterrupted run."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    command = " ".join(f"'{arg}'" for arg in _command(disk, TWO_STAGES))
    script = (
        f"mount -t tmpfs -o size=3m none {disk} && "
        f"{{ {command} > {tmp_path}/full.out 2> {tmp_path}/full.err; echo $? > {tmp_path}/rc1; }}"
        f" && cp -a {disk}/smoke {tmp_path}/at-full && "
        f"mount -o remount,size=200m none {disk} && "
        f"{{ {command} > {tmp_path}/resumed.out 2>&1; echo $? > {tmp_path}/rc2; }}"
        f" && cp -a {disk}/smoke {kept}"
    )
    subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], check=True, env=_env())
    error = (tmp_path / "full.err").read_text().strip().splitlines()
    assert (tmp_path / "rc1").read_text().strip() == "2", error
    assert error[-1].startswith("birdtrain: cannot write ")
    assert "No space left on device" in error[-1]
    assert error[-1].endswith("make room and run the same command to resume")
    assert "Traceback" not in "\n".join(error)
    at_full = tmp_path / "at-full"
    assert (at_full / "stage1" / "DONE").is_file()
    assert not (at_full / "stage4" / "DONE").exists()
    assert not (at_full / "stage4" / "checkpoint").exists()
    assert (tmp_path / "rc2").read_text().strip() == "0", (tmp_path / "resumed.out").read_text()
    _check_against(two_stage_reference[0], kept)
