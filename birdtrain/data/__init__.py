"""Synthetic data of stages 1 and 2, and the ``birdtrain synth`` entry point.

- :func:`~birdtrain.data.reasoning.build_reasoning_examples`: stage-1 single-turn examples;
- :func:`~birdtrain.data.tool_use.build_tool_trajectories`: stage-2 tool-use trajectories;
- :class:`~birdtrain.endpoint.Teacher`: an optional OpenAI-compatible endpoint for both;
- :mod:`~birdtrain.data.bird`: the same two forms for BIRD text-to-SQL questions;
- :mod:`~birdtrain.data.mixture`: mixtures of task sources by weight (``data.mixture``);
- :func:`synth`: both datasets for a curriculum configuration, as JSONL files.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from birdenv.tasks import load_tasks
from birdtrain.config import CurriculumConfig
from birdtrain.data.kinds import by_kind, training_kind
from birdtrain.data.mixture import load_sources, mix_tasks
from birdtrain.data.reasoning import build_reasoning_examples
from birdtrain.data.tool_use import build_tool_trajectories
from birdtrain.endpoint import Teacher, TeacherError

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


def load_train_tasks(cfg: CurriculumConfig) -> list:
    """The training tasks of ``cfg.data``, debugging tasks and BIRD questions alike.

    With ``data.mixture`` weights: a seeded draw from the sources in those proportions
    (:func:`birdtrain.data.mixture.mix_tasks`, seed ``cfg.seed``), ``max_train_tasks`` of them
    (default: as many as repeat no task). Without: ``train_suite`` (with ``db_dir``), its first
    ``max_train_tasks``. ``mixture: auto`` must be resolved first
    (:func:`birdtrain.curriculum.mixture.resolve_mixture`).
    """

    mixture = cfg.data.mixture
    if mixture == "auto":
        raise ValueError(
            "data.mixture is 'auto': estimate the weights first (birdtrain mixture, or "
            "birdtrain.curriculum.mixture.resolve_mixture(cfg, run_dir))"
        )
    if mixture:
        sources = load_sources(list(mixture), cfg.data.db_dir)
        return mix_tasks(sources, mixture, total=cfg.data.max_train_tasks, seed=cfg.seed)
    tasks = load_tasks(cfg.data.train_suite, db_dir=cfg.data.db_dir)
    if cfg.data.max_train_tasks is not None:
        tasks = tasks[: cfg.data.max_train_tasks]
    return tasks


def make_teacher(cfg: CurriculumConfig) -> Teacher | None:
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


def _follow(tasks: list, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The examples in the order of the draw ``tasks``, a task drawn twice giving its examples twice."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for example in examples:
        by_task.setdefault(example["task_id"], []).append(example)
    return [e for t in tasks for e in by_task.get(t.instance_id, [])]


def synth(cfg: CurriculumConfig, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir/stage1.jsonl`` and ``out_dir/stage2.jsonl`` for a curriculum config.

    Tasks come from ``cfg.data`` (train suite, ``max_train_tasks``); the teacher too, when
    ``data.teacher_url`` is set. Each kind's examples are built by its
    :class:`~birdtrain.data.kinds.TrainingKind`. Stage-2 episodes get ``cfg.stage4.max_turns``
    turns, the budget the policy has in stage 4. Returns the counts (tasks, ``<kind>_tasks`` of
    each kind, examples kept, what was dropped and why, summed over the kinds) and the two paths.
    """
    out_dir = Path(out_dir)
    tasks = load_train_tasks(cfg)
    teacher = make_teacher(cfg)
    prompt = cfg.prompt.options()
    stage1: list[dict[str, Any]] = []
    stage2: list[dict[str, Any]] = []
    stage1_stats: Counter[str] = Counter()
    stage2_stats: Counter[str] = Counter()
    kinds: dict[str, int] = {}
    # A mixture may draw a task twice: build each task's examples once, then follow the draw.
    unique = list({t.instance_id: t for t in tasks}.values())
    for kind, group in by_kind(unique).items():
        training, stats1, stats2 = training_kind(kind), {}, {}
        kinds[f"{kind}_tasks"] = len(group)
        stage1 += training.reasoning_examples(
            group, teacher=teacher, stats=stats1, prompt=prompt, thought_rows=cfg.data.thought_rows
        )
        stage2 += training.tool_trajectories(
            group, teacher=teacher, max_turns=cfg.stage4.max_turns, stats=stats2, prompt=prompt
        )
        stage1_stats.update(stats1)
        stage2_stats.update(stats2)
    # The files follow the draw: its order interleaves the sources, and a task drawn twice counts twice.
    stage1, stage2 = _follow(tasks, stage1), _follow(tasks, stage2)
    return {
        "tasks": len(tasks),
        "mixture": cfg.data.mixture,
        "teacher": None if teacher is None else f"{teacher.model} at {teacher.endpoint}",
        "stage1": len(stage1),
        "stage2": len(stage2),
        "stage1_stats": dict(stage1_stats),
        "stage2_stats": dict(stage2_stats),
        **kinds,
        "stage1_path": str(write_jsonl(stage1, out_dir / "stage1.jsonl")),
        "stage2_path": str(write_jsonl(stage2, out_dir / "stage2.jsonl")),
    }
