"""The authorizer policy: what a statement in a session may not do.

SQLite calls the authorizer for every action while it prepares a statement, so a denial is an
ordinary ``sqlite3.DatabaseError`` ("not authorized") and nothing has run. The policy keeps a
session inside its own state: no other files (ATTACH of any path or URI, ``VACUUM INTO``, which
SQLite authorizes as an ATTACH; plain VACUUM and ``:memory:`` stay allowed), no extensions, and no
pragmas that point SQLite at directories or other files. Everything a BIRD-CRITIC task may
legitimately do, including ``PRAGMA foreign_keys``/``journal_mode``, DDL, triggers and
transactions, stays allowed: a session's files are private, so changing them is safe.

Two more kinds of pragma are denied, found by the hostile catalogue (``tests/fixtures/hostile``):

- settings that are global to the *process*, not the connection (``hard_heap_limit``,
  ``soft_heap_limit``): one trajectory setting ``hard_heap_limit=1000`` made every statement of
  every session in its worker fail with MemoryError;
- writes that can corrupt the session's own schema beyond repair (``writable_schema``,
  ``schema_version``) or lift the copy strategy's disk cap (``max_page_count``). Reading them
  stays allowed.

The official evaluator allows all of these (one subprocess per instance protects it); no
BIRD-CRITIC task needs them.
"""

from __future__ import annotations

import sqlite3

__all__ = ["DENIED_FUNCTIONS", "DENIED_PRAGMAS", "READ_ONLY_PRAGMAS", "authorizer"]

#: Functions that reach outside the database (extensions, the file system, the tokenizer hook).
DENIED_FUNCTIONS = frozenset(
    {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "zipfile", "lsdir"}
)
#: Pragmas that change where SQLite writes, or that could escape the session's files.
# mmap_size: the pool sets it so that the overlay reads unchanged base pages in place; a session
# that changed it would read differently from its siblings, never differently in content.
# hard/soft_heap_limit: process-wide, so one session would starve every other one in its process.
DENIED_PRAGMAS = frozenset(
    {
        "temp_store_directory",
        "data_store_directory",
        "mmap_size",
        "hard_heap_limit",
        "soft_heap_limit",
    }
)
#: Pragmas that may be read but not set: setting them can corrupt the session's schema for good
#: (``writable_schema`` then ``UPDATE sqlite_master``; ``schema_version``) or lift the copy
#: strategy's cap on the session's disk (``max_page_count``).
READ_ONLY_PRAGMAS = frozenset({"writable_schema", "schema_version", "max_page_count"})

_ATTACH = sqlite3.SQLITE_ATTACH
_PRAGMA = sqlite3.SQLITE_PRAGMA
_FUNCTION = sqlite3.SQLITE_FUNCTION
_OK = sqlite3.SQLITE_OK
_DENY = sqlite3.SQLITE_DENY


def authorizer(
    action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None
) -> int:
    """``sqlite3.Connection.set_authorizer`` callback enforcing the session policy."""
    if action == _ATTACH:
        # A plain VACUUM is authorized as an ATTACH of '' (its internal temporary database), and
        # ':memory:' names no file: both stay inside the session. Every path or URI is denied.
        return _OK if arg1 in ("", ":memory:") else _DENY
    if action == _FUNCTION and arg2 is not None and arg2.lower() in DENIED_FUNCTIONS:
        return _DENY
    if action == _PRAGMA and arg1 is not None:
        name = arg1.lower()
        if name in DENIED_PRAGMAS or (arg2 is not None and name in READ_ONLY_PRAGMAS):
            return _DENY
    return _OK
