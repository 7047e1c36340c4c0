"""The run directory's mechanisms on their own: the one-writer lock, the settings rule, verified
folders and the words of an interrupt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from interrupting import HANG

from birdenv.errors import DirectoryBusyError
from birdenv.files import LOCK_FILE, directory_lock
from birdenv.interrupts import Terminated, interrupted_status
from birdtrain.config import STAGES
from birdtrain.errors import DamagedFileError
from birdtrain.rundir import (
    MANIFEST,
    NO_EFFECT,
    command_line,
    commit_folder,
    first_changed,
    folder_hash,
    hold,
    interrupted_message,
    settings_differ,
    verify_folder,
    working_on,
)

HOLDER = textwrap.dedent(
    """
    import sys, time
    from birdenv.files import directory_lock
    with directory_lock(sys.argv[1], "holder-command"):
        print("held", flush=True)
        time.sleep(60)
    """
)


def _start_holder(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(DirectoryBusyError) as caught, directory_lock(tmp_path):
            pass
        message = str(caught.value)
        assert f"pid {holder.pid} (holder-command) since " in message
        assert str(tmp_path) in message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lock_is_taken_over_and_said(tmp_path: Path, capsys) -> None:
    holder = _start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with hold(tmp_path) as held:
        assert held == tmp_path
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["command"] == command_line()
    out = capsys.readouterr().out
    assert f"taking over from pid {holder.pid} (holder-command)" in out
    # Released in order: the next holder has no one to take over from.
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with hold(tmp_path):
        pass
    assert "taking over" not in capsys.readouterr().out


def test_settings_differ_names_each_key_with_both_values() -> None:
    recorded = {"seed": 0, "stage1": {"learning_rate": 1e-5, "save_steps": 0}, "eval": {"n": 1}}
    current = {
        "seed": 7,
        "stage1": {"learning_rate": 0.5, "save_steps": 5},
        "eval": {"n": 1},
        "new": 1,
    }
    differ = settings_differ(recorded, current, ignore=NO_EFFECT)
    assert differ == ["seed: 0 there, 7 here", "stage1.learning_rate: 1e-05 there, 0.5 here"]
    assert settings_differ({"after": ("a",)}, {"after": ["a"]}) == []


def test_first_changed_is_the_earliest_stage_a_key_touches() -> None:
    line = "{}: 1 there, 2 here"
    assert first_changed([line.format("stage3.beta"), line.format("stage4.beta")], STAGES) == (
        "stage3"
    )
    assert first_changed([line.format("seed")], STAGES) == "stage1"
    assert first_changed([line.format("data.max_train_tasks")], STAGES) == "stage1"
    assert first_changed([line.format("eval.max_tasks")], STAGES) == "eval"


def _committed(tmp_path: Path) -> Path:
    staging = tmp_path / ".checkpoint.partial"
    (staging / "sub").mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"w" * 1000)
    (staging / "sub" / "config.json").write_text("{}")
    final = commit_folder(staging, tmp_path / "checkpoint")
    assert not staging.exists() and (final / MANIFEST).is_file()
    return final


def test_a_committed_folder_is_verified_by_size(tmp_path: Path) -> None:
    final = _committed(tmp_path)
    verify_folder(final, fix="retrain it")
    before = folder_hash(final)
    with (final / "model.safetensors").open("r+b") as fh:
        fh.truncate(10)
    with pytest.raises(DamagedFileError) as caught:
        verify_folder(final, fix="retrain it with --from stage2")
    assert str(caught.value) == (
        f"{final / 'model.safetensors'} is damaged (10 bytes, 1000 when written); "
        "retrain it with --from stage2"
    )
    (final / "model.safetensors").write_bytes(b"w" * 1000)
    (final / "sub" / "config.json").unlink()
    with pytest.raises(DamagedFileError, match=r"sub/config.json is missing; x"):
        verify_folder(final, fix="x")
    assert folder_hash(final) == before  # the manifest names what was written


def test_a_changed_byte_is_found_on_first_use_in_a_process(tmp_path: Path) -> None:
    final = _committed(tmp_path)
    with (final / "model.safetensors").open("r+b") as fh:
        fh.write(b"X")  # same size
    check = (
        "import sys; from pathlib import Path; from birdtrain.rundir import verify_folder; "
        "verify_folder(Path(sys.argv[1]), fix='retrain')"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(final)], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "model.safetensors is damaged (its content changed); retrain" in result.stderr


def test_an_interrupt_says_what_it_interrupted_and_how_to_resume(tmp_path: Path) -> None:
    assert interrupted_status(KeyboardInterrupt()) == 130
    assert interrupted_status(Terminated()) == 143
    (tmp_path / "stage1").mkdir()
    (tmp_path / "stage1" / "DONE").write_text("{}")
    (tmp_path / "eval" / "before").mkdir(parents=True)
    (tmp_path / "eval" / "before" / "summary.json").write_text("{}")
    with (
        pytest.raises(Terminated) as caught,
        working_on(tmp_path, "the run"),
        working_on(tmp_path, "stage2"),
    ):
        raise Terminated()
    assert interrupted_message(caught.value) == (
        f"interrupted by SIGTERM during stage2; {tmp_path} keeps its complete stages (stage1) "
        "and its complete evaluations (before); run the same command to resume"
    )
    assert interrupted_message(KeyboardInterrupt()) == "interrupted by SIGINT"


AFTER_AN_INTERRUPT = """
import os, signal
from pathlib import Path
from birdenv.interrupts import interrupt_behind, raise_on_sigterm
from birdtrain.rundir import working_on

