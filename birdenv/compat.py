"""Old spellings that still work for one release, with a :class:`DeprecationWarning` saying the new one.

The database folder is ``db_dir`` everywhere (both environments, the loaders, ``make_vec``, the TRL
adapters, the command line); ``db_root``, its old name on the BIRD side, still works.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from birdenv.errors import ArgumentError

__all__ = ["db_dir_argument"]


def db_dir_argument(db_dir: Any, db_root: Any, where: str, *, stacklevel: int = 3) -> Any:
    """``db_dir``, or the value given under the old name ``db_root`` (with a warning).

    Python shows a :class:`DeprecationWarning` once per calling line. Both names with different
    folders is an :class:`~birdenv.errors.ArgumentError`.

    >>> db_dir_argument("dbs", None, "f")
    'dbs'
    """
    if db_root is None:
        return db_dir
    warnings.warn(
        f"{where}: db_root= is deprecated, use db_dir= (the same folder: "
        "{db_id}/{db_id}.sqlite or {db_id}/{db_id}_template.sqlite inside it)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if db_dir is not None and Path(db_dir) != Path(db_root):
        raise ArgumentError(
            f"{where}: db_dir={db_dir!r} and db_root={db_root!r} differ: give db_dir only"
        )
    return db_root
