"""An evaluation's output files: official predictions, verdicts, BIRD's prediction file, and its
episodes in the trajectory store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from birdenv.errors import MissingExtraError
from birdenv.predictions import layout_of
from birdenv.tasks import Task
from birdtrain import require
from birdtrain.rollout import Episode
from birdtrain.trajectory_store import TrajectoryStore, episode_rows

__all__ = ["read_verdicts", "store_episodes", "write_files"]


def write_files(
    out_dir: Path, episodes: list[Episode], by_id: dict[str, Task], kind: type[Task]
) -> None:
    """``predictions.jsonl`` (official form, first samples), ``verdicts.jsonl``, and the kind's
    own official prediction file where its layout has one (BIRD's ``predict.json``)."""
    firsts = [e for e in episodes if e.group == 0]
    with (out_dir / "predictions.jsonl").open("w") as fh:
        for e in firsts:
            fh.write(json.dumps({"instance_id": e.task_id, "pred_sqls": e.pred_sqls}) + "\n")
    with (out_dir / "verdicts.jsonl").open("w") as fh:
        for e in episodes:
            row = {
                "instance_id": e.task_id,
                "sample": e.group,
                "category": by_id[e.task_id].category,
                "status": "success" if e.passed else "failed",
                "pred_sqls": e.pred_sqls,
                "verdict": e.verdict,
            }
            fh.write(json.dumps(row, default=str) + "\n")
    layout = layout_of(kind)
    if layout.write is not None:  # the kind's own official file (BIRD's predict.json)
        layout.write(out_dir, [(by_id[e.task_id], e.pred_sqls) for e in firsts])


def read_verdicts(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of an evaluation's ``verdicts.jsonl`` (one per sample of each task).

    Raises ``ValueError`` naming the file and line when it is missing or a row is broken.
    """
    path = Path(out_dir) / "verdicts.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give the --out folder of a `birdtrain eval`")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            if not isinstance(row["instance_id"], str) or row["status"] not in (
                "success",
                "failed",
            ):
                raise ValueError("instance_id or status has the wrong type")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a verdict row ({exc})") from None
        rows.append(row)
    return rows


def store_episodes(
    store_dir: str | Path,
    episodes: list[Episode],
    by_id: dict[str, Task],
    *,
    label: str,
    mode: str,
    name: str,
) -> None:
    """Append the episodes to the trajectory store in ``store_dir`` under ``name``, one row per
    turn.

    The store is DuckDB's (the ``train`` extra). Without it, an evaluation that needs nothing
    else (a reference policy, an endpoint) still writes its other files, and says on stderr that
    the store was left out and which extra writes it.
    """
    try:
        require("duckdb")
    except MissingExtraError as missing:
        print(f"[eval {label}] trajectory store not written: {missing}", file=sys.stderr)
        return
    TrajectoryStore(store_dir).append(
        (
            row
            for e in episodes
            for row in episode_rows(
                e, category=by_id[e.task_id].category, run=label, stage="eval", mode=mode
            )
        ),
        name=name,
    )
