"""Difficulty filtering: each training task's pass rate under the current policy.

GRPO learns only from groups whose rewards differ. A task the policy never solves (p = 0) or
always solves (p = 1) gives groups of equal rewards, and its rollouts are spent for nothing. Before
an RL stage, :func:`estimate_pass_rates` samples each training task ``k`` times under the policy
the stage starts from, through the real environment and judge (single-turn answers for stage 3,
agent rollouts for stage 4, both with the stage's own sampling settings), and
:func:`select_tasks` keeps the tasks with 0 < p < 1.

The estimates are written to ``RUN_DIR/difficulty/<stage>.json`` and reused when the same policy
asks again with the same sampling settings (a resumed run does not sample twice; a changed
temperature, turn limit or prompt samples anew). With ``difficulty_chunk`` the tasks are sampled
in parts of that many, each evaluated into ``RUN_DIR/difficulty/<stage>/<kind>/<part>/``; a part
whose summary shows the same tasks and settings is reused, so an estimate interrupted after hours
resumes at its first missing part::

    {"stage": "stage3", "model": "...", "mode": "single", "samples": 8,
     "settings": {"policy": "...", "n": 8, "temperature": 1.0, ...},
     "tasks": {"task_id": {"passed": 3, "samples": 8, "p": 0.375}, ...}}
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from birdenv.errors import BirdEnvError
from birdtrain.config import CurriculumConfig, EvaluationConfig
from birdtrain.evaluate import episode_settings, evaluate_policy, read_verdicts
from birdtrain.stages.precision import sampling_dtype

__all__ = ["DifficultyError", "estimate_pass_rates", "filter_tasks", "select_tasks"]


class DifficultyError(BirdEnvError, ValueError):
    """Too few training tasks are of useful difficulty for the stage's batch."""


