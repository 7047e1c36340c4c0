"""Run a command with CPU hogs beside it: ``python .ci/under_load.py [--hogs N] -- COMMAND...``.

A shared CI machine or a laptop with other work on it is slow by turns; a suite whose verdicts
hold there does not depend on the machine's speed. Each hog is a process spinning on a core
(default: two per core, a load like the one other jobs make on a busy machine). The hogs end
with the command, and with this process whatever ends it (they die with their parent); the
command's exit status is this one's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

SPIN = "while True: pass"


def _die_with_parent() -> None:
    """In the hog, before it spins: Linux sends it SIGKILL when this process dies, however."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    # SIGTERM unwinds like Ctrl-C: the hogs are ended in the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    hogs = [
        subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=_die_with_parent)
        for _ in range(args.hogs)
    ]
    started = time.monotonic()
    try:
        print(f"under load: {args.hogs} CPU hogs beside {' '.join(command)}", flush=True)
        proc = subprocess.Popen(command)
        # wait4 gives the CPU time of the command and of every process of its tree that was
        # waited for: a figure the load does not inflate, where the wall time is the load's.
        _, raw, usage = os.wait4(proc.pid, 0)
        proc.returncode = status = os.waitstatus_to_exitcode(raw)
        cpu = usage.ru_utime + usage.ru_stime
        cores = os.cpu_count() or 1
        print(
            f"under load: exit status {status} after {time.monotonic() - started:.0f} s; "
            f"{cpu:.0f} CPU-s in the command's processes (without the load, at least "
            f"{cpu / cores:.0f} s on {cores} cores)"
        )
        return status
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
