"""Where birdenv keeps its files, the content hash that names a file, and a lock between processes.

The lowest layer beside :mod:`birdenv.errors`: the bundled suites build their databases under
:func:`home`, and the replica store names its bases by :func:`file_sha256`, without either one
importing the other; both, and the Ray staging cache, build under :func:`exclusive_lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["exclusive_lock", "file_sha256", "home", "identify"]


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
