"""The run directory's record: created or resumed, its changed settings settled, its parts verified.

A run directory ``{output_dir}/{name}/`` holds ``config.json`` (the resolved configuration and the
git commit), ``data/`` (synthesized examples), ``stage1/`` … ``stage4/`` (each with ``metrics.jsonl``,
``checkpoint/`` and ``DONE`` once complete) and ``eval/`` (``eval/<label>/`` the debugging
evaluation, ``eval/<label>-bird/`` execution accuracy on BIRD questions when there are any), and
``mixture.json`` when ``data.mixture`` is ``auto``. Rerunning resumes: completed stages are
skipped and the next one starts from the last checkpoint.

The directory can be trusted (:mod:`birdtrain.rundir` holds the mechanisms):

- one writer: a command that writes it holds its lock (:func:`open_run`) for its whole life;
- an honest record: ``config.json`` holds the settings the run's stages were trained with and a
  ``history`` of every change; each stage's ``DONE`` records its settings, its input checkpoint
  (path and content hash), the code commit and its data's hash. A rerun under settings that touch
  work already begun is refused, naming each changed key; ``restart_from`` (``--from stageN``)
  retrains from that stage, removing it, the later stages and their evaluations;
- verified files: checkpoints are renamed into place with a manifest, checked on resume (sizes)
  and before a stage loads one (hashes); so are the synthesized data and stage 4's part of the
  trajectory store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdtrain.config import STAGES, CurriculumConfig
from birdtrain.curriculum.isolation import isolated
from birdtrain.curriculum.mixture import resolve_mixture
from birdtrain.models import resolve_model
from birdtrain.rundir import (
    NO_EFFECT,
    command_line,
    first_changed,
    folder_hash,
    hold,
    settings_differ,
    verify_folder,
)

__all__ = [
    "PARTS",
    "content_hash",
    "git_commit",
    "open_run",
    "prepare_run",
    "resolve_auto_mixture",
    "retrain_hint",
    "start_checkpoint",
    "verify_input",
    "write_json",
]


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def open_run(
    cfg: CurriculumConfig, *, mixture: bool = True, restart_from: str | None = None
) -> Iterator[Path]:
    """Hold the run directory as its one writer (a second fails naming this one) and prepare it
    (:func:`prepare_run`); yield it."""
    with hold(cfg.run_dir):
        yield prepare_run(cfg, mixture=mixture, restart_from=restart_from)


def prepare_run(
    cfg: CurriculumConfig, *, mixture: bool = True, restart_from: str | None = None
) -> Path:
    """Create or resume the run directory, its record in ``config.json`` kept honest.

    A new run records the configuration, the git commit and the Python version. A resumed run
    compares its settings with the record: a change that touches work already begun (a stage
    folder, the data, an evaluation) is refused (``ValueError`` naming each key with both
    values) unless ``restart_from`` (a stage, or ``"eval"``) says where to start again; that part,
    the later stages and their evaluations are then removed, and ``config.json`` takes the new
    settings with an entry in its ``history``. Completed stages' checkpoints and the data are
    then checked against their manifests (sizes). Call it under :func:`open_run`'s lock.

    With ``mixture``, ``data.mixture: auto`` is settled too (see :func:`resolve_auto_mixture`).
    """
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    current = cfg.to_dict()
    command = command_line()
    if path.is_file():
        record = json.loads(path.read_text())
        record.setdefault("history", [])
        differ = settings_differ(record["config"], current, ignore=NO_EFFECT)
        event = _settle(run_dir, differ, restart_from)
        if event is not None:
            record["config"], record["git_commit"] = current, git_commit()
            record["history"].append({"at": time.time(), "command": command, **event})
            write_json(path, record)
    else:
        record = {
            "config": current,
            "git_commit": git_commit(),
            "python": sys.version.split()[0],
            "history": [{"at": time.time(), "command": command, "event": "created"}],
        }
        write_json(path, record)
    _verify_completed(run_dir)
    if mixture:
        resolve_auto_mixture(cfg, run_dir)
    return run_dir


def write_json(path: Path, record: dict[str, Any]) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(record, indent=2, default=str))
    os.replace(staging, path)  # the record is whole, the old one or the new one


#: The parts of a run in order: its stages, then the evaluations (``--from eval``).
PARTS = (*STAGES, "eval")


def _begun(run_dir: Path, part: str) -> bool:
    """Whether anything of ``part`` or what follows it is on disk: its folder, a later stage's;
    for the first stage also the data and any evaluation (they all follow the base model)."""
    evaluated = any((run_dir / "eval").glob("*"))
    if part == "eval":
        return evaluated
    if any((run_dir / stage).exists() for stage in STAGES[STAGES.index(part) :]):
        return True
    return part == STAGES[0] and ((run_dir / "data").exists() or evaluated)


def _settle(run_dir: Path, differ: list[str], restart_from: str | None) -> dict[str, Any] | None:
    """Decide a resumed run's changed settings (:func:`prepare_run`); the ``history`` entry to
    record, or None when the record stays as it is."""
    if restart_from is not None and restart_from not in PARTS:
        raise ValueError(f"--from takes one of {', '.join(PARTS)}, not {restart_from!r}")
    first = first_changed(differ, STAGES) if differ else None
    changes = "; ".join(differ)
    if restart_from is None:
        if first is None:
            return None
        if _begun(run_dir, first):
            begin = "evaluate again" if first == "eval" else f"retrain from {first}"
            raise ValueError(
                f"{run_dir} was run with other settings ({changes}); they touch {first}, which "
                f"has begun: rerun with the recorded settings to resume, add --from {first} to "
                f"{begin} (what follows is redone too), or give another --output-dir"
            )
        return {"event": f"settings changed before {first} began", "changed": differ}
    if first is not None and PARTS.index(first) < PARTS.index(restart_from):
        raise ValueError(
            f"--from {restart_from}: the changed settings ({changes}) touch {first}, which comes "
            f"earlier; use --from {first}"
        )
    all_evaluations = any(line.startswith("eval.") for line in differ)
    removed = _invalidate(run_dir, restart_from, all_evaluations=all_evaluations)
    if removed:
        print(f"[{restart_from}] removed to be redone: {', '.join(removed)}")
    return {"event": f"redone from {restart_from}", "changed": differ, "removed": removed}


def _invalidate(run_dir: Path, start: str, *, all_evaluations: bool) -> list[str]:
    """Remove ``start`` (a stage, or ``"eval"``), every later stage, and their evaluations (all
    of them from the first stage on, or when ``all_evaluations``); return what was removed."""
    later = STAGES[STAGES.index(start) :] if start in STAGES else ()
    labels = {f"after_{stage}" for stage in later}
    every = all_evaluations or start in (STAGES[0], "eval")
    targets = [run_dir / stage for stage in later]
    targets += [run_dir / "difficulty" / f"{stage}.json" for stage in later]
    targets += [
        folder
        for folder in sorted((run_dir / "eval").glob("*"))
        if every or folder.name.split("-")[0] in labels
    ]
    if start == STAGES[0]:
        targets += [run_dir / "data", run_dir / "mixture.json"]
    removed = []
    for target in targets:
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            continue
        removed.append(str(target.relative_to(run_dir)))
    return removed


def _verify_completed(run_dir: Path) -> None:
    """Check the data and each completed stage's checkpoint and trajectory store against their
    manifests (sizes; hashes are checked when a stage loads a checkpoint)."""
    data = run_dir / "data"
    if (data / "DONE").is_file():
        verify_folder(data, fix=retrain_hint(STAGES[0]), hashes=False)
    for stage in STAGES:
        if (run_dir / stage / "DONE").is_file():
            for folder in ("checkpoint", "trajectories"):
                if (run_dir / stage / folder).exists() or folder == "checkpoint":
                    verify_folder(run_dir / stage / folder, fix=retrain_hint(stage), hashes=False)


def retrain_hint(stage: str) -> str:
    return f"retrain {stage}: rerun the same command with --from {stage}"


def resolve_auto_mixture(cfg: CurriculumConfig, run_dir: Path) -> None:
    """``data.mixture: auto`` becomes the weights of the run's ``mixture.json`` (estimated once)."""
    if cfg.data.mixture == "auto":
        if (run_dir / "mixture.json").is_file():
            weights = resolve_mixture(cfg, run_dir)
        else:
            # The estimate trains proxy models: in a process of its own, like a stage (which
            # sets cfg.data.mixture there, not here).
            weights = isolated(cfg, run_dir, "mixture", resolve_mixture, cfg, run_dir)
            cfg.data.mixture = weights
        print(f"[mixture] weights: {weights} (evidence in {run_dir / 'mixture.json'})")


def start_checkpoint(cfg: CurriculumConfig, run_dir: Path, before: str) -> str:
    """The checkpoint a stage starts from: the latest completed earlier stage, else the base model."""

    for stage in reversed(STAGES[: STAGES.index(before)]):
        if (run_dir / stage / "DONE").is_file():
            return str(run_dir / stage / "checkpoint")
    return resolve_model(cfg.model.name_or_path)


def content_hash(model_path: str) -> str | None:
    """A stage checkpoint's content hash (its manifest's); None for a base model."""
    path = Path(model_path)
    return folder_hash(path) if (path / "MANIFEST.json").is_file() else None


def verify_input(run_dir: Path, model_path: str) -> None:
    """Before a stage loads an earlier stage's checkpoint: every file whole (sizes and hashes)."""
    path = Path(model_path)
    if path.parent.name in STAGES and path.parent.parent.resolve() == run_dir.resolve():
        verify_folder(path, fix=retrain_hint(path.parent.name))
