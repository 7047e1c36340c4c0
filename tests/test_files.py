"""``birdenv.files``: ``exclusive_lock`` (one holder at a time across processes, released by
death) and ``identify`` (a real path, resolved again when the path names another file)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from birdenv.files import exclusive_lock, identify


def _holder(lock: Path, log: Path, seconds: float) -> subprocess.Popen:
    """A process that takes the lock, notes it, holds it ``seconds`` and notes its release."""
    script = textwrap.dedent(f"""
        import time
        from birdenv.files import exclusive_lock
        with exclusive_lock({str(lock)!r}):
            with open({str(log)!r}, "a") as fh:
                fh.write("holder in\\n")
            time.sleep({seconds})
            with open({str(log)!r}, "a") as fh:
                fh.write("holder out\\n")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (log.is_file() and "holder in" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.01)
    return proc


def test_a_second_process_waits_for_the_holder(tmp_path: Path) -> None:
    lock, log = tmp_path / "x.lock", tmp_path / "log"
    holder = _holder(lock, log, 0.5)
    with exclusive_lock(lock), log.open("a") as fh:
        fh.write("here in\n")
    assert holder.wait(timeout=60) == 0
    assert log.read_text().split("\n")[:3] == ["holder in", "holder out", "here in"]
    assert lock.is_file()


def test_a_holder_that_dies_releases_the_lock(tmp_path: Path) -> None:
    lock, log = tmp_path / "x.lock", tmp_path / "log"
    holder = _holder(lock, log, 600)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    with exclusive_lock(lock):
        pass
    assert "holder out" not in log.read_text()


def test_identify_resolves_a_path_again_once_it_names_another_file(tmp_path: Path) -> None:
    first, second = tmp_path / "first.sqlite", tmp_path / "second.sqlite"
    first.write_bytes(b"1")
    second.write_bytes(b"22")
    folder = tmp_path / "folder"
    folder.mkdir()
    link = folder / "db.sqlite"
    link.symlink_to(first)
    real, st = identify(link)
    assert (real, st.st_size) == (str(first), 1)
    assert identify(link)[0] == str(first)  # remembered: the same file
    link.unlink()
    link.symlink_to(second)
    real, st = identify(link)
    assert (real, st.st_size) == (str(second), 2)
    link.unlink()
    with pytest.raises(FileNotFoundError):
        identify(link)
