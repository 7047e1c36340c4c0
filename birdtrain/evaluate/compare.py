"""Comparing two evaluations task by task."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from birdtrain.evaluate.files import read_verdicts
from birdtrain.stats import paired_difference

__all__ = ["compare_evaluations"]


def compare_evaluations(a_dir: str | Path, b_dir: str | Path) -> dict[str, Any]:
    """Evaluation ``b_dir`` against evaluation ``a_dir``, task by task, on the tasks both hold.

    Returns :func:`birdtrain.stats.paired_difference` of their samples' outcomes (every sample,
    not only the first), with each side's ``labels`` and ``samples`` per task from their
    summaries. Use it to ask whether training changed a policy: evaluate both checkpoints on the
    same tasks, with several samples at a temperature when the tasks are few.
    """

    outcomes: list[dict[str, list[bool]]] = []
    labels, samples = [], []
    for out_dir in (a_dir, b_dir):
        by_task: dict[str, list[bool]] = defaultdict(list)
        for row in read_verdicts(out_dir):
            by_task[row["instance_id"]].append(row["status"] == "success")
        outcomes.append(dict(by_task))
        summary_path = Path(out_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        labels.append(summary.get("label", Path(out_dir).name))
        samples.append(max(len(v) for v in by_task.values()) if by_task else 0)
    result = paired_difference(outcomes[0], outcomes[1])
    result.update(labels=labels, samples=samples)
    return result
