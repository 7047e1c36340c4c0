"""The curriculum runner: the run directory, resuming, the stage order and the evaluations
between stages.

A run directory ``{output_dir}/{name}/`` holds ``config.json`` (the resolved configuration and the
git commit), ``data/`` (synthesized examples), ``stage1/`` … ``stage4/`` (each with ``metrics.jsonl``,
``checkpoint/`` and ``DONE`` once complete) and ``eval/`` (``eval/<label>/`` the debugging
evaluation, ``eval/<label>-bird/`` execution accuracy on BIRD questions when there are any), and
``mixture.json`` when ``data.mixture`` is ``auto``. Rerunning resumes: completed stages are
skipped and the next one starts from the last checkpoint.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from birdenv.errors import ProcessDiedError
from birdtrain.config import STAGES

__all__ = [
    "estimate_difficulty",
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


def prepare_run(cfg: Any, *, mixture: bool = True) -> Path:
    """Create the run directory and record the configuration and git commit in ``config.json``.

    With ``mixture``, ``data.mixture: auto`` is settled too (see :func:`_resolve_mixture`).
    """
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "config": cfg.to_dict(),
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
    }
    (run_dir / "config.json").write_text(json.dumps(record, indent=2))
    if mixture:
        _resolve_mixture(cfg, run_dir)
    return run_dir


def _tasks(cfg: Any, which: str) -> list:
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


def _rl_tasks(cfg: Any, stage: str) -> list:
    """The training tasks an RL stage draws from: the first ``max_tasks`` of them, or all."""
    return _tasks(cfg, "train")[: getattr(cfg, stage).max_tasks]


def _bird_eval_suite(cfg: Any) -> str | None:
    """``data.bird_eval_suite``; ``auto``: bird-mini-eval when training sees BIRD questions."""
    from birdenv.bird import BIRD_SUITES

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
    from birdenv.bird import BirdTask
    from birdenv.tasks import source_kind

    return source_kind(name) is BirdTask


def _resolve_mixture(cfg: Any, run_dir: Path) -> None:
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


def _isolates(cfg: Any) -> bool:
    """``cfg.isolate``; None: when CUDA is present (each process then starts on a clean GPU)."""
    if cfg.isolate is not None:
        return cfg.isolate
    import torch

    return torch.cuda.is_available()


def _child(conn: Any, fn: Any, args: tuple, kwargs: dict) -> None:
    """The body of an isolated process: run ``fn`` and send back its result or its exception."""
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        traceback.print_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # it would not arrive whole (e.g. a constructor with other arguments)
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send(("error", exc))
        sys.exit(1)
    conn.send(("ok", result))


def _isolated(cfg: Any, run_dir: Path, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
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
    process.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:
        outcome = None  # it died before it could say anything (killed, or a crash in native code)
    finally:
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


def synthesize(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Synthesize the stage-1 and stage-2 data into ``run_dir/data`` once; return the counts."""
    from birdtrain.data import synth

    data_dir = run_dir / "data"
    done = data_dir / "DONE"
    if done.is_file():
        return json.loads(done.read_text())
    counts = synth(cfg, data_dir)
    done.write_text(json.dumps(counts))
    return counts


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_stage(cfg: Any, stage: str, model_path: str, run_dir: Path) -> str:
    """Run one stage unless its DONE marker exists; return the checkpoint the next stage starts from."""
    out_dir = run_dir / stage
    done = out_dir / "DONE"
    if done.is_file():
        print(f"[{stage}] already complete: {out_dir / 'checkpoint'}")
        return str(out_dir / "checkpoint")
    if not getattr(cfg, stage).enabled:
        print(f"[{stage}] disabled in the configuration; skipped")
        return model_path
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if stage in ("stage1", "stage2"):
        from birdtrain.stages import sft

        synthesize(cfg, run_dir)
        examples = _read_jsonl(run_dir / "data" / f"{stage}.jsonl")
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
    elapsed = time.perf_counter() - started
    done.write_text(json.dumps({"checkpoint": str(checkpoint), "seconds": round(elapsed, 1)}))
    print(f"[{stage}] done in {elapsed:.1f} s from {model_path}: {checkpoint}")
    return str(checkpoint)


def estimate_difficulty(
    cfg: Any, stage: str, model_path: str | None = None
) -> tuple[dict[str, Any], list]:
    """Each training task's pass rate for ``stage`` under ``model_path`` (default: the checkpoint
    the stage starts from), reused from ``RUN_DIR/difficulty/<stage>.json`` when it was measured
    for that policy; returns the record and the tasks with 0 < p < 1."""
    from birdtrain.curriculum.difficulty import estimate_pass_rates

    run_dir = prepare_run(cfg)
    model_path = model_path or start_checkpoint(cfg, run_dir, stage)
    tasks = _rl_tasks(cfg, stage)
    record = estimate_pass_rates(cfg, stage, model_path, tasks, run_dir)
    rates = record["tasks"]
    return record, [t for t in tasks if 0 < rates[t.instance_id]["p"] < 1]


def start_checkpoint(cfg: Any, run_dir: Path, before: str) -> str:
    """The checkpoint a stage starts from: the latest completed earlier stage, else the base model."""
    from birdtrain.models import resolve_model

    for stage in reversed(STAGES[: STAGES.index(before)]):
        if (run_dir / stage / "DONE").is_file():
            return str(run_dir / stage / "checkpoint")
    return resolve_model(cfg.model.name_or_path)


def _evaluate(cfg: Any, model_path: str, run_dir: Path, label: str) -> dict[str, Any] | None:
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
    cfg: Any,
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
    return _isolated(
        cfg,
        run_dir,
        f"eval {folder}",
        evaluate_policy,
        model_path,
        tasks=tasks,
        out_dir=out_dir,
        mode=mode,
        max_turns=cfg.eval.max_turns,
        max_new_tokens=cfg.eval.max_new_tokens,
        temperature=cfg.eval.temperature,
        num_envs=cfg.eval.num_envs,
        label=label,
        suite=suite,
        prompt=cfg.prompt.options(),
        task_set="train" if suite == "training" else "heldout",
        max_context=cfg.eval.max_context,
        engine_options=cfg.eval.engine_options(),
        dtype=sampling_dtype(cfg.model),
    )


def run_curriculum(cfg: Any) -> dict[str, Any]:
    """Run (or resume) stages 1→4, evaluating before and after the stages of ``eval.after``.

    Returns the summaries: ``before``, ``after_<stage>`` for each stage of ``eval.after``,
    ``after`` (the final model's, when stage 4 is evaluated) and ``run_dir``.
    """
    from birdtrain.models import resolve_model
    from birdtrain.report import write_report

    run_dir = prepare_run(cfg)
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
            model_path = _isolated(cfg, run_dir, stage, run_stage, cfg, stage, model_path, run_dir)
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
    (run_dir / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    return results
