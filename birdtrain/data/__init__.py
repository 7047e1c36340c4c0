"""Synthetic data of stages 1 and 2, and the ``birdtrain synth`` entry point.

- :func:`~birdtrain.data.reasoning.build_reasoning_examples`: stage-1 single-turn examples;
- :func:`~birdtrain.data.trajectories.build_tool_trajectories`: stage-2 tool-use trajectories;
- :class:`~birdtrain.data.teacher.Teacher`: an optional OpenAI-compatible endpoint for both;
- :func:`synth`: both datasets for a curriculum configuration, as JSONL files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from birdtrain.data.reasoning import build_reasoning_examples
from birdtrain.data.teacher import Teacher, TeacherError
from birdtrain.data.trajectories import build_tool_trajectories

__all__ = [
    "Teacher",
    "TeacherError",
    "build_reasoning_examples",
    "build_tool_trajectories",
    "load_train_tasks",
    "make_teacher",
    "synth",
    "write_jsonl",
]


def load_train_tasks(cfg: Any) -> list:
    """The training tasks of ``cfg.data``: ``train_suite`` (with ``db_dir``), first ``max_train_tasks``."""
    from birdenv.tasks import load_tasks

    tasks = load_tasks(cfg.data.train_suite, db_dir=cfg.data.db_dir)
    if cfg.data.max_train_tasks is not None:
        tasks = tasks[: cfg.data.max_train_tasks]
    return tasks


def make_teacher(cfg: Any) -> Teacher | None:
    """The teacher of ``cfg.data`` (``teacher_url``, ``teacher_model``, key from the named variable), or None."""
    data = cfg.data
    if not data.teacher_url:
        return None
    if not data.teacher_model:
        raise ValueError("data.teacher_url is set but data.teacher_model is not: name the model")
    return Teacher(
        data.teacher_url, data.teacher_model, api_key=os.environ.get(data.teacher_api_key_env)
    )


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as JSON lines (UTF-8, non-ASCII kept) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def synth(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir/stage1.jsonl`` and ``out_dir/stage2.jsonl`` for a curriculum config.

    Tasks come from ``cfg.data`` (train suite, ``max_train_tasks``); the teacher too, when
    ``data.teacher_url`` is set. Stage-2 episodes get ``cfg.stage4.max_turns`` turns, the budget
    the policy has in stage 4. Returns the counts (tasks, examples kept, what was dropped and why)
    and the two paths.
    """
    out_dir = Path(out_dir)
    tasks = load_train_tasks(cfg)
    teacher = make_teacher(cfg)
    stage1_stats: dict[str, int] = {}
    stage2_stats: dict[str, int] = {}
    stage1 = build_reasoning_examples(tasks, teacher=teacher, stats=stage1_stats)
    stage2 = build_tool_trajectories(
        tasks, teacher=teacher, max_turns=cfg.stage4.max_turns, stats=stage2_stats
    )
    return {
        "tasks": len(tasks),
        "teacher": None if teacher is None else f"{teacher.model} at {teacher.endpoint}",
        "stage1": len(stage1),
        "stage2": len(stage2),
        "stage1_stats": stage1_stats,
        "stage2_stats": stage2_stats,
        "stage1_path": str(write_jsonl(stage1, out_dir / "stage1.jsonl")),
        "stage2_path": str(write_jsonl(stage2, out_dir / "stage2.jsonl")),
    }
