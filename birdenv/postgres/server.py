"""The PostgreSQL server sessions run on: a private cluster the project starts, or a given DSN.

:func:`default_server` picks, in order: ``BIRDENV_PG_DSN`` (an external server whose user may
create databases and roles), else a private cluster under ``$BIRDENV_HOME/postgres`` made with the
PostgreSQL binaries found on the machine (:func:`find_bindir`). The private cluster:

- listens on a Unix socket only (``BIRDENV_PG_LISTEN=127.0.0.1`` adds loopback TCP on a free
  port), in a directory only its owner may enter;
- runs as an unprivileged operating-system user when the process is root (PostgreSQL refuses to
  run as root): ``BIRDENV_PG_USER``, else ``postgres`` when that user exists, else ``nobody``; the
  cluster then lives where that user can reach it (``$BIRDENV_HOME/postgres`` when every folder
  above it lets that user through, else a folder of the system's temporary directory named after
  ``$BIRDENV_HOME``);
- is shared by every process using the same ``$BIRDENV_HOME``: each holds a shared ``flock`` on
  ``users.lock`` while it uses the cluster, and the last one to let go (at exit) stops it; a
  process killed outright leaves it running for the next user;
- is restarted by :meth:`Server.ensure_running` when it died.

The server's superuser (``birdenv``) is for the pool alone. Agents log in as roles with no
privilege beyond their own database (:mod:`birdenv.postgres.pool`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import hashlib
import os
import pwd
import re
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from birdenv.errors import BirdEnvError, MissingExtraError
from birdenv.files import exclusive_lock, home

__all__ = [
    "ADMIN_ROLE",
    "ExternalServer",
    "PostgresNotFoundError",
    "PostgresServerError",
    "PrivateCluster",
    "Server",
    "default_server",
    "describe_default",
    "find_bindir",
    "install_hint",
    "process_alive",
    "psycopg",
]

#: The superuser the project's own cluster is made with.
ADMIN_ROLE = "birdenv"
# The binaries a private cluster needs.
_NEEDED = ("initdb", "pg_ctl", "postgres")
# Where PostgreSQL's binaries usually are, besides what pg_config says (Debian/Ubuntu, RPM
# distributions, Homebrew on Apple silicon and Intel).
_USUAL = (
    "/usr/lib/postgresql/*/bin",
    "/usr/pgsql-*/bin",
    "/opt/homebrew/opt/postgresql@*/bin",
    "/opt/homebrew/opt/postgresql/bin",
    "/usr/local/opt/postgresql@*/bin",
    "/usr/local/opt/postgresql/bin",
    "/opt/homebrew/bin",
    "/usr/local/bin",
    "/usr/bin",
)
# Longest Unix socket path the kernel takes (sun_path is 108 bytes, with its NUL).
_SOCKET_PATH_MAX = 107


class PostgresNotFoundError(BirdEnvError, FileNotFoundError):
    """No PostgreSQL server binaries on this machine and no ``BIRDENV_PG_DSN``; the message says
    how to install one."""


class PostgresServerError(BirdEnvError, RuntimeError):
    """The PostgreSQL server could not be started or reached, or it went away; the message names
    the server, what failed and where its log is."""


def psycopg() -> Any:
    """The ``psycopg`` module (PostgreSQL's driver), or :class:`MissingExtraError` naming the extra."""
    try:
        # the postgres extra: imported only where used
        import psycopg as module
    except ImportError as exc:
        raise MissingExtraError("psycopg", "postgres") from exc
    return module


def install_hint() -> str:
    """How to get a PostgreSQL server on this kind of machine, in one sentence."""
    if sys.platform == "darwin":
        how = "brew install postgresql@16"
    elif shutil.which("apt-get"):
        how = "apt-get install postgresql (as root)"
    elif shutil.which("dnf"):
        how = "dnf install postgresql-server"
    else:
        how = "your system's postgresql server package"
    return (
        f"install PostgreSQL ({how}), or point BIRDENV_PG_DSN at a server whose user may create "
        "databases and roles"
    )


def _version(bindir: Path) -> tuple[int, ...]:
    match = re.search(r"(\d+)(?:\.(\d+))?", bindir.as_posix().split("postgresql")[-1])
    return tuple(int(g) for g in match.groups() if g) if match else (0,)


def _complete(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in _NEEDED)


def find_bindir() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``: ``BIRDENV_PG_BINDIR``, else
    ``pg_config --bindir``, else the newest of the usual Debian, RPM and Homebrew locations.

    Raises :class:`PostgresNotFoundError`, saying how to install PostgreSQL, when none has them.
    """
    given = os.environ.get("BIRDENV_PG_BINDIR")
    if given:
        if not _complete(Path(given)):
            raise PostgresNotFoundError(
                f"BIRDENV_PG_BINDIR={given} lacks one of {', '.join(_NEEDED)}; {install_hint()}"
            )
        return Path(given)
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _complete(Path(out)):
                return Path(out)
    found = [
        Path(p) for pattern in _USUAL for p in sorted(glob.glob(pattern)) if _complete(Path(p))
    ]
    if not found:
        raise PostgresNotFoundError(
            f"no PostgreSQL server binaries on this machine; {install_hint()}"
        )
    return max(found, key=_version)


class Server:
    """A PostgreSQL server: how to connect to it as its administrator, and what it is."""

    #: One line for ``birdenv doctor``.
    description: str

    def connect_kwargs(self, dbname: str, user: str | None = None) -> dict[str, Any]:
        """``psycopg.connect`` keywords for ``dbname`` as ``user`` (default: the administrator)."""
        raise NotImplementedError

    def admin(self, dbname: str = "postgres") -> Any:
        """A new autocommit connection as the administrator (close it when done)."""
        try:
            return psycopg().connect(
                **self.connect_kwargs(dbname), autocommit=True, connect_timeout=10
            )
        except psycopg().OperationalError as exc:
            raise PostgresServerError(
                f"cannot connect to {self.description}: {exc}".strip()
            ) from exc

    def ensure_running(self) -> None:
        """Start the server again if it died (an external server is only checked)."""
        self.admin().close()

    def close(self) -> None:
        """Let go of the server (a private cluster stops when its last user lets go)."""


class ExternalServer(Server):
    """A server named by a libpq DSN (``BIRDENV_PG_DSN`` or ``pg_dsn=``); its user must be able
    to create databases and roles."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        conninfo = psycopg().conninfo.conninfo_to_dict(dsn)
        self._base = {k: v for k, v in conninfo.items() if k != "dbname"}
        shown = {k: v for k, v in self._base.items() if k != "password"}
        self.description = "external server " + " ".join(
            f"{k}={v}" for k, v in sorted(shown.items())
        )

    def connect_kwargs(self, dbname: str, user: str | None = None) -> dict[str, Any]:
        kwargs = {**self._base, "dbname": dbname}
        if user is not None:
            kwargs["user"] = user
        return kwargs


def _server_user() -> pwd.struct_passwd | None:
    """The operating-system user a root process runs the cluster as (None: not root)."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("BIRDENV_PG_USER"), "postgres", "nobody"):
        if name:
            with contextlib.suppress(KeyError):
                return pwd.getpwnam(name)
    raise PostgresServerError(
        "running as root, and no unprivileged user to run PostgreSQL as: set BIRDENV_PG_USER"
    )


def _reachable(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether ``user`` may pass through every existing folder above ``path``."""
    for folder in [*reversed(path.parents)]:
        try:
            st = folder.stat()
        except FileNotFoundError:
            return True  # made below by us, with the right owner
        if st.st_uid == user.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateCluster(Server):
    """The project's own cluster under ``$BIRDENV_HOME/postgres`` (see the module's docstring).

    ``root``: where it lives (default: chosen as described above); ``bindir``: the binaries
    (default :func:`find_bindir`); ``listen``: ``""`` for the Unix socket alone, or
    ``"127.0.0.1"`` (default ``BIRDENV_PG_LISTEN``); ``max_connections``: the server's limit (a
    connection past it is refused at once, with a :class:`PostgresServerError` that says so);
    ``max_backend_memory``: bytes each server process may allocate besides the shared memory and
    its program (None: no bound). It is an operating-system limit on the address space that every
    process of the server inherits from the postmaster, so no setting of a session lifts it: an
    allocation past it fails with the server's "out of memory" error for that statement alone. It
    takes effect when the cluster starts.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        bindir: Path | None = None,
        listen: str | None = None,
        max_connections: int = 300,
        max_backend_memory: int | None = 1 << 30,
    ) -> None:
        self.bindir = bindir or find_bindir()
        self.max_connections = max_connections
        self.max_backend_memory = max_backend_memory
        self.user = _server_user()
        self.listen = listen if listen is not None else os.environ.get("BIRDENV_PG_LISTEN", "")
        if self.listen not in ("", "127.0.0.1"):
            raise ValueError("listen must be '' (Unix socket only) or '127.0.0.1'")
        major = _version(self.bindir)[0] or "pg"
        wanted = Path(root) if root is not None else home() / "postgres" / str(major)
        if self.user is not None and not _reachable(wanted.absolute(), self.user):
            # PostgreSQL runs as an unprivileged user who cannot pass through e.g. /root.
            tag = hashlib.sha256(str(wanted.absolute()).encode()).hexdigest()[:12]
            wanted = Path(tempfile.gettempdir()) / f"birdenv-postgres-{tag}"
        self.root = wanted.absolute()
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        socket_dir = self.root / "run"
        if len(str(socket_dir)) + len("/.s.PGSQL.65535") > _SOCKET_PATH_MAX:
            tag = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
            socket_dir = Path(tempfile.gettempdir()) / f"birdenv-pg-{tag}"
        self.socket_dir = socket_dir
        self.description = (
            f"private cluster {self.root} (PostgreSQL {'.'.join(map(str, _version(self.bindir)))} "
            f"from {self.bindir}, socket {self.socket_dir}"
            + (", 127.0.0.1" if self.listen else "")
            + (f", run as {self.user.pw_name}" if self.user else "")
            + ")"
        )
        self._users_fd: int | None = None
        self._lock = threading.Lock()
        self._port: int | None = None

    # -- files and processes ------------------------------------------------------------------
    def _run(
        self, *args: str, timeout: float = 120, address_space: int | None = None
    ) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        if address_space is not None:
            limit = (address_space, address_space)
            kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_AS, limit)
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            start_new_session=True,  # the server outlives us, and our terminal's signals
            **kwargs,
        )

    def _own(self, path: Path, mode: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    @property
    def port(self) -> int:
        """The port: it names the socket file, and the TCP port when listening on 127.0.0.1."""
        if self._port is None:
            path = self.data / "postmaster.opts"
            with contextlib.suppress(OSError):
                match = re.search(r'"-p" "(\d+)"', path.read_text())
                if match:
                    self._port = int(match.group(1))
        return self._port or 5432

    def connect_kwargs(self, dbname: str, user: str | None = None) -> dict[str, Any]:
        return {
            "host": str(self.socket_dir),
            "port": self.port,
            "dbname": dbname,
            "user": user or ADMIN_ROLE,
        }

    def _initdb(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            os.chmod(self.root, 0o711)  # root-owned, the server user may pass through
        self._own(self.data, 0o700)
        done = self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            ADMIN_ROLE,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        if done.returncode != 0:
            shutil.rmtree(self.data, ignore_errors=True)
            raise PostgresServerError(
                f"initdb failed for {self.description}: {done.stderr.strip() or done.stdout.strip()}"
            )

    def _answers(self) -> bool:
        try:
            psycopg().connect(**self.connect_kwargs("postgres"), connect_timeout=5).close()
        except psycopg().OperationalError:
            return False
        return True

    def _running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        if process_alive(pid):
            return True
        # Killed: its lock file stays, naming a process that is gone, or a zombie nobody reaps
        # (an init that does not reap), which PostgreSQL would take for a live server.
        (self.data / "postmaster.pid").unlink(missing_ok=True)
        for lock in self.socket_dir.glob(".s.PGSQL.*.lock"):
            lock.unlink(missing_ok=True)
        return False

    def _start(self) -> None:
        if not (self.data / "PG_VERSION").is_file():
            self._initdb()
        self._own(self.socket_dir, 0o700)
        self._port = 5432 if not self.listen else _free_port()
        settings = {
            "listen_addresses": f"'{self.listen}'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "unix_socket_permissions": "0700",
            # A scratch server: databases are rebuilt from their sources, never backed up.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": str(self.max_connections),
            # The lock table is shared by every session: room for a statement of each to hold
            # the watchdog's cap of locks (birdenv.postgres.watchdog) before it is cancelled.
            "max_locks_per_transaction": "256",
        }
        options = " ".join([f"-p {self._port}", *(f"-c {k}={v}" for k, v in settings.items())])
        address_space = None
        if self.max_backend_memory is not None:
            address_space = self._shared_memory(settings) + self.max_backend_memory + (256 << 20)
        if self.log.exists() and self.user is not None:
            os.chown(self.log, self.user.pw_uid, self.user.pw_gid)
        elif self.user is not None:
            self.log.touch()
            os.chown(self.log, self.user.pw_uid, self.user.pw_gid)
        for _ in range(10):
            done = self._run(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-o",
                options,
                address_space=address_space,
            )
            if done.returncode == 0:
                return
            # After the server was killed, its orphaned backends hold its shared memory for a
            # moment ("pre-existing shared memory block is still in use"): they exit on their own.
            time.sleep(0.5)
        if done.returncode != 0:
            raise PostgresServerError(
                f"could not start {self.description}: {done.stderr.strip() or done.stdout.strip()} "
                f"(log: {self.log})"
            )

    def _shared_memory(self, settings: dict[str, str]) -> int:
        """Bytes of shared memory the server maps with ``settings`` (it counts in every server
        process's address space); asked of ``postgres -C`` while the server is stopped."""
        args = [f"--{k.replace('_', '-')}={v.strip(chr(39))}" for k, v in settings.items()]
        done = self._run("postgres", "-D", str(self.data), *args, "-C", "shared_memory_size")
        try:
            return int(done.stdout.strip()) << 20
        except ValueError:
            return 1 << 30  # an answer this version does not give: room for any usual size

    # -- lifetime -----------------------------------------------------------------------------
    def ensure_running(self) -> None:
        """Start the cluster if it is not running (made on first use), and count this process
        among its users; idempotent and safe across processes."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            with exclusive_lock(self.root / "start.lock"):
                for _ in range(50):
                    if not self._running():
                        self._start()
                        break
                    if self._answers():
                        break
                    # Running but refusing: just killed (the signal not yet taken) or still
                    # starting. Either settles within moments.
                    time.sleep(0.1)
                if self._users_fd is None:
                    fd = os.open(self.root / "users.lock", os.O_RDWR | os.O_CREAT, 0o600)
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    self._users_fd = fd
                    atexit.register(self.close)

    def close(self) -> None:
        """Stop counting this process among the users, and stop the cluster if it was the last."""
        with self._lock:
            fd, self._users_fd = self._users_fd, None
            if fd is None:
                return
            with exclusive_lock(self.root / "start.lock"):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # others still use it
                finally:
                    os.close(fd)
                self.stop()

    def stop(self) -> None:
        """Stop the server now (fast shutdown: open sessions are ended)."""
        self._run("pg_ctl", "stop", "-m", "fast", "-w", "-D", str(self.data), timeout=60)

    def remove(self) -> None:
        """Stop the server if it runs and delete the cluster's files: its folder (in the system's
        temporary directory where the home was out of the server user's reach, see the class's
        docstring) and its socket folder. For clusters made for a while, such as a test's: the
        folder a temporary home is moved to outlives that home."""
        with self._lock:  # this process no longer uses it: nothing is left to close at exit
            fd, self._users_fd = self._users_fd, None
        if fd is not None:
            os.close(fd)
            atexit.unregister(self.close)
        if self.postmaster_pid() is not None:
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        if not self.socket_dir.is_relative_to(self.root):
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def postmaster_pid(self) -> int | None:
        """The running server's process id, if it is running."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None


def describe_default() -> str:
    """Which server :func:`default_server` would use, and whether it can, without starting it."""
    env = os.environ.get("BIRDENV_PG_DSN")
    try:
        if env:
            return f"{ExternalServer(env).description} (BIRDENV_PG_DSN)"
        cluster = PrivateCluster()
    except (BirdEnvError, ValueError) as exc:
        return f"unavailable: {exc}"
    state = "running" if cluster._running() else "started on first use"
    return f"{cluster.description}, {state}"


_DEFAULT: Server | None = None
_DEFAULT_LOCK = threading.Lock()


def default_server(dsn: str | None = None) -> Server:
    """The process's server: ``dsn``, else ``BIRDENV_PG_DSN``, else the private cluster (started
    on first use). One per process for the default; a ``dsn`` gives a new :class:`ExternalServer`."""
    global _DEFAULT
    if dsn:
        return ExternalServer(dsn)
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            env = os.environ.get("BIRDENV_PG_DSN")
            server: Server = ExternalServer(env) if env else PrivateCluster()
            server.ensure_running()
            _DEFAULT = server
        return _DEFAULT
