"""The replica pool: leases isolated sessions on immutable bases, cheaply.

Two strategies behind one interface, chosen by a capability check at start-up:

``overlay``
    A session is a copy-on-write page overlay over the shared base (the C VFS in
    :mod:`birdenv.replicas.overlay`): opening costs O(1), the session's private disk holds only the
    pages it changed, and reset is close + unlink, whatever the base size. The sessions of a pool
    on one base share a content-addressed page store (``share_pages``): the G rollouts of a task
    mostly write the same pages, and each distinct page is kept once.
``copy``
    The fallback where the overlay cannot register (a Python whose ``_sqlite3`` links SQLite
    statically, or no compiler at install time): a private full copy of the base per session,
    removed at reset. Same semantics, O(database size) time and space.

Sessions are throwaway, so they live on a memory filesystem (``/dev/shm``) where the machine has
one with room, and on disk (``{root}/sessions``) otherwise: see :func:`default_sessions_dir`.
Opening a pool raises the process's soft limit on open files to its hard limit, since every
session holds a few descriptors (:mod:`birdenv.replicas.descriptors`).

The pool also keeps a :class:`~birdenv.replicas.results.ResultCache` (``share_results``): a
read-only statement that a session runs on a state another of its sessions already had (same base,
same history of changes) gets that session's result without running again.

Any number of processes can share one pool root without partitions: every process holds an
exclusive ``flock`` on its own lock file in each sessions folder while it lives, so a new pool
recognises the session files of dead processes (their lock is free) and sweeps them.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import itertools
import logging
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from birdenv.errors import PoolClosedError, PoolTimeoutError, PreprocessError
from birdenv.replicas import descriptors, overlay
from birdenv.replicas.placement import (
    default_root,
    default_sessions_dir,
    disk_usage,
    is_memory_filesystem,
    room,
)
from birdenv.replicas.results import ResultCache, initial_state
from birdenv.replicas.session import Limits, Session
from birdenv.replicas.store import Base, BaseStore

__all__ = [
    "HELD_BASES",
    "MEMORY_HEADROOM",
    "STRATEGIES",
    "ReplicaPool",
    "StartingState",
    "default_pool",
]

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "overlay", "copy")
_COPY_SUFFIXES = ("", "-journal", "-wal", "-shm")

#: Bytes a memory filesystem, and the machine's available memory, must keep free for a new session
#: to go there; below that, new sessions go to disk.
MEMORY_HEADROOM = 1 << 30
#: A pool keeps the descriptor and in-place map of this many of its most recently leased bases
#: open between their sessions.
HELD_BASES = 64
# How long a "there is room in memory" answer is trusted: the check reads /proc/meminfo.
_ROOM_TTL = 0.25


class StartingState(Protocol):
    """What :meth:`ReplicaPool.session` reads of a task (any kind): its database file, its id
    (for messages) and the statements that prepare the state an episode starts from."""

    @property
    def instance_id(self) -> str: ...

    @property
    def db_path(self) -> Path: ...

    @property
    def preprocess_sql(self) -> Sequence[str]: ...


def _tune(conn: sqlite3.Connection, exclusive: bool) -> None:
    """Per-connection settings that keep a session's private disk at O(its changes), and fast.

    Debian's build zero-fills freed pages (``secure_delete``), which would copy them into the
    session. Every statement then switches to ``journal_mode=WAL`` and ``synchronous=OFF``, in
    that order, as the official evaluator does; with ``synchronous`` still at its default the
    first switch of a fresh state syncs the file (~25 ms of every episode's first statement and
    of both judge phases here), so it is off from the start. A session is thrown away, never
    recovered, so durability buys nothing; neither setting changes a result.

    ``exclusive``: ``locking_mode=EXCLUSIVE``. Set before the first WAL access, SQLite keeps the
    WAL index in heap memory instead of a ``-shm`` file (32 KiB less disk per session); other
    connections to the session then wait on its lock, so only sessions nobody else opens ask for
    it. Set before ``synchronous``, which reads the schema: the lock then taken is kept, and no
    later transaction locks, unlocks and looks for a hot journal again.
    """
    conn.execute("PRAGMA secure_delete = OFF")
    if exclusive:
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
    conn.execute("PRAGMA synchronous = OFF")


class ReplicaPool:
    """Leases :class:`~birdenv.replicas.session.Session` objects on fresh, isolated database states.

    >>> with ReplicaPool(root=tmp) as pool:                      # doctest: +SKIP
    ...     with pool.session(task) as session:
    ...         session.execute("SELECT count(*) FROM orders").rows

    Arguments: ``root`` (default ``$BIRDENV_HOME/replicas``: the bases, and sessions that fall back
    to disk); keyword-only: ``sessions_dir`` (where sessions are made; default
    :func:`default_sessions_dir`, a memory filesystem where there is one: while it has less than
    :data:`MEMORY_HEADROOM` free, new sessions go to ``{root}/sessions`` instead), ``strategy``
    (``"auto"``, ``"overlay"`` or ``"copy"``), ``limits`` (deadline and caps of every statement),
    ``max_sessions`` (open sessions at once in this process; ``None``: unbounded), ``timeout``
    (seconds to wait for a free slot before :class:`PoolTimeoutError`), ``share_pages`` (overlay
    sessions on one base keep identical changed pages once; on by default), ``share_results``
    (sessions in the same state share read-only results; on by default) and
    ``results_max_bytes`` (the memory that cache may hold).
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        sessions_dir: str | Path | None = None,
        strategy: str = "auto",
        limits: Limits | None = None,
        max_sessions: int | None = None,
        timeout: float = 60.0,
        share_pages: bool = True,
        share_results: bool = True,
        results_max_bytes: int = 64 << 20,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if strategy in ("auto", "overlay") and not overlay.available():
            if strategy == "overlay":
                raise RuntimeError(f"overlay strategy unavailable: {overlay.unavailable_reason()}")
            log.warning(
                "copy-on-write overlay unavailable (%s); using the copy strategy",
                overlay.unavailable_reason(),
            )
            strategy = "copy"
        elif strategy == "auto":
            strategy = "overlay"
        self.strategy = strategy
        self.root = Path(root) if root is not None else default_root()
        self.limits = limits or Limits()
        self.timeout = timeout
        self.share_pages = share_pages and strategy == "overlay"
        self.results = ResultCache(results_max_bytes) if share_results else None
        self.store = BaseStore(self.root)
        self.descriptors_raised_from = descriptors.raise_soft_limit()
        if self.descriptors_raised_from is not None:
            log.info(
                "raised this process's soft limit on open files from %d to %d (its hard limit)",
                self.descriptors_raised_from,
                descriptors.limits()[0],
            )
        sessions = Path(
            sessions_dir if sessions_dir is not None else default_sessions_dir(self.root)
        )
        sessions.mkdir(parents=True, exist_ok=True)
        # Real paths (symbolic links resolved), as SQLite names the files: a reset then needs no
        # resolving of its own (a system call per path component).
        self.sessions_dir = sessions.resolve()
        self.in_memory = is_memory_filesystem(self.sessions_dir)
        disk = (self.root / "sessions").resolve()
        #: Where new sessions go while the memory filesystem lacks room (None: sessions are on disk).
        self.fallback_dir: Path | None = (
            disk if self.in_memory and disk != self.sessions_dir else None
        )
        self._slots = threading.BoundedSemaphore(max_sessions) if max_sessions else None
        self._lock = threading.Lock()
        self._open: set[Session] = set()
        # base sha256 -> overlay.hold_base handle, least recently leased first: a base's
        # descriptor and in-place map stay open between its sessions (see _prepare).
        self._held: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._counter = itertools.count()
        self._stats = {
            "leases": 0,
            "peak_sessions": 0,
            "resets": 0,
            "reset_seconds": 0.0,
            "fallbacks": 0,
        }
        self._room_until = 0.0
        self._closed = False
        self._pid = os.getpid()
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._claims = [self._claim(folder) for folder in self._folders()]
        self.swept = sum(self._sweep_orphans(folder) for folder in self._folders())
        where = (
            f"sessions in memory at {self.sessions_dir}"
            if self.in_memory
            else (f"sessions on disk at {self.sessions_dir}")
        )
        log.info("replica pool at %s, strategy %s, %s", self.root, self.strategy, where)

    def _folders(self) -> list[Path]:
        return [self.sessions_dir] + ([self.fallback_dir] if self.fallback_dir else [])

    def _claim(self, folder: Path) -> tuple[Path, Any]:
        """Hold this pool's lock file in ``folder`` (how sweepers there know it is alive)."""
        # Lock first, then publish under the final name, so a sweeper never sees it unlocked. The
        # staging name must not match the sweeper's "*.lock": between open() and flock() another
        # pool could take the free lock, call it an orphan and delete it.
        staging = folder / f".{self._prefix}.lock-staging"
        for attempt in range(3):
            folder.mkdir(parents=True, exist_ok=True)
            try:
                lockfile = open(staging, "w")  # noqa: SIM115 - held for the pool's lifetime
                break
            except FileNotFoundError:  # a closing pool removed the empty folder meanwhile
                if attempt == 2:
                    raise
        fcntl.flock(lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock_path = folder / f"{self._prefix}.lock"
        os.replace(staging, lock_path)
        return lock_path, lockfile

    # -- leasing -------------------------------------------------------------------------
    def session(
        self,
        task: StartingState,
        *,
        preprocess: bool = True,
        limits: Limits | None = None,
        exclusive: bool = False,
        timeout: float | None = None,
    ) -> Session:
        """A fresh, isolated state of ``task``'s database, with its ``preprocess_sql`` applied.

        A failing preprocess statement raises :class:`PreprocessError` (the session is released);
        ``preprocess=False`` leaves the state untouched (the judge applies it itself, the
        official way). ``limits`` overrides the pool's statement limits for this session;
        ``exclusive=True`` keeps the session's lock for its whole life (no ``-shm`` file; other
        connections to it wait), for trajectories whose session nobody else opens.
        """
        base = self.store.base_for(task.db_path)
        session = self.open_base(
            base, task_id=task.instance_id, limits=limits, exclusive=exclusive, timeout=timeout
        )
        if preprocess:
            for i, sql in enumerate(task.preprocess_sql, 1):
                try:
                    session.prepare(sql)
                except (sqlite3.Error, ValueError, OverflowError) as exc:
                    session.close()
                    raise PreprocessError(
                        f"task {task.instance_id!r}: preprocess_sql statement {i} failed: {exc}"
                    ) from exc
                except BaseException:  # out of descriptors, interrupted: the session goes back
                    session.close()
                    raise
        return session

    def open_base(
        self,
        base: Base,
        *,
        task_id: str | None = None,
        limits: Limits | None = None,
        exclusive: bool = False,
        timeout: float | None = None,
    ) -> Session:
        """A fresh session directly on a base (what :meth:`session` uses)."""
        if self._closed:
            raise PoolClosedError("the replica pool is closed")
        if os.getpid() != self._pid:
            raise PoolClosedError("this pool belongs to the parent process; create one per process")
        wait = self.timeout if timeout is None else timeout
        if self._slots is not None and not self._slots.acquire(timeout=wait):
            raise PoolTimeoutError(f"no free session slot within {wait:g} s")
        path = self._place(base) / f"{self._prefix}-{next(self._counter)}.db"
        limits = limits or self.limits
        try:
            connect = self._prepare(base, path)
            session = Session(
                path=path,
                connect=connect,
                limits=limits,
                release=self._release,
                task_id=task_id,
                exclusive=exclusive,
                results=self.results,
                # everything that shapes a result besides the history: the base's bytes, the
                # caps, and the locking mode
                state=initial_state(base.sha256, limits, exclusive),
            )
        except BaseException as exc:
            out = isinstance(exc, (sqlite3.OperationalError, OSError)) and descriptors.exhausted()
            self._discard(path)
            if self._slots is not None:
                self._slots.release()
            if out:
                raise descriptors.limit_error("cannot open a session") from exc
            raise
        with self._lock:
            self._open.add(session)
            self._stats["leases"] += 1
            self._stats["peak_sessions"] = max(self._stats["peak_sessions"], len(self._open))
        return session

    def _place(self, base: Base) -> Path:
        """The folder of a new session: memory while it has room, else the fallback on disk."""
        if self.fallback_dir is None:
            return self.sessions_dir
        now = time.monotonic()
        if now < self._room_until:
            return self.sessions_dir
        # A copy needs the whole base beside the headroom; an overlay only its changes.
        need = MEMORY_HEADROOM + (base.size if self.strategy == "copy" else 0)
        if room(self.sessions_dir) >= need:
            self._room_until = now + _ROOM_TTL
            return self.sessions_dir
        with self._lock:
            self._stats["fallbacks"] += 1
        return self.fallback_dir

    def _prepare(self, base: Base, path: Path):
        limit = self.limits.max_session_bytes
        if self.strategy == "overlay":
            # An env resets by closing its session before it leases the next: without a hold,
            # every episode would open the base, map it, fault its pages in and unmap it again.
            with self._lock:
                if base.sha256 in self._held:
                    self._held.move_to_end(base.sha256)
                else:
                    self._held[base.sha256] = overlay.hold_base(base.path)
                    if len(self._held) > HELD_BASES:  # bound the descriptors and address space
                        overlay.release_base(self._held.popitem(last=False)[1])
            pages = self._pages(base, path.parent) if self.share_pages else None
            uri = overlay.session_uri(path, base.path, max_bytes=limit, pages=pages)

            def connect(exclusive: bool) -> sqlite3.Connection:
                conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
                # Unchanged base pages are read in place from one map of the base that every
                # session of the process shares (the overlay's xFetch): no copy into each
                # session's page cache, which a scan larger than that cache would repeat on every
                # run. The guard keeps statements from changing it. Set first: the schema, read
                # next, is read in place too.
                conn.execute(f"PRAGMA mmap_size = {base.size}")
                _tune(conn, exclusive)
                return conn

            return connect
        shutil.copyfile(base.path, path)
        path.chmod(0o644)

        def connect_copy(exclusive: bool) -> sqlite3.Connection:
            conn = sqlite3.connect(path, check_same_thread=False)
            _tune(conn, exclusive)
            if limit is not None:
                # Bound the private copy's growth to the base plus the session's allowance.
                page = conn.execute("PRAGMA page_size").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count = {(base.size + limit) // page}")
            return conn

        return connect_copy

    def _pages(self, base: Base, folder: Path) -> Path:
        """The page store this pool's sessions on ``base`` in ``folder`` share (named like their
        files, so a dead process's store is swept with them; beside them, so that sessions sent
        to disk for lack of memory keep their pages on disk too)."""
        return folder / f"{self._prefix}-pages-{base.sha256[:16]}"

    def _discard(self, path: Path) -> None:
        if self.strategy == "overlay":
            overlay.discard_real(str(path))  # a real path: its folder is (see __init__)
            return
        for suffix in _COPY_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                Path(f"{path}{suffix}").unlink()

    def _release(self, session: Session) -> None:
        start = time.perf_counter()
        self._discard(session.path)
        elapsed = time.perf_counter() - start
        with self._lock:
            if session in self._open:
                self._open.discard(session)
                self._stats["resets"] += 1
                self._stats["reset_seconds"] += elapsed
                if self._slots is not None:
                    self._slots.release()

    # -- housekeeping --------------------------------------------------------------------
    def _sweep_orphans(self, folder: Path) -> int:
        """Delete session files left by dead processes (their lock file is no longer held)."""
        swept = 0
        for lock_path in folder.glob("*.lock"):
            prefix = lock_path.stem
            if prefix == self._prefix:
                continue
            try:
                with open(lock_path, "a") as fh:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    for orphan in folder.glob(f"{prefix}-*"):
                        orphan.unlink(missing_ok=True)
                        swept += 1
                    lock_path.unlink(missing_ok=True)
            except BlockingIOError:
                continue  # its owner is alive
            except FileNotFoundError:
                continue  # another pool swept it first
        if swept:
            log.info("swept %d orphaned session files in %s", swept, folder)
        return swept

    def stats(self) -> dict[str, Any]:
        """Counters: strategy, open and peak sessions, where sessions live, bytes they hold,
        resets and mean reset time, and the process's file descriptors.

        ``sessions_dir`` and ``sessions_in_memory`` say where new sessions go; open sessions are
        counted by place (``open_in_memory``, ``open_on_disk``) and ``fallbacks`` counts the
        sessions sent to disk for lack of room in memory. ``bytes_on_disk`` is the bases plus the
        sessions' files, wherever they are. ``descriptor_limit`` is the soft limit now,
        ``descriptor_limit_raised_from`` what it was before this pool raised it (None: unchanged).

        With shared results, also ``results_lookups``, ``results_hits``, ``results_stored``,
        ``results_evicted``, ``results_entries``, ``results_bytes`` and ``results_saved_seconds``
        (what the statements answered from the cache took when they ran). With shared pages,
        also ``pages_stored_bytes`` (distinct changed pages held),
        ``pages_mapped_bytes`` (what the open sessions' changed pages would take unshared),
        ``pages_written`` and ``pages_shared`` (written pages that found an identical one stored).
        """
        with self._lock:
            stats = dict(self._stats)
            stats["open_sessions"] = len(self._open)
            on_disk = sum(s.path.parent != self.sessions_dir for s in self._open)
        if self.results is not None:
            for name, value in self.results.stats().items():
                stats[f"results_{name}"] = value
        if self.share_pages:
            mine = [
                s
                for s in overlay.page_stores()
                if Path(s["pages"]).name.startswith(f"{self._prefix}-pages-")
            ]
            stats["pages_stored_bytes"] = sum(s["stored_bytes"] for s in mine)
            stats["pages_mapped_bytes"] = sum(s["mapped_bytes"] for s in mine)
            stats["pages_written"] = sum(s["writes"] for s in mine)
            stats["pages_shared"] = sum(s["shared_writes"] for s in mine)
        resets = stats.pop("reset_seconds")
        stats["mean_reset_ms"] = 1000 * resets / stats["resets"] if stats["resets"] else 0.0
        stats["strategy"] = self.strategy
        stats["sessions_dir"] = str(self.sessions_dir)
        stats["sessions_in_memory"] = self.in_memory
        stats["open_in_memory"] = stats["open_sessions"] - on_disk if self.in_memory else 0
        stats["open_on_disk"] = on_disk if self.in_memory else stats["open_sessions"]
        stats["bases_bytes"] = disk_usage(self.store.bases())
        stats["sessions_bytes"] = disk_usage(
            [p for folder in self._folders() for p in folder.glob(f"{self._prefix}-*")]
        )
        stats["bytes_on_disk"] = stats["bases_bytes"] + stats["sessions_bytes"]
        stats["descriptor_limit"] = descriptors.limits()[0]
        stats["descriptor_limit_raised_from"] = self.descriptors_raised_from
        stats["descriptors_in_use"] = descriptors.in_use()
        return stats

    def close(self) -> None:
        """Close every open session and release this process's claim on the root (idempotent)."""
        if self._closed:
            return
        for session in list(self._open):
            session.close()
        self._closed = True
        for handle in self._held.values():
            overlay.release_base(handle)
        self._held.clear()
        for lock_path, lockfile in self._claims:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            lockfile.close()
        if self.in_memory:
            # An empty folder in memory is clutter; another pool starting there re-creates it.
            with contextlib.suppress(OSError):
                self.sessions_dir.rmdir()

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "memory" if self.in_memory else "disk"
        return (
            f"<ReplicaPool {self.root} strategy={self.strategy} sessions={where} "
            f"open={len(self._open)}>"
        )


_pools: dict[int, ReplicaPool] = {}
_pools_lock = threading.Lock()


def default_pool() -> ReplicaPool:
    """The process-wide pool on :func:`default_root`: one per process, created on first use.

    The judge and every environment that is not given a pool share it, so a process opens each
    base once and sweeps orphans once.
    """
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None or pool._closed:
            pool = _pools[os.getpid()] = ReplicaPool()
            atexit.register(pool.close)
        return pool
