"""Where birdenv keeps its files, the content hash that names a file, and a lock between processes.

The lowest layer beside :mod:`birdenv.errors`: the bundled suites build their databases under
:func:`home`, and the replica store names its bases by :func:`file_sha256`, without either one
importing the other; both, and the Ray staging cache, build under :func:`exclusive_lock`. A
command that writes a run or output directory holds it with :func:`directory_lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from birdenv.errors import DirectoryBusyError

__all__ = [
    "LOCK_FILE",
    "DirectoryLock",
    "describe_holder",
    "directory_lock",
    "exclusive_lock",
    "file_sha256",
    "home",
    "identify",
]

#: The file in a directory whose ``flock`` :func:`directory_lock` holds; it names the holder.
LOCK_FILE = ".lock"


def home() -> Path:
    """The cache directory: ``$BIRDENV_HOME``, else ``$XDG_CACHE_HOME/birdenv``, else ``~/.cache/birdenv``."""
    if os.environ.get("BIRDENV_HOME"):
        return Path(os.environ["BIRDENV_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "birdenv"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def identify(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
    """The real path of the file at ``path`` (symbolic links resolved) and its ``stat``.

    One ``stat`` a call: the resolution, a system call per path component, is remembered for the
    file the path names now (its device, inode and modification time), so a path that comes to
    name another file is resolved again. Raises ``FileNotFoundError`` when nothing is there.
    """
    name = os.fspath(path)
    st = os.stat(name)
    return _real_path(name, st.st_dev, st.st_ino, st.st_mtime_ns), st


@functools.lru_cache(maxsize=4096)
def _real_path(name: str, device: int, inode: int, mtime_ns: int) -> str:
    return os.path.realpath(name)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing), waiting for whoever holds it.

    Between processes, and between threads that each take it: every call opens the file anew.
    The lock goes with the descriptor, so a holder that dies releases it; the file stays.
    """
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class DirectoryLock:
    """A directory held by :func:`directory_lock`: the directory, and ``took_over``, the record of
    a holder that died without letting go (``pid``, ``command``, ``since``), else None."""

    directory: Path
    took_over: dict | None


def describe_holder(record: dict) -> str:
    """``pid N (command) since YYYY-MM-DD HH:MM:SS``, from a record of :func:`directory_lock`."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("since", 0))))
    return f"pid {record.get('pid')} ({record.get('command')}) since {since}"


def _read_record(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        record = json.loads(raw) if raw.strip() else None
    except ValueError:  # a holder killed while writing its record
        return {"pid": "?", "command": "?", "since": 0}
    return record if isinstance(record, dict) else None


#: Descriptors of the directory locks this process holds.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    # A process forked while a lock is held (a judge or environment worker) must not keep it: the
    # lock would outlive its holder, a killed curriculum, for as long as the worker lives.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


@contextlib.contextmanager
def directory_lock(
    directory: str | os.PathLike[str], command: str | None = None
) -> Iterator[DirectoryLock]:
    """Hold ``directory`` (created if missing) as its one writer, or raise at once.

    The lock is an ``flock`` on ``directory/.lock``: the system lets go of it when the holder's
    process ends, however it ends, so a lock is never left held by a dead process. The file names
    the holder (PID, ``command``, default this process's arguments, and since when) while it is
    held and is emptied on release; a record found in it on taking the lock is that of a holder
    that died without letting go, returned as :attr:`DirectoryLock.took_over`.

    A process forked while the lock is held (a worker) does not hold it: the lock ends with its
    holder. Raises :class:`~birdenv.errors.DirectoryBusyError` naming the holder when a live
    process holds it. Readers take no lock: they read what writers have finished (renamed into place).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder may still be writing its record: give it a moment before naming it.
            record = _read_record(fd)
            for _ in range(20):
                if record:
                    break
                time.sleep(0.05)
                record = _read_record(fd)
            holder = describe_holder(record) if record else "another process"
            raise DirectoryBusyError(
                f"{directory} is being written by {holder}; wait for it to end, or give this "
                "command another directory"
            ) from None
        previous = _read_record(fd)
        mine = {
            "pid": os.getpid(),
            "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        _HELD.add(fd)
        try:
            yield DirectoryLock(directory, previous)
        finally:
            _HELD.discard(fd)
            os.ftruncate(fd, 0)  # released in order: the next holder finds no one to take over
    finally:
        os.close(fd)  # lets go of the flock
