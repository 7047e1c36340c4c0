"""Running the curriculum: its stages in order, and the evaluations between them.

The run directory, its record and resuming are :mod:`birdtrain.curriculum.directory`'s; which tasks
each part uses, :mod:`birdtrain.curriculum.tasks`'s; the process each stage runs in,
:mod:`birdtrain.curriculum.isolation`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from birdtrain.config import STAGES, CurriculumConfig
from birdtrain.curriculum.difficulty import estimate_pass_rates, filter_tasks
from birdtrain.curriculum.directory import (
    content_hash,
    git_commit,
    open_run,
    retrain_hint,
    start_checkpoint,
    verify_input,
    write_json,
)
from birdtrain.curriculum.isolation import isolated
from birdtrain.curriculum.tasks import bird_eval_suite, rl_tasks, tasks_for
from birdtrain.data import synth
from birdtrain.evaluate import evaluate_policy, sharing_engines
from birdtrain.models import resolve_model
from birdtrain.report import write_report
from birdtrain.rundir import (
    NO_EFFECT,
    flatten,
    folder_hash,
    verify_folder,
    working_on,
    write_manifest,
    write_once,
)
from birdtrain.stages import agentic, grpo, sft
from birdtrain.stages.precision import sampling_dtype

__all__ = [
    "estimate_difficulty",
    "run_curriculum",
    "run_stage",
    "synthesize",
]


def synthesize(cfg: CurriculumConfig, run_dir: Path) -> dict[str, Any]:
    """Synthesize the stage-1 and stage-2 data into ``run_dir/data`` once; return the counts."""

    data_dir = run_dir / "data"
    done = data_dir / "DONE"
    if done.is_file():
        verify_folder(data_dir, fix=retrain_hint(STAGES[0]))
        return json.loads(done.read_text())
    counts = synth(cfg, data_dir)
    write_manifest(data_dir)  # before DONE: a finished synthesis always has its manifest
    write_once(done, counts)
    return counts


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_stage(cfg: CurriculumConfig, stage: str, model_path: str, run_dir: Path) -> str:
    """Run one stage unless its DONE marker exists; return the checkpoint the next stage starts from."""
    out_dir = run_dir / stage
    done = out_dir / "DONE"
    if done.is_file():
        print(f"[{stage}] already complete: {out_dir / 'checkpoint'}")
        return str(out_dir / "checkpoint")
    if not getattr(cfg, stage).enabled:
        print(f"[{stage}] disabled in the configuration; skipped")
        return model_path
    verify_input(run_dir, model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if stage in ("stage1", "stage2"):
        synthesize(cfg, run_dir)
        examples = _read_jsonl(run_dir / "data" / f"{stage}.jsonl")
        data_hash = folder_hash(run_dir / "data")
        checkpoint = sft.run(
            cfg, model_path=model_path, out_dir=out_dir, examples=examples, stage=int(stage[-1])
        )
    else:
        tasks = rl_tasks(cfg, stage)
        if getattr(cfg, stage).difficulty_filter:
            # Its sampling engine (vLLM on a GPU) is not freed in-process: a process of its own,
            # so the stage's own engine starts on a clean GPU.
            tasks = isolated(
                cfg,
                run_dir,
                f"difficulty {stage}",
                filter_tasks,
                cfg,
                stage,
                model_path,
                tasks,
                run_dir,
            )
        trainer = grpo if stage == "stage3" else agentic
        checkpoint = trainer.run(cfg, model_path=model_path, out_dir=out_dir, tasks=tasks)
        ids = json.dumps([t.instance_id for t in tasks]).encode()
        data_hash = hashlib.sha256(ids).hexdigest()  # the tasks it drew from, in order
    elapsed = time.perf_counter() - started
    if (out_dir / "trajectories").is_dir():
        write_manifest(out_dir / "trajectories")
    write_once(
        done,
        {
            "checkpoint": str(checkpoint),
            "seconds": round(elapsed, 1),
            "settings": {
                key: value
                for key, value in flatten(cfg.to_dict()).items()
                if key not in NO_EFFECT and not key.startswith("eval.")
            },
            "input": {"path": model_path, "sha256": content_hash(model_path)},
            "git_commit": git_commit(),
            "data_sha256": data_hash,
            "finished": time.time(),
        },
    )
    print(f"[{stage}] done in {elapsed:.1f} s from {model_path}: {checkpoint}")
    return str(checkpoint)


def estimate_difficulty(
    cfg: CurriculumConfig, stage: str, model_path: str | None = None
) -> tuple[dict[str, Any], list]:
    """Each training task's pass rate for ``stage`` under ``model_path`` (default: the checkpoint
    the stage starts from), reused from ``RUN_DIR/difficulty/<stage>.json`` when it was measured
    for that policy; returns the record and the tasks with 0 < p < 1."""

    with open_run(cfg) as run_dir:
        model_path = model_path or start_checkpoint(cfg, run_dir, stage)
        verify_input(run_dir, model_path)
        tasks = rl_tasks(cfg, stage)
        record = estimate_pass_rates(cfg, stage, model_path, tasks, run_dir)
    rates = record["tasks"]
    return record, [t for t in tasks if 0 < rates[t.instance_id]["p"] < 1]


@dataclasses.dataclass(frozen=True)
class _Evaluation:
    """One evaluation of a round: where its summary goes in the round's summary (``key``: ``""``
    for the first mode on the evaluation tasks), its folder under ``eval/``, its tasks, suite and
    mode."""

    key: str
    folder: str
    tasks: list
    suite: str
    mode: str


def _evaluations(cfg: CurriculumConfig, label: str) -> list[_Evaluation]:
    """The evaluations of one round, in the order they run: each mode of ``eval.modes`` on the
    first ``eval.train_tasks`` training tasks, then on the evaluation tasks, then BIRD questions
    when there are any."""
    held_out = tasks_for(cfg, "eval")
    kind = held_out[0].kind
    fit = [t for t in tasks_for(cfg, "train") if t.kind == kind][: cfg.eval.train_tasks]
    fit = list({t.instance_id: t for t in fit}.values())  # a mixture may draw a task twice
    suffixes = ["" if i == 0 else f"-{mode}" for i, mode in enumerate(cfg.eval.modes)]
    modes = list(zip(suffixes, cfg.eval.modes, strict=True))
    # The training tasks first: fewer, so an evaluation interrupted on a slow machine (each
    # part resumes whole) has the fit figures before the long held-out runs.
    jobs = [
        _Evaluation(f"train{suffix}", f"{label}-train{suffix}", fit, "training", mode)
        for suffix, mode in modes
        if fit
    ]
    jobs += [
        _Evaluation(mode if suffix else "", label + suffix, held_out, cfg.data.eval_suite, mode)
        for suffix, mode in modes
    ]
    bird = tasks_for(cfg, "bird_eval")
    if bird:
        # Generation beside debugging: execution accuracy on BIRD questions, same policy and turns.
        jobs.append(_Evaluation("generation", f"{label}-bird", bird, bird_eval_suite(cfg), "agent"))
    return jobs


def _evaluate(
    cfg: CurriculumConfig, model_path: str, run_dir: Path, label: str
) -> dict[str, Any] | None:
    """Every evaluation of one policy (:func:`_evaluations`), in one process and on one engine.

    Returns the first mode's summary on the evaluation tasks, with the others under
    ``"single"`` / ``"agent"``, ``"train"`` / ``"train-<mode>"`` and ``"generation"``.
    """
    if not cfg.eval.enabled:
        return None
    jobs = _evaluations(cfg, label)
    paths = {job.key: run_dir / "eval" / job.folder / "summary.json" for job in jobs}
    if not all(path.is_file() for path in paths.values()):
        # One process for the round, and one engine: a vLLM engine starts once (~80 s on a CPU)
        # for all the round's evaluations of the same policy.
        with working_on(run_dir, f"the evaluations {label}"):
            isolated(
                cfg,
                run_dir,
                f"eval {label}",
                _evaluate_round,
                cfg,
                model_path,
                run_dir,
                label,
                jobs,
            )
    results = {key: json.loads(path.read_text()) for key, path in paths.items()}
    summary = dict(results.pop(""))
    summary.update(results)
    return summary


def _evaluate_round(
    cfg: CurriculumConfig, model_path: str, run_dir: Path, label: str, jobs: list[_Evaluation]
) -> None:
    """Run the round's evaluations that have no summary yet, sharing one generation engine."""

    with sharing_engines():
        for job in jobs:
            out_dir = run_dir / "eval" / job.folder
            if (out_dir / "summary.json").is_file():
                continue
            with working_on(run_dir, f"the evaluation {job.folder}"):
                evaluate_policy(
                    model_path,
                    tasks=job.tasks,
                    out_dir=out_dir,
                    config=cfg.eval.evaluation(
                        job.mode,
                        label=label,
                        suite=job.suite,
                        prompt=cfg.prompt.options(),
                        task_set="train" if job.suite == "training" else "heldout",
                        dtype=sampling_dtype(cfg.model),
                    ),
                )


