"""Per-trajectory PostgreSQL databases: a pool of clones of templates.

Templates (one per source, named by content hash, checked and repaired when a pool starts) are
:mod:`birdenv.postgres.templates`; clones' names and leftovers, :mod:`birdenv.postgres.clones`.

:class:`DatabasePool` keeps ``ready`` clones of each template it has served (``CREATE DATABASE ...
TEMPLATE``), refilled by a background thread, so that :meth:`DatabasePool.lease` hands out a ready
database in about a millisecond; :meth:`DatabasePool.release` drops it in the background while
fewer than ``backlog`` released clones wait for their drop, else at once: drops keep pace with
leases, so the disk the clones take and the work left when the pool closes stay bounded. Each
clone has its own login role, of the same name, which owns what lives inside the clone (its
schemas, tables, views and sequences, given to it when the clone is made) and nothing else. It is
a member of no role, and the clone database itself is the administrator's: the role has
``CONNECT``, ``CREATE`` and ``TEMPORARY`` on it, so no ``ALTER DATABASE``, ``COMMENT ON
DATABASE``, ``GRANT`` on a template or ``REASSIGN OWNED`` can reach shared state. It is not a
superuser, has no ``CREATEDB``/``CREATEROLE``, no ``pg_execute_server_program``, and its backends
can be signalled by no other clone's role (PostgreSQL lets a role signal only its own backends).
The server refuses ``COPY ... TO PROGRAM``, ``ALTER SYSTEM``, server-side ``lo_import``, untrusted
languages, ``dblink``, ``CREATE DATABASE`` and ``SET ROLE`` to the administrator by itself. The
advisory-lock functions are revoked in every clone (a lock taken by one would outlive its
statement); :mod:`birdenv.postgres.watchdog` bounds each statement's time and locks, the private
cluster its memory (:class:`~birdenv.postgres.server.PrivateCluster`).

Clones left by a process that is gone are dropped when a pool starts
(:func:`~birdenv.postgres.clones.leaked`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from birdenv.errors import PoolClosedError
from birdenv.postgres.clones import ADOPT, RENAMED, clone_name, leaked
from birdenv.postgres.server import (
    PostgresServerError,
    PrivateCluster,
    Server,
    default_server,
    psycopg,
)
from birdenv.postgres.templates import (
    OWNER_ROLE,
    Template,
    build_template,
    check_templates,
    literal,
    quote,
)
from birdenv.postgres.values import psycopg2_values
from birdenv.postgres.watchdog import Watchdog

__all__ = [
    "DatabasePool",
    "Lease",
    "RoleLimits",
    "current_database_pool",
    "default_database_pool",
]


@dataclasses.dataclass(frozen=True)
class RoleLimits:
    """Bounds every clone's role gets. ``temp_file_limit`` is a superuser's setting, which the
    agent cannot raise; ``work_mem`` is the default (a session may change it for itself);
    ``client_connection_check_interval`` ends a statement whose client went away (a session
    that sets it to 0 is ended by the next pool that starts: see the module's docstring).

    The others hold whatever a session sets (:mod:`birdenv.postgres.watchdog`): ``max_locks``
    locks one backend may hold while a statement runs (checked every 0.1 s; past it the statement
    is cancelled); ``grace`` seconds a cancelled statement has to stop before its backend is
    terminated. Memory is bounded by the server
    (:class:`~birdenv.postgres.server.PrivateCluster`'s ``max_backend_memory``)."""

    work_mem: str = "32MB"
    temp_file_limit: str = "1GB"
    client_connection_check_interval: str = "1s"
    max_locks: int = 2000
    grace: float = 2.0


@dataclasses.dataclass(frozen=True)
class Lease:
    """A clone handed to one trajectory: its login role ``name`` (also its database's name,
    unless the clone was leased under the name ``database``), its template."""

    name: str
    template: str
    database: str = ""

    def __post_init__(self) -> None:
        if not self.database:
            object.__setattr__(self, "database", self.name)


class DatabasePool:
    """Clones of templates, ready before they are asked for (see the module's docstring).

    ``server``: the :class:`~birdenv.postgres.server.Server` (default
    :func:`~birdenv.postgres.server.default_server`, or ``dsn=``); ``ready``: clones kept ready
    per template; ``workers``: background threads cloning and dropping; ``role_limits``: the
    clones' roles' settings; ``strategy``: ``CREATE DATABASE``'s (default ``FILE_COPY`` on the
    private cluster, the server's own default elsewhere); ``backlog``: the most released clones
    left to background drops (a release past it drops its clone in the caller's thread).
    """

    def __init__(
        self,
        server: Server | None = None,
        *,
        dsn: str | None = None,
        ready: int = 2,
        workers: int = 2,
        role_limits: RoleLimits | None = None,
        strategy: str | None = None,
        backlog: int = 4,
    ) -> None:
        if ready < 0:
            raise ValueError("ready must be 0 or more")
        if backlog < 0:
            raise ValueError("backlog must be 0 or more")
        if strategy not in (None, "FILE_COPY", "WAL_LOG"):
            raise ValueError("strategy must be None, 'FILE_COPY' or 'WAL_LOG'")
        self.server = server or default_server(dsn)
        # FILE_COPY copies the template's files and checkpoints: 2-3x faster than the default
        # WAL_LOG on this project's scratch cluster (fsync off); another server keeps its default.
        if strategy is None and isinstance(self.server, PrivateCluster):
            strategy = "FILE_COPY"
        self.strategy = strategy
        self.ready = ready
        self.backlog = backlog
        self.role_limits = role_limits or RoleLimits()
        self._lock = threading.Lock()
        self._ready: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self._pending: dict[str, int] = collections.defaultdict(int)
        self._expected: dict[str, int] = {}  # leases still to come, where a caller said (expect)
        self._made: set[str] = set()
        self._dropping = 0  # released clones left to the background, not dropped yet
        # One lease of a database name at a time in this process (lease_as).
        self._names: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="birdenv-pg")
        self._futures: set[Future[Any]] = set()
        self._closed = False
        self._leased = 0
        # Failures of background drops (a clone left behind), raised by the next lease.
        self._errors: list[BaseException] = []
        #: Time and lock bounds on every statement of the connections :meth:`connect` opens.
        self.watchdog = Watchdog(
            self._admin, max_locks=self.role_limits.max_locks, grace=self.role_limits.grace
        )
        self._setup()

    # -- set-up ---------------------------------------------------------------------------------
    def _admin(self) -> Any:
        try:
            return self.server.admin()
        except PostgresServerError:
            self.server.ensure_running()  # a private cluster that died is started again
            return self.server.admin()

    def _setup(self) -> None:
        with self._admin() as conn:
            conn.execute(
                "SELECT pg_advisory_lock(hashtext('birdenv-setup'))"
            )  # roles are cluster-wide: one process sets them up at a time
            try:
                exists = conn.execute(
                    "SELECT 1 FROM pg_roles WHERE rolname = %s", (OWNER_ROLE,)
                ).fetchone()
                if not exists:
                    conn.execute(f"CREATE ROLE {OWNER_ROLE} NOLOGIN")
                self._drop_leaked(conn)
                check_templates(conn, self.server.description)
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext('birdenv-setup'))")

    def _drop_leaked(self, conn: Any) -> None:
        """Drop the clones and roles of this host's processes that are gone (also a clone that
        such a process had renamed, :meth:`lease_as`)."""
        names = {r for (r,) in conn.execute("SELECT datname FROM pg_database").fetchall()}
        names |= {r for (r,) in conn.execute("SELECT rolname FROM pg_roles").fetchall()}
        for name in sorted(names):
            if leaked(name):
                self._drop(name, conn)
        for database, clone in conn.execute(RENAMED).fetchall():
            if leaked(clone):
                conn.execute(f"DROP DATABASE IF EXISTS {quote(database)} WITH (FORCE)")
                self._drop(clone, conn)

    def template(self, source: Template) -> str:
        """Make the template for ``source`` unless it exists; return its name (safe across
        processes: one makes it, the others wait for it)."""
        name = source.name
        if name in self._made:
            return name
        with self._admin() as conn:
            conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (name,))
            try:
                if not conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s AND datistemplate", (name,)
                ).fetchone():
                    build_template(source, conn, self.server)
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (name,))
        self._made.add(name)
        return name

    def templates(self) -> dict[str, str]:
        """The templates on the server: name -> comment (key and content hash)."""
        with self._admin() as conn:
            rows = conn.execute(
                "SELECT d.datname, shobj_description(d.oid, 'pg_database') FROM pg_database d "
                "WHERE d.datistemplate AND d.datname LIKE 'bt\\_%'"
            ).fetchall()
        return dict(rows)

    # -- clones -------------------------------------------------------------------------------
    def _clone(self, template: str) -> str:
        name = clone_name()
        limits = self.role_limits
        with self._admin() as conn:
            # A member of no role: nothing it inherits reaches a template or another role.
            conn.execute(f"CREATE ROLE {name} LOGIN")
            for setting in ("temp_file_limit", "work_mem", "client_connection_check_interval"):
                value = getattr(limits, setting)
                conn.execute(f"ALTER ROLE {name} SET {setting} = {literal(value)}")
            try:
                how = f" STRATEGY {self.strategy}" if self.strategy else ""
                # The administrator's database: its role cannot ALTER, COMMENT ON or mark it.
                conn.execute(f"CREATE DATABASE {name} TEMPLATE {quote(template)}{how}")
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.execute(f"DROP ROLE IF EXISTS {name}")
                raise
            conn.execute(f"REVOKE ALL ON DATABASE {name} FROM PUBLIC")
            conn.execute(f"GRANT CONNECT, CREATE, TEMPORARY ON DATABASE {name} TO {name}")
        self._adopt(name)
        return name

    def _adopt(self, name: str) -> None:
        """Give a clone's role the clone's schemas, tables, views and sequences (a template's
        objects belong to ``birdenv_owner``, or, for a template made by someone else such as
        ``{db_id}_template`` of the official images, to a superuser): as their owner the role may
        query and change them. Revoke the advisory-lock functions there. Nothing outside the
        clone changes."""
        with psycopg().connect(**self.server.connect_kwargs(name), autocommit=True) as db:
            db.execute(ADOPT.replace("{role}", name))

    def _drop(self, name: str, conn: Any | None = None) -> None:
        if conn is None:
            with self._admin() as own:
                self._drop(name, own)
            return
        quoted = quote(name)
        try:
            conn.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
        except psycopg().errors.WrongObjectType:  # marked a template (by an older version's role)
            conn.execute(f"ALTER DATABASE {quoted} IS_TEMPLATE false")
            conn.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
        try:
            conn.execute(f"DROP ROLE IF EXISTS {quoted}")
        except psycopg().errors.DependentObjectsStillExist:
            # Granted privileges elsewhere, or owning something outside its clone (possible
            # with an older version's roles): those go first.
            conn.execute(f"REASSIGN OWNED BY {quoted} TO CURRENT_USER")
            conn.execute(f"DROP OWNED BY {quoted}")
            conn.execute(f"DROP ROLE IF EXISTS {quoted}")

    def _recorded(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``; its failure is kept, and raised by a later lease (never lost)."""
        try:
            fn(*args)
        except BaseException as exc:
            with self._lock:
                self._errors.append(exc)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        future = self._executor.submit(self._recorded, fn, *args)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._futures.discard)

    def _again(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, tried once more after the server went away under it (killed,
        restarted) and runs again: background work recovers by itself."""
        try:
            return fn(*args)
        except (psycopg().OperationalError, PostgresServerError):
            self.server.ensure_running()
            return fn(*args)

    def _refill(self, template: str) -> None:
        with self._lock:
            if self._closed:  # queued before the pool closed: nobody will lease it
                self._pending[template] -= 1
                return
        try:
            name = self._again(self._clone, template)
        except Exception:
            # One ready clone fewer (e.g. the disk was full): the next lease that finds none
            # clones it then, and raises that clone's error if it fails again.
            return
        finally:
            with self._lock:
                self._pending[template] -= 1
        with self._lock:
            if not self._closed and len(self._ready[template]) < self._wanted(template):
                self._ready[template].append(name)
                return
        self._drop(name)  # the pool closed, or the leases it was made for were served

    def _wanted(self, template: str) -> int:
        """Clones to keep ready for ``template`` (under the lock): ``ready``, or fewer where
        fewer leases are expected."""
        return min(self.ready, self._expected.get(template, self.ready))

    def expect(self, template: str, leases: int) -> None:
        """Say that ``leases`` more leases of ``template`` will follow: until they are made, no
        more clones of it are kept ready than are still to be leased, and none after (a lease
        nobody said would come brings back ``ready``). A batch that says so leaves no ready
        clone behind to drop."""
        with self._lock:
            self._expected[template] = self._expected.get(template, 0) + leases
        self._top_up(template)

    def _top_up(self, template: str) -> None:
        with self._lock:
            if self._closed:
                return
            want = self._wanted(template)
            queue = self._ready[template]
            surplus = [queue.pop() for _ in range(len(queue) - want)]
            missing = want - len(queue) - self._pending[template]
            self._pending[template] += max(missing, 0)
        for name in surplus:  # no lease will come for them
            self._submit(self._again, self._drop, name)
        for _ in range(max(missing, 0)):
            self._submit(self._refill, template)

    def warm(self, template: str) -> None:
        """Start cloning ``template`` in the background so that its first lease is ready."""
        self._top_up(template)

    def lease(self, template: str) -> Lease:
        """A fresh clone of ``template`` for one trajectory: a ready one when there is one (then
        a replacement is cloned in the background), else one cloned now (see :meth:`expect`).

        Raises :class:`PostgresServerError` when no clone can be made now (its message is the
        server's, e.g. ``No space left on device``) or when a background drop failed."""
        with self._lock:
            if self._closed:
                raise PoolClosedError("this database pool is closed")
            if self._errors:
                error = self._errors.pop(0)
                raise PostgresServerError(f"a background drop failed: {error}") from error
            queue = self._ready[template]
            name = queue.popleft() if queue else None
            if self._expected.get(template):
                self._expected[template] -= 1
            else:
                self._expected.pop(template, None)  # not announced: the default again
        if name is None:
            try:
                name = self._clone(template)
            except psycopg().Error as exc:
                raise PostgresServerError(
                    f"cannot clone {template} on {self.server.description}: {str(exc).strip()}"
                ) from exc
        self._top_up(template)
        with self._lock:
            self._leased += 1
        return Lease(name, template)

    def lease_as(self, template: str, database: str, *, wait: float = 600.0) -> Lease:
        """A fresh clone of ``template`` that answers to the name ``database`` (a ready clone,
        renamed), for SQL that names its database (``db.schema.table``, ``table_catalog =
        'db'``) as the official evaluator's databases are named. A name is held by one lease at
        a time: a second lease of it waits for the first one's release (here or in another
        process on the same server, up to ``wait`` seconds). Where the server holds a database
        of that name that no pool made (the official images hold ``{db_id}`` beside
        ``{db_id}_template``), the clone keeps its own name."""
        with self._lock:
            lock = self._names[database]
        if not lock.acquire(timeout=wait):
            raise PostgresServerError(f"no clone could take the name {database} in {wait:g} s")
        try:
            lease = self.lease(template)
            try:
                named = self._rename(lease.name, database, time.monotonic() + wait)
            except BaseException:
                self.release(lease)
                raise
        except BaseException:
            lock.release()
            raise
        if not named:
            lock.release()
            return lease
        return Lease(lease.name, template, database)

    def _rename(self, name: str, database: str, deadline: float) -> bool:
        """Rename clone ``name`` to ``database``; False where a database of that name is not a
        pool's (then nothing changes)."""
        mark = f"birdenv clone {name}"
        with self._admin() as conn:
            while True:
                try:
                    conn.execute(f"ALTER DATABASE {quote(name)} RENAME TO {quote(database)}")
                    conn.execute(f"COMMENT ON DATABASE {quote(database)} IS {literal(mark)}")
                    return True
                except psycopg().errors.DuplicateDatabase:
                    (comment,) = conn.execute(
                        "SELECT coalesce(shobj_description(oid, 'pg_database'), '') "
                        "FROM pg_database WHERE datname = %s",
                        (database,),
                    ).fetchone() or ("birdenv clone ",)  # dropped meanwhile: try again
                    if not comment.startswith("birdenv clone "):
                        return False
                    holder = comment.removeprefix("birdenv clone ")
                    if leaked(holder):  # its process is gone: nobody will release it
                        conn.execute(f"DROP DATABASE IF EXISTS {quote(database)} WITH (FORCE)")
                        self._drop(holder, conn)
                        continue
                except psycopg().errors.ObjectInUse:
                    pass  # the backend that made the clone ready is still exiting
                if time.monotonic() > deadline:
                    raise PostgresServerError(
                        f"no clone could take the name {database}: another process holds it"
                    )
                time.sleep(0.05)

    def release(self, lease: Lease) -> None:
        """Drop a leased clone (its connections are ended first): in the background while fewer
        than ``backlog`` released clones wait for theirs, else now. Without the bound, leases
        made faster than the server drops would pile clones up on the disk, and the process
        would wait for every one of them at exit."""
        if lease.database != lease.name:
            # Dropped now, so that the name is free when the next lease of it gets the lock.
            try:
                with self._admin() as conn:
                    conn.execute(f"DROP DATABASE IF EXISTS {quote(lease.database)} WITH (FORCE)")
                    self._drop(lease.name, conn)
            finally:
                self._names[lease.database].release()
            return
        with self._lock:
            closed = self._closed
            later = not closed and self._dropping < self.backlog
            self._dropping += later
            self._leased -= 1
        if closed:
            self._drop(lease.name)
        elif later:
            self._submit(self._drop_released, lease.name)
        else:
            self._recorded(self._again, self._drop, lease.name)

    def _drop_released(self, name: str) -> None:
        try:
            self._again(self._drop, name)
        finally:
            with self._lock:
                self._dropping -= 1

    def connect(self, lease: Lease) -> Any:
        """A new connection to a leased clone, as its own role (not autocommit, as the official
        evaluator's connections), reading values as psycopg2 reads them
        (:func:`birdenv.postgres.values.psycopg2_values`), its statements guarded by
        :attr:`watchdog`."""
        try:
            conn = psycopg().connect(
                **self.server.connect_kwargs(lease.database, user=lease.name),
                connect_timeout=10,
                context=psycopg2_values(),
            )
            self.watchdog.register(conn)
            return conn
        except psycopg().OperationalError as exc:
            text = str(exc).strip()
            if "too many clients" in text or "connection slots are reserved" in text:
                text += (
                    " (the server's max_connections is reached: close sessions, or raise it "
                    "on the server)"
                )
            elif "could not write" in text or "No space left on device" in text:
                text += " (the disk under the server's data directory may be full)"
            raise PostgresServerError(
                f"cannot connect to clone {lease.name} on {self.server.description}: {text}"
            ) from exc

    def drain(self) -> None:
        """Wait until every background clone and drop has finished."""
        while True:
            with self._lock:
                futures = list(self._futures)
            if not futures:
                return
            for future in futures:
                future.result()

    def stats(self) -> dict[str, int]:
        """Clones ready, being made, leased and not released yet, and released but not dropped
        yet, over all templates."""
        with self._lock:
            return {
                "ready": sum(map(len, self._ready.values())),
                "pending": sum(self._pending.values()),
                "leased": self._leased,
                "dropping": self._dropping,
            }

    def close(self) -> None:
        """Drop every ready clone and wait for background work (idempotent); leased clones are
        dropped when released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drain()
        self._executor.shutdown(wait=True)
        self.watchdog.close()
        with self._lock:
            names = [n for q in self._ready.values() for n in q]
            self._ready.clear()
        if names:
            with contextlib.suppress(PostgresServerError), self._admin() as conn:
                for name in names:
                    self._drop(name, conn)

    def __enter__(self) -> DatabasePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DEFAULT: DatabasePool | None = None
_DEFAULT_LOCK = threading.Lock()


def _forget_in_child() -> None:
    # A forked process (an environment worker) makes a pool of its own: the ready clones its
    # copy of the parent's pool lists are the parent's, which both would lease, and the first
    # to release one would drop it (and its role) under the other.
    global _DEFAULT, _DEFAULT_LOCK
    _DEFAULT, _DEFAULT_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def current_database_pool() -> DatabasePool | None:
    """The process's default pool if it was made and is open, else None (nothing is started)."""
    with _DEFAULT_LOCK:
        return None if _DEFAULT is None or _DEFAULT._closed else _DEFAULT


def default_database_pool() -> DatabasePool:
    """The process's pool on the default server (made on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = DatabasePool()
            atexit.register(_DEFAULT.close)  # before the server's own exit hook: LIFO
        return _DEFAULT
