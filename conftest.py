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

from hypothesis import HealthCheck, settings

_HOME = Path(tempfile.gettempdir()) / f"birdenv-tests-{os.getuid()}"
os.environ.setdefault("BIRDENV_HOME", str(_HOME))
os.environ.setdefault("HF_HOME", str(_HOME / "huggingface"))
os.environ.setdefault("XDG_CACHE_HOME", str(_HOME / "cache"))

# Hypothesis' defaults judge a test by the machine's speed: a 200 ms deadline per example, and a
# health check failing a strategy that generates slowly. On a shared, loaded machine both fail
# tests whose behaviour is right. Two profiles, chosen by HYPOTHESIS_PROFILE (make test and CI set
# `ci`; inherited by every process a test starts) or pytest's --hypothesis-profile:
# - ci: no deadline, no too_slow check, and the same examples every run (derandomize), so a
#   failure seen there is seen again by the same command; the failing example is printed with
#   the @reproduce_failure blob.
# - dev (the default): no deadline either (a deadline is a wall-clock guess), but fresh examples
#   each run, remembered in Hypothesis' example database, and the health checks kept, so that a
#   strategy written too slow is noticed while it is written.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The adapters of other RL frameworks import them at module level; where a framework is not
# installed (the main .venv: verl pins transformers below the training stack's), its module is not
# collected for doctests. The .venv-adapters lane of `make test` has them all.
collect_ignore = [
    f"birdenv/integrations/{name}.py"
    for name, module in (("verl", "verl"), ("openenv", "openenv"), ("skyrl", "skyrl_gym"))
    if importlib.util.find_spec(module) is None
]
