"""A run directory you can trust, from the user's side: ``birdtrain curriculum`` run twice at once,
rerun with other settings, resumed over a damaged checkpoint, and interrupted."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from interrupting import birdtrain, foreground, interrupt_and_resume, wait_for

from birdtrain.cli import main

pytestmark = pytest.mark.long  # conftest.py: started first

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
        birdtrain(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: (run_copy / "stage2").exists() or first.poll() is not None, "stage2 begins"
        )
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
    # A job scheduler signals the command, which runs the round of evaluations in a process of
    # its own (the command knows the round, not which of its evaluations was under way).
    "sigterm-isolated": Interrupt(
        [*EVAL_ONLY, "isolate=true"],
        signal.SIGTERM,
        False,
        "eval/before",
        "the evaluations before",
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
    # The same with the environments in Ray actors (on loopback, in a private network).
    "sigterm-group-stage4-ray": Interrupt(
        [*_rl_only("stage4"), "stage4.vector=ray"],
        signal.SIGTERM,
        True,
        "stage4/trajectories/*-000.parquet",
        "stage4",
    ),
    # An evaluation on PostgreSQL tasks: the workers' sessions hold clones of the project's
    # cluster (which outlives the command by design; the clones must not).
    "sigterm-group-eval-postgres": Interrupt(
        [*EVAL_ONLY, "data.eval_suite=critic-mini-pg"],
        signal.SIGTERM,
        True,
        "eval/before/episodes.partial.jsonl",
        "the evaluation before",
    ),
    # Stage 3 between its steps' sampling and judging: its first step's groups recorded.
    "sigterm-group-stage3": Interrupt(
        _rl_only("stage3"), signal.SIGTERM, True, "stage3/groups.jsonl", "stage3"
    ),
}
# Minutes each (a stage trained twice, an evaluation played twice): in make test-all. The fast
# representative of workers dying of the group's signal is tests/test_vector.py's.
_SLOW = {name for name in INTERRUPTS if name.startswith("sigterm-group-")}
_MARKS = {
    "sigterm-group-stage4-ray": [pytest.mark.private_network],
    "sigterm-group-eval-postgres": [
        pytest.mark.skipif(importlib.util.find_spec("psycopg") is None, reason="no psycopg")
    ],
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            name, marks=[*([pytest.mark.slow] if name in _SLOW else []), *_MARKS.get(name, [])]
        )
        for name in INTERRUPTS
    ],
)
def test_an_interrupt_is_one_line_leaves_no_process_and_resumes(tmp_path: Path, case: str) -> None:
    interrupt = INTERRUPTS[case]
    argv = ["curriculum", "--output-dir", str(tmp_path), *interrupt.argv]
    run = tmp_path / "smoke"
    interrupt_and_resume(
        argv,
        signum=interrupt.signum,
        group=interrupt.group,
        ready=lambda _: any(run.glob(interrupt.marker)),
        what=f"{interrupt.marker} is written",
        during=interrupt.during,
    )
    assert (tmp_path / "smoke" / "summary.json").is_file()


def test_an_interrupt_under_verbose_shows_the_traceback(tmp_path: Path) -> None:
    argv = ["-v", "curriculum", "--output-dir", str(tmp_path), *EVAL_ONLY]
    command = foreground(argv)
    before = tmp_path / "smoke" / "eval" / "before"
    wait_for(lambda: before.exists() or command.poll() is not None, "the evaluation begins")
    assert command.poll() is None, command.communicate()
    os.killpg(command.pid, signal.SIGINT)
    _, err = command.communicate(timeout=300)
    assert command.returncode != 0
    assert "Traceback (most recent call last)" in err and "KeyboardInterrupt" in err
