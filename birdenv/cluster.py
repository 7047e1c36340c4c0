"""Ray clusters: connecting, task databases on every node by content hash, judging on Ray actors.

:func:`connect` joins the cluster at ``RAY_ADDRESS`` when it is set, else starts a local Ray.
:func:`ship` hashes the databases of a task set on the driver; on each node,
:meth:`Shipment.localize` finds every database in the node's own content-addressed cache
(``$BIRDENV_HOME/cluster/databases/{sha256}/``) or fetches it from the driver once, checks its
hash, and rewrites the tasks to point there. Nothing assumes a shared filesystem.
:func:`ray_map` is :func:`birdenv.workers.supervised_map` on Ray actors spread over the nodes.

Ray is imported only here and in :mod:`birdenv.ray_vector`, and only when called: without the
``ray`` extra birdenv imports and runs as before, and asking for Ray raises
:class:`~birdenv.errors.MissingExtraError`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from birdenv.errors import MissingExtraError, StagingError, WorkerStartError
from birdenv.files import exclusive_lock, file_sha256, home

__all__ = ["DatabaseRef", "Shipment", "connect", "import_ray", "ray_map", "ship", "spread"]

R = TypeVar("R")

#: Bytes per request when a node fetches a database from the driver (bounded object-store use).
CHUNK = 32 << 20
#: Seconds an actor may take to start (import birdenv, open its pool) before it is a setup error.
START_TIMEOUT = 120.0


def import_ray() -> Any:
    """The ``ray`` module, or :class:`~birdenv.errors.MissingExtraError` naming the ``ray`` extra."""
    try:
        # the ray extra: imported only where used
        import ray
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise  # Ray is there but one of its own imports is not: a different problem
        raise MissingExtraError("ray", "ray") from exc
    return ray


def connect() -> Any:
    """Join the Ray cluster at ``RAY_ADDRESS`` if set, else start a local Ray; return ``ray``.

    A driver that already called ``ray.init`` keeps its connection.
    """
    ray = import_ray()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        with _interrupt_handlers_kept():
            if address:
                ray.init(address=address)
            else:
                # "local" starts a new instance instead of attaching to whatever cluster this
                # machine happens to run: without RAY_ADDRESS the run is this machine's alone.
                ray.init(address="local", include_dashboard=False)
    return ray


@contextlib.contextmanager
def _interrupt_handlers_kept() -> Iterator[None]:
    """Keep the program's SIGINT and SIGTERM handlers through ``ray.init``.

    ``ray.init`` sets SIGTERM's Python handler to ``sys.exit``, and its core worker then puts a
    C handler in its place that aborts the process with a stack dump (exit status 134): a
    driver sent SIGTERM (by ``timeout``, a job scheduler) would neither unwind nor say what it
    was doing. The program's own handler is put back; where it had none (Python's default),
    Ray's Python handler is, so that the process exits through ``atexit`` (``ray.shutdown``).
    Only the main thread can set handlers; elsewhere nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            kept = handler if callable(handler) else signal.getsignal(signum)
            if callable(kept):
                signal.signal(signum, kept)


def spread(count: int) -> list[str]:
    """Node ids for ``count`` actors, interleaved over the alive nodes in proportion to their CPUs."""
    ray = connect()
    nodes = sorted(
        (n["NodeID"], float(n["Resources"].get("CPU", 0)))
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("CPU", 0) > 0
    )
    if not nodes:
        raise WorkerStartError("the Ray cluster has no alive node with a CPU")
    # Node n's k-th actor goes at time (k + 0.5) / cpus(n): a 4-CPU node gets two actors for each
    # one of a 2-CPU node, and consecutive actors land on different nodes.
    slots = sorted(((k + 0.5) / cpus, node) for node, cpus in nodes for k in range(count))
    return [node for _, node in slots[:count]]


def placement(node_id: str) -> Any:
    """Scheduling on ``node_id`` while it lives; anywhere else once it is gone."""
    # the ray extra: imported only where used
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=True)


def cluster_cpus() -> float:
    """CPUs of the whole cluster (what actors are sized against)."""
    return float(connect().cluster_resources().get("CPU", 1.0))


# --------------------------------------------------------------------------------------------
# Databases by content hash


@dataclasses.dataclass(frozen=True)
class DatabaseRef:
    """A task database as the driver has it: its content hash and its place under a root."""

    sha256: str
    db_id: str
    name: str  # the file name in {root}/{db_id}/: the layouts of both task kinds
    size: int


