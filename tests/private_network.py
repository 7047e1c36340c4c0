"""Tests marked ``private_network`` (the Ray tests) run inside a private network namespace.

Ray listens on the machine's interface address even when told ``127.0.0.1``, and test traffic
may only go to loopback. So the first marked test of a session starts one child pytest for all of
them under ``unshare -n`` (only ``lo``, brought up), and each marked test reports the outcome the
child recorded for it, failures with their tracebacks. Under pytest-xdist (``make test`` runs
``-n auto --dist loadscope``, which keeps each module on one worker) a child runs one module's
marked tests, on the worker that has that module. Where no namespace can be made (no
``unshare``/``ip``, or not permitted) and where Ray is not installed, they are skipped with the
reason. The session-wide ``ray_cluster`` fixture is a two-node cluster on 127.0.0.1 (one CPU per
node); the second node has a ``BIRDENV_HOME`` of its own, so it shares no files with the driver.

Benchmarks go the same way: ``--benchmark-only`` and ``--benchmark-json=PATH`` are passed on (the
child writes ``PATH`` with ``.private-network`` before its suffix), and the child's output,
pytest-benchmark's table included, is shown in the summary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INSIDE = "BIRDENV_TEST_PRIVATE_NETWORK"  # set in the child: run the marked tests for real
_REPORTS = "BIRDENV_TEST_PRIVATE_NETWORK_REPORTS"  # where the child writes its reports
_CHILD_TIMEOUT = 1200
_RESULTS = pytest.StashKey[dict[str, list[Any]]]()
_OUTPUT = pytest.StashKey[str]()


def _unshare_command() -> tuple[list[str] | None, str]:
    """The command prefix that enters a private network namespace, or why there is none."""
    if importlib.util.find_spec("ray") is None:
        return None, "Ray is not installed: pip install 'bird-rl[ray]'"
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        return None, "private network namespace unavailable: `unshare` and `ip` (iproute2) needed"
    why = ""
    for flags in (["-n"], ["-r", "-n"]):  # as root; else in a user namespace of our own
        probe = subprocess.run(
            [unshare, *flags, "--", ip, "link", "set", "lo", "up"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return [unshare, *flags, "--", "bash", "-c", 'ip link set lo up && exec "$@"', "-"], ""
        why = probe.stderr.strip()
    return None, f"cannot create a private network namespace with unshare: {why}"


def _scope(item: pytest.Item) -> str:
    """Which marked tests share a child: all of a session's, or under pytest-xdist (whose
    ``--dist loadscope`` keeps a module on one worker) those of the item's module."""
    return item.nodeid.split("::")[0] if os.environ.get("PYTEST_XDIST_WORKER") else ""


def _run_children(session: pytest.Session, scope: str) -> dict[str, list[Any]]:
    """Run the marked tests of ``scope`` in one child pytest; its reports by node id."""
    config = session.config
    items = [
        i for i in session.items if i.get_closest_marker("private_network") and _scope(i) == scope
    ]
    prefix, why = _unshare_command()
    if prefix is None:
        return {i.nodeid: [_skipped(i, why)] for i in items}
    with tempfile.TemporaryDirectory(prefix="birdenv-netns-") as tmp:
        reports_path = Path(tmp) / "reports.jsonl"
        env = {**os.environ, INSIDE: "1", _REPORTS: str(reports_path), "RAY_AUTH_MODE": "disabled"}
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts its workers at niceness 15, to yield to the driver; beside other test
        # processes (make test runs its lanes side by side) every one of those would come first,
        # and a test that waits on an actor would wait on them all.
        env.setdefault("RAY_worker_niceness", "0")
        command = [
            *prefix,
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "",  # the parent chose these tests already
            *_benchmark_options(config),
            *(i.nodeid for i in items),
        ]
        try:
            child = subprocess.run(
                command,
                cwd=config.rootpath,
                env=env,
                capture_output=True,
                text=True,
                timeout=_CHILD_TIMEOUT,
            )
            output = child.stdout + child.stderr
        except subprocess.TimeoutExpired as exc:
            output = f"the private-network pytest ran past {_CHILD_TIMEOUT} s\n{exc.stdout or ''}"
        reports: dict[str, list[Any]] = {}
        if reports_path.exists():
            for line in reports_path.read_text().splitlines():
                report = config.hook.pytest_report_from_serializable(
                    config=config, data=json.loads(line)
                )
                reports.setdefault(report.nodeid, []).append(report)
    session.stash[_OUTPUT] = output
    missing = (
        f"the private-network pytest reported nothing for this test; its output:\n{output[-6000:]}"
    )
    return {i.nodeid: reports.get(i.nodeid) or [_failed(i, missing)] for i in items}


