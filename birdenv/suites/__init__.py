"""The bundled suites: databases built deterministically on first use, and their task files.

Layout of the cache (``$BIRDENV_HOME``, default ``~/.cache/birdenv``), the official one::

    {home}/suites-v{FORMAT}/databases/{db_id}/{db_id}_template.sqlite
    {home}/suites-v{FORMAT}/{suite}.jsonl
    {home}/suites-v{FORMAT}/manifest.json      # sha256 and size of every database

Each database has a builder module in :mod:`birdenv.suites.databases` exposing ``DB_ID``,
``VERSION`` and ``build(conn)``; the tasks of a database live in ``tasks/{db_id}.jsonl`` with one
extra field, ``suite``, that assigns the row to ``gym-mini`` (training) or ``critic-mini``
(evaluation). Building is guarded by a file lock so concurrent processes build once; a database
whose hash no longer matches the manifest is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import pkgutil
import sqlite3
import time
from pathlib import Path
from types import ModuleType

from birdenv.errors import SuiteBuildError, UnknownSuiteError
from birdenv.files import exclusive_lock, file_sha256, home

__all__ = [
    "SUITES",
    "Suite",
    "UnknownSuiteError",
    "database_modules",
    "ensure",
    "file_sha256",
    "home",
    "is_suite",
    "names",
]

#: Bump when the cache layout changes; builders carry their own ``VERSION``.
FORMAT = 1
#: Bundled suites and what they are for.
SUITES = {
    "gym-mini": "training tasks (disjoint from critic-mini)",
    "critic-mini": "evaluation tasks in the style of BIRD-CRITIC-SQLite",
    "gym-mini-pg": "training tasks on PostgreSQL (disjoint from critic-mini-pg)",
    "critic-mini-pg": "evaluation tasks in the style of BIRD-CRITIC-PostgreSQL",
}
_TASKS_DIR = Path(__file__).with_name("tasks")


@dataclasses.dataclass(frozen=True)
class Suite:
    """A built suite: where its task file and its database directory are."""

    name: str
    tasks_path: Path
    db_dir: Path


def names() -> list[str]:
    """Names of the bundled suites."""
    return list(SUITES)


def is_suite(name: str) -> bool:
    """Whether ``name`` is a bundled suite."""
    return name in SUITES


def database_modules() -> dict[str, ModuleType]:
    """Every database builder module, keyed by its ``DB_ID``."""
    from birdenv.suites import databases  # the builders are large: loaded when a suite is built

    modules = {}
    for info in pkgutil.iter_modules(databases.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{databases.__name__}.{info.name}")
        modules[module.DB_ID] = module
    return dict(sorted(modules.items()))


def _root() -> Path:
    return home() / f"suites-v{FORMAT}"


def _build_database(module: ModuleType, target: Path) -> None:
    """Run a builder into a temporary file, then move it into place atomically (read-only)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".building-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        # Speed settings for a one-off bulk load; the file is fsynced once at the end.
        conn.execute("PRAGMA page_size = 4096")
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("BEGIN")
        module.build(conn)
        if conn.in_transaction:
            conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.execute("VACUUM")
        problems = conn.execute("PRAGMA foreign_key_check").fetchmany(5)
        if problems:
            raise SuiteBuildError(f"{module.DB_ID}: foreign key violations after build: {problems}")
    except Exception:
        conn.close()
        tmp.unlink(missing_ok=True)
        raise
    conn.close()
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    tmp.chmod(0o444)
    os.replace(tmp, target)


def _manifest_key(module: ModuleType) -> str:
    # The builder's own source is part of the key: editing a builder rebuilds its database even
    # when nobody remembered to bump VERSION.
    source = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]
    return f"{module.DB_ID}@{module.VERSION}@{source}"


def _database_ok(path: Path, entry: dict | None, *, full: bool) -> bool:
    if entry is None or not path.is_file():
        return False
    stat = path.stat()
    if stat.st_size != entry["size"]:
        return False
    if not full and stat.st_mtime_ns == entry["mtime_ns"]:
        return True
    return file_sha256(path) == entry["sha256"]


def _write_suite_files(root: Path) -> None:
    """Split the per-database task files into one JSONL file per suite (official rows)."""
    rows: dict[str, list[str]] = {name: [] for name in SUITES}
    for path in sorted(_TASKS_DIR.glob("*.jsonl")):
        for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not text.strip():
                continue
            row = json.loads(text)
            suite = row.pop("suite", None)
            if suite not in rows:
                raise SuiteBuildError(
                    f"{path}:{lineno}: field 'suite' must be one of {list(SUITES)}"
                )
            rows[suite].append(json.dumps(row, ensure_ascii=False))
    for name, lines in rows.items():
        tmp = root / f".{name}.jsonl.tmp"
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, root / f"{name}.jsonl")


def ensure(name: str | None = None, *, verify: bool = False, force: bool = False) -> Suite:
    """Build (once) and return a bundled suite; with ``name=None`` build every database.

    Databases whose size or hash no longer match the manifest are rebuilt; ``verify=True`` rehashes
    every file even when its size and mtime look unchanged; ``force=True`` rebuilds everything.
    """
    if name is not None and not is_suite(name):
        raise UnknownSuiteError(f"no bundled suite named {name!r}; choose one of {names()}")
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    db_dir = root / "databases"
    manifest_path = root / "manifest.json"
    with exclusive_lock(root / ".build.lock"):
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        changed = False
        for db_id, module in database_modules().items():
            target = db_dir / db_id / f"{db_id}_template.sqlite"
            entry = manifest.get(_manifest_key(module))
            if not force and _database_ok(target, entry, full=verify):
                continue
            started = time.perf_counter()
            _build_database(module, target)
            stat = target.stat()
            manifest[_manifest_key(module)] = {
                "db_id": db_id,
                "sha256": file_sha256(target),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "build_seconds": round(time.perf_counter() - started, 2),
            }
            changed = True
        if (
            changed
            or force
            or not all((root / f"{s}.jsonl").is_file() for s in SUITES)
            or any(
                p.stat().st_mtime > (root / "critic-mini.jsonl").stat().st_mtime
                for p in _TASKS_DIR.glob("*.jsonl")
            )
        ):
            _write_suite_files(root)
        if changed:
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            os.replace(tmp, manifest_path)
    suite = name or "critic-mini"
    return Suite(name=suite, tasks_path=root / f"{suite}.jsonl", db_dir=db_dir)
