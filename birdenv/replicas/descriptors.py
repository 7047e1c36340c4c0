"""File descriptors: the process limit a replica pool raises, and the error when it runs out.

An open session holds three descriptors (its private file, its side file and its WAL; four with a
``-shm`` file when it is not exclusive); every session on a base shares one descriptor for it. Under
the common default soft limit of 1,024, a few hundred sessions exhaust it, and SQLite then says only
"unable to open database file": :func:`limit_error` says which limit, how many are in use, and
what to do.
"""

from __future__ import annotations

import errno
import os
import resource

from birdenv.errors import DescriptorLimitError

__all__ = ["exhausted", "in_use", "limit_error", "limits", "raise_soft_limit"]

# Fewer free descriptors than this cannot open a session and run its first write.
_HEADROOM = 8
_FALLBACK_CEILING = 1 << 20  # where the hard limit is "unlimited" and the kernel says nothing


def limits() -> tuple[int, int]:
    """The process's ``RLIMIT_NOFILE``: ``(soft, hard)``."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _ceiling(hard: int) -> int:
    if hard != resource.RLIM_INFINITY:
        return hard
    # Linux refuses a soft limit above fs.nr_open, even under an unlimited hard limit.
    try:
        with open("/proc/sys/fs/nr_open") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return _FALLBACK_CEILING


def raise_soft_limit() -> int | None:
    """Raise the soft limit to the hard limit; the previous soft limit when it changed, else None.

    Raising the soft limit up to the hard one needs no privilege. Where the system refuses (some
    platforms cap it lower), the limit stays as it was.
    """
    soft, hard = limits()
    target = _ceiling(hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return None
        return soft
    return None


def in_use() -> int | None:
    """Descriptors this process has open, or None where the system does not say."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            # listdir's own descriptor on the folder is counted too
            return len(os.listdir(folder)) - 1
        except OSError:
            continue
    return None


def exhausted() -> bool:
    """Whether this process (or the system) is out of descriptors, or too close to open a session."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    os.close(fd)
    used, (soft, _) = in_use(), limits()
    return used is not None and soft != resource.RLIM_INFINITY and soft - used < _HEADROOM


def limit_error(action: str) -> DescriptorLimitError:
    """The error for ``action`` (e.g. "cannot open a session") failing for lack of descriptors."""
    soft, hard = limits()
    used = in_use()
    count = "most" if used is None else f"{used}"
    fmt = {resource.RLIM_INFINITY: "unlimited"}
    return DescriptorLimitError(
        f"{action}: this process has {count} of its {fmt.get(soft, soft)} file descriptors open "
        f"(RLIMIT_NOFILE soft {fmt.get(soft, soft)}, hard {fmt.get(hard, hard)}); each open "
        "session holds 2-4 of them. A replica pool already raises the soft limit to the hard one: "
        "raise the hard limit (as root `ulimit -Hn 65536` before starting Python, LimitNOFILE= "
        "in a systemd unit, `docker run --ulimit nofile=65536:65536`), or lease fewer sessions "
        "at once (ReplicaPool(max_sessions=...), fewer environments per process)"
    )
