"""Where replicas live: the cache's root, the memory filesystem sessions go to, and room left."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

from birdenv.files import home

__all__ = [
    "MEMORY_FILESYSTEM",
    "available_memory",
    "default_root",
    "default_sessions_dir",
    "disk_usage",
    "is_memory_filesystem",
    "memory_home",
    "room",
]

#: The memory filesystem sessions live on by default, where it exists.
MEMORY_FILESYSTEM = Path("/dev/shm")
_MEMORY_TYPES = frozenset({"tmpfs", "ramfs"})


def default_root() -> Path:
    """``$BIRDENV_HOME/replicas`` (the suite cache's home)."""
    return home() / "replicas"


def _mounts() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mounts") as fh:
            return [(f[1].replace("\\040", " "), f[2]) for f in (line.split() for line in fh)]
    except OSError:
        return []


def is_memory_filesystem(path: str | Path) -> bool:
    """Whether ``path`` (an existing folder) lies on a memory filesystem (tmpfs, ramfs)."""
    real = os.path.realpath(path)
    best, kind = "", None
    for mount, fstype in _mounts():
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind in _MEMORY_TYPES


def memory_home() -> Path | None:
    """This user's folder on :data:`MEMORY_FILESYSTEM`, or None where there is no usable one."""
    if not MEMORY_FILESYSTEM.is_dir() or not is_memory_filesystem(MEMORY_FILESYSTEM):
        return None
    folder = MEMORY_FILESYSTEM / f"birdenv-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return None
    # /dev/shm is shared by every user: a folder someone else made (or a link) is not ours to use.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return folder


def default_sessions_dir(root: str | Path) -> Path:
    """Where a pool on ``root`` makes its sessions unless told otherwise.

    ``$BIRDENV_SESSIONS_DIR`` when set; else a folder for this root under
    ``/dev/shm/birdenv-{uid}`` where ``/dev/shm`` is a memory filesystem; else ``{root}/sessions``.
    """
    configured = os.environ.get("BIRDENV_SESSIONS_DIR")
    if configured:
        return Path(configured)
    folder = memory_home()
    if folder is None:
        return Path(root) / "sessions"
    digest = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:16]
    return folder / f"sessions-{digest}"


def available_memory() -> int | None:
    """The machine's available memory in bytes (``MemAvailable``), or None where it is not known."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def room(folder: Path) -> int:
    """Bytes a new session may still use in ``folder``'s filesystem and the machine's memory."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    free = st.f_bavail * st.f_frsize
    memory = available_memory()
    return free if memory is None else min(free, memory)


def disk_usage(paths: list[Path]) -> int:
    """Bytes of disk the files really occupy (allocated blocks, not apparent size)."""
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_blocks * 512
    return total
