"""The curriculum runner: the run directory, resuming, the stage order and the evaluations
between stages.

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
import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdenv.errors import ProcessDiedError
from birdenv.interrupts import INTERRUPTS, interrupts_held
from birdtrain.config import STAGES, CurriculumConfig
from birdtrain.rundir import (
    NO_EFFECT,
    command_line,
    first_changed,
    flatten,
    folder_hash,
    hold,
    raise_on_sigterm,
    settings_differ,
    verify_folder,
    working_on,
    write_manifest,
    write_once,
)

__all__ = [
    "estimate_difficulty",
    "open_run",
    "prepare_run",
    "run_curriculum",
    "run_stage",
    "start_checkpoint",
    "synthesize",
]


def _git_commit() -> str | None:
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

    With ``mixture``, ``data.mixture: auto`` is settled too (see :func:`_resolve_mixture`).
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
            record["config"], record["git_commit"] = current, _git_commit()
            record["history"].append({"at": time.time(), "command": command, **event})
            _write_json(path, record)
    else:
        record = {
            "config": current,
            "git_commit": _git_commit(),
            "python": sys.version.split()[0],
            "history": [{"at": time.time(), "command": command, "event": "created"}],
        }
        _write_json(path, record)
    _verify_completed(run_dir)
    if mixture:
        _resolve_mixture(cfg, run_dir)
    return run_dir


def _write_json(path: Path, record: dict[str, Any]) -> None:
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
        verify_folder(data, fix=_fix(STAGES[0]), hashes=False)
    for stage in STAGES:
        if (run_dir / stage / "DONE").is_file():
            for folder in ("checkpoint", "trajectories"):
                if (run_dir / stage / folder).exists() or folder == "checkpoint":
                    verify_folder(run_dir / stage / folder, fix=_fix(stage), hashes=False)


def _fix(stage: str) -> str:
    return f"retrain {stage}: rerun the same command with --from {stage}"


def _tasks(cfg: CurriculumConfig, which: str) -> list:
    """The training tasks (a mixture's draw, or the train suite), the evaluation tasks (either
    kind), or ``"bird_eval"``: the BIRD questions scored for execution accuracy (may be empty)."""
    from birdenv.tasks import load_tasks
    from birdtrain.data import load_train_tasks

    if which == "train":
        return load_train_tasks(cfg)
    if which == "bird_eval":
        suite = _bird_eval_suite(cfg)
        if suite is None:
            return []
        tasks = load_tasks(suite, db_dir=cfg.data.bird_db_root)
    else:
        tasks = load_tasks(cfg.data.eval_suite, db_dir=cfg.data.eval_db_dir)
    return tasks[: cfg.eval.max_tasks] if cfg.eval.max_tasks else tasks


def _rl_tasks(cfg: CurriculumConfig, stage: str) -> list:
    """The training tasks an RL stage draws from: the first ``max_tasks`` of them, or all."""
    return _tasks(cfg, "train")[: getattr(cfg, stage).max_tasks]


def _bird_eval_suite(cfg: CurriculumConfig) -> str | None:
    """``data.bird_eval_suite``; ``auto``: bird-mini-eval when training sees BIRD questions."""
    from birdenv.tasks import BIRD_SUITES

    suite = cfg.data.bird_eval_suite
    if suite != "auto":
        return suite or None
    mixture = cfg.data.mixture
    if mixture == "auto":
        names = list(cfg.data.mixture_sources)
    else:
        names = list(mixture) if mixture else [cfg.data.train_suite]
    if cfg.data.eval_suite in BIRD_SUITES:
        return None  # the main evaluation already scores BIRD questions
    return "bird-mini-eval" if any(_is_bird_source(n) for n in names) else None


def _is_bird_source(name: str) -> bool:
    from birdenv.tasks import BirdTask, source_kind

    return source_kind(name) is BirdTask


def _resolve_mixture(cfg: CurriculumConfig, run_dir: Path) -> None:
    """``data.mixture: auto`` becomes the weights of the run's ``mixture.json`` (estimated once)."""
    if cfg.data.mixture == "auto":
        from birdtrain.curriculum.mixture import resolve_mixture

        if (run_dir / "mixture.json").is_file():
            weights = resolve_mixture(cfg, run_dir)
        else:
            # The estimate trains proxy models: in a process of its own, like a stage (which
            # sets cfg.data.mixture there, not here).
            weights = _isolated(cfg, run_dir, "mixture", resolve_mixture, cfg, run_dir)
            cfg.data.mixture = weights
        print(f"[mixture] weights: {weights} (evidence in {run_dir / 'mixture.json'})")


