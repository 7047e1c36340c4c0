"""A command interrupted as a user, ``timeout`` or a job scheduler interrupts it, from outside:
started as a terminal's foreground job, signalled once given work is under way, then checked
for one line, no traceback, no process left, and a rerun that completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: How long a wait that ends as soon as its event happens may last before it is called a hang.
#: Generous: a loaded machine is slow, and only an event that never comes should fail a test.
HANG = 900


def birdtrain(*args: str) -> list[str]:
    """The command line of ``birdtrain args`` in this Python."""
    return [sys.executable, "-m", "birdtrain", *args]


def session_processes(session: int) -> list[int]:
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


def foreground(
    argv: list[str], env: dict[str, str] | None = None, *, stdout: Any = None, stderr: Any = None
) -> subprocess.Popen:
    """Start ``birdtrain argv`` as a terminal starts a foreground job: in a process group of its
    own (so that a signal to the group is Ctrl-C), with SIGINT at its default action.

    A process started in the background by a shell without job control (``make test &``)
    inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored; so would the command,
    and Ctrl-C would never reach it. A handled signal is reset to its default on ``exec``:
    SIGINT handled here while the command starts gives it the default a terminal's job has.
    Its output goes to ``stdout`` and ``stderr`` (default: pipes, as text)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            birdtrain(*argv),
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE if stderr is None else stderr,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = HANG) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def no_process_left(session: int) -> None:
    """No process of the command's session outlives it. The command joins every process it
    started before it exits, so none should remain; one still ending (its signal taken, its exit
    not yet done by the system) is given time to, bounded for a hang, not for a slow machine."""
    try:
        wait_for(lambda: not session_processes(session), "the command's processes end")
    except AssertionError:
        left = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in session_processes(session)
        }
        raise AssertionError(f"processes left after the command exited: {left}") from None


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (its ``SigCgt`` mask): a
    command signalled before then meets the default action, as any program still starting up."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def process_named(session: int, name: str) -> bool:
    """Whether a live process of ``session`` has ``name`` in its name (``/proc/PID/comm``: at
    most 15 characters, e.g. ``VLLM::EngineCor`` for vLLM's engine process)."""
    for pid in session_processes(session):
        try:
            if name in Path(f"/proc/{pid}/comm").read_text():
                return True
        except OSError:
            continue
    return False


def interrupt_and_resume(
    argv: list[str],
    *,
    signum: int,
    group: bool,
    ready: Callable[[int], bool],
    what: str,
    during: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``birdtrain argv``; once ``ready(session)`` holds (``what``: the work then under way),
    send ``signum`` to it or (``group``) to its whole process group, as ``timeout``, Slurm,
    systemd and Kubernetes do. It must end in one line naming ``during`` and saying how to
    resume, with 128 + ``signum``, no traceback and no process left; then the same command must
    complete. Returns the completed rerun."""
    command = foreground(argv, env)
    wait_for(lambda: ready(command.pid) or command.poll() is not None, what)
    assert command.poll() is None, command.communicate()
    if group:
        os.killpg(command.pid, signum)
    else:
        command.send_signal(signum)
    _, err = command.communicate(timeout=HANG)
    assert command.returncode == 128 + signum, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"birdtrain: interrupted by {name} during {during}; "), err
    assert last.endswith("run the same command to resume")
    no_process_left(command.pid)
    done = subprocess.run(
        birdtrain(*argv), capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr
    return done
