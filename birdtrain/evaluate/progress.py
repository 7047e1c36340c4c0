"""The resume file of an evaluation: its finished episodes, saved as they end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from birdtrain.errors import OutputWriteError
from birdtrain.rollout import Episode
from birdtrain.rundir import settings_differ

__all__ = ["PROGRESS_FILE", "EvaluationProgress"]

#: The file in an evaluation's folder that holds its finished episodes until its summary is written.
PROGRESS_FILE = "episodes.partial.jsonl"


class EvaluationProgress:
    """The finished episodes of an evaluation in ``out_dir``, saved one line each as they end, so
    that an interrupted evaluation (a killed process, a machine that went away) resumes where it
    stopped instead of from the start.

    The file's first line holds the evaluation's ``settings``; resuming under other settings is an
    error that names the ones that differ. Each further line is one episode and the seconds its
    run had spent when it was saved. On opening, :attr:`kept` are the episodes of tasks whose
    ``n`` samples were all saved (those of a task cut short are sampled again), and
    :attr:`earlier_seconds` the time earlier runs had spent when they saved their last episode; the
    file is rewritten to hold only those. A file without episodes (a run that failed before its
    first) holds nothing to resume, whatever its settings. A last line cut short by the
    interruption is dropped; a broken line elsewhere is an error naming it. An episode that broke
    (``dropped``, an environment error) is not saved, so a resumed run plays it again. A file that
    cannot be written (a full disk) raises :class:`~birdtrain.errors.OutputWriteError` and keeps the
    lines saved before. :meth:`close` stops saving; :meth:`finish` removes the file once the
    summary is written. :attr:`id` names the evaluation across its resumptions (its part of the
    trajectory store is written under it, so a resumed run that stores again replaces that part).
    """

    def __init__(
        self, out_dir: Path, settings: dict[str, Any], task_ids: list[str], n: int
    ) -> None:
        self.path = out_dir / PROGRESS_FILE
        self.settings = json.loads(json.dumps(settings, default=str))
        self.kept: list[Episode] = []
        self._kept_rows: list[dict[str, Any]] = []
        self.earlier_seconds = 0.0
        self.id = uuid.uuid4().hex[:12]
        self._run = 0
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        if self.path.is_file():
            self._read(set(task_ids), n)
        tmp = self.path.with_suffix(".tmp")
        try:
            with tmp.open("w") as fh:
                fh.write(json.dumps({"settings": self.settings, "id": self.id}) + "\n")
                for row in self._kept_rows:
                    fh.write(json.dumps(row) + "\n")
            os.replace(tmp, self.path)  # the file as it was until the new one is whole
            self._fh = self.path.open("a", buffering=1)  # one line each: a kill loses no whole line
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._unwritable(exc) from exc

    def _read(self, task_ids: set[str], n: int) -> None:
        lines = self.path.read_text().splitlines()
        rows: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        seconds: dict[int, float] = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                row = json.loads(line)
                episode = row["episode"]
                run, spent = int(row["run"]), float(row["seconds"])
                task_id, group = episode["task_id"], int(episode["group"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                if number == len(lines):
                    break  # the line being written when the run was interrupted
                raise ValueError(f"{self.path}:{number}: not a saved episode ({exc})") from None
            if task_id in task_ids and 0 <= group < n:
                rows[task_id][group] = row
            seconds[run] = max(seconds.get(run, 0.0), spent)
        if not seconds:
            return  # no episode saved: nothing to resume, whatever the settings were
        try:
            header = json.loads(lines[0])
            saved, self.id = header["settings"], str(header.get("id", self.id))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{self.path}:1: not the progress of an evaluation") from None
        differ = settings_differ(saved, self.settings)
        if differ:
            raise ValueError(
                f"{self.path} holds an interrupted evaluation with other settings "
                f"({'; '.join(differ)}); run it with the same settings to resume it, or remove "
                "the file (or write to another folder) to start over"
            )
        self._run = max(seconds) + 1
        self.earlier_seconds = sum(seconds.values())
        self._kept_rows = [
            groups[g] for groups in rows.values() if len(groups) == n for g in range(n)
        ]
        self.kept = [Episode.from_dict(row["episode"]) for row in self._kept_rows]

    @property
    def complete(self) -> set[str]:
        """Tasks whose every sample was kept from an earlier run."""
        return {e.task_id for e in self.kept}

    def save(self, episode: Episode) -> None:
        """Save a finished episode (from any thread); one that broke is left to be played again."""
        if episode.dropped:
            return
        row = {
            "run": self._run,
            "seconds": round(time.perf_counter() - self._started, 3),
            "episode": dataclasses.asdict(episode),
        }
        line = json.dumps(row, default=str) + "\n"
        with self._lock:
            try:
                self._fh.write(line)
            except OSError as exc:
                raise self._unwritable(exc) from exc

    def _unwritable(self, exc: OSError) -> OutputWriteError:
        return OutputWriteError(
            f"cannot save the evaluation's progress in {self.path} ({exc.strerror or exc}); the "
            "episodes saved before are kept: make room and run the same command to resume"
        )

    def close(self) -> None:
        """Stop saving (the episodes are all in, or the evaluation failed: the file stays)."""
        # Every whole line is written already; what a failed write left in the buffer is a torn
        # line that a resumed run drops, and flushing it again must not hide the first error.
        with contextlib.suppress(OSError):
            self._fh.close()

    def finish(self) -> None:
        """The evaluation's files are written: the progress file has served its purpose."""
        self.close()
        self.path.unlink(missing_ok=True)
