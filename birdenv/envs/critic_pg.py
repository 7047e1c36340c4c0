"""``BirdCritic-PostgreSQL-v0``: the debugging environment on PostgreSQL."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any, ClassVar

from birdenv.dialects import POSTGRESQL
from birdenv.envs.critic import BirdCriticEnv
from birdenv.errors import ArgumentError, DatabaseNotFoundError
from birdenv.schema import ServerCatalog, read_server_catalog

__all__ = ["BirdCriticPgEnv"]

# The server catalogs of the official layout's templates, per pool they were read from.
_CATALOGS: weakref.WeakKeyDictionary[Any, dict[str, ServerCatalog]] = weakref.WeakKeyDictionary()


class BirdCriticPgEnv(BirdCriticEnv):
    """
    ## Description
    ``BirdCritic-SQLite-v0``'s environment, tools, observations and protocol, on PostgreSQL: every
    episode owns a database cloned from its task's template (leased ready from a pool, dropped in
    the background when the episode ends), reached through a role that owns that database and
    nothing else. Statements run as the official BIRD-CRITIC PostgreSQL evaluator runs them (each
    committed; 60 s ``statement_timeout`` there, the env's ``statement_timeout`` here) under the
    same row and byte caps, and a submission is judged by the official PostgreSQL evaluator's
    phases (:mod:`birdenv.judge.postgres`). Needs the ``postgres`` extra and a PostgreSQL server:
    the project starts its own from the binaries on the machine, or uses ``BIRDENV_PG_DSN``.

    ```python
    >>> import gymnasium as gym, birdenv
    >>> env = gym.make("BirdCritic-PostgreSQL-v0")
    >>> obs, info = env.reset(seed=0)
    >>> env.unwrapped.session.execute("SELECT version()").rows[0][0].split()[0]
    'PostgreSQL'
    >>> env.close()

    ```

    ## Arguments
    Those of ``BirdCritic-SQLite-v0``, with ``suite`` defaulting to ``"critic-mini-pg"``; tasks
    from a file (``tasks=``) are played on PostgreSQL whatever dialect their rows name. With
    ``db_dir``, each task's database is the SQLite file of the official layout, converted once
    into a template (:mod:`birdenv.postgres.convert`); without it (``tasks=`` alone), the server's
    own ``{db_id}_template`` database, as the official PostgreSQL images hold them. ``pool`` is a
    :class:`birdenv.judge.postgres.TaskDatabases` to share (default: the process's), or
    ``pool_options`` (``ready``, ``dsn``, ...) to build one; ``pg_dsn``: a libpq connection string
    of the server to use instead of the default one (``BIRDENV_PG_DSN``, else the project's own
    cluster); its user must be able to create databases and roles.

    ## Version History
    - v0: initial release.
    """

    env_id: ClassVar[str] = "BirdCritic-PostgreSQL-v0"
    dialect: ClassVar[str] = "postgresql"
    #: Rows of a file that name no dialect are read as SQLite's: they are played here.
    dialects: ClassVar[tuple[str, ...]] = ("postgresql", "sqlite")

    def __init__(
        self,
        suite: str | None = None,
        *,
        tasks: str | Path | list[Any] | None = None,
        pg_dsn: str | None = None,
        **kwargs: Any,
    ) -> None:
        if suite is None and tasks is None:
            suite = "critic-mini-pg"
        if pg_dsn is not None:
            if kwargs.get("pool") is not None:
                raise ArgumentError("BirdCriticPgEnv: give pg_dsn= or pool=, not both")
            kwargs["pool_options"] = {**(kwargs.get("pool_options") or {}), "dsn": pg_dsn}
        super().__init__(suite, tasks=tasks, **kwargs)
        self.tasks = [
            t if t.dialect == POSTGRESQL.name else dataclasses.replace(t, dialect=POSTGRESQL.name)
            for t in self.tasks
        ]
        self._by_id = {str(t.instance_id): t for t in self.tasks}

    def server_catalog(self, task: Any) -> ServerCatalog | None:
        """For a task of the official layout (no ``db_dir``: the server's ``{db_id}_template``),
        its database as the server holds it, read once per template and pool from a fresh clone
        (the template itself is never connected to)."""
        if task.db_dir is not None:
            return None
        catalogs = _CATALOGS.setdefault(self.pool, {})
        template = self.pool.template_for(task)
        if template not in catalogs:
            from birdenv.postgres import PgSession  # psycopg: the postgres extra

            self._require_template(task, template)

            lease = self.pool.lease(task)
            with PgSession(self.pool.pool, lease, limits=self.limits) as session:
                catalogs[template] = read_server_catalog(session)
        return catalogs[template]

    def _require_template(self, task: Any, template: str) -> None:
        """:class:`DatabaseNotFoundError` saying where the official layout's databases must be
        when the server does not hold ``template`` (before any clone of it is asked for)."""
        server = self.pool.pool.server
        with server.admin() as admin:
            found = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (template,))
            if found.fetchone() is not None:
                return
        raise DatabaseNotFoundError(
            f"task {task.instance_id!r} has no database folder, so its database is the server's "
            f"own {template!r} (the official PostgreSQL layout), but {server.description} holds "
            "none: create it there, point BIRDENV_PG_DSN (or pg_dsn=) at the server that holds "
            "it, or load the tasks with db_dir= (SQLite files converted into templates). On a "
            "Ray cluster each node uses its own server unless BIRDENV_PG_DSN names one that "
            "every node reaches"
        )

    @property
    def pool(self) -> Any:
        """The :class:`~birdenv.judge.postgres.TaskDatabases` clones are leased from."""
        # psycopg: the postgres extra, needed once a PostgreSQL episode starts
        from birdenv.judge.postgres import TaskDatabases, default_task_databases

        if self._pool is None:
            if self._pool_options:
                self._pool, self._owns_pool = TaskDatabases(**self._pool_options), True
            else:
                self._pool = default_task_databases()
        return self._pool
