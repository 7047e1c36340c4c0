"""Template databases: one per source, named by its content hash, made once and kept as made.

A template is an ordinary database made once from a source (:class:`Template`: a key, the
source's content hash, and a function that loads it), named ``bt_{key}_{hash}``, marked a template
and closed to connections: after it is made nobody connects to it again, so cloning it never
fails on a visitor. Its objects belong to the role ``birdenv_owner``, which logs in nowhere and
has no members; the databases themselves belong to the administrator. :func:`check_templates`,
run when a pool starts, checks every template's catalog entry (a template, closed to
connections, no connection limit, no settings, no grants, its comment) and that
``birdenv_owner`` has no members: what differs is repaired, a template that was opened to
connections (its contents may have changed) is dropped and rebuilt from its source on next use,
and one line of the log says what was done.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

from birdenv.postgres.server import Server, psycopg

log = logging.getLogger(__name__)

__all__ = ["OWNER_ROLE", "Template", "build_template", "check_templates", "literal", "quote"]

#: The role that owns every template's objects; it logs in nowhere and has no members.
OWNER_ROLE = "birdenv_owner"


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


def quote(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """``text`` as a quoted SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def build_template(source: Template, conn: Any, server: Server) -> None:
    """Make ``source``'s template on ``server`` through ``conn`` (an administrator's
    autocommit connection): built under a temporary name and published whole, marked a
    template, closed to connections, its comment naming its key and content hash."""
    name, building = source.name, source.name[:55] + "_build"
    conn.execute(f"DROP DATABASE IF EXISTS {quote(building)} WITH (FORCE)")
    conn.execute(
        f"CREATE DATABASE {quote(building)} TEMPLATE template0 OWNER {OWNER_ROLE} ENCODING 'UTF8'"
    )
    try:
        with psycopg().connect(**server.connect_kwargs(building), autocommit=True) as db:
            db.execute(f"SET ROLE {OWNER_ROLE}")
            source.load(db)
    except BaseException:
        conn.execute(f"DROP DATABASE IF EXISTS {quote(building)} WITH (FORCE)")
        raise
    # Published whole, under its final name, only once it is complete.
    conn.execute(f"ALTER DATABASE {quote(building)} RENAME TO {quote(name)}")
    conn.execute(f"ALTER DATABASE {quote(name)} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
    comment = f"birdenv template {source.key} sha256:{source.content_hash}"
    conn.execute(f"COMMENT ON DATABASE {quote(name)} IS {literal(comment)}")


def check_templates(conn: Any, where: str) -> None:
    """Put the owner role and every template on the server back in the state
    :func:`build_template` left them in (see the module's docstring); log one line, naming
    ``where`` (the server), when anything differed. ``conn``: an administrator's autocommit
    connection."""
    repaired: list[str] = []
    members = conn.execute(
        "SELECT m.rolname FROM pg_auth_members a JOIN pg_roles r ON r.oid = a.roleid "
        "JOIN pg_roles m ON m.oid = a.member WHERE r.rolname = %s",
        (OWNER_ROLE,),
    ).fetchall()
    for (member,) in members:
        conn.execute(f"REVOKE {OWNER_ROLE} FROM {quote(member)}")
        repaired.append(f"{member} no longer a member of {OWNER_ROLE}")
    if conn.execute(
        "SELECT 1 FROM pg_roles WHERE rolname = %s AND (rolcanlogin OR rolsuper OR "
        "rolcreatedb OR rolcreaterole OR rolreplication OR rolbypassrls)",
        (OWNER_ROLE,),
    ).fetchone():
        conn.execute(
            f"ALTER ROLE {OWNER_ROLE} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
            "NOREPLICATION NOBYPASSRLS"
        )
        repaired.append(f"{OWNER_ROLE}'s attributes")
    dropped: list[str] = []
    rows = conn.execute(
        "SELECT d.datname, d.datistemplate, d.datallowconn, d.datconnlimit, "
        "pg_get_userbyid(d.datdba), coalesce(shobj_description(d.oid, 'pg_database'), ''), "
        "EXISTS (SELECT 1 FROM pg_db_role_setting s WHERE s.setdatabase = d.oid), "
        "ARRAY(SELECT DISTINCT a.grantee::regrole::text FROM aclexplode(d.datacl) a "
        "      WHERE a.grantee NOT IN (0, d.datdba)) "
        "FROM pg_database d WHERE d.datname ~ '^bt_.+_[0-9a-f]+$'"
    ).fetchall()
    for name, template, allowconn, limit, owner, comment, settings, grantees in rows:
        quoted = quote(name)
        if allowconn or not comment.startswith("birdenv template "):
            # Open to connections, its contents may have changed; or not ours as made.
            if template:
                conn.execute(f"ALTER DATABASE {quoted} IS_TEMPLATE false")
            conn.execute(f"DROP DATABASE {quoted} WITH (FORCE)")
            dropped.append(name)
            continue
        fixes = []
        if not template:
            fixes.append("IS_TEMPLATE true")
        if limit != -1:
            fixes.append("CONNECTION LIMIT -1")
        if fixes:
            conn.execute(f"ALTER DATABASE {quoted} WITH {' '.join(fixes)}")
        if owner != OWNER_ROLE:
            conn.execute(f"ALTER DATABASE {quoted} OWNER TO {OWNER_ROLE}")
            fixes.append("owner")
        if settings:
            for (role,) in conn.execute(
                "SELECT CASE WHEN s.setrole = 0 THEN NULL ELSE s.setrole::regrole::text END "
                "FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase "
                "WHERE d.datname = %s",
                (name,),
            ).fetchall():
                target = f"ROLE {role} IN DATABASE" if role else "DATABASE"
                conn.execute(f"ALTER {target} {quoted} RESET ALL")
            fixes.append("settings")
        for grantee in grantees:
            conn.execute(f"REVOKE ALL ON DATABASE {quoted} FROM {grantee}")
            fixes.append(f"grant to {grantee}")
        if fixes:
            repaired.append(f"{name} ({', '.join(fixes)})")
    if repaired or dropped:
        log.warning(
            "database pool on %s: templates and roles checked: repaired %s; dropped %s "
            "(rebuilt from their sources on next use)",
            where,
            "; ".join(repaired) or "nothing",
            ", ".join(dropped) or "none",
        )