def _benchmark_options(config: pytest.Config) -> list[str]:
    """The parent's pytest-benchmark options that the child must share."""
    options = []
    if config.getoption("benchmark_only", False):
        options.append("--benchmark-only")
    json_path = config.getoption("benchmark_json", None)
    if json_path:
        path = Path(json_path)
        options.append(f"--benchmark-json={path.with_suffix('.private-network' + path.suffix)}")
    return options


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Show the child's output where the child ran benchmarks (their figures are in it)."""
    output = terminalreporter._session.stash.get(_OUTPUT, None)
    if output and _benchmark_options(config):
        terminalreporter.section("the private-network run (Ray benchmarks)")
        terminalreporter.write(output)


def _skipped(item: pytest.Item, why: str) -> pytest.TestReport:
    path, line, _ = item.location
    return pytest.TestReport(
        item.nodeid, item.location, {}, "skipped", (str(path), (line or 0) + 1, why), "setup"
    )


def _failed(item: pytest.Item, why: str) -> pytest.TestReport:
    return pytest.TestReport(item.nodeid, item.location, {}, "failed", why, "call")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Report a marked test from the child's run instead of running it here."""
    if os.environ.get(INSIDE) or item.get_closest_marker("private_network") is None:
        return None
    results = item.session.stash.setdefault(_RESULTS, {})
    if item.nodeid not in results:
        results.update(_run_children(item.session, _scope(item)))
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in results[item.nodeid]:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    # Nothing of this item was set up here; leave the fixture stack as the next item needs it.
    item.session._setupstate.teardown_exact(nextitem)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """In the child: record every report for the parent."""
    report = yield
    path = os.environ.get(_REPORTS)
    if path and os.environ.get(INSIDE):
        data = item.config.hook.pytest_report_to_serializable(config=item.config, report=report)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(data) + "\n")
    return report


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A head and a second node on 127.0.0.1, one CPU each; the driver connected to the head."""
    if not os.environ.get(INSIDE):
        pytest.fail("ray_cluster needs the private_network marker on the test using it")
    import ray
    from ray.cluster_utils import Cluster

    from birdenv.suites import home

    if ray.is_initialized():
        ray.shutdown()
    second_home = tmp_path_factory.mktemp("second-node-home")
    # Ray gives a starting node 30 s to register with the GCS, a figure fixed in its code
    # (ray._private.node.Node), which no setting lengthens. Under two CPU hogs per core beside
    # make test's other lanes, a start missed it twice in a row: each miss starts afresh.
    attempts = 4
    for attempt in range(attempts):
        cluster = Cluster()
        try:
            cluster.add_node(
                num_cpus=1, include_dashboard=False, env_vars={"BIRDENV_HOME": str(home())}
            )
            cluster.add_node(num_cpus=1, env_vars={"BIRDENV_HOME": str(second_home)})
            cluster.wait_for_nodes()
            break
        except Exception:
            cluster.shutdown()
            if attempt == attempts - 1:
                raise
    ray.init(address=cluster.address)
    cluster.second_home = second_home
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _remove_postgres_cluster_of(second_home)


def _remove_postgres_cluster_of(node_home: Path) -> None:
    """Stop and delete the private PostgreSQL cluster a node with its own ``BIRDENV_HOME`` made
    (a PostgreSQL task played there). The node's processes die with the Ray cluster, their exit
    hooks unrun, so its server runs on; and its folder lives in the system's temporary directory
    when the home is out of the server user's reach, outliving the home."""
    from birdenv.errors import BirdEnvError
    from birdenv.postgres.server import PrivateCluster

    before = os.environ.get("BIRDENV_HOME")
    os.environ["BIRDENV_HOME"] = str(node_home)
    try:
        cluster = PrivateCluster()  # where that node's cluster is, by the same rule it used
    except BirdEnvError:  # no PostgreSQL on this machine: no cluster was made
        return
    finally:
        if before is None:
            del os.environ["BIRDENV_HOME"]
        else:
            os.environ["BIRDENV_HOME"] = before
    cluster.remove()
