"""Settings for every pytest run in this repository: tests, doctests and benchmarks.

Nothing a run writes may land in the user's caches (``~/.cache/birdenv``, the Hugging Face
caches). Before anything is imported, every cache left to its default points into one directory
under the system's temporary directory, per user, kept between runs so that the bundled databases
are built once (under a file lock: concurrent runs share them safely). A cache named in the
environment (``BIRDENV_HOME=...``) is the caller's choice and is kept. Worker processes and
command-line tests inherit these variables.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

_HOME = Path(tempfile.gettempdir()) / f"birdenv-tests-{os.getuid()}"
os.environ.setdefault("BIRDENV_HOME", str(_HOME))
os.environ.setdefault("HF_HOME", str(_HOME / "huggingface"))
os.environ.setdefault("XDG_CACHE_HOME", str(_HOME / "cache"))

# The adapters of other RL frameworks import them at module level; where a framework is not
# installed (the main .venv: verl pins transformers below the training stack's), its module is not
# collected for doctests. The .venv-adapters lane of `make test` has them all.
collect_ignore = [
    f"birdenv/integrations/{name}.py"
    for name, module in (("verl", "verl"), ("openenv", "openenv"), ("skyrl", "skyrl_gym"))
    if importlib.util.find_spec(module) is None
]