def _isolates(cfg: CurriculumConfig) -> bool:
    """``cfg.isolate``; None: when CUDA is present (each process then starts on a clean GPU), or
    when a stage generates with vLLM (TRL's colocated engine makes its process a
    ``torch.distributed`` rank, and a later trainer there would wrap its model for data
    parallelism)."""
    if cfg.isolate is not None:
        return cfg.isolate
    import torch

    from birdtrain.policies import uses_vllm

    return torch.cuda.is_available() or any(
        stage.enabled and uses_vllm(stage.use_vllm, cfg.model.name_or_path)
        for stage in (cfg.stage3, cfg.stage4)
    )


def _die_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent dies (a killed curriculum leaves no
    stage running on behind it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _child(conn: Any, fn: Any, args: tuple, kwargs: dict) -> None:
    """The body of an isolated process: run ``fn`` and send back its result or its exception.

    SIGTERM (from the parent on an interrupt, or from the system when the parent dies) unwinds it
    like Ctrl-C, ending its own workers on the way out."""
    _die_with_parent()
    raise_on_sigterm()
    try:
        # The parent held the interrupts back while it started this process (see _isolated);
        # one that came meanwhile is raised here, inside the handling below.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):  # the parent reports an interrupt
            traceback.print_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # it would not arrive whole (e.g. a constructor with other arguments)
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send(("error", exc))
        sys.exit(1)
    conn.send(("ok", result))


def _isolated(
    cfg: CurriculumConfig, run_dir: Path, name: str, fn: Any, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, in a process of its own when :func:`_isolates` says so.

    The process is started fresh (``spawn``: it inherits no CUDA state, and none of this
    process's memory), and this one waits for it to exit before going on, so every stage and
    evaluation starts on a GPU no other holds. Its exception is raised here; each process is
    recorded in ``run_dir/processes.jsonl`` (``name``, ``pid``, ``started``, ``exited``,
    ``exitcode``).
    """
    if not _isolates(cfg):
        return fn(*args, **kwargs)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    process = context.Process(target=_child, args=(send, fn, args, kwargs), name=name)
    started = time.time()
    try:
        # An interrupt that comes while the process starts is raised once it has, here, where
        # the process is ended with this one. It inherits the mask until _child unblocks it.
        with interrupts_held():
            process.start()
            send.close()
        outcome = receive.recv()
    except EOFError:
        outcome = None  # it died before it could say anything (killed, or a crash in native code)
    except BaseException:  # an interrupt here: the process is ended with this one, not orphaned
        if process.pid is not None:
            process.terminate()
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        raise
    finally:
        if process.pid is not None:
            process.join()
        receive.close()
    record = {
        "name": name,
        "pid": process.pid,
        "started": started,
        "exited": time.time(),
        "exitcode": process.exitcode,
    }
    with open(run_dir / "processes.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if outcome is None:
        raise ProcessDiedError(
            f"{name}: its process (pid {process.pid}) ended with exit code {process.exitcode} "
            "before returning a result (killed for memory? see the system log); rerun to resume"
        )
    status, value = outcome
    if status == "error":
        raise value
    return value


def synthesize(cfg: CurriculumConfig, run_dir: Path) -> dict[str, Any]:
    """Synthesize the stage-1 and stage-2 data into ``run_dir/data`` once; return the counts."""
    from birdtrain.data import synth

    data_dir = run_dir / "data"
    done = data_dir / "DONE"
    if done.is_file():
        verify_folder(data_dir, fix=_fix(STAGES[0]))
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
    _verify_input(run_dir, model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if stage in ("stage1", "stage2"):
        from birdtrain.stages import sft

        synthesize(cfg, run_dir)
        examples = _read_jsonl(run_dir / "data" / f"{stage}.jsonl")
        data_hash = folder_hash(run_dir / "data")
        checkpoint = sft.run(
            cfg, model_path=model_path, out_dir=out_dir, examples=examples, stage=int(stage[-1])
        )
    else:
        from birdtrain.curriculum.difficulty import filter_tasks
        from birdtrain.stages import agentic, grpo

        tasks = _rl_tasks(cfg, stage)
        if getattr(cfg, stage).difficulty_filter:
            # Its sampling engine (vLLM on a GPU) is not freed in-process: a process of its own,
            # so the stage's own engine starts on a clean GPU.
            tasks = _isolated(
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
            "input": {"path": model_path, "sha256": _content_hash(model_path)},
            "git_commit": _git_commit(),
            "data_sha256": data_hash,
            "finished": time.time(),
        },
    )
    print(f"[{stage}] done in {elapsed:.1f} s from {model_path}: {checkpoint}")
    return str(checkpoint)


def _content_hash(model_path: str) -> str | None:
    """A stage checkpoint's content hash (its manifest's); None for a base model."""
    path = Path(model_path)
    return folder_hash(path) if (path / "MANIFEST.json").is_file() else None


def _verify_input(run_dir: Path, model_path: str) -> None:
    """Before a stage loads an earlier stage's checkpoint: every file whole (sizes and hashes)."""
    path = Path(model_path)
    if path.parent.name in STAGES and path.parent.parent.resolve() == run_dir.resolve():
        verify_folder(path, fix=_fix(path.parent.name))


def estimate_difficulty(
    cfg: CurriculumConfig, stage: str, model_path: str | None = None
) -> tuple[dict[str, Any], list]:
    """Each training task's pass rate for ``stage`` under ``model_path`` (default: the checkpoint
    the stage starts from), reused from ``RUN_DIR/difficulty/<stage>.json`` when it was measured
    for that policy; returns the record and the tasks with 0 < p < 1."""
    from birdtrain.curriculum.difficulty import estimate_pass_rates

    with open_run(cfg) as run_dir:
        model_path = model_path or start_checkpoint(cfg, run_dir, stage)
        _verify_input(run_dir, model_path)
        tasks = _rl_tasks(cfg, stage)
        record = estimate_pass_rates(cfg, stage, model_path, tasks, run_dir)
    rates = record["tasks"]
    return record, [t for t in tasks if 0 < rates[t.instance_id]["p"] < 1]


def start_checkpoint(cfg: CurriculumConfig, run_dir: Path, before: str) -> str:
    """The checkpoint a stage starts from: the latest completed earlier stage, else the base model."""
    from birdtrain.models import resolve_model

    for stage in reversed(STAGES[: STAGES.index(before)]):
        if (run_dir / stage / "DONE").is_file():
            return str(run_dir / stage / "checkpoint")
    return resolve_model(cfg.model.name_or_path)


def _evaluate(
    cfg: CurriculumConfig, model_path: str, run_dir: Path, label: str
) -> dict[str, Any] | None:
    """Every evaluation of one policy: each mode of ``eval.modes`` on the evaluation tasks, on
    the first ``eval.train_tasks`` training tasks, and on BIRD questions when there are any.

    Returns the first mode's summary on the evaluation tasks, with the others under
    ``"single"`` / ``"agent"``, ``"train"`` / ``"train-<mode>"`` and ``"generation"``.
    """
    if not cfg.eval.enabled:
        return None
    held_out = _tasks(cfg, "eval")
    kind = type(held_out[0])
    fit = [t for t in _tasks(cfg, "train") if type(t) is kind][: cfg.eval.train_tasks]
    fit = list({t.instance_id: t for t in fit}.values())  # a mixture may draw a task twice
    suffixes = ["" if i == 0 else f"-{mode}" for i, mode in enumerate(cfg.eval.modes)]
    # The training tasks first: fewer, so an evaluation interrupted on a slow machine (each
    # part resumes whole) has the fit figures before the long held-out runs.
    fits = {
        f"train{suffix}": _evaluate_on(
            cfg, model_path, run_dir, label, fit, f"{label}-train{suffix}", "training", mode
        )
        for suffix, mode in zip(suffixes, cfg.eval.modes, strict=True)
        if fit
    }
    summary: dict[str, Any] = {}
    for suffix, mode in zip(suffixes, cfg.eval.modes, strict=True):
        result = _evaluate_on(
            cfg, model_path, run_dir, label, held_out, label + suffix, cfg.data.eval_suite, mode
        )
        if suffix:
            summary[mode] = result
        else:
            summary = dict(result)
    summary.update(fits)
    bird = _tasks(cfg, "bird_eval")
    if bird:
        # Generation beside debugging: execution accuracy on BIRD questions, same policy and turns.
        summary["generation"] = _evaluate_on(
            cfg, model_path, run_dir, label, bird, f"{label}-bird", _bird_eval_suite(cfg), "agent"
        )
    return summary


def _evaluate_on(
    cfg: CurriculumConfig,
    model_path: str,
    run_dir: Path,
    label: str,
    tasks: list,
    folder: str,
    suite: str,
    mode: str,
) -> dict[str, Any]:
    from birdtrain.evaluate import evaluate_policy
    from birdtrain.stages.common import sampling_dtype

    out_dir = run_dir / "eval" / folder
    summary_path = out_dir / "summary.json"
    if summary_path.is_file():
        return json.loads(summary_path.read_text())
    with working_on(run_dir, f"the evaluation {folder}"):
        return _isolated(
            cfg,
            run_dir,
            f"eval {folder}",
            evaluate_policy,
            model_path,
            tasks=tasks,
            out_dir=out_dir,
            config=cfg.eval.evaluation(
                mode,
                label=label,
                suite=suite,
                prompt=cfg.prompt.options(),
                task_set="train" if suite == "training" else "heldout",
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
    with open_run(cfg, restart_from=restart_from) as run_dir:
        return _run_curriculum(cfg, run_dir)


def _run_curriculum(cfg: CurriculumConfig, run_dir: Path) -> dict[str, Any]:
    from birdtrain.models import resolve_model
    from birdtrain.report import write_report

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
                model_path = _isolated(
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
    _write_json(run_dir / "summary.json", results)
    return results
