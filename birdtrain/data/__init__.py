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
from pathlib import Path
from typing import Any

from birdtrain.config import CurriculumConfig
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
    from birdenv.tasks import load_tasks
    from birdtrain.data.mixture import load_sources, mix_tasks

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
    ``data.teacher_url`` is set. Stage-2 episodes get ``cfg.stage4.max_turns`` turns, the budget
    the policy has in stage 4. Returns the counts (tasks, examples kept, what was dropped and why)
    and the two paths.
    """
    from birdenv.tasks import BirdTask, Task
    from birdtrain.data.bird import build_bird_reasoning_examples, build_bird_tool_trajectories

    out_dir = Path(out_dir)
    tasks = load_train_tasks(cfg)
    teacher = make_teacher(cfg)
    # A mixture may draw a task twice: build each task's examples once, then follow the draw.
    unique = list({t.instance_id: t for t in tasks}.values())
    critic = [t for t in unique if isinstance(t, Task)]
    bird = [t for t in unique if isinstance(t, BirdTask)]
    stage1_stats: dict[str, int] = {}
    stage2_stats: dict[str, int] = {}
    prompt = cfg.prompt.options()
    rows = cfg.data.thought_rows
    stage1 = (
        build_reasoning_examples(
            critic, teacher=teacher, stats=stage1_stats, prompt=prompt, thought_rows=rows
        )
        if critic
        else []
    )
    stage2 = (
        build_tool_trajectories(
            critic,
            teacher=teacher,
            max_turns=cfg.stage4.max_turns,
            stats=stage2_stats,
            prompt=prompt,
        )
        if critic
        else []
    )
    kinds: dict[str, Any] = {}
    if bird:
        bird1: dict[str, int] = {}
        bird2: dict[str, int] = {}
        stage1 += build_bird_reasoning_examples(
            bird, teacher=teacher, stats=bird1, prompt=prompt, thought_rows=rows
        )
        stage2 += build_bird_tool_trajectories(
            bird, teacher=teacher, max_turns=cfg.stage4.max_turns, stats=bird2, prompt=prompt
        )
        kinds = {"critic_tasks": len(critic), "bird_tasks": len(bird)}
        kinds["bird_stage1_stats"], kinds["bird_stage2_stats"] = bird1, bird2
    # The files follow the draw: its order interleaves the sources, and a task drawn twice counts twice.
    stage1, stage2 = _follow(tasks, stage1), _follow(tasks, stage2)
    return {
        "tasks": len(tasks),
        "mixture": cfg.data.mixture,
        "teacher": None if teacher is None else f"{teacher.model} at {teacher.endpoint}",
        "stage1": len(stage1),
        "stage2": len(stage2),
        "stage1_stats": stage1_stats,
        "stage2_stats": stage2_stats,
        **kinds,
        "stage1_path": str(write_jsonl(stage1, out_dir / "stage1.jsonl")),
        "stage2_path": str(write_jsonl(stage2, out_dir / "stage2.jsonl")),
    }