def estimate_pass_rates(
    cfg: CurriculumConfig, stage: str, model_path: str, tasks: Sequence[Any], run_dir: Path
) -> dict[str, Any]:
    """Estimate the pass rate of every task in ``tasks`` for ``stage`` (``"stage3"``/``"stage4"``).

    Reuses ``run_dir/difficulty/<stage>.json`` when it was made for the same tasks under the same
    settings (the policy, the sample count and how the stage samples); otherwise samples
    (:func:`birdtrain.evaluate.evaluate_policy` with ``n`` samples per task, its files under
    ``run_dir/difficulty/<stage>/``) and writes it.
    """

    s = getattr(cfg, stage)
    mode = "single" if stage == "stage3" else "agent"
    path = Path(run_dir) / "difficulty" / f"{stage}.json"
    tasks = list({t.instance_id: t for t in tasks}.values())  # a mixture may draw a task twice
    ids = [t.instance_id for t in tasks]
    k = s.difficulty_samples
    settings = EvaluationConfig(
        mode=mode,
        n=k,
        temperature=s.temperature,
        max_turns=getattr(s, "max_turns", 1),
        max_new_tokens=s.max_completion_length if mode == "single" else s.max_new_tokens,
        label=f"difficulty-{stage}",
        prompt=cfg.prompt.options(),
        # An agent's rollouts end where the stage's do; a vLLM engine starts as evaluations' do.
        **({"max_context": s.max_context} if mode == "agent" else {}),
        engine_options=cfg.eval.engine_options(),
        dtype=sampling_dtype(cfg.model),
    )
    sampled = episode_settings(str(model_path), settings)
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("settings") == sampled and sorted(record.get("tasks", {})) == sorted(ids):
            return record
    passed: dict[str, int] = dict.fromkeys(ids, 0)
    # One evaluation per task kind: they are scored by different metrics (SR, EX).
    kinds: dict[type, list[Any]] = {}
    for task in tasks:
        kinds.setdefault(type(task), []).append(task)
    for n, group in enumerate(kinds.values()):
        size = s.difficulty_chunk or len(group)
        for part, start in enumerate(range(0, len(group), size)):
            chunk = group[start : start + size]
            out_dir = path.parent / stage / str(n) / str(part)
            rows = _finished_part(out_dir, sampled, chunk)
            if rows is None:
                shutil.rmtree(out_dir, ignore_errors=True)  # an interrupted try's trajectories
                evaluate_policy(str(model_path), tasks=chunk, out_dir=out_dir, config=settings)
                rows = read_verdicts(out_dir)
            for row in rows:
                passed[row["instance_id"]] += row["status"] == "success"
    record = {
        "stage": stage,
        "model": str(model_path),
        "mode": mode,
        "samples": k,
        "settings": sampled,
        "tasks": {t: {"passed": c, "samples": k, "p": c / k} for t, c in passed.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def _finished_part(
    out_dir: Path, settings: dict[str, Any], tasks: Sequence[Any]
) -> list[dict[str, Any]] | None:
    """The verdicts of a part evaluated earlier for the same tasks under the same ``settings``
    (:func:`~birdtrain.evaluate.episode_settings`: the policy, the sample count and how it
    samples), or None when it must be sampled (never finished, or made for something else)."""
    summary_path = out_dir / "summary.json"
    if not summary_path.is_file():  # written last: its presence marks a finished part
        return None

    if json.loads(summary_path.read_text()).get("settings") != settings:
        return None
    rows = read_verdicts(out_dir)
    expected = sorted(t.instance_id for t in tasks for _ in range(settings["n"]))
    return rows if sorted(r["instance_id"] for r in rows) == expected else None


def select_tasks(
    record: dict[str, Any], tasks: Sequence[Any], *, stage: str, per_step: int
) -> list[Any]:
    """The tasks of ``record`` with 0 < p < 1, in their order in ``tasks``.

    Raises :class:`DifficultyError` when fewer remain than one step's batch (``per_step``), with
    the counts and what to change.

    >>> class T:
    ...     def __init__(self, i): self.instance_id = i
    >>> record = {"samples": 4, "tasks": {"a": {"p": 0.0}, "b": {"p": 0.5}, "c": {"p": 1.0},
    ...                                   "d": {"p": 0.25}}}
    >>> [t.instance_id for t in select_tasks(record, [T(i) for i in "abcd"], stage="stage3",
    ...                                      per_step=2)]
    ['b', 'd']
    >>> select_tasks(record, [T(i) for i in "abcd"], stage="stage3", per_step=4)
    Traceback (most recent call last):
    ...
    birdtrain.curriculum.difficulty.DifficultyError: stage3: 2 of 4 training tasks have 0 < p < 1 at 4 samples (p = 0: 1, p = 1: 1), fewer than one step's 4; lower the batch, raise stage3.difficulty_samples, train the earlier stages longer, or set stage3.difficulty_filter=false
    """
    rates = {t: v["p"] for t, v in record["tasks"].items()}
    kept = [t for t in tasks if 0.0 < rates.get(t.instance_id, 0.0) < 1.0]
    if len(kept) < per_step:
        zero = sum(1 for p in rates.values() if p == 0.0)
        one = sum(1 for p in rates.values() if p == 1.0)
        raise DifficultyError(
            f"{stage}: {len(kept)} of {len(rates)} training tasks have 0 < p < 1 at "
            f"{record['samples']} samples (p = 0: {zero}, p = 1: {one}), fewer than one step's "
            f"{per_step}; lower the batch, raise {stage}.difficulty_samples, train the earlier "
            f"stages longer, or set {stage}.difficulty_filter=false"
        )
    return kept


def filter_tasks(
    cfg: CurriculumConfig, stage: str, model_path: str, tasks: Sequence[Any], run_dir: Path
) -> list[Any]:
    """The training tasks of an RL stage: all of them, or with ``<stage>.difficulty_filter`` those
    of useful difficulty for the policy at ``model_path`` (estimated, or reused from the run)."""
    s = getattr(cfg, stage)
    if not s.difficulty_filter:
        return list(tasks)
    record = estimate_pass_rates(cfg, stage, model_path, tasks, run_dir)
    per_step = s.prompts_per_step if stage == "stage3" else s.tasks_per_step
    kept = select_tasks(record, tasks, stage=stage, per_step=per_step)
    print(
        f"[{stage}] difficulty filter: {len(kept)} of {len(tasks)} tasks have 0 < p < 1 "
        f"({record['samples']} samples each; {Path(run_dir) / 'difficulty' / f'{stage}.json'})"
    )
    return kept