class _DatabaseServer:
    """Runs on the driver's node and hands out the bytes of the databases it was given."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths

    def read(self, sha256: str, offset: int, size: int) -> bytes:
        with open(self.paths[sha256], "rb") as fh:
            fh.seek(offset)
            return fh.read(size)


# The driver hashes a database once per (path, size, mtime, inode).
_hashes: dict[tuple[str, int, int, int], str] = {}


def _sha256_of(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _hashes:
        _hashes[key] = file_sha256(path)
    return _hashes[key]


@dataclasses.dataclass
class Shipment:
    """The databases of a task set, for nodes to obtain by content hash (see :func:`ship`).

    It pickles into env builders and actors: ``databases`` maps each task's ``(db_dir, db_id)``
    on the driver to its :class:`DatabaseRef`; ``server`` is the driver-side actor that sends a
    database to a node that lacks it; ``driver_node`` is the node whose files the tasks name.
    """

    databases: dict[tuple[str, str], DatabaseRef]
    server: Any
    driver_node: str

    def localize(self, tasks: Iterable[Any]) -> list[Any]:
        """The tasks with ``db_dir`` on this node's copies (fetched and verified on first use).

        On the driver's own node the tasks already name files that are there: they stay as they
        are.
        """
        if import_ray().get_runtime_context().get_node_id() == self.driver_node:
            return list(tasks)
        roots = _stage(self.databases.values(), self.server)
        out = []
        for task in tasks:
            if task.db_dir is None:  # a database the PostgreSQL server holds: nothing to move
                out.append(task)
                continue
            ref = self.databases[(str(task.db_dir), task.db_id)]
            out.append(dataclasses.replace(task, db_dir=roots[ref.sha256]))
        return out

    def close(self) -> None:
        """Stop the driver-side server (safe to call twice)."""
        if self.server is not None:
            with contextlib.suppress(Exception):
                import_ray().kill(self.server)
            self.server = None


def ship(tasks: Iterable[Any]) -> Shipment:
    """Hash every database the tasks use and serve them from this (the driver's) node.

    Raises :class:`~birdenv.errors.DatabaseNotFoundError` for a task whose database is missing.
    """
    ray = connect()
    databases: dict[tuple[str, str], DatabaseRef] = {}
    paths: dict[str, str] = {}
    for task in tasks:
        key = (str(task.db_dir), task.db_id)
        if key in databases or task.db_dir is None:
            # Without a folder the database is a template on the PostgreSQL server
            # (BIRDENV_PG_DSN, which every node must then reach).
            continue
        path = task.db_path
        sha = _sha256_of(path)
        databases[key] = DatabaseRef(sha, task.db_id, path.name, path.stat().st_size)
        paths[sha] = str(path)
    node = ray.get_runtime_context().get_node_id()
    server = (
        ray.remote(_DatabaseServer)
        .options(num_cpus=0, scheduling_strategy=placement(node))
        .remote(paths)
    )
    return Shipment(databases, server, node)


# What this process has staged: sha256 -> root (a worker stages a database once).
_staged: dict[str, Path] = {}


def _cache_dir() -> Path:
    return home() / "cluster" / "databases"


def _stat_record(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _intact(path: Path, marker: Path, ref: DatabaseRef) -> bool:
    """Whether the cached copy is the database named by ``ref``: its recorded stat, else its hash."""
    if not path.is_file():
        return False
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()) == {"sha256": ref.sha256, **_stat_record(path)}:
            return True
    if path.stat().st_size == ref.size and file_sha256(path) == ref.sha256:
        marker.write_text(json.dumps({"sha256": ref.sha256, **_stat_record(path)}))
        return True
    return False


def _fetch(server: Any, ref: DatabaseRef, path: Path, marker: Path) -> None:
    """Copy the database from the driver in chunks, check its hash, move it into place read-only."""
    ray = import_ray()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as fh:
            for offset in range(0, max(ref.size, 1), CHUNK):
                data = ray.get(server.read.remote(ref.sha256, offset, CHUNK))
                digest.update(data)
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if digest.hexdigest() != ref.sha256:
            raise StagingError(
                f"database {ref.db_id!r} arrived with sha256 {digest.hexdigest()[:12]}..., not "
                f"{ref.sha256[:12]}...: the driver's file changed after it was hashed; start again"
            )
        tmp.chmod(0o444)
        if path.exists():  # a copy that failed its check: never served, replaced
            path.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(json.dumps({"sha256": ref.sha256, **_stat_record(path)}))


def _stage(refs: Iterable[DatabaseRef], server: Any) -> dict[str, Path]:
    """Every database of ``refs`` on this node: from the cache, else from the driver."""
    cache = _cache_dir()
    for ref in refs:
        root = cache / ref.sha256
        path, marker = root / ref.db_id / ref.name, root / "sha256.json"
        if ref.sha256 in _staged and path.is_file():
            continue
        root.mkdir(parents=True, exist_ok=True)
        # Actors on one node share the cache: one fetches, the others wait and find it intact.
        with exclusive_lock(cache / f"{ref.sha256}.lock"):
            if not _intact(path, marker, ref):
                if server is None:
                    raise StagingError(
                        f"database {ref.db_id!r} (sha256 {ref.sha256[:12]}...) is not on this node "
                        "and its shipment was closed"
                    )
                _fetch(server, ref, path, marker)
        _staged[ref.sha256] = root
    return dict(_staged)


# --------------------------------------------------------------------------------------------
# Supervised jobs on Ray actors


class _JobRunner:
    """A Ray actor that runs jobs one at a time on its node, each on its own replica pool."""

    def __init__(self, shipment: Shipment) -> None:
        # In the Ray actor's own process, on first use there: the driver never builds a pool.
        from birdenv.replicas.placement import default_root
        from birdenv.replicas.pool import ReplicaPool

        self.shipment = shipment
        self.pool = ReplicaPool(default_root())

    def ready(self) -> str:
        return import_ray().get_runtime_context().get_node_id()

    def run(self, run: Callable[[Any, Any], Any], job: tuple[Any, ...]) -> Any:
        task = self.shipment.localize([job[0]])[0]
        return run(self.pool, (task, *job[1:]))


def ray_map(
    run: Callable[[Any, Any], R],
    jobs: Sequence[tuple[Any, ...]],
    *,
    workers: int | None,
    kill_after: float,
    failed: Callable[[Any, str, str], R],
    order: Sequence[int] | None = None,
) -> Iterator[R]:
    """:func:`~birdenv.workers.supervised_map`'s contract on Ray actors; results in job order.

    Each job is a tuple whose first item is a task: its database reaches the actor's node by
    content hash (:func:`ship`). ``workers`` actors (default: one per CPU of the cluster) are
    spread over the nodes and run one job at a time. An actor still busy ``kill_after`` seconds
    after it took a job is killed (``failed(job, "timeout", why)``); one that dies, or whose job
    raises, gives ``failed(job, "crash", why)``; a new actor takes over and the run goes on. An
    actor that cannot start raises :class:`~birdenv.errors.WorkerStartError`.
    """
    if not jobs:
        return
    ray = connect()
    # the ray extra: imported only where used
    from ray.exceptions import RayActorError, RayTaskError

    shipment = ship(job[0] for job in jobs)
    count = max(1, min(len(jobs), workers or int(cluster_cpus())))
    runner, cpus = ray.remote(_JobRunner), min(1.0, cluster_cpus() / count)
    run_ref = ray.put(run)

    def start(where: list[str]) -> list[Any]:
        """Actors on these nodes, started at once; each answers before any job goes out."""
        started = [
            runner.options(num_cpus=cpus, scheduling_strategy=placement(node)).remote(shipment)
            for node in where
        ]
        for actor, node in zip(started, where, strict=True):
            try:
                ray.get(actor.ready.remote(), timeout=START_TIMEOUT)
            except Exception as exc:
                for other in started:
                    ray.kill(other)
                raise WorkerStartError(
                    f"a judging actor could not start on node {node[:12]}... within "
                    f"{START_TIMEOUT:g} s: {type(exc).__name__}: {exc}. Every node needs bird-rl "
                    "installed in the same Python as the driver."
                ) from exc
        return started

    nodes = spread(count)
    actors = start(nodes)
    busy: dict[Any, tuple[int, int, float]] = {}  # ref -> (actor slot, job index, deadline)
    pending = collections.deque(range(len(jobs)) if order is None else order)
    done: dict[int, R] = {}
    next_out = 0
    try:
        while pending or busy:
            for slot, actor in enumerate(actors):
                if pending and all(s != slot for s, _, _ in busy.values()):
                    index = pending.popleft()
                    ref = actor.run.remote(run_ref, jobs[index])
                    busy[ref] = (slot, index, time.monotonic() + kill_after)
            soonest = min(deadline for _, _, deadline in busy.values())
            wait = None if math.isinf(soonest) else max(0.0, soonest - time.monotonic())
            ready, _ = ray.wait(list(busy), num_returns=1, timeout=wait)
            for ref in list(busy):
                slot, index, deadline = busy[ref]
                if ref in ready:
                    del busy[ref]
                    try:
                        done[index] = ray.get(ref)
                    except RayTaskError as exc:  # the job raised; its actor is still sound
                        why = f"crash: the judging job raised {exc.cause!r}"
                        done[index] = failed(jobs[index], "crash", why)
                    except RayActorError as exc:
                        why = f"crash: the judging actor died ({type(exc).__name__})"
                        done[index] = failed(jobs[index], "crash", why)
                        actors[slot] = start([nodes[slot]])[0]
                elif time.monotonic() >= deadline:
                    del busy[ref]
                    done[index] = failed(
                        jobs[index],
                        "timeout",
                        f"timeout: still running {kill_after:g} s after it started; the judging "
                        "actor was killed",
                    )
                    ray.kill(actors[slot])
                    actors[slot] = start([nodes[slot]])[0]
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        shipment.close()
