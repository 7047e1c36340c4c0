"""Per-trajectory PostgreSQL databases: templates named by content hash, and a pool of clones.

A template is an ordinary database made once from a source (:class:`Template`: a key, the
source's content hash, and a function that loads it), named ``bt_{key}_{hash}``, marked a template
and closed to connections: after it is made nobody connects to it again, so cloning it never
fails on a visitor. Its objects belong to the role ``birdenv_owner``, which logs in nowhere.

:class:`DatabasePool` keeps ``ready`` clones of each template it has served (``CREATE DATABASE ...
TEMPLATE``), refilled by a background thread, so that :meth:`DatabasePool.lease` hands out a ready
database in about a millisecond; :meth:`DatabasePool.release` drops it in the background. Each
clone has its own login role, of the same name, which owns the clone and is a member of
``birdenv_owner`` (so it may alter and drop the tables), and nothing else: not a superuser, no
``CREATEDB``/``CREATEROLE``, no ``pg_execute_server_program``, and its backends can be signalled
by no other clone's role (PostgreSQL lets a role signal only its own backends). The server refuses
``COPY ... TO PROGRAM``, ``ALTER SYSTEM``, server-side ``lo_import``, untrusted languages,
``dblink``, ``CREATE DATABASE`` and ``SET ROLE`` to the administrator by itself.

Clones are named ``bc_{host}_{pid}_{life}_{n}`` (``life``: random per process); a pool drops, when
it starts, the clones and roles left by a process of this host that is no longer alive (a crash),
or by an earlier process that had its process id.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import hashlib
import itertools
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from birdenv.errors import PoolClosedError
from birdenv.postgres.server import (
    PostgresServerError,
    PrivateCluster,
    Server,
    default_server,
    psycopg,
)

__all__ = [
    "OWNER_ROLE",
    "DatabasePool",
    "Lease",
    "RoleLimits",
    "Template",
    "default_database_pool",
]

#: The role that owns every template's objects; clones' roles are its members.
OWNER_ROLE = "birdenv_owner"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_CLONE = re.compile(r"^bc_([0-9a-f]{6})_(\d+)_([0-9a-f]{6})_\d+$")
# Tells this process's clones from those of an earlier process that had the same id.
_LIFE = secrets.token_hex(3)
# Numbers clones across every pool of the process: names must not meet on one server.
_COUNTER = itertools.count()


@dataclasses.dataclass(frozen=True)
class Template:
    """A template's source: ``key`` (a short name, e.g. the database id), ``content_hash`` (of
    the source: a different source is a different template) and ``load(conn)``, which fills the
    new database through ``conn``, an administrator's autocommit connection whose role is
    already set to ``birdenv_owner``."""

    key: str
    content_hash: str
    load: Callable[[Any], None] = dataclasses.field(compare=False)

    @property
    def name(self) -> str:
        """The template database's name: ``bt_{key}_{first 16 hex digits of the hash}``."""
        key = re.sub(r"[^a-z0-9_]", "_", self.key.lower())[:40]
        return f"bt_{key}_{self.content_hash[:16]}"


@dataclasses.dataclass(frozen=True)
class RoleLimits:
    """Settings every clone's role gets, which the agent cannot raise: ``temp_file_limit`` is a
    superuser's setting; ``work_mem`` is the default (a session may change it for itself)."""

    work_mem: str = "32MB"
    temp_file_limit: str = "1GB"


@dataclasses.dataclass(frozen=True)
class Lease:
    """A clone handed to one trajectory: its database (and login role) ``name``, its template."""

    name: str
    template: str


