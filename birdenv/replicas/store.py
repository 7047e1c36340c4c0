"""Immutable base databases, named by content hash and shared by every process on the machine.

A task's template (``{db_dir}/{db_id}/{db_id}_template.sqlite``) is materialised once into
``{root}/bases/{sha256}.sqlite`` with SQLite's backup API (a consistent snapshot even of a template
in WAL mode), made read-only, and hashed; its size and mtime are recorded with the hash. Sessions
only ever read a base. Every lease checks the base's size, mtime and ctime against the record (a
write, a chmod or a ``utime`` to restore the mtime all change the ctime, which cannot be set back),
and :meth:`BaseStore.verify` re-hashes its bytes. A base that no longer matches is
moved aside and rebuilt from its template, never served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from urllib.parse import quote

from birdenv.errors import DatabaseNotFoundError
from birdenv.files import exclusive_lock, file_sha256, identify

__all__ = ["Base", "BaseStore"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Base:
    """An immutable base database file and its content hash."""

    sha256: str
    path: Path
    size: int
    mtime_ns: int
    ctime_ns: int


class BaseStore:
    """Content-addressed, read-only copies of task templates under ``{root}/bases``."""

    def __init__(self, root: str | Path) -> None:
        self.dir = Path(root) / "bases"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._by_source: dict[tuple, Base] = {}

    def base_for(self, template: str | Path) -> Base:
        """The base of a template, materialised on first use and verified before it is served."""
        template = Path(template)
        try:
            real, st = identify(template)
        except FileNotFoundError:
            raise DatabaseNotFoundError(f"template database not found: {template}") from None
        key = (real, st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            base = self._by_source.get(key) or self._lookup_index(key)
            if base is None or not self._intact(base):
                base = self._materialise(template, key)
            self._by_source[key] = base
            return base

    def verify(self, base: Base) -> bool:
        """Re-hash a base's bytes; True when they still match its name."""
        return base.path.is_file() and file_sha256(base.path) == base.sha256

    def bases(self) -> list[Path]:
        """Every base file currently in the store."""
        return sorted(self.dir.glob("*.sqlite"))

    # -- internals -------------------------------------------------------------------------
    def _index_path(self) -> Path:
        return self.dir / "sources.json"

    def _lookup_index(self, key: tuple) -> Base | None:
        try:
            index = json.loads(self._index_path().read_text())
        except (FileNotFoundError, ValueError):
            return None
        entry = index.get("|".join(map(str, key)))
        if not isinstance(entry, dict) or "ctime_ns" not in entry:
            return None  # unknown, or recorded by an older layout: materialise (and record) again
        return Base(
            entry["sha256"],
            self.dir / f"{entry['sha256']}.sqlite",
            entry["size"],
            entry["mtime_ns"],
            entry["ctime_ns"],
        )

    def _intact(self, base: Base) -> bool:
        try:
            st = base.path.stat()
        except FileNotFoundError:
            return False
        # Any write, chmod or utime() changes the ctime, and nothing can set it back: a base whose
        # ctime still matches the one recorded right after hashing has not been touched.
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (
            base.size,
            base.mtime_ns,
            base.ctime_ns,
        ):
            self._quarantine(base, "size, mtime or ctime changed since it was hashed")
            return False
        return True

    def _quarantine(self, base: Base, why: str) -> None:
        log.error(
            "base %s modified behind the store's back (%s): not served, rebuilding", base.path, why
        )
        with contextlib.suppress(FileNotFoundError):
            os.replace(base.path, base.path.with_suffix(f".corrupt-{os.getpid()}"))

    def _materialise(self, template: Path, key: tuple) -> Base:
        with exclusive_lock(self.dir / ".lock"):
            tmp = self.dir / f".incoming-{os.getpid()}-{threading.get_ident()}.sqlite"
            tmp.unlink(missing_ok=True)
            src = sqlite3.connect(f"file:{_quote(template)}?mode=ro", uri=True)
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)
                # A base must not need a -wal beside it: sessions read it as one plain file.
                dst.execute("PRAGMA journal_mode = DELETE")
            finally:
                src.close()
                dst.close()
            sha = file_sha256(tmp)
            path = self.dir / f"{sha}.sqlite"
            if path.is_file() and file_sha256(path) == sha:
                tmp.unlink()
            else:
                tmp.chmod(0o444)
                os.replace(tmp, path)
            st = path.stat()
            base = Base(sha, path, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            index_path = self._index_path()
            try:
                index = json.loads(index_path.read_text())
            except (FileNotFoundError, ValueError):
                index = {}
            index["|".join(map(str, key))] = {
                "sha256": sha,
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns,
            }
            staging = index_path.with_suffix(f".{os.getpid()}.tmp")
            staging.write_text(json.dumps(index))
            os.replace(staging, index_path)
        log.info("materialised base %s from %s", path.name, template)
        return base


def _quote(path: Path) -> str:
    return quote(str(path.resolve()))
