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

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INSIDE = "BIRDENV_TEST_PRIVATE_NETWORK"  # set in the child: run the marked tests for real
_REPORTS = "BIRDENV_TEST_PRIVATE_NETWORK_REPORTS"  # where the child writes its reports
#: A child that records no report (each test's setup, call and teardown records one) for this
#: long is taken as hung and stopped. A bound on one test phase, not on a module's worth of them:
#: under ``make test-under-load`` beside other work the slowest phase, a cluster's start, took
#: 287 s, and a whole module ran past the 1,200 s that once bounded the child.
_STALL_TIMEOUT = 900.0
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
        output = _run_child(command, config.rootpath, env, reports_path)
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


def _run_child(command: list[str], cwd: Path, env: dict[str, str], reports_path: Path) -> str:
    """Run the child pytest until it exits, or until it has recorded no report for
    :data:`_STALL_TIMEOUT` seconds (then it is killed); its output, with the reason it was
    stopped. The output goes to a file: a pipe left open by a process the child started would
    hold a reader until that process ended."""
    stopped = ""
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        size, progressed = -1, time.monotonic()
        while child.poll() is None:
            now = reports_path.stat().st_size if reports_path.exists() else 0
            if now != size:
                size, progressed = now, time.monotonic()
            elif time.monotonic() - progressed > _STALL_TIMEOUT:
                child.kill()
                child.wait()
                stopped = (
                    f"\nthe private-network pytest recorded no report for {_STALL_TIMEOUT:.0f} s "
                    "(a test phase hung, or took that long): stopped"
                )
                break
            time.sleep(1.0)
        out.seek(0)
        return out.read() + stopped


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
    # (ray._private.node.Node), which no setting lengthens: under two CPU hogs per core beside
    # make test's other lanes and other work, four starts in a row missed it. While the nodes
    # start, the lookup it polls waits for the registration itself, bounded by a hang's measure.
    with _registration_awaited(ray._private.services):
        cluster = Cluster()
        try:
            cluster.add_node(
                num_cpus=1, include_dashboard=False, env_vars={"BIRDENV_HOME": str(home())}
            )
            cluster.add_node(num_cpus=1, env_vars={"BIRDENV_HOME": str(second_home)})
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
    ray.init(address=cluster.address)
    cluster.second_home = second_home
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _remove_postgres_cluster_of(second_home)


#: How long a starting Ray node may take to register with the GCS before it is taken as failed:
#: a bound for a node that will never register (its raylet died), not a guess at a start's time.
_REGISTRATION_TIMEOUT = 600.0


@contextlib.contextmanager
def _registration_awaited(services: Any) -> Iterator[None]:
    """While in the block, ``services.get_node`` (what a starting ``ray._private.node.Node``
    polls, raising ``RuntimeError`` until the GCS knows the node) retries for up to
    :data:`_REGISTRATION_TIMEOUT` seconds before it raises."""
    lookup = services.get_node

    def awaited(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + _REGISTRATION_TIMEOUT
        while True:
            try:
                return lookup(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = awaited
    try:
        yield
    finally:
        services.get_node = lookup


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
