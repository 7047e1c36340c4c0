"""Loader for the copy-on-write page-overlay SQLite VFS (the C extension ``_overlay``).

A session is a private sparse file ``P`` plus a side file ``P-ovl`` over a read-only base file:
open it with the stdlib as ``sqlite3.connect(session_uri(P, base), uri=True)``. Every page the
session writes lands in ``P``; the base is never written. Resetting a session is
:func:`discard` (unlink its files), O(1) whatever the base size.

With ``session_uri(..., pages=prefix)`` the sessions of one process that name the same page store
keep each distinct changed page once: pages are content-addressed (hashed, then compared byte for
byte), reference-counted, never changed once written, and freed when the last session that maps
them is discarded. Such a session's state lives in its process (``P`` then only carries its locks),
so only that process can open it; :func:`discard` is then also what releases its pages.

The VFS registers into the ``libsqlite3`` the extension links. That only helps when Python's
``_sqlite3`` links the very same shared library; :func:`available` proves it end to end with a
real round trip and never raises, so the pool can pick a fallback at start-up and say why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sqlite3
import tempfile
from contextlib import closing, suppress
from pathlib import Path
from urllib.parse import quote

VFS_NAME = "birdoverlay"
"""Name the VFS is registered under (never as the default VFS)."""

# Files a session may leave beside P, in the order discard() removes them: the side file first,
# so that an interrupted discard with no hot journal already reads as the pristine base; then the
# marker of a session on shared pages, which a session opened without them refuses.
_SUFFIXES = ("-ovl", "-shared", "-journal", "-wal", "-shm", "")
_MODES = ("ro", "rw", "rwc")


@functools.lru_cache(maxsize=1)
def _load():
    """Import the extension and register the VFS (once); raises on any failure."""
    # a C extension that may not be built: imported when first used
    from birdenv.replicas.native import _overlay

    _overlay.register(VFS_NAME)
    return _overlay


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _probe() -> str | None:
    """Return None when the overlay works with the stdlib ``sqlite3``, else the reason why not."""
    try:
        ext = _load()
    except ImportError as exc:
        return f"the C extension birdenv.replicas.native._overlay is not built ({exc})"
    except Exception as exc:  # a registration failure must not break importers
        return f"registering the SQLite VFS {VFS_NAME!r} failed: {exc!r}"
    try:
        with tempfile.TemporaryDirectory(prefix="birdovl-probe-") as tmp:
            base = Path(tmp) / "base.sqlite"
            with closing(sqlite3.connect(base)) as conn:
                conn.execute("PRAGMA synchronous=OFF")  # fsyncs would dominate start-up time
                conn.execute("CREATE TABLE t(x)")
                conn.execute("INSERT INTO t VALUES (1)")
                conn.commit()
            before = _file_digest(base)
            session = Path(tmp) / "session.sqlite"
            uri = session_uri(session, base)
            with closing(sqlite3.connect(uri, uri=True)) as conn:
                conn.execute("PRAGMA synchronous=OFF")
                conn.execute("INSERT INTO t VALUES (2)")
                conn.commit()
            with closing(sqlite3.connect(uri, uri=True)) as conn:
                rows = conn.execute("SELECT x FROM t ORDER BY x").fetchall()
            if rows != [(1,), (2,)]:
                return f"overlay round trip returned {rows!r}, expected [(1,), (2,)]"
            if _file_digest(base) != before:
                return "overlay round trip modified the base file"
            with closing(sqlite3.connect(base)) as conn:
                if conn.execute("SELECT count(*) FROM t").fetchone() != (1,):
                    return "overlay round trip is visible in the base"
    except sqlite3.OperationalError as exc:
        if "no such vfs" in str(exc):
            return (
                f"Python's sqlite3 (SQLite {sqlite3.sqlite_version}) does not see the VFS the "
                f"extension registered in SQLite {ext.libversion()}: _sqlite3 links a different "
                f"or static SQLite ({exc})"
            )
        return f"overlay round trip failed: {exc!r}"
    except Exception as exc:
        return f"overlay round trip failed: {exc!r}"
    return None


def available() -> bool:
    """True when the overlay VFS is built, registered, and proven to work with stdlib ``sqlite3``.

    The result is cached for the life of the process; the check never raises.
    """
    return _probe() is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (one line for logs and ``birdenv doctor``), else None."""
    return _probe()


