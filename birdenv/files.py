"""Where birdenv keeps its files, and the content hash that names a file.

The lowest layer beside :mod:`birdenv.errors`: the bundled suites build their databases under
:func:`home`, and the replica store names its bases by :func:`file_sha256`, without either one
importing the other.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["file_sha256", "home"]


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
