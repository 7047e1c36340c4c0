"""PostgreSQL against a hostile agent: no statement may change shared state, outlive its bound,
starve another trajectory or wedge its own session."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from birdenv.postgres import DatabasePool, PgSession, PrivateCluster, Template, find_bindir
from birdenv.postgres.pool import OWNER_ROLE
from birdenv.replicas.session import Limits

psycopg = pytest.importorskip("psycopg")


def _session(pool: DatabasePool, template: str, **limits: Any) -> PgSession:
    return PgSession(pool, pool.lease(template), limits=Limits(**limits))


def _shared_state(pool: DatabasePool, template: str) -> list[Any]:
    """What a trajectory must never change: the template's catalog entry, comment and settings,
    the owner role, its memberships and settings, the administrator's database."""
    with pool.server.admin() as admin:
        return [
            admin.execute(
                "SELECT datname, datistemplate, datallowconn, datconnlimit, "
                "pg_get_userbyid(datdba), shobj_description(oid, 'pg_database'), ARRAY(SELECT "
                "DISTINCT a.grantee::regrole::text FROM aclexplode(datacl) a "
                "WHERE a.grantee NOT IN (0, datdba)) "
                "FROM pg_database WHERE datname IN (%s, 'postgres') ORDER BY 1",
                (template,),
            ).fetchall(),
            admin.execute(
                "SELECT rolname, rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolconfig "
                "FROM pg_roles WHERE rolname IN (%s, current_user) ORDER BY 1",
                (OWNER_ROLE,),
            ).fetchall(),
            admin.execute(
                "SELECT count(*) FROM pg_auth_members a JOIN pg_roles r ON r.oid = a.roleid "
                "WHERE r.rolname = %s",
                (OWNER_ROLE,),
            ).fetchall(),
            admin.execute(
                "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d "
                "ON d.oid = s.setdatabase WHERE d.datname IN (%s, 'postgres')",
                (template,),
            ).fetchall(),
        ]


def _attacks(template: str) -> list[str]:
    here = "DO $$BEGIN EXECUTE format('{}', current_database()); END$$"
    return [
        here.format("ALTER DATABASE %I IS_TEMPLATE true"),
        here.format("ALTER DATABASE %I CONNECTION LIMIT 0"),
        here.format("ALTER DATABASE %I SET work_mem = ''1GB''"),
        here.format("COMMENT ON DATABASE %I IS ''mine''"),
        here.format("ALTER DATABASE %I OWNER TO CURRENT_USER"),
        f'GRANT CONNECT ON DATABASE "{template}" TO CURRENT_USER',
        f"REASSIGN OWNED BY {OWNER_ROLE} TO CURRENT_USER",
        f'ALTER DATABASE "{template}" IS_TEMPLATE false',
        f'ALTER DATABASE "{template}" ALLOW_CONNECTIONS true',
        f'ALTER DATABASE "{template}" CONNECTION LIMIT 0',
        f"ALTER DATABASE \"{template}\" SET work_mem = '1GB'",
        f"COMMENT ON DATABASE \"{template}\" IS 'mine'",
        f'ALTER DATABASE "{template}" RENAME TO stolen',
        "ALTER DATABASE postgres SET statement_timeout = 0",
        f"GRANT {OWNER_ROLE} TO CURRENT_USER",
        f"SET ROLE {OWNER_ROLE}",
        f"ALTER ROLE {OWNER_ROLE} LOGIN",
        f"ALTER ROLE {OWNER_ROLE} SET work_mem = '1GB'",
        f"DROP OWNED BY {OWNER_ROLE}",
    ]


def test_nothing_a_trajectory_runs_changes_a_template_a_role_or_a_database_setting(
    pg_pool: DatabasePool, pg_shop: str
) -> None:
    before = _shared_state(pg_pool, pg_shop)
    with _session(pg_pool, pg_shop) as s:
        for sql in _attacks(pg_shop):
            result = s.execute(sql)
            if sql.startswith("GRANT CONNECT"):  # a warning: "no privileges were granted"
                continue
            assert result.error is not None, f"allowed: {sql}"
            assert any(
                word in result.error for word in ("must be", "must have", "permission denied")
            ), result.error
        # what lives inside its own clone is its own to change
        for sql in (
            "CREATE SCHEMA scratch",
            "CREATE TABLE scratch.t (n int)",
            "ALTER TABLE customers ADD COLUMN note text",
            "CREATE INDEX ON orders (total)",
            "TRUNCATE orders",
            "DROP TABLE orders CASCADE",
            "CREATE TEMP TABLE tmp AS SELECT 1 AS n",
            "CREATE FUNCTION one() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        ):
            assert s.execute(sql).ok, sql
    assert _shared_state(pg_pool, pg_shop) == before
    pg_pool.drain()  # its clone and role are dropped in the background, without an error
    with _session(pg_pool, pg_shop) as again:  # the next lease: fresh, from the intact template
        assert again.execute("SELECT count(*) FROM orders").rows == [(4,)]
    DatabasePool(pg_pool.server, ready=0).close()  # a new process's pool starts


def test_a_new_pool_repairs_its_templates_and_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Templates and the owner role damaged as an older version's agent could: the next pool
    repairs what it can in place, drops the template that was opened to connections (rebuilt
    from its source on next use) and logs one line; leases then work on the original data."""
    server = PrivateCluster(tmp_path / "cluster", bindir=find_bindir())
    server.ensure_running()
    kept = Template("kept", "a1", lambda db: db.execute("CREATE TABLE t AS SELECT 1 AS x"))
    opened = Template("opened", "b2", lambda db: db.execute("CREATE TABLE t AS SELECT 2 AS x"))
    try:
        with DatabasePool(server, ready=0) as pool:
            names = pool.template(kept), pool.template(opened)
            clean = _shared_state(pool, names[0])
        with server.admin() as admin:
            admin.execute("CREATE ROLE intruder LOGIN")
            admin.execute(f"GRANT {OWNER_ROLE} TO intruder")
            admin.execute(f'GRANT CONNECT ON DATABASE "{names[0]}" TO intruder')
            admin.execute(f'ALTER DATABASE "{names[0]}" CONNECTION LIMIT 0')
            admin.execute(f"ALTER DATABASE \"{names[0]}\" SET work_mem = '1GB'")
            admin.execute(f'ALTER DATABASE "{names[0]}" OWNER TO intruder')
            admin.execute(f'ALTER DATABASE "{names[0]}" IS_TEMPLATE false')
            admin.execute(f'ALTER DATABASE "{names[1]}" ALLOW_CONNECTIONS true')
        caplog.set_level(logging.WARNING, logger="birdenv.postgres.pool")
        with DatabasePool(server, ready=0) as pool:
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1, lines
            assert "repaired" in lines[0] and f"dropped {names[1]}" in lines[0], lines[0]
            assert _shared_state(pool, names[0]) == clean
            with server.admin() as admin:
                admin.execute("DROP ROLE intruder")  # nothing of the pool depends on it now
            assert pool.template(opened) == names[1]  # rebuilt from its source
            for template, value in zip(names, (1, 2), strict=True):
                with _session(pool, template) as s:
                    assert s.execute("SELECT x FROM t").rows == [(value,)]
        caplog.clear()
        DatabasePool(server, ready=0).close()
        assert not caplog.records  # nothing differed: nothing said
    finally:
        server.close()
