"""Supervised worker processes for judging many instances, each on its own replica pool.

:func:`supervised_map` runs one job at a time in each of ``processes`` workers, the way the official
evaluators run each instance in a subprocess, but without a new interpreter per instance: workers
fork from a server that has imported the judging code once. A worker still busy ``kill_after``
seconds after it took a job is killed and its job gets the caller's ``"timeout"`` verdict (test
code can swallow an in-process deadline; only a process boundary bounds it); a worker that dies
gives its job a ``"crash"`` verdict; a new worker takes over and the run goes on. A worker that
dies before it is ready is a setup problem, not a verdict: :class:`WorkerStartError`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from birdenv.errors import WorkerStartError
from birdenv.interrupts import INTERRUPTS, interrupts_held
from birdenv.replicas.placement import default_root
from birdenv.replicas.pool import ReplicaPool

__all__ = ["KILL_GRACE", "supervised_map"]

R = TypeVar("R")

#: A worker gets this long past a job's own deadline to return on its own before it is killed.
KILL_GRACE = 2.0
# What a worker sends once it has started, before its first result.
_READY = "ready"
_START_FAILED = (
    "a judging worker process exited (code {}) before it could judge anything; its error is "
    "printed above. Workers start from a fresh interpreter that imports the calling script's main "
    "module: a script that judges in worker processes must keep that call under "
    "`if __name__ == '__main__':`."
)


def _serve(conn: Any, root: str, run: Callable[[ReplicaPool, Any], Any]) -> None:
    """Answer each job that arrives on ``conn`` with ``run(pool, job)`` until ``None`` arrives.

    A worker leaves Ctrl-C to its parent, which stops it (a worker that raised on the terminal's
    group signal would print its own traceback); SIGTERM ends it. Workers are started with both
    held (:func:`~birdenv.interrupts.interrupts_held`), so that neither reaches one before it has
    set them so; and so is the fork server the first one starts, which imports its preload
    modules before it ignores SIGINT (a Ctrl-C then printed its own traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
    with ReplicaPool(root) as pool:
        conn.send(_READY)
        while (job := conn.recv()) is not None:
            conn.send(run(pool, job))


class _Worker:
    """One worker process and the job it is running."""

    def __init__(self, context: Any, root: str, run: Callable[[ReplicaPool, Any], Any]) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, root, run), daemon=True)
        self.process.start()
        child.close()
        self.job: int | None = None
        self.deadline = 0.0
        self.ready = False

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        self.process.join(timeout=None if kill else 5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def supervised_map(
    run: Callable[[ReplicaPool, Any], R],
    jobs: Sequence[Any],
    *,
    processes: int | None,
    kill_after: float,
    failed: Callable[[Any, str, str], R],
    order: Sequence[int] | None = None,
    preload: Sequence[str] = (),
    ray: bool = False,
) -> Iterator[R]:
    """``run(pool, job)`` for every job, in supervised workers; results in the order of ``jobs``.

    ``run`` must be a module-level function (workers receive it by name). Each worker has its own
    pool on the caller's replica root (passed on: a forkserver keeps the environment it started
    with), so bases are materialised once for the machine and sessions never collide.
    ``failed(job, phase, why)`` makes the result of a job whose worker was killed past
    ``kill_after`` seconds (``phase="timeout"``) or died (``phase="crash"``). ``order`` lists the
    job indices in the order they should start (default: input order); ``preload`` names the
    modules the worker server imports once. ``processes=None`` means one.

    With ``ray=True`` the workers are Ray actors spread over the cluster
    (:func:`birdenv.cluster.ray_map`; ``processes=None``: one per CPU of the cluster), each job's
    first item must be its task, and each node uses its own pool and its own copies of the
    databases.
    """
    if ray:
        from birdenv.cluster import ray_map  # Ray: an optional extra, for ray=True only

        yield from ray_map(
            run, jobs, workers=processes, kill_after=kill_after, failed=failed, order=order
        )
        return
    processes = processes or 1
    if not jobs:
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    root = str(default_root())
    pending = collections.deque(range(len(jobs)) if order is None else order)
    workers: list[_Worker] = []
    done: dict[int, R] = {}
    next_out = 0
    try:
        # An interrupt held while they start is raised once each started one is in the list.
        with interrupts_held(spawning=True):
            for _ in range(max(1, min(processes, len(jobs)))):
                workers.append(_Worker(context, root, run))
        while pending or any(w.job is not None for w in workers):
            for worker in workers:
                if worker.job is None and pending:
                    worker.job = pending.popleft()
                    worker.deadline = time.monotonic() + kill_after
                    worker.conn.send(jobs[worker.job])
            busy = [w for w in workers if w.job is not None]
            soonest = min(w.deadline for w in busy)
            wait = None if math.isinf(soonest) else max(0.0, soonest - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=wait)
            for i, worker in enumerate(workers):
                index = worker.job
                if index is None:
                    continue
                if worker.conn in ready:
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=5)  # reaped, for its exit code
                        if not worker.ready:
                            raise WorkerStartError(
                                _START_FAILED.format(worker.process.exitcode)
                            ) from None
                        phase = "crash"
                        why = (
                            f"crash: the judging worker died (exit code {worker.process.exitcode})"
                        )
                    else:
                        if message == _READY:
                            worker.ready = True
                        else:
                            done[index], worker.job = message, None
                        continue
                elif time.monotonic() >= worker.deadline:
                    phase = "timeout"
                    why = (
                        f"timeout: still running {kill_after:g} s after it started; the judging "
                        "worker was killed"
                    )
                else:
                    continue
                done[index] = failed(jobs[index], phase, why)
                worker.stop(kill=True)
                with interrupts_held(spawning=True):
                    workers[i] = _Worker(context, root, run)
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        for worker in workers:
            worker.stop(kill=worker.job is not None)
