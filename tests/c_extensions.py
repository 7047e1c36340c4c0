"""The C twins of Python rules, for the tests that check each gives what its rule gives.

The extensions build as optional (a machine without a C compiler still installs the package and
runs the rules in Python), so off CI a missing one skips its parity tests. In CI (``CI=true``,
which ``.ci/run`` sets) every extension must build: a missing one fails them instead.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest


def c_extension(name: str) -> types.ModuleType:
    """Import the C extension ``name``; skip the test when it is not built, fail it in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{name} is not built ({exc}); CI=true needs every C extension built")
        pytest.skip(f"{name} is not built ({exc}): installed without a C compiler")
