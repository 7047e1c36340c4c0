"""PostgreSQL: the server (a private cluster or a DSN), templates and a pool of per-trajectory
clones, and sessions with the same ``execute(sql) -> Result`` face as the SQLite sessions.

Needs the ``postgres`` extra (``psycopg``); nothing on the SQLite path imports this package.
"""

from birdenv.postgres.pool import DatabasePool, Lease, RoleLimits, default_database_pool
from birdenv.postgres.server import (
    ExternalServer,
    PostgresNotFoundError,
    PostgresServerError,
    PrivateCluster,
    Server,
    default_server,
    find_bindir,
)
from birdenv.postgres.session import PgSession
from birdenv.postgres.templates import Template

__all__ = [
    "DatabasePool",
    "ExternalServer",
    "Lease",
    "PgSession",
    "PostgresNotFoundError",
    "PostgresServerError",
    "PrivateCluster",
    "RoleLimits",
    "Server",
    "Template",
    "default_database_pool",
    "default_server",
    "find_bindir",
]