# Run in a clone as the administrator, {role} being the clone's role: schemas and relations
# change owner (a table's own sequences follow it; other sequences after).
_ADOPT = """
DO $adopt$
DECLARE item record;
BEGIN
    FOR item IN SELECT nspname FROM pg_namespace
            WHERE nspname NOT IN ('pg_catalog', 'information_schema') AND nspname NOT LIKE 'pg\\_%'
    LOOP
        EXECUTE format('ALTER SCHEMA %I OWNER TO {role}', item.nspname);
    END LOOP;
    FOR item IN SELECT c.relkind, n.nspname, c.relname FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
              AND n.nspname NOT IN ('pg_catalog', 'information_schema')
              AND n.nspname NOT LIKE 'pg\\_%'
            ORDER BY c.relkind = 'S'
    LOOP
        BEGIN
            EXECUTE format('ALTER %s %I.%I OWNER TO {role}',
                CASE item.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                    WHEN 'f' THEN 'FOREIGN TABLE' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                item.nspname, item.relname);
        EXCEPTION WHEN feature_not_supported OR object_not_in_prerequisite_state THEN
            NULL;  -- a sequence owned by a table column: it moved with its table
        END;
    END LOOP;
END
$adopt$
"""


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DatabasePool:
    """Clones of templates, ready before they are asked for (see the module's docstring).

    ``server``: the :class:`~birdenv.postgres.server.Server` (default
    :func:`~birdenv.postgres.server.default_server`, or ``dsn=``); ``ready``: clones kept ready
    per template; ``workers``: background threads cloning and dropping; ``role_limits``: the
    clones' roles' settings; ``strategy``: ``CREATE DATABASE``'s (default ``FILE_COPY`` on the
    private cluster, the server's own default elsewhere).
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
    ) -> None:
        if ready < 0:
            raise ValueError("ready must be 0 or more")
        if strategy not in (None, "FILE_COPY", "WAL_LOG"):
            raise ValueError("strategy must be None, 'FILE_COPY' or 'WAL_LOG'")
        self.server = server or default_server(dsn)
        # FILE_COPY copies the template's files and checkpoints: 2-3x faster than the default
        # WAL_LOG on this project's scratch cluster (fsync off); another server keeps its default.
        if strategy is None and isinstance(self.server, PrivateCluster):
            strategy = "FILE_COPY"
        self.strategy = strategy
        self.ready = ready
        self.role_limits = role_limits or RoleLimits()
        self._lock = threading.Lock()
        self._ready: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self._pending: dict[str, int] = collections.defaultdict(int)
        self._made: set[str] = set()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="birdenv-pg")
        self._futures: set[Future[Any]] = set()
        self._closed = False
        # Failures of background drops (a clone left behind), raised by the next lease.
        self._errors: list[BaseException] = []
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
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext('birdenv-setup'))")

    def _drop_leaked(self, conn: Any) -> None:
        """Drop the clones and roles of this host's processes that are gone."""
        names = {r for (r,) in conn.execute("SELECT datname FROM pg_database").fetchall()}
        names |= {r for (r,) in conn.execute("SELECT rolname FROM pg_roles").fetchall()}
        for name in sorted(names):
            match = _CLONE.match(name)
            if not match or match.group(1) != _HOST:
                continue
            pid = int(match.group(2))
            if not _alive(pid) or (pid == os.getpid() and match.group(3) != _LIFE):
                self._drop(name, conn)

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
                    self._build(source, conn)
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (name,))
        self._made.add(name)
        return name

    def _build(self, source: Template, conn: Any) -> None:
        name, building = source.name, source.name[:55] + "_build"
        conn.execute(f"DROP DATABASE IF EXISTS {_quote(building)} WITH (FORCE)")
        conn.execute(
            f"CREATE DATABASE {_quote(building)} TEMPLATE template0 OWNER {OWNER_ROLE} "
            "ENCODING 'UTF8'"
        )
        try:
            with psycopg().connect(**self.server.connect_kwargs(building), autocommit=True) as db:
                db.execute(f"SET ROLE {OWNER_ROLE}")
                source.load(db)
        except BaseException:
            conn.execute(f"DROP DATABASE IF EXISTS {_quote(building)} WITH (FORCE)")
            raise
        # Published whole, under its final name, only once it is complete.
        conn.execute(f"ALTER DATABASE {_quote(building)} RENAME TO {_quote(name)}")
        conn.execute(f"ALTER DATABASE {_quote(name)} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
        comment = f"birdenv template {source.key} sha256:{source.content_hash}"
        conn.execute(f"COMMENT ON DATABASE {_quote(name)} IS {_literal(comment)}")

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
        name = f"bc_{_HOST}_{os.getpid()}_{_LIFE}_{next(_COUNTER)}"
        limits = self.role_limits
        with self._admin() as conn:
            conn.execute(f"CREATE ROLE {name} LOGIN IN ROLE {OWNER_ROLE}")
            conn.execute(f"ALTER ROLE {name} SET temp_file_limit = '{limits.temp_file_limit}'")
            conn.execute(f"ALTER ROLE {name} SET work_mem = '{limits.work_mem}'")
            try:
                how = f" STRATEGY {self.strategy}" if self.strategy else ""
                conn.execute(
                    f"CREATE DATABASE {name} TEMPLATE {_quote(template)} OWNER {name}{how}"
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.execute(f"DROP ROLE IF EXISTS {name}")
                raise
            conn.execute(f"REVOKE ALL ON DATABASE {name} FROM PUBLIC")
        if not template.startswith("bt_"):
            self._adopt(name)
        return name

    def _adopt(self, name: str) -> None:
        """Give a clone's role the clone's schemas, tables, views and sequences, for a template
        made by someone else (e.g. ``{db_id}_template`` of the official images, owned by a
        superuser): as the owner of a clone it made itself, the role may then query and change
        them. Nothing outside the clone changes."""
        with psycopg().connect(**self.server.connect_kwargs(name), autocommit=True) as db:
            db.execute(_ADOPT.replace("{role}", name))

    def _drop(self, name: str, conn: Any | None = None) -> None:
        if conn is None:
            with self._admin() as own:
                self._drop(name, own)
            return
        conn.execute(f"DROP DATABASE IF EXISTS {_quote(name)} WITH (FORCE)")
        conn.execute(f"DROP ROLE IF EXISTS {_quote(name)}")

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # kept, and raised by a later lease (never lost)
                with self._lock:
                    self._errors.append(exc)

        future = self._executor.submit(run)
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
            if not self._closed:
                self._ready[template].append(name)
                return
        self._drop(name)

    def _top_up(self, template: str) -> None:
        with self._lock:
            if self._closed:
                return
            missing = self.ready - len(self._ready[template]) - self._pending[template]
            self._pending[template] += max(missing, 0)
        for _ in range(max(missing, 0)):
            self._submit(self._refill, template)

    def warm(self, template: str) -> None:
        """Start cloning ``template`` in the background so that its first lease is ready."""
        self._top_up(template)

    def lease(self, template: str) -> Lease:
        """A fresh clone of ``template`` for one trajectory: a ready one when there is one (then
        a replacement is cloned in the background), else one cloned now.

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
        if name is None:
            try:
                name = self._clone(template)
            except psycopg().Error as exc:
                raise PostgresServerError(
                    f"cannot clone {template} on {self.server.description}: {str(exc).strip()}"
                ) from exc
        self._top_up(template)
        return Lease(name, template)

    def release(self, lease: Lease) -> None:
        """Drop a leased clone, in the background (its connections are ended first)."""
        with self._lock:
            closed = self._closed
        if closed:
            self._drop(lease.name)
        else:
            self._submit(self._again, self._drop, lease.name)

    def connect(self, lease: Lease) -> Any:
        """A new connection to a leased clone, as its own role (not autocommit, as the official
        evaluator's connections)."""
        try:
            return psycopg().connect(
                **self.server.connect_kwargs(lease.name, user=lease.name), connect_timeout=10
            )
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
        """Clones ready and being made, over all templates."""
        with self._lock:
            return {
                "ready": sum(map(len, self._ready.values())),
                "pending": sum(self._pending.values()),
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


def default_database_pool() -> DatabasePool:
    """The process's pool on the default server (made on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = DatabasePool()
            atexit.register(_DEFAULT.close)  # before the server's own exit hook: LIFO
        return _DEFAULT
