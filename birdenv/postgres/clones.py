"""Clones' names, and what tells a clone left by a process that is gone from a live one.

Clones are named ``bc_{host}_{pid}_{life}_{n}`` (``life``: random per process); a pool drops, when
it starts, the clones and roles left by a process of this host that is no longer alive (a crash),
or by an earlier process that had its process id (:func:`leaked`). :data:`ADOPT` gives a new
clone's objects to its role.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import secrets
import socket

from birdenv.postgres.server import process_alive

__all__ = ["ADOPT", "RENAMED", "clone_name", "leaked"]

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_CLONE = re.compile(r"^bc_([0-9a-f]{6})_(\d+)_([0-9a-f]{6})_\d+$")
# Tells this process's clones from those of an earlier process that had the same id.
_LIFE = secrets.token_hex(3)
# Numbers clones across every pool of the process: names must not meet on one server.
_COUNTER = itertools.count()

#: Databases a clone was renamed to (``DatabasePool.lease_as``), and that clone's own name.
RENAMED = (
    "SELECT datname, substr(shobj_description(oid, 'pg_database'), 15) FROM pg_database "
    "WHERE shobj_description(oid, 'pg_database') LIKE 'birdenv clone %'"
)

# Run in every new clone as the administrator, {role} being the clone's role: schemas and
# relations change owner (a table's own sequences follow it; other sequences after), and the
# advisory-lock functions are revoked (unlocking stays): a session-level advisory lock outlives its
# statement, and thousands of them fill the cluster's shared lock table for every trajectory.
ADOPT = """
DO $adopt$
DECLARE item record;
BEGIN
    FOR item IN SELECT p.oid::regprocedure AS fn FROM pg_proc p
            WHERE p.pronamespace = 'pg_catalog'::regnamespace
              AND p.proname LIKE '%advisory%lock%' AND p.proname NOT LIKE '%unlock%'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', item.fn);
    END LOOP;
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


def clone_name(pid: int | None = None) -> str:
    """A new clone's name (also its role's), as made by process ``pid`` (default: this one)."""
    return f"bc_{_HOST}_{os.getpid() if pid is None else pid}_{_LIFE}_{next(_COUNTER)}"


def leaked(name: str) -> bool:
    """Whether ``name`` is a clone of a process of this host that is gone (or of an earlier
    process that had this one's id)."""
    match = _CLONE.match(name)
    if not match or match.group(1) != _HOST:
        return False
    pid = int(match.group(2))
    return not process_alive(pid) or (pid == os.getpid() and match.group(3) != _LIFE)