def session_uri(
    session_path: str | os.PathLike[str],
    base_path: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    mode: str = "rwc",
    pages: str | os.PathLike[str] | None = None,
) -> str:
    """Build the ``file:`` URI that opens the session at ``session_path`` over ``base_path``.

    Pass it to ``sqlite3.connect(uri, uri=True)``. All paths are made absolute and
    percent-encoded, so spaces, ``%``, ``?``, ``#``, ``&`` and ``=`` in them are safe.
    ``max_bytes`` caps the session's private data (and, separately, its ``-journal`` and
    ``-wal`` files): a write past it fails with "database or disk is full" and the session stays
    usable. ``mode`` is SQLite's ``mode`` parameter: ``"rwc"`` (default), ``"rw"`` or ``"ro"``.
    ``pages`` names a content-addressed page store (its files are ``<pages>-<unit size>``) shared
    with the other sessions of this process on the same base that name it; every connection to
    the session must name it, and a store serves one base only.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, not {mode!r}")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(f"max_bytes must be a positive int or None, not {max_bytes!r}")
    # Register on first use so a URI is usable even before anyone called available(); a failure
    # surfaces at connect time as SQLite's "no such vfs", and available() explains it.
    with suppress(Exception):
        _load()
    session = os.path.abspath(os.fspath(session_path))
    base = os.path.abspath(os.fspath(base_path))
    # safe="/" keeps path separators and encodes everything SQLite's URI parser treats specially
    uri = f"file:{quote(session, safe='/')}?vfs={VFS_NAME}&base={quote(base, safe='/')}"
    if max_bytes is not None:
        uri += f"&maxbytes={max_bytes}"
    if pages is not None:
        uri += f"&pages={quote(os.path.abspath(os.fspath(pages)), safe='/')}"
    return f"{uri}&mode={mode}"


def session_files(session_path: str | os.PathLike[str]) -> list[Path]:
    """Every file a session may leave: ``P-ovl``, ``P-shared``, ``P-journal``, ``P-wal``, ``P-shm``
    and ``P``.

    Used to reset a session and to sweep orphans; the order is the safe unlink order.
    """
    p = os.path.abspath(os.fspath(session_path))
    return [Path(p + suffix) for suffix in _SUFFIXES]


def discard(session_path: str | os.PathLike[str]) -> None:
    """Delete a session's files (missing ones are fine), restoring the pristine base view, and
    release the shared pages it maps.

    Close every connection to the session first (pages a connection still uses are released when
    it closes). Idempotent: if interrupted, call it again before the session path is reused.
    """
    # SQLite names a session by its real path (symbolic links resolved); so does the store.
    name = os.fspath(session_path)
    _discard(os.path.realpath(name), os.path.abspath(name))


def discard_real(path: str) -> None:
    """:func:`discard` for a session named by its real path (absolute, no symbolic links), as a
    pool names its own: no resolving (a system call per path component) on every reset."""
    _discard(path, path)


def _discard(real: str, path: str) -> None:
    if available():
        _load().release(real)
    # The files of session_files(), as strings: this runs on every reset.
    for suffix in _SUFFIXES:
        with suppress(FileNotFoundError):
            os.unlink(path + suffix)


def hold_base(base_path: str | os.PathLike[str]) -> int:
    """Keep this process's descriptor of the base at ``base_path`` open, and its in-place map
    once a session made it, until :func:`release_base` is given the returned handle.

    Sessions share one descriptor and one map per base, which go when the last of them closes; a
    holder keeps them for sessions that come and go one at a time. Raises ``OSError`` when the
    base cannot be opened.
    """
    return _load().hold_base(os.fspath(base_path))


def release_base(handle: int) -> None:
    """Drop a hold taken by :func:`hold_base` (once per hold)."""
    _load().release_base(handle)


def page_stores() -> list[dict[str, int | str]]:
    """Figures of this process's shared page stores, one dict each.

    ``pages`` (the store's prefix), ``sessions`` on it, ``units`` and ``stored_bytes`` (distinct
    pages held), ``mapped_bytes`` (what the sessions' changed pages would take unshared),
    ``writes`` (pages written since the store opened) and ``shared_writes`` (those that found an
    identical page already stored). Empty where the overlay is unavailable.
    """
    return _load().page_stores() if available() else []