raise_on_sigterm()
assert interrupt_behind(BrokenPipeError()) is None  # nothing received: an error is an error
try:
    with working_on(Path("run"), "stage4"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the group's signal, as it reaches the parent
            signal.pause()
        finally:
            # the workers died of it too: their pipes break as the parent closes them
            raise BrokenPipeError(32, "Broken pipe")
except KeyboardInterrupt as exc:
    print(type(exc).__name__, exc.during, type(exc.__cause__).__name__)
"""


def test_an_error_that_follows_an_interrupt_is_reported_as_the_interrupt() -> None:
    done = subprocess.run(
        [sys.executable, "-c", AFTER_AN_INTERRUPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "Terminated",
        "(PosixPath('run'),",
        "'stage4')",
        "BrokenPipeError",
    ]


STUBBORN_WAIT = """
import os, signal, threading, time
from birdenv.interrupts import interruptible
from birdenv.interrupts import raise_on_sigterm

raise_on_sigterm()
ended = []

def stubborn():
    # As pyzmq's poll in vLLM's engine handshake: a wait that drops the interrupt and goes on.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    while True:
        try:
            time.sleep(0.01)
        except KeyboardInterrupt:
            pass

try:
    interruptible(stubborn, on_interrupt=lambda: ended.append("ended"))
except KeyboardInterrupt as exc:
    print(type(exc).__name__, ended)
print(interruptible(int, "42", on_interrupt=print))
"""


def test_an_interruptible_call_acts_on_an_interrupt_its_wait_drops() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STUBBORN_WAIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Terminated", "['ended']", "42"]


HELD_INTERRUPTS = """
import os, signal, threading, time
from birdenv.interrupts import interrupts_held
from birdenv.interrupts import raise_on_sigterm

raise_on_sigterm()
# Ctrl-C at its default, as in a terminal's foreground job (a background job inherits it ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
# A second thread, as torch and tokenizers start: the kernel hands a process-directed signal to a
# thread that does not block it, so blocking it in this thread alone would not hold it.
threading.Thread(target=threading.Event().wait, daemon=True).start()
order = []
for signum in (signal.SIGTERM, signal.SIGINT):
    try:
        with interrupts_held():
            os.kill(os.getpid(), signum)
            for _ in range(100):
                time.sleep(0.001)  # each call returns through the interpreter's signal check
            order.append("body")
    except KeyboardInterrupt as exc:
        order.append(type(exc).__name__)
print(order, signal.getsignal(signal.SIGTERM).__name__,
      signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_interrupts_held_are_raised_when_the_body_ends_even_with_other_threads() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HELD_INTERRUPTS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "['body',",
        "'Terminated',",
        "'body',",
        "'KeyboardInterrupt']",
        "_on_interrupt",
        "True",
    ]


# Judging workers fork from a fork server, which imports its preload modules before it ignores
# Ctrl-C; this preload module is where a Ctrl-C lands.
CTRL_C_AT_IMPORT = "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
JOBS = (
    "def run(pool, job):\n    return job * 2\n\n\ndef failed(job, phase, why):\n    return phase\n"
)
JUDGE_WITH_WORKERS = """
import signal
from birdenv.workers import supervised_map
from jobs import failed, run

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job
    print(list(supervised_map(
        run, [1, 2], processes=2, kill_after=600, failed=failed, preload=["ctrl_c_at_import"]
    )))
"""


def test_the_fork_server_starts_with_the_interrupts_held(tmp_path: Path) -> None:
    # The resource tracker's start (the first forkserver process makes it) unblocks SIGINT and
    # SIGTERM in the starting thread: a fork server started after it got Ctrl-C while it
    # imported its preload modules, printed its traceback and died, and the parent's worker start
    # failed with EOFError.
    (tmp_path / "ctrl_c_at_import.py").write_text(CTRL_C_AT_IMPORT)
    (tmp_path / "jobs.py").write_text(JOBS)
    (tmp_path / "main.py").write_text(JUDGE_WITH_WORKERS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "main.py")],
        capture_output=True,
        text=True,
        timeout=HANG,
        env=env,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "[2, 4]\n", "")


IGNORED_AND_HELD = """
import signal, subprocess, sys
from birdenv.interrupts import interrupts_held

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
child = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
with interrupts_held():
    started = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
print(started.stdout.strip(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
"""


