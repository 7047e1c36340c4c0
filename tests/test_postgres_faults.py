"""PostgreSQL faults that need a cluster of their own: the disk under it filling up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from birdenv.postgres import (
    DatabasePool,
    PgSession,
    PostgresServerError,
    PrivateCluster,
    Template,
    find_bindir,
)
from birdenv.replicas.session import Limits

psycopg = pytest.importorskip("psycopg")

# The template's contents, summed up: equal before and after every fault when it is intact.
CHECKSUM = "SELECT count(*), sum(x), md5(string_agg(h, '' ORDER BY x)) FROM t"


@contextlib.contextmanager
def small_disk(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` that the cluster's unprivileged user can reach (the system's
    temporary directory, not pytest's root-only one); skipped where mounting is not allowed."""
    path = Path(tempfile.mkdtemp(prefix="birdenv-pg-disk-"))
    os.chmod(path, 0o711)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def _fill(disk: Path, leave: int) -> Path:
    """A ballast file taking all of ``disk``'s free space but ``leave`` bytes."""
    ballast = disk / "ballast"
    st = os.statvfs(disk)
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(st.f_bavail * st.f_frsize - leave, 1))
    return ballast


def _load(db: object) -> None:
    db.execute(  # type: ignore[attr-defined]
        "CREATE TABLE t AS SELECT g AS x, md5(g::text) AS h FROM generate_series(1, 20000) g"
    )


def test_a_disk_that_fills_ends_the_episode_clearly_and_the_pool_recovers() -> None:
    """The cluster on a 160 MB disk: an episode's huge write fills it (an error for that
    statement, or, when the server cannot write its WAL and restarts, the end of the episode,
    both naming the cause); a clone on a full disk is a clear error; once space is back, leases
    work again and the template never changed."""
    with small_disk("160m") as disk:
        server = PrivateCluster(disk / "cluster", bindir=find_bindir())
        assert server.root == disk / "cluster"  # on the small disk, not moved elsewhere
        server.ensure_running()
        try:
            with DatabasePool(server, ready=1, workers=1) as pool:
                template = pool.template(Template("disk", "d1", _load))
                with PgSession(pool, pool.lease(template), limits=Limits()) as first:
                    before = first.execute(CHECKSUM).rows
                assert before[0][0] == 20000

                # 1. An episode writes 1 GB: the disk fills under the statement. Where the
                # table's file cannot grow, the statement fails and the episode goes on; where
                # the server cannot write its WAL, it restarts and the episode ends (on a fresh
                # cluster the first time, then the WAL's files are there to be reused).
                for _ in range(2):
                    episode = PgSession(pool, pool.lease(template), limits=Limits())
                    try:
                        result = episode.execute(
                            "CREATE TABLE big AS SELECT repeat('x', 1000) AS pad "
                            "FROM generate_series(1, 1000000)"
                        )
                        assert not result.ok
                        assert "Check free disk space" in result.error
                        assert "does not exist" in episode.execute("SELECT 1 FROM big").error
                    except PostgresServerError as lost:
                        # The cause is in the message when this backend hit it; when another
                        # process of the server did (the WAL writer), the restart is named.
                        assert "out of disk space" in str(lost)
                        assert "this episode cannot go on" in str(lost)
                    finally:
                        episode.close()  # its clone is dropped: the space comes back
                    pool.drain()
                    with PgSession(pool, pool.lease(template), limits=Limits()) as after:
                        assert after.execute(CHECKSUM).rows == before

                # 2. The disk full from outside: a lease or its first connection fails
                # clearly (a clone cannot be copied; a new connection to a clone cannot write
                # its catalog cache file), or it works and reads.
                pool.drain()
                ballast = _fill(disk, leave=256 * 1024)
                sessions: list[PgSession] = []
                with pytest.raises(PostgresServerError, match=r"No space left|may be full"):
                    for _ in range(3):  # the clone made ahead may still open
                        sessions.append(PgSession(pool, pool.lease(template), limits=Limits()))
                        assert sessions[-1].execute(CHECKSUM).rows == before
                        pool.drain()  # its replacement fails to clone in the background
                for session in sessions:
                    session.close()

                # 3. Space is back: the pool recovers, the template is as it was.
                ballast.unlink()
                pool.drain()
                for _ in range(3):
                    with PgSession(pool, pool.lease(template), limits=Limits()) as again:
                        assert again.execute(CHECKSUM).rows == before
                        assert again.execute("INSERT INTO t VALUES (0, 'x')").ok
                pool.drain()
                assert pool.stats()["ready"] == 1
            with server.admin() as admin:  # nothing left behind but the template
                names = {n for (n,) in admin.execute("SELECT datname FROM pg_database")}
                assert names == {"postgres", "template0", "template1", template}
        finally:
            server.close()
