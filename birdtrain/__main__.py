"""``birdtrain``, the command, and ``python -m birdtrain``: SIGINT and SIGTERM are acted on from the
first moment, while the command's modules load (:func:`birdenv.interrupts.launch`)."""

from __future__ import annotations

import sys

from birdenv.interrupts import launch

__all__ = ["main"]


def main() -> int:
    """Run the ``birdtrain`` command (:func:`birdtrain.cli.main`) on the process's arguments."""
    return launch("birdtrain", "birdtrain.cli")


if __name__ == "__main__":
    sys.exit(main())