def test_a_signal_ignored_stays_ignored_while_held_and_in_what_starts_then() -> None:
    # A noting handler in its place would reach a started program as the default action.
    done = subprocess.run(
        [sys.executable, "-c", IGNORED_AND_HELD], capture_output=True, text=True, timeout=HANG
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_the_lock_is_released_when_its_holder_ends(tmp_path: Path) -> None:
    holder = _start_holder(tmp_path)
    holder.terminate()
    holder.wait()
    # The system releases the lock as the holder exits: only a lock that is never released
    # may fail this (bounded for a hang, not for a slow machine).
    deadline = time.monotonic() + 60
    while True:
        try:
            with directory_lock(tmp_path):
                break
        except DirectoryBusyError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_birdenv_evaluate_refuses_a_folder_another_process_writes(tmp_path: Path, capsys) -> None:
    from birdenv.cli import main as birdenv_main

    predictions = tmp_path / "p.jsonl"
    predictions.write_text(json.dumps({"instance_id": "bank_finance_001", "pred_sqls": []}) + "\n")
    out = tmp_path / "verdicts"
    holder = _start_holder(out)
    try:
        argv = ["evaluate", str(predictions), "--suite", "critic-mini"]
        assert birdenv_main([*argv, "--out", str(out / "v.jsonl")]) == 2
        assert f"is being written by pid {holder.pid} (holder-command)" in capsys.readouterr().err
        assert not (out / "v.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from birdenv.files import directory_lock
    ready, started = os.pipe()
    with directory_lock(sys.argv[1], "forking-holder"):
        if os.fork() == 0:  # a worker, as a judge pool forks one
            os.write(started, b"1")  # running: what it does at fork is done
            time.sleep(60)
            os._exit(0)
        os.read(ready, 1)
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_a_worker_forked_by_the_holder_does_not_keep_the_lock(tmp_path: Path, capsys) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)  # the holder dies; its worker lives on
        holder.wait()
        with hold(tmp_path):
            pass
        assert f"taking over from pid {holder.pid} (forking-holder)" in capsys.readouterr().out
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


def test_birdtrain_eval_refuses_an_output_folder_another_process_writes(
    tmp_path: Path, capsys
) -> None:
    from birdtrain.cli import main as birdtrain_main

    holder = _start_holder(tmp_path)
    try:
        argv = ["eval", "--policy", "scripted", "--limit", "1", "--out", str(tmp_path)]
        assert birdtrain_main(argv) == 2
        assert f"is being written by pid {holder.pid} (holder-command)" in capsys.readouterr().err
        assert not (tmp_path / "summary.json").exists()
    finally:
        holder.kill()
        holder.wait()


# The command's process: a finder sends ``signum`` to the process as ``module`` starts to import
# (a signal at a moment chosen by the test, not by the machine's speed), then the command runs as
# its console script runs it.
SIGNALLED_AT_IMPORT = """
import os, signal, sys
module, signum, ignore, prog, *argv = sys.argv[1:]
# As a shell starts a background job (SIGINT ignored), or a terminal its foreground job, whatever
# the test run's own SIGINT is.
handler = signal.SIG_IGN if ignore == "ignored" else signal.default_int_handler
signal.signal(signal.SIGINT, handler)

class Finder:
    def find_spec(self, name, path=None, target=None):
        if name == module:
            os.kill(os.getpid(), int(signum))
        return None

sys.meta_path.insert(0, Finder())
sys.argv = [prog, *argv]
from importlib import import_module
sys.exit(import_module(prog + ".__main__").main())
"""


def _signalled_at_import(
    module: str, signum: int, prog: str, *argv: str, ignore: bool = False
) -> subprocess.CompletedProcess:
    args = [module, str(int(signum)), "ignored" if ignore else "-", prog, *argv]
    return subprocess.run(
        [sys.executable, "-c", SIGNALLED_AT_IMPORT, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("prog", ["birdenv", "birdtrain"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_command_loads_ends_it_in_one_line(prog: str, signum: int) -> None:
    # Before its main() is in place: a SIGTERM would end it with no word, a SIGINT in a traceback
    # of whatever module was loading.
    done = _signalled_at_import(f"{prog}.cli", signum, prog, "--help")
    assert done.returncode == 128 + signum, done.stderr
    assert done.stdout == ""  # nothing was done: not even the help
    assert done.stderr == (
        f"{prog}: interrupted by {signal.Signals(signum).name} while starting, before doing "
        "anything; run the same command again\n"
    )


def test_a_signal_the_command_was_started_ignoring_stays_ignored() -> None:
    done = _signalled_at_import("birdenv.cli", signal.SIGINT, "birdenv", "--help", ignore=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: birdenv")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_birdenv_command_interrupted_at_work_ends_in_one_line(
    signum: int, tmp_path: Path
) -> None:
    # `birdenv demo` loads gymnasium when it starts playing, well inside its work.
    done = _signalled_at_import("gymnasium", signum, "birdenv", "demo", "--out", str(tmp_path))
    assert done.returncode == 128 + signum, done.stderr
    assert done.stderr.splitlines()[-1:] == [
        f"birdenv: interrupted by {signal.Signals(signum).name}"
    ]
    assert "Traceback" not in done.stderr, done.stderr