def run_curriculum(cfg: CurriculumConfig, *, restart_from: str | None = None) -> dict[str, Any]:
    """Run (or resume) stages 1→4, evaluating before and after the stages of ``eval.after``, as
    the run directory's one writer (see :func:`open_run`; ``restart_from``: a stage, or
    ``"eval"``, to redo from there, see :func:`prepare_run`).

    Returns the summaries: ``before``, ``after_<stage>`` for each stage of ``eval.after``,
    ``after`` (the final model's, when stage 4 is evaluated) and ``run_dir``.
    """
    # The outermost name of the work under way: a signal between the stages and evaluations
    # (preparing the directory, building the model, writing the report) is named too.
    with (
        working_on(cfg.run_dir, "the curriculum"),
        open_run(cfg, restart_from=restart_from) as run_dir,
    ):
        return _run_curriculum(cfg, run_dir)


def _run_curriculum(cfg: CurriculumConfig, run_dir: Path) -> dict[str, Any]:

    base = resolve_model(cfg.model.name_or_path)
    results: dict[str, Any] = {"run_dir": str(run_dir), "mixture": cfg.data.mixture}
    results["before"] = _evaluate(cfg, base, run_dir, "before") if cfg.eval.before else None
    # The label each policy was evaluated under: a stage that trains nothing (disabled) hands on
    # the policy it was given, whose evaluation is then reused rather than run again.
    evaluated = {base: "before"} if cfg.eval.before else {}
    model_path = start_checkpoint(cfg, run_dir, "stage1")
    for stage in STAGES:
        if (run_dir / stage / "DONE").is_file() or not getattr(cfg, stage).enabled:
            model_path = run_stage(cfg, stage, model_path, run_dir)  # nothing to train
        else:
            with working_on(run_dir, stage):
                model_path = isolated(
                    cfg, run_dir, stage, run_stage, cfg, stage, model_path, run_dir
                )
        if stage in cfg.eval.after:
            label = f"after_{stage}"
            if model_path in evaluated:
                print(
                    f"[eval {label}] the policy of {evaluated[model_path]}: its evaluation reused"
                )
                results[label] = results[evaluated[model_path]]
            else:
                results[label] = _evaluate(cfg, model_path, run_dir, label)
                evaluated[model_path] = label
    # "after": the evaluation of the final model, when eval.after asks for one.
    results["after"] = results.get(f"after_{STAGES[-1]}")
    results["report"] = str(write_report(run_dir))
    write_json(run_dir / "summary.json", results)
    return results
