"""A run directory you can trust, from the user's side: ``birdtrain curriculum`` run twice at once,
rerun with other settings, resumed over a damaged checkpoint, and interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from birdtrain.cli import main

#: The smoke preset cut to one optimizer step of stage 1 and no evaluation: a run in seconds.
STAGE1 = [
    "--preset",
    "smoke",
    "stage1.max_steps=1",
    "data.max_train_tasks=2",
    "eval.enabled=false",
    "stage2.enabled=false",
    "stage3.enabled=false",
    "stage4.enabled=false",
]


def _birdtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "birdtrain.cli", *args]


def _session_processes(session: int) -> list[int]:
    """The live processes of a session (the command started in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _foreground(argv: list[str]) -> subprocess.Popen:
    """Start ``birdtrain argv`` as a terminal starts a foreground job: in a process group of its
    own (so that a signal to the group is Ctrl-C), with SIGINT at its default action.

    A process started in the background by a shell without job control (``make test &``)
    inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored; so would the command,
    and Ctrl-C would never reach it. A handled signal is reset to its default on ``exec``:
    SIGINT handled here while the command starts gives it the default a terminal's job has."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            _birdtrain(*argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stage1_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stage1")
    assert main(["curriculum", *STAGE1, "--output-dir", str(out)]) == 0
    return out / "smoke"


@pytest.fixture
def run_copy(stage1_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished stage-1 run, to change."""
    shutil.copytree(stage1_run, tmp_path / "smoke")
    return tmp_path / "smoke"


def test_a_second_writer_exits_2_naming_the_first_while_readers_read(
    run_copy: Path, capsys
) -> None:
    argv = ["curriculum", "--output-dir", str(run_copy.parent), *STAGE1]
    argv += ["stage2.enabled=true", "stage2.max_steps=1"]
    first = subprocess.Popen(
        _birdtrain(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: (run_copy / "stage2").exists() or first.poll() is not None)
        assert first.poll() is None, first.communicate()
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1
        assert f"{run_copy} is being written by pid {first.pid} (" in error
        assert f"(birdtrain curriculum --output-dir {run_copy.parent} --preset smoke" in error
        assert " since " in error
        # Readers work during the run, on what is complete.
        sql = "SELECT count(*) FROM trajectories"
        assert main(["trajectories", str(run_copy), "--sql", sql]) == 0
        assert main(["report", str(run_copy)]) == 0
    finally:
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert json.loads((run_copy / "stage2" / "DONE").read_text())["input"]["sha256"]


def test_a_rerun_with_other_settings_is_refused_and_the_record_kept(run_copy: Path, capsys) -> None:
    argv = ["curriculum", "--output-dir", str(run_copy.parent), *STAGE1]
    recorded = (run_copy / "config.json").read_text()
    assert main([*argv, "seed=7", "stage1.learning_rate=0.5"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "seed: 0 there, 7 here; stage1.learning_rate: 1e-05 there, 0.5 here" in error
    assert "--from stage1" in error
    assert (run_copy / "config.json").read_text() == recorded
    # A key that cannot change a result does not count: the run resumes.
    assert main([*argv, "eval.num_envs=3"]) == 0
    assert "[stage1] already complete" in capsys.readouterr().out
    assert (run_copy / "config.json").read_text() == recorded
    # --from retrains from there, and the record says so.
    stage1_record = json.loads((run_copy / "stage1" / "DONE").read_text())
    assert stage1_record["settings"]["seed"] == 0
    assert stage1_record["input"]["sha256"] is None  # the base model
    assert stage1_record["data_sha256"] and stage1_record["git_commit"] is not None
    assert main(["curriculum", "--from", "stage1", "--output-dir", *argv[2:], "seed=7"]) == 0
    record = json.loads((run_copy / "config.json").read_text())
    assert record["config"]["seed"] == 7
    assert record["history"][-1]["event"] == "redone from stage1"
    assert record["history"][-1]["changed"] == ["seed: 0 there, 7 here"]
    assert {"stage1", "data"} <= set(record["history"][-1]["removed"])
    assert json.loads((run_copy / "stage1" / "DONE").read_text())["settings"]["seed"] == 7


@pytest.mark.parametrize("damaged", ["stage1/checkpoint/model.safetensors", "data/stage1.jsonl"])
def test_a_damaged_file_is_one_line_naming_it_and_the_fix(
    run_copy: Path, damaged: str, capsys
) -> None:
    argv = ["curriculum", "--output-dir", str(run_copy.parent), *STAGE1, "stage2.enabled=true"]
    path = run_copy / damaged
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size // 2)  # a disk that filled, a copy cut short
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith(f"birdtrain: {path} is damaged (")
    assert error.endswith("retrain stage1: rerun the same command with --from stage1\n")
    assert not (run_copy / "stage2").exists()


EVAL_ONLY = [
    "--preset",
    "smoke",
    "eval.after=[]",
    "eval.max_tasks=2",
    "stage1.enabled=false",
    "stage2.enabled=false",
    "stage3.enabled=false",
    "stage4.enabled=false",
]


def _rl_only(stage: str) -> list[str]:
    """The smoke preset's ``stage`` alone (3 or 4: GRPO, multi-turn GRPO), with no evaluation."""
    return [
        "--preset",
        "smoke",
        "eval.enabled=false",
        *(f"{other}.enabled=false" for other in ("stage1", "stage2", "stage3", "stage4")),
        f"{stage}.enabled=true",
    ]


class Interrupt:
    """Who signals what, when: ``signum`` to the command or (``group``) to its whole process
    group, as ``timeout``, Slurm, systemd and Kubernetes do, once ``marker`` (a glob under the
    run directory) exists, which names work that is under way then, ``during``."""

    def __init__(self, argv: list[str], signum: int, group: bool, marker: str, during: str) -> None:
        self.argv, self.signum, self.group = argv, signum, group
        self.marker, self.during = marker, during


INTERRUPTS = {
    # Ctrl-C: the terminal signals the whole process group (the env workers ignore SIGINT).
    "ctrl-c": Interrupt(EVAL_ONLY, signal.SIGINT, True, "eval/before", "the evaluation before"),
    # A job scheduler signals the command, which runs the evaluation in a process of its own.
    "sigterm-isolated": Interrupt(
        [*EVAL_ONLY, "isolate=true"],
        signal.SIGTERM,
        False,
        "eval/before",
        "the evaluation before",
    ),
    # timeout(1), Slurm, systemd: SIGTERM to the group; the evaluation's async env workers die
    # of it at once, and their broken pipes must not become the parent's traceback.
    "sigterm-group-eval": Interrupt(
        EVAL_ONLY,
        signal.SIGTERM,
        True,
        "eval/before/episodes.partial.jsonl",  # its episodes under way
        "the evaluation before",
    ),
    # The same in stage 4, as its rollouts go on: the first batch stored, the second begun.
    "sigterm-group-stage4": Interrupt(
        _rl_only("stage4"), signal.SIGTERM, True, "stage4/trajectories/*-000.parquet", "stage4"
    ),
    # Stage 3 between its steps' sampling and judging: its first step's groups recorded.
    "sigterm-group-stage3": Interrupt(
        _rl_only("stage3"), signal.SIGTERM, True, "stage3/groups.jsonl", "stage3"
    ),
}
# Minutes each (a stage trained twice, an evaluation played twice): in make test-all. The fast
# representative of workers dying of the group's signal is tests/test_vector.py's.
_SLOW = {"sigterm-group-eval", "sigterm-group-stage4", "sigterm-group-stage3"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=[pytest.mark.slow] if name in _SLOW else []) for name in INTERRUPTS],
)
def test_an_interrupt_is_one_line_leaves_no_process_and_resumes(tmp_path: Path, case: str) -> None:
    interrupt = INTERRUPTS[case]
    argv = ["curriculum", "--output-dir", str(tmp_path), *interrupt.argv]
    run = tmp_path / "smoke"
    command = _foreground(argv)
    _wait_for(lambda: any(run.glob(interrupt.marker)) or command.poll() is not None)
    assert command.poll() is None, command.communicate()
    if interrupt.group:
        os.killpg(command.pid, interrupt.signum)
    else:
        command.send_signal(interrupt.signum)
    _, err = command.communicate(timeout=300)
    assert command.returncode == 128 + interrupt.signum, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    name = signal.Signals(interrupt.signum).name
    assert last.startswith(f"birdtrain: interrupted by {name} during {interrupt.during}; "), err
    assert last.endswith("run the same command to resume")
    _no_process_left(command.pid)
    # The same command resumes and completes.
    done = subprocess.run(_birdtrain(*argv), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (run / "summary.json").is_file()


def _no_process_left(session: int) -> None:
    """No process of the command's session outlives it. The command joins every process it
    started before it exits, so none should remain at all; a process still ending (one the
    command's signal reached but the system has not finished) gets time to, bounded generously
    since only a hang, not a slow machine, must fail here."""
    try:
        _wait_for(lambda: not _session_processes(session), timeout=120)
    except AssertionError:
        left = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _session_processes(session)
        }
        raise AssertionError(f"processes left 120 s after the command exited: {left}") from None


def test_an_interrupt_under_verbose_shows_the_traceback(tmp_path: Path) -> None:
    argv = ["-v", "curriculum", "--output-dir", str(tmp_path), *EVAL_ONLY]
    command = _foreground(argv)
    before = tmp_path / "smoke" / "eval" / "before"
    _wait_for(lambda: before.exists() or command.poll() is not None)
    assert command.poll() is None, command.communicate()
    os.killpg(command.pid, signal.SIGINT)
    _, err = command.communicate(timeout=300)
    assert command.returncode != 0
    assert "Traceback (most recent call last)" in err and "KeyboardInterrupt" in err
